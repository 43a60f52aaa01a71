// Package api serves vmhost's HTTP contract (docs/api.md): the
// routes, authentication, the error envelope, strict body decoding (422)
// and the JSON views.
//
// Every request goes: route match (unknown paths: 404 NOT_FOUND, wrong
// method: 405 with Allow) → auth (401/403; nothing is read or written
// before it passes) → body limit and strict decode (422 plain text; one
// helper, decodeBody) → validation (400) → admission (409) → execution
// (201/202, or 500). The handlers call down only: into appvm for the
// AppVM family's create, views, spec edits and redeploys, and into vm for
// the rules both families share (lifecycle actions, volumes, balloon) and
// for classic VMs.
//
// Knobs: MaxBodyBytes. A body larger than that is refused with 400
// BAD_REQUEST before decoding (the contract has no 413). A body must
// arrive within Config.BodyReadTimeout (DefaultBodyReadTimeout): a client
// that sends headers and then trickles or stalls is answered 400 and
// cannot hold a connection and a handler forever. The deadline is set per
// request body, not as the server's ReadTimeout, which would also end
// long-lived responses (the event stream) whose request has long been read.
package api

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"vmhost/appvm"
	"vmhost/audit"
	"vmhost/auth"
	"vmhost/disk"
	"vmhost/events"
	"vmhost/hostpci"
	"vmhost/registry"
	"vmhost/vm"
)

// MaxBodyBytes is the largest request body accepted (1 MiB), except on
// the routes that carry an AppVM's files: MaxWorkloadBodyBytes there.
const MaxBodyBytes = 1 << 20

// MaxWorkloadBodyBytes bounds an AppVM create or spec edit: its files may
// hold 4 MiB of content (appvm.MaxInjectedTotalBytes), which JSON escaping
// can grow.
const MaxWorkloadBodyBytes = 12 << 20

// DefaultBodyReadTimeout bounds the reading of a request body: 1 MiB in
// 30 s needs no more than about 35 KB/s.
const DefaultBodyReadTimeout = 30 * time.Second

// Error codes of docs/api.md (Conventions), plus CAPACITY_CONFLICT (docs/design.md §5).
const (
	CodeBadRequest       = "BAD_REQUEST"
	CodeUnauthorized     = "UNAUTHORIZED"
	CodeForbidden        = "FORBIDDEN"
	CodeNotFound         = "NOT_FOUND"
	CodeAlreadyExists    = "ALREADY_EXISTS"
	CodeConflict         = "CONFLICT"
	CodeInvalidState     = "INVALID_STATE"
	CodeCapacityConflict = "CAPACITY_CONFLICT"
	CodeCHError          = "CH_ERROR"
	CodeNetworkError     = "NETWORK_ERROR"
	CodeStorageError     = "STORAGE_ERROR"
	CodeInternal         = "INTERNAL"
)

// Authorizer checks an Authorization header for a route pattern, exactly
// as the mux spells it. *auth.Keyring implements it.
type Authorizer interface {
	Authorize(header, pattern string, mutates bool) (*auth.Key, error)
}

// Config holds the dependencies of the API. Keys, VMs and AppVMs are
// required.
type Config struct {
	Keys   Authorizer
	VMs    *vm.Service
	AppVMs *appvm.Service
	Logger *slog.Logger
	// Images runs AppVM image imports. Nil means an Importer over AppVMs'
	// catalog with default options (as root: owners and devices kept) and
	// the import limits of VMs' config, recovered at once: imports an agent
	// restart interrupted are failed and their leftovers removed.
	Images *appvm.Importer
	// BodyReadTimeout bounds the reading of a request body; 0 means
	// DefaultBodyReadTimeout.
	BodyReadTimeout time.Duration
	// Registry lists the registry images; nil lists none.
	Registry *registry.Registry
	// ImageCache is the verified image cache classic creates download
	// into; nil shows an empty cache.
	ImageCache *disk.Cache
	// PCIIDs are the pci.ids files tried for device names; nil means
	// hostpci.PCIIDsPaths.
	PCIIDs []string
	// Events is the event log GET /api/events streams, and where the
	// default Images publishes image_ready and image_failed; nil answers
	// the stream with 500.
	Events *events.Log
	// Audit gets one entry per request to a mutating route (denied ones
	// included); nil audits nothing.
	Audit *audit.Log
	// AgentID and Version are what GET /api/host says this agent is: its
	// id on the host (package agentid) and its release.
	AgentID, Version string
	// KVMDevice is the device GET /api/host tries for kvm; empty means
	// /dev/kvm.
	KVMDevice string
	// Features are the capabilities GET /api/host lists besides the API's
	// own (api/host.go), from the packages below it.
	Features []Feature
}

// Server is the API's http.Handler. It is safe for concurrent use.
type Server struct {
	keys   Authorizer
	vms    *vm.Service
	apps   *appvm.Service
	images *appvm.Importer
	log    *slog.Logger
	// bodyTimeout is Config.BodyReadTimeout.
	bodyTimeout time.Duration
	registry    *registry.Registry
	cache       *disk.Cache
	pciIDs      []string
	mux         *http.ServeMux
	routes      []Route
	events      *events.Log
	audit       *audit.Log
	scrape      scrapeState
	// agentID, version, kvmDevice and features are GET /api/host's.
	agentID, version, kvmDevice string
	features                    []Feature
	// streamsCtx ends when CloseStreams is called.
	streamsCtx   context.Context
	closeStreams context.CancelFunc
}

// Route is one API route: its pattern as the mux spells it (also the
// allowlist entry of an API key) and whether it mutates (needs a
// readwrite key).
type Route struct {
	Pattern string
	Mutates bool
	handle  func(*Server, http.ResponseWriter, *http.Request)
}

// routeTable is every route of the API, in one place.
var routeTable = []Route{
	{"GET /api/vms", false, (*Server).listVMs},
	{"GET /api/vms/{id}", false, (*Server).getVM},
	{"POST /api/vms", true, (*Server).createVM},
	{"GET /api/appvm/vms", false, (*Server).listAppVMs},
	{"GET /api/appvm/vms/{id}", false, (*Server).getAppVM},
	{"POST /api/appvm/vms", true, (*Server).createAppVM},
	{"PATCH /api/appvm/vms/{id}/spec", true, (*Server).editAppVMSpec},
	{"POST /api/appvm/vms/{id}/redeploy", true, (*Server).redeployAppVM},
	// Labels and the host's capacity (api/labels.go, api/host.go).
	{"PATCH /api/vms/{id}/labels", true, editLabels(vm.ModeVM)},
	{"PATCH /api/appvm/vms/{id}/labels", true, editLabels(vm.ModeAppVM)},
	{"GET /api/host", false, (*Server).getHost},
	// Lifecycle (api/lifecycle.go).
	{"POST /api/vms/{id}/start", true, startVM(vm.ModeVM)},
	{"POST /api/vms/{id}/shutdown", true, actVM(vm.ModeVM, vm.ActionShutdown)},
	{"POST /api/vms/{id}/stop", true, actVM(vm.ModeVM, vm.ActionStop)},
	{"POST /api/vms/{id}/pause", true, actVM(vm.ModeVM, vm.ActionPause)},
	{"POST /api/vms/{id}/resume", true, actVM(vm.ModeVM, vm.ActionResume)},
	{"POST /api/vms/{id}/reboot", true, actVM(vm.ModeVM, vm.ActionReboot)},
	{"DELETE /api/vms/{id}", true, deleteVM(vm.ModeVM)},
	{"POST /api/appvm/vms/{id}/start", true, startVM(vm.ModeAppVM)},
	{"POST /api/appvm/vms/{id}/shutdown", true, actVM(vm.ModeAppVM, vm.ActionShutdown)},
	{"POST /api/appvm/vms/{id}/stop", true, actVM(vm.ModeAppVM, vm.ActionStop)},
	{"POST /api/appvm/vms/{id}/pause", true, actVM(vm.ModeAppVM, vm.ActionPause)},
	{"POST /api/appvm/vms/{id}/resume", true, actVM(vm.ModeAppVM, vm.ActionResume)},
	{"POST /api/appvm/vms/{id}/reboot", true, actVM(vm.ModeAppVM, vm.ActionReboot)},
	{"DELETE /api/appvm/vms/{id}", true, deleteVM(vm.ModeAppVM)},
	{"GET /api/appvm/images", false, (*Server).listImages},
	{"GET /api/appvm/images/{id}", false, (*Server).getImage},
	{"POST /api/appvm/images", true, (*Server).importImage},
	{"DELETE /api/appvm/images/{id}", true, (*Server).deleteImage},
	{"GET /api/networks", false, (*Server).listNetworks},
	// Host catalogs and the balloon (api/catalogs.go).
	{"GET /api/registry/images", false, (*Server).listRegistryImages},
	{"GET /api/registry/images/{id}", false, (*Server).getRegistryImage},
	{"GET /api/host/pci", false, (*Server).listHostPCI},
	{"GET /api/images/cache", false, (*Server).listImageCache},
	{"DELETE /api/images/cache/{digest}", true, (*Server).deleteImageCache},
	{"POST /api/vms/{id}/balloon", true, setBalloon(vm.ModeVM)},
	{"POST /api/appvm/vms/{id}/balloon", true, setBalloon(vm.ModeAppVM)},
	// Volumes (api/volumes.go).
	{"GET /api/volumes", false, (*Server).listVolumes},
	{"GET /api/volumes/{id}", false, (*Server).getVolume},
	{"POST /api/volumes", true, (*Server).createVolume},
	{"DELETE /api/volumes/{id}", true, (*Server).deleteVolume},
	{"POST /api/vms/{id}/volumes", true, attachVolume(vm.ModeVM)},
	{"DELETE /api/vms/{id}/volumes/{vol}", true, detachVolume(vm.ModeVM)},
	{"POST /api/appvm/vms/{id}/volumes", true, attachVolume(vm.ModeAppVM)},
	{"DELETE /api/appvm/vms/{id}/volumes/{vol}", true, detachVolume(vm.ModeAppVM)},
	// Suspend and snapshots (api/snapshots.go).
	{"POST /api/vms/{id}/suspend", true, suspendVM(vm.ModeVM)},
	{"POST /api/appvm/vms/{id}/suspend", true, suspendVM(vm.ModeAppVM)},
	{"POST /api/vms/{id}/snapshots", true, createSnapshot(vm.ModeVM)},
	{"POST /api/appvm/vms/{id}/snapshots", true, createSnapshot(vm.ModeAppVM)},
	{"POST /api/vms/{id}/restore", true, restoreVM(vm.ModeVM)},
	{"POST /api/appvm/vms/{id}/restore", true, restoreVM(vm.ModeAppVM)},
	{"GET /api/snapshots", false, (*Server).listSnapshots},
	{"GET /api/snapshots/{id}", false, (*Server).getSnapshot},
	{"DELETE /api/snapshots/{id}", true, (*Server).deleteSnapshot},
	// Guest operations (api/guestops.go).
	{"POST /api/appvm/vms/{id}/exec", true, (*Server).execAppVM},
	{"GET /api/appvm/vms/{id}/files", false, (*Server).getFiles},
	{"PUT /api/appvm/vms/{id}/files", true, (*Server).putFiles},
	{"POST /api/appvm/vms/{id}/signal", true, (*Server).signalAppVM},
	// Guest operations that read (api/guestlogs.go).
	{"GET /api/vms/{id}/wait", false, waitVM(vm.ModeVM)},
	{"GET /api/appvm/vms/{id}/wait", false, waitVM(vm.ModeAppVM)},
	{"GET /api/vms/{id}/console", false, consoleLog(vm.ModeVM)},
	{"GET /api/appvm/vms/{id}/console", false, consoleLog(vm.ModeAppVM)},
	{"GET /api/appvm/vms/{id}/logs", false, (*Server).workloadLogs},
	// Observability (api/events.go, api/metrics.go).
	{"GET /api/events", false, (*Server).streamEvents},
	{"GET /metrics", false, (*Server).metrics},
	{"GET /api/openapi.json", false, (*Server).serveOpenAPI},
}

// Routes lists the API's routes, for key allowlists and documentation.
func Routes() []Route { return slices.Clone(routeTable) }

// New returns the API handler.
func New(c Config) *Server {
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	if c.Images == nil {
		cfg := c.VMs.Config()
		io := appvm.ImportOptions{Logger: c.Logger, MaxBytes: cfg.ImageImportMaxBytes, MaxEntries: cfg.ImageImportMaxEntries}
		if c.Events != nil {
			io.Events = c.Events
		}
		var err error
		if c.Images, err = c.AppVMs.NewImporter(io); err != nil {
			c.Logger.Error("recovering AppVM image imports", "err", err)
		}
	}
	if c.BodyReadTimeout <= 0 {
		c.BodyReadTimeout = DefaultBodyReadTimeout
	}
	if c.PCIIDs == nil {
		c.PCIIDs = hostpci.PCIIDsPaths
	}
	if c.KVMDevice == "" {
		c.KVMDevice = "/dev/kvm"
	}
	s := &Server{keys: c.Keys, vms: c.VMs, apps: c.AppVMs, images: c.Images, log: c.Logger, mux: http.NewServeMux(), routes: Routes(),
		bodyTimeout: c.BodyReadTimeout, registry: c.Registry, cache: c.ImageCache, pciIDs: c.PCIIDs,
		events: c.Events, audit: c.Audit, agentID: c.AgentID, version: c.Version, kvmDevice: c.KVMDevice, features: c.Features}
	s.streamsCtx, s.closeStreams = context.WithCancel(context.Background())
	for _, rt := range s.routes {
		s.mux.Handle(rt.Pattern, s.guard(rt))
	}
	s.mux.HandleFunc("/", s.noRoute)
	return s
}

// ServeHTTP serves the API.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) { s.mux.ServeHTTP(w, r) }

// guard authenticates a request for rt before anything else happens, and
// audits it when rt mutates.
func (s *Server) guard(rt Route) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key, err := s.keys.Authorize(r.Header.Get("Authorization"), rt.Pattern, rt.Mutates)
		if rt.Mutates && s.audit != nil {
			aw := &auditWriter{ResponseWriter: w, status: http.StatusOK}
			w, r = aw, withAudit(r, aw)
			defer s.audited(rt, r, key, aw, time.Now())
		}
		if err != nil {
			switch {
			case errors.Is(err, auth.ErrForbidden):
				writeError(w, http.StatusForbidden, CodeForbidden, err.Error())
			default:
				writeError(w, http.StatusUnauthorized, CodeUnauthorized, err.Error()) // never holds the token
			}
			return
		}
		rt.handle(s, w, r)
	})
}

var probeMethods = []string{http.MethodGet, http.MethodPost, http.MethodPut, http.MethodPatch, http.MethodDelete}

// noRoute answers requests that match no route: 405 with Allow when the
// path exists under another method, else 404, both as JSON.
func (s *Server) noRoute(w http.ResponseWriter, r *http.Request) {
	var allow []string
	for _, m := range probeMethods {
		probe := r.Clone(r.Context())
		probe.Method = m
		if _, pat := s.mux.Handler(probe); pat != "/" && pat != "" {
			allow = append(allow, m)
		}
	}
	if len(allow) > 0 {
		if slices.Contains(allow, http.MethodGet) {
			allow = append(allow, http.MethodHead)
		}
		w.Header().Set("Allow", strings.Join(allow, ", "))
		writeError(w, http.StatusMethodNotAllowed, CodeBadRequest, fmt.Sprintf("method %s is not allowed on %s", r.Method, r.URL.Path))
		return
	}
	writeError(w, http.StatusNotFound, CodeNotFound, fmt.Sprintf("no such endpoint: %s", r.URL.Path))
}

// errorBody is the contract's error envelope.
type errorBody struct {
	Code    string `json:"code"`
	Message string `json:"message"`
}

func writeError(w http.ResponseWriter, status int, code, msg string) {
	writeJSON(w, status, errorBody{Code: code, Message: msg})
}

var bufPool = sync.Pool{New: func() any { return new(bytes.Buffer) }}

// writeJSON encodes v and writes it with its length.
func writeJSON(w http.ResponseWriter, status int, v any) {
	buf := bufPool.Get().(*bytes.Buffer)
	defer func() {
		if buf.Cap() <= 1<<20 {
			buf.Reset()
			bufPool.Put(buf)
		}
	}()
	enc := json.NewEncoder(buf)
	enc.SetEscapeHTML(false) // shell snippets in args stay readable
	if err := enc.Encode(v); err != nil {
		buf.Reset()
		status = http.StatusInternalServerError
		fmt.Fprintf(buf, "{\"code\":%q,\"message\":\"encoding the response failed\"}\n", CodeInternal)
	}
	h := w.Header()
	h["Content-Type"] = jsonContentType
	h["Content-Length"] = []string{strconv.Itoa(buf.Len())}
	w.WriteHeader(status)
	w.Write(buf.Bytes())
}

var jsonContentType = []string{"application/json"}

// writeDecodeError answers 422 with one plain-text line.
func writeDecodeError(w http.ResponseWriter, err error) {
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	w.WriteHeader(http.StatusUnprocessableEntity)
	io.WriteString(w, err.Error()+"\n")
}

// decodeBody is the opening of every handler with a body: it reads the
// request body (at most max bytes, within the body read timeout) and
// decodes it strictly into v (decodeStrict). It answers the request itself
// and returns false when the body is refused (400) or does not decode
// (422); otherwise it returns the body too, for handlers that look at it
// again.
func (s *Server) decodeBody(w http.ResponseWriter, r *http.Request, max int64, v any) ([]byte, bool) {
	body, ok := s.readBody(w, r, max)
	if !ok {
		return nil, false
	}
	if err := decodeStrict(body, v); err != nil {
		writeDecodeError(w, err)
		return nil, false
	}
	return body, true
}

// readBody reads a request body of at most max bytes within the body read
// timeout. It answers the request itself and returns false when the body
// is refused.
func (s *Server) readBody(w http.ResponseWriter, r *http.Request, max int64) ([]byte, bool) {
	if r.ContentLength > max {
		writeError(w, http.StatusBadRequest, CodeBadRequest, fmt.Sprintf("body: larger than %d bytes", max))
		return nil, false
	}
	rc := http.NewResponseController(w)
	// A writer without deadlines (a test recorder) reads without one.
	deadline := rc.SetReadDeadline(time.Now().Add(s.bodyTimeout)) == nil
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, max))
	if err == nil && deadline {
		// The body is in: the connection may idle or stream again.
		rc.SetReadDeadline(time.Time{})
	}
	if err != nil {
		// The deadline stays, so the server's drain of the rest of the
		// body after the answer does not wait on the stalled client
		// either; the connection is not reused.
		w.Header().Set("Connection", "close")
		var tooBig *http.MaxBytesError
		switch {
		case errors.As(err, &tooBig):
			writeError(w, http.StatusBadRequest, CodeBadRequest, fmt.Sprintf("body: larger than %d bytes", max))
		case errors.Is(err, os.ErrDeadlineExceeded):
			writeError(w, http.StatusBadRequest, CodeBadRequest, fmt.Sprintf("body: not received within %v", s.bodyTimeout))
		default:
			writeError(w, http.StatusBadRequest, CodeBadRequest, "body: reading failed")
		}
		return nil, false
	}
	return body, true
}

// fail answers err with its status and code.
func (s *Server) fail(w http.ResponseWriter, r *http.Request, err error) {
	var (
		fe  *vm.FieldError
		ee  *vm.ExistsError
		ce  *vm.CapacityError
		cfe *appvm.ConflictError
		re  *appvm.RefusedError
		se  *vm.StateError
		he  *vm.HostError
	)
	switch {
	case errors.As(err, &fe):
		writeError(w, http.StatusBadRequest, CodeBadRequest, fe.Error())
	case errors.As(err, &re):
		// The guest agent refused an operation (or the host an archive).
		writeError(w, http.StatusBadRequest, CodeBadRequest, re.Error())
	case errors.As(err, &ee):
		writeError(w, http.StatusConflict, CodeAlreadyExists, ee.Error())
	case errors.As(err, &se):
		// A lifecycle action, or a create whose VM changed state under it.
		writeError(w, http.StatusConflict, CodeInvalidState, se.Error())
	case errors.As(err, &ce):
		writeError(w, http.StatusConflict, CodeCapacityConflict, "host capacity: "+ce.Error())
	case errors.As(err, &cfe):
		writeError(w, http.StatusConflict, CodeConflict, cfe.Error())
	case errors.As(err, &he):
		code := map[vm.HostErrorKind]string{
			vm.HostStorage:    CodeStorageError,
			vm.HostNetwork:    CodeNetworkError,
			vm.HostHypervisor: CodeCHError,
		}[he.Kind]
		if code == "" {
			code = CodeInternal
		}
		s.log.Error("request failed", "method", r.Method, "path", r.URL.Path, "err", err)
		writeError(w, http.StatusInternalServerError, code, he.Error())
	case errors.Is(err, fs.ErrNotExist):
		writeError(w, http.StatusNotFound, CodeNotFound, err.Error())
	default:
		s.log.Error("request failed", "method", r.Method, "path", r.URL.Path, "err", err)
		writeError(w, http.StatusInternalServerError, CodeInternal, "internal error")
	}
}

func (s *Server) getVM(w http.ResponseWriter, r *http.Request) {
	rec, err := s.vms.Get(vm.ModeVM, r.PathValue("id"))
	if err != nil {
		writeError(w, http.StatusNotFound, CodeNotFound, "no classic VM has this id")
		return
	}
	writeView(w, http.StatusOK, s.vms.ViewJSON(rec, vm.ViewOptions{DiskBytes: true}))
}

// writeView writes an encoded classic view (vm.Service.ViewJSON): the
// bytes writeJSON would write for the view.
func writeView(w http.ResponseWriter, status int, view []byte) {
	bp := viewBufPool.Get().(*[]byte)
	b := append(append((*bp)[:0], view...), '\n')
	writeBytes(w, status, b)
	if cap(b) <= 1<<20 {
		*bp = b
		viewBufPool.Put(bp)
	}
}

func writeBytes(w http.ResponseWriter, status int, b []byte) {
	h := w.Header()
	h["Content-Type"] = jsonContentType
	h["Content-Length"] = []string{strconv.Itoa(len(b))}
	w.WriteHeader(status)
	w.Write(b)
}

var viewBufPool = sync.Pool{New: func() any { b := make([]byte, 0, 4096); return &b }}

func (s *Server) getAppVM(w http.ResponseWriter, r *http.Request) {
	rec, err := s.apps.Get(r.PathValue("id"))
	if err != nil {
		writeError(w, http.StatusNotFound, CodeNotFound, "no AppVM has this id")
		return
	}
	writeJSON(w, http.StatusOK, s.apps.View(rec, vm.ViewOptions{DiskBytes: true}))
}

type appvmList struct {
	VMs []*appvm.View `json:"vms"`
}

// listVMs writes {"vms":[...]} (docs/design.md §5) from each VM's encoded list
// view (vm.Service.ViewJSON), piece by piece without copying them: the
// bytes writeJSON would give for the list. ?label= filters it.
func (s *Server) listVMs(w http.ResponseWriter, r *http.Request) {
	sel, ok := labelSelector(w, r)
	if !ok {
		return
	}
	recs := filterLabels(s.vms.List(vm.ModeVM), sel)
	items := make([][]byte, len(recs))
	n := len(listHead) + len(listTail) + max(len(recs)-1, 0) // the commas
	for i, rec := range recs {
		items[i] = s.vms.ViewJSON(rec, vm.ViewOptions{})
		n += len(items[i])
	}
	h := w.Header()
	h["Content-Type"] = jsonContentType
	h["Content-Length"] = []string{strconv.Itoa(n)}
	w.WriteHeader(http.StatusOK)
	w.Write(listHead)
	for i, b := range items {
		if i > 0 {
			w.Write(comma)
		}
		w.Write(b)
	}
	w.Write(listTail)
}

var listHead, comma, listTail = []byte(`{"vms":[`), []byte(","), []byte("]}\n")

func (s *Server) listAppVMs(w http.ResponseWriter, r *http.Request) {
	sel, ok := labelSelector(w, r)
	if !ok {
		return
	}
	out := appvmList{VMs: []*appvm.View{}}
	for _, rec := range filterLabels(s.apps.List(), sel) {
		out.VMs = append(out.VMs, s.apps.View(rec, vm.ViewOptions{}))
	}
	writeJSON(w, http.StatusOK, out)
}

func (s *Server) createVM(w http.ResponseWriter, r *http.Request) {
	var spec vm.Spec
	body, ok := s.decodeBody(w, r, MaxBodyBytes, &spec)
	if !ok {
		return
	}
	noteID(r, spec.VMID)
	if err := checkEmptyVMID(body); err != nil {
		s.fail(w, r, err)
		return
	}
	rec, async, err := s.vms.CreateVM(r.Context(), &spec)
	if err != nil {
		s.fail(w, r, err)
		return
	}
	noteID(r, rec.ID)
	status := http.StatusCreated
	if async {
		status = http.StatusAccepted
	}
	writeView(w, status, s.vms.ViewJSON(rec, vm.ViewOptions{DiskBytes: true}))
}

func (s *Server) createAppVM(w http.ResponseWriter, r *http.Request) {
	var req appvm.CreateRequest
	body, ok := s.decodeBody(w, r, MaxWorkloadBodyBytes, &req)
	if !ok {
		return
	}
	noteID(r, req.VMID)
	if err := checkEmptyVMID(body); err != nil {
		s.fail(w, r, err)
		return
	}
	resp, err := s.apps.Create(r.Context(), &req)
	if err != nil {
		s.fail(w, r, err)
		return
	}
	noteID(r, resp.ID)
	writeJSON(w, http.StatusCreated, resp)
}

// checkEmptyVMID refuses a create body that gives vm_id as "" (400). The
// decoded request cannot tell it from an absent vm_id, which asks for a
// generated id; a client whose id came out empty would otherwise get a new
// VM on every retry. Run after decodeStrict, which has refused every
// spelling of the key but the exact one.
func checkEmptyVMID(body []byte) error {
	var probe struct {
		VMID *string `json:"vm_id"`
	}
	if json.Unmarshal(body, &probe) == nil && probe.VMID != nil && *probe.VMID == "" {
		return &vm.FieldError{Field: "vm_id", Msg: "must not be empty; omit vm_id to have one generated"}
	}
	return nil
}
