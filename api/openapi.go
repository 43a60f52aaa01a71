package api

import (
	"net/http"
	"reflect"
	"strings"
	"sync"

	"vmhost/appvm"
	"vmhost/openapi"
	"vmhost/vm"
)

// The OpenAPI 3.1 document (docs/api.md, The OpenAPI document), built from the route table
// and the types the handlers encode and decode (package openapi). What
// reflection cannot see is here: each route's summary, request type and
// success responses. The error statuses follow from the route: every
// route answers 401, 403 and 500; one with a body 400 and 422, one with
// query parameters 400; one naming
// a VM or image 404; one that mutates 409. Tests validate every response
// the api and e2e suites receive against the document, so a status or a
// field the code answers without the document fails them.

// routeDoc is what the document says of a route beyond its pattern.
type routeDoc struct {
	summary string
	tag     string
	request any // the body's type, as a nil pointer; nil: no body
	ok      []openapi.Response
	query   []openapi.Param
	// requestType is the media type of a body that is not JSON.
	requestType string
	// errs are error statuses the route answers beyond those its shape
	// implies.
	errs []int
}

func jsonOK(status int, v any) openapi.Response {
	return openapi.Response{Status: status, Type: reflect.TypeOf(v)}
}

var noContent = openapi.Response{Status: http.StatusNoContent}

// vmList is GET /api/vms's body (written piece by piece by listVMs).
type vmList struct {
	VMs []*vm.View `json:"vms"`
}

// labelParam is ?label= of the lists and the event stream.
var labelParam = openapi.Param{Name: "label", Repeated: true,
	Description: "key=value: only VMs whose label key has that value; key: only VMs with that label; repeated: all must match"}

var routeDocs = map[string]routeDoc{
	"GET /api/vms": {summary: "List classic VMs", tag: "vms", ok: []openapi.Response{jsonOK(200, vmList{})},
		query: []openapi.Param{labelParam}},
	"GET /api/vms/{id}": {summary: "Read a classic VM", tag: "vms", ok: []openapi.Response{jsonOK(200, vm.View{})}},
	"POST /api/vms":     {summary: "Create a classic VM (202 when an image is downloaded first)", tag: "vms", request: (*vm.Spec)(nil), ok: []openapi.Response{jsonOK(201, vm.View{}), jsonOK(202, vm.View{})}},
	"GET /api/appvm/vms": {summary: "List AppVMs", tag: "appvms", ok: []openapi.Response{jsonOK(200, appvmList{})},
		query: []openapi.Param{labelParam}},
	"GET /api/appvm/vms/{id}": {summary: "Read an AppVM", tag: "appvms", ok: []openapi.Response{jsonOK(200, appvm.View{})}},
	"POST /api/appvm/vms":     {summary: "Create an AppVM", tag: "appvms", request: (*appvm.CreateRequest)(nil), ok: []openapi.Response{jsonOK(201, appvm.CreateResponse{})}},
	"DELETE /api/vms/{id}": {summary: "Delete a classic VM", tag: "vms", ok: []openapi.Response{noContent},
		query: []openapi.Param{{Name: "force", Description: "true: also a running VM, or one still provisioning"}}},
	"DELETE /api/appvm/vms/{id}": {summary: "Delete an AppVM", tag: "appvms", ok: []openapi.Response{noContent},
		query: []openapi.Param{{Name: "force", Description: "true: also a running AppVM"}}},
	"GET /api/appvm/images":             {summary: "List AppVM images", tag: "images", ok: []openapi.Response{jsonOK(200, imageList{})}},
	"GET /api/appvm/images/{id}":        {summary: "Read an AppVM image", tag: "images", ok: []openapi.Response{jsonOK(200, appvm.Image{})}},
	"POST /api/appvm/images":            {summary: "Import an AppVM image (in the background)", tag: "images", request: (*appvm.ImportRequest)(nil), ok: []openapi.Response{jsonOK(202, appvm.Image{})}},
	"DELETE /api/appvm/images/{id}":     {summary: "Delete an AppVM image no AppVM uses", tag: "images", ok: []openapi.Response{noContent}},
	"GET /api/networks":                 {summary: "List host networks and their bridges", tag: "host", ok: []openapi.Response{jsonOK(200, networkList{})}},
	"GET /api/registry/images":          {summary: "List registry images", tag: "host", ok: []openapi.Response{jsonOK(200, registryList{})}},
	"GET /api/registry/images/{id}":     {summary: "Read a registry image", tag: "host", ok: []openapi.Response{jsonOK(200, registryImage{})}},
	"GET /api/host/pci":                 {summary: "List host PCI devices", tag: "host", ok: []openapi.Response{jsonOK(200, pciList{})}},
	"GET /api/images/cache":             {summary: "List the verified image cache", tag: "host", ok: []openapi.Response{jsonOK(200, cacheList{})}},
	"DELETE /api/images/cache/{digest}": {summary: "Delete a cached image no provision uses", tag: "host", ok: []openapi.Response{noContent}},
	"POST /api/vms/{id}/balloon":        {summary: "Set a classic VM's balloon", tag: "vms", request: (*balloonRequest)(nil), ok: []openapi.Response{noContent}},
	"POST /api/appvm/vms/{id}/balloon":  {summary: "Set an AppVM's balloon", tag: "appvms", request: (*balloonRequest)(nil), ok: []openapi.Response{noContent}},
	"POST /api/appvm/vms/{id}/redeploy": {summary: "Redeploy an AppVM on its image's current build (in the background)", tag: "appvms",
		ok: []openapi.Response{jsonOK(202, appvm.View{})}},
	"PATCH /api/appvm/vms/{id}/spec": {summary: "Edit an AppVM's workload spec (absent keeps, null resets, a value replaces)", tag: "appvms",
		request: (*appvm.SpecEdit)(nil), ok: []openapi.Response{jsonOK(200, appvm.View{})},
		query: []openapi.Param{{Name: "restart", Description: "true: a running AppVM restarts on the new spec now"}}},
	"GET /api/volumes":         {summary: "List first-class volumes (sorted by id, without disk_bytes)", tag: "volumes", ok: []openapi.Response{jsonOK(200, volumeList{})}},
	"GET /api/volumes/{id}":    {summary: "Read a first-class volume", tag: "volumes", ok: []openapi.Response{jsonOK(200, vm.VolumeInfo{})}},
	"POST /api/volumes":        {summary: "Create a first-class volume", tag: "volumes", request: (*vm.VolumeRequest)(nil), ok: []openapi.Response{jsonOK(201, vm.VolumeInfo{})}},
	"DELETE /api/volumes/{id}": {summary: "Delete a first-class volume no VM has attached", tag: "volumes", ok: []openapi.Response{noContent}},
	"POST /api/vms/{id}/volumes": {summary: "Attach a volume to a classic VM (hot-plug when it runs)", tag: "vms",
		request: (*vm.AttachRequest)(nil), ok: []openapi.Response{jsonOK(200, vm.View{})}},
	"DELETE /api/vms/{id}/volumes/{vol}": {summary: "Detach a volume (per-VM id or volume_id) from a classic VM; a VM-owned one is kept as a first-class volume", tag: "vms",
		ok: []openapi.Response{jsonOK(200, vm.View{})}},
	"POST /api/appvm/vms/{id}/volumes": {summary: "Attach an ext4 volume to an AppVM at a mountpoint (hot-plug and mount when it runs)", tag: "appvms",
		request: (*vm.AttachRequest)(nil), ok: []openapi.Response{jsonOK(200, appvm.View{})}},
	"DELETE /api/appvm/vms/{id}/volumes/{vol}": {summary: "Detach a volume (per-VM id or volume_id) from an AppVM; a VM-owned one is kept as a first-class volume", tag: "appvms",
		ok: []openapi.Response{jsonOK(200, appvm.View{})}},
	"GET /api/events": {summary: "Follow the event stream (Server-Sent Events)", tag: "observability",
		ok: []openapi.Response{{Status: 200, ContentType: "text/event-stream", Description: "id: <seq> and data: <event JSON> per event"}},
		query: []openapi.Param{{Name: "since", Integer: true, Description: "resume after this seq (or the Last-Event-ID header)"},
			{Name: "vm_id", Description: "only this VM's events"}, labelParam}},
	"PATCH /api/vms/{id}/labels": {summary: "Edit a classic VM's labels (a merge patch: a value sets, null deletes, absent keeps)", tag: "vms",
		request: (*LabelsEdit)(nil), ok: []openapi.Response{jsonOK(200, vm.View{})}},
	"PATCH /api/appvm/vms/{id}/labels": {summary: "Edit an AppVM's labels (a merge patch: a value sets, null deletes, absent keeps)", tag: "appvms",
		request: (*LabelsEdit)(nil), ok: []openapi.Response{jsonOK(200, appvm.View{})}},
	"GET /api/host": {summary: "The host: this agent, its capacity in admission's numbers, its VMs by state, its features", tag: "host",
		ok: []openapi.Response{jsonOK(200, HostView{})}},
	"POST /api/appvm/vms/{id}/exec": {summary: "Run a command in an AppVM beside its workload (one-shot JSON, or interactive over an upgraded connection)", tag: "appvms",
		request: (*appvm.ExecRequest)(nil), ok: []openapi.Response{jsonOK(200, appvm.ExecResult{}),
			{Status: 101, Description: "Switching Protocols to " + ExecUpgrade + " (interactive or tty true, with the upgrade headers): frames both ways, " +
				"each 1 byte type, 3 zero bytes, the payload length (4 bytes, big-endian, at most 65536), the payload. " +
				"Types: 0 stdin, 3 resize {\"cols\",\"rows\"}, 5 stdin closed (client); 1 stdout, 2 stderr, 4 exit {\"exit_code\",\"signal\"} (the last frame)"}},
		query: []openapi.Param{{Name: "Connection", Header: true, Description: "Upgrade, for an interactive exec"},
			{Name: "Upgrade", Header: true, Description: ExecUpgrade + ", for an interactive exec"}}},
	"GET /api/appvm/vms/{id}/files": {summary: "Copy a file or directory out of an AppVM (a tar archive; secret files left out)", tag: "appvms",
		ok:    []openapi.Response{{Status: 200, ContentType: "application/x-tar", Description: "members relative to the path's parent, owners as numbers"}},
		query: []openapi.Param{{Name: "path", Description: "absolute path in the workload's root"}}, errs: []int{409}},
	"PUT /api/appvm/vms/{id}/files": {summary: "Copy a tar archive into a directory of an AppVM (checked whole before anything is written)", tag: "appvms",
		requestType: "application/x-tar", ok: []openapi.Response{noContent},
		query: []openapi.Param{{Name: "path", Description: "absolute path of an existing directory in the workload's root"}}},
	"POST /api/appvm/vms/{id}/signal": {summary: "Send a signal to an AppVM's workload", tag: "appvms",
		request: (*signalRequest)(nil), ok: []openapi.Response{noContent}},
	"GET /metrics":          {summary: "Prometheus metrics (text format 0.0.4)", tag: "observability", ok: []openapi.Response{{Status: 200, ContentType: "text/plain"}}},
	"GET /api/openapi.json": {summary: "This document", tag: "observability", ok: []openapi.Response{jsonOK(200, map[string]any{})}},
}

func init() {
	for _, a := range vm.Actions {
		var q []openapi.Param
		if a == vm.ActionStart {
			q = []openapi.Param{{Name: "cold", Description: "true: discard a saved state (a suspend's) and boot"}}
		}
		routeDocs["POST /api/vms/{id}/"+string(a)] = routeDoc{summary: string(a) + " a classic VM", tag: "vms", ok: []openapi.Response{noContent}, query: q}
		routeDocs["POST /api/appvm/vms/{id}/"+string(a)] = routeDoc{summary: string(a) + " an AppVM", tag: "appvms", ok: []openapi.Response{noContent}, query: q}
	}
	for pattern, d := range snapshotDocs {
		routeDocs[pattern] = d
	}
}

// healthzDoc documents GET /healthz, which package main serves before and
// beside the API.
var healthzDoc = openapi.Operation{Pattern: "GET /healthz", Summary: "Health: ok once records are loaded and VMs reconciled",
	Tag: "observability", NoAuth: true, Responses: []openapi.Response{
		{Status: 200, ContentType: "text/plain", Description: "ok"},
		{Status: 503, ContentType: "text/plain"},
	}}

var (
	openAPIOnce sync.Once
	openAPIDoc  []byte
	openAPIErr  error
)

// OpenAPI returns the document (`vmhost openapi` prints it).
func OpenAPI() ([]byte, error) { return openAPI(Routes()) }

// openAPI builds the document of routes once (they are always the route
// table; the server passes its copy, which keeps the table's
// initialization free of a cycle through this function).
func openAPI(routes []Route) ([]byte, error) {
	openAPIOnce.Do(func() { openAPIDoc, openAPIErr = buildOpenAPI(routes) })
	return openAPIDoc, openAPIErr
}

func buildOpenAPI(routes []Route) ([]byte, error) {
	errType := reflect.TypeOf(errorBody{})
	errResp := func(status int) openapi.Response { return openapi.Response{Status: status, Type: errType} }
	ops := []openapi.Operation{healthzDoc}
	for _, rt := range routes {
		d := routeDocs[rt.Pattern]
		op := openapi.Operation{Pattern: rt.Pattern, Summary: d.summary, Tag: d.tag, Mutates: rt.Mutates,
			QueryParams: d.query, Responses: append([]openapi.Response(nil), d.ok...), RequestContentType: d.requestType}
		op.Responses = append(op.Responses, errResp(401), errResp(403), errResp(500))
		if d.request != nil {
			op.Request = reflect.TypeOf(d.request).Elem()
			op.Responses = append(op.Responses, errResp(400), openapi.Response{Status: 422, ContentType: "text/plain"})
		}
		if d.query != nil { // a bad query value
			op.Responses = append(op.Responses, errResp(400))
		}
		if strings.Contains(rt.Pattern, "{") {
			op.Responses = append(op.Responses, errResp(404))
		}
		if rt.Mutates {
			op.Responses = append(op.Responses, errResp(409))
		}
		for _, st := range d.errs {
			op.Responses = append(op.Responses, errResp(st))
		}
		ops = append(ops, op)
	}
	return openapi.Build(openapi.Options{
		Title:   "vmhost",
		Version: "1",
		Description: "The per-host VM agent's API: classic VMs and AppVMs, their lifecycle, images, host catalogs, " +
			"events and metrics. Errors are {\"code\",\"message\"}; a body that is not valid JSON for its route is a 422 in plain text.",
		Enums: map[reflect.Type][]string{
			reflect.TypeFor[vm.State](): {string(vm.StateCreated), string(vm.StateRunning), string(vm.StatePaused), string(vm.StateStopped), string(vm.StateFailed)},
		},
	}, ops)
}

// serveOpenAPI answers GET /api/openapi.json.
func (s *Server) serveOpenAPI(w http.ResponseWriter, r *http.Request) {
	doc, err := openAPI(s.routes)
	if err != nil {
		s.fail(w, r, err)
		return
	}
	h := w.Header()
	h["Content-Type"] = jsonContentType
	w.WriteHeader(http.StatusOK)
	w.Write(doc)
}
