package api

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"vmhost/appvm"
	"vmhost/auth"
	"vmhost/vm"
)

// spyBody records whether the handler read the request body.
type spyBody struct {
	r    io.Reader
	read bool
}

func (b *spyBody) Read(p []byte) (int, error) { b.read = true; return b.r.Read(p) }
func (b *spyBody) Close() error               { return nil }

// allStates are the display states a wait may ask for.
const allStates = "created,running,paused,stopped,failed,booting,downloading,creating,provision_failed"

// TestAuthMatrix runs every route with no header, malformed headers, an
// unknown token, a read key, a key whose allowlist lacks the route, and an
// allowed key. A request that fails auth reads no body and changes nothing.
func TestAuthMatrix(t *testing.T) {
	h := newHarness(t)
	if st, _, b := h.do(t, "POST", "/api/vms", h.rw, minimalVMBody(h, "fixture")); st != 201 {
		t.Fatalf("fixture: %d %s", st, b)
	}
	if st, _, b := h.do(t, "POST", "/api/appvm/vms", h.rw, `{"vm_id":"app-fixture","image_id":"plain","vcpus":1,"memory_mb":64,"disk_gib":1}`); st != 201 {
		t.Fatalf("fixture: %d %s", st, b)
	}
	// The volume routes' fixtures: a classic VM and a stopped AppVM, each
	// with a VM-owned volume data0 to detach, and first-class volumes to
	// read and to delete.
	for _, c := range [][2]string{
		{"/api/vms", fmt.Sprintf(`{"vm_id":"vol-fixture","vcpus":1,"memory_mb":512,"kernel_path":%q,"disk":{"base_path":%q},"volumes":[{"size_gib":1}]}`, h.e.Kernel, h.e.Base)},
		{"/api/appvm/vms", `{"vm_id":"app-vol-fixture","image_id":"plain","vcpus":1,"memory_mb":64,"disk_gib":1,"auto_boot":false,"data_volumes":[{"size_gib":1,"mountpoint":"/d"}]}`},
		{"/api/volumes", `{"volume_id":"vol-a","size_gib":1}`},
		{"/api/volumes", `{"volume_id":"vol-spare","size_gib":1}`},
		// The snapshot routes': one to read and one to delete.
		{"/api/vms/vol-fixture/snapshots", `{"snapshot_id":"snap-fixture"}`},
		{"/api/vms/vol-fixture/snapshots", `{"snapshot_id":"snap-spare"}`},
	} {
		if st, _, b := h.do(t, "POST", c[0], h.rw, c[1]); st != 201 {
			t.Fatalf("fixture %s: %d %s", c[0], st, b)
		}
	}
	// A key allowed only a route that is not the one under test.
	other, err := auth.Add(h.keysPath, "other", auth.ScopeReadWrite, []string{"GET /api/networks"})
	if err != nil {
		t.Fatal(err)
	}
	otherForNetworks, err := auth.Add(h.keysPath, "other2", auth.ScopeReadWrite, []string{"GET /api/vms"})
	if err != nil {
		t.Fatal(err)
	}
	h.start(t) // reload the keyring

	paths := map[string]string{
		"GET /api/vms":            "/api/vms",
		"GET /api/vms/{id}":       "/api/vms/fixture",
		"POST /api/vms":           "/api/vms",
		"GET /api/appvm/vms":      "/api/appvm/vms",
		"GET /api/appvm/vms/{id}": "/api/appvm/vms/app-fixture",
		"POST /api/appvm/vms":     "/api/appvm/vms",

		"GET /api/appvm/images":         "/api/appvm/images",
		"GET /api/appvm/images/{id}":    "/api/appvm/images/web",
		"POST /api/appvm/images":        "/api/appvm/images",
		"DELETE /api/appvm/images/{id}": "/api/appvm/images/spare",
		"GET /api/networks":             "/api/networks",

		"GET /api/registry/images":          "/api/registry/images",
		"GET /api/registry/images/{id}":     "/api/registry/images/debian-12",
		"GET /api/host/pci":                 "/api/host/pci",
		"GET /api/host":                     "/api/host",
		"GET /api/images/cache":             "/api/images/cache",
		"DELETE /api/images/cache/{digest}": "/api/images/cache/" + fixtureDigest,

		"GET /api/events": "/api/events",
		"GET /metrics":    "/metrics",

		"GET /api/openapi.json": "/api/openapi.json",

		"PATCH /api/appvm/vms/{id}/spec":    "/api/appvm/vms/app-fixture/spec",
		"POST /api/appvm/vms/{id}/redeploy": "/api/appvm/vms/app-fixture/redeploy",
		"PATCH /api/vms/{id}/labels":        "/api/vms/fixture/labels",
		"PATCH /api/appvm/vms/{id}/labels":  "/api/appvm/vms/app-fixture/labels",

		"GET /api/volumes":                         "/api/volumes",
		"GET /api/volumes/{id}":                    "/api/volumes/vol-a",
		"POST /api/volumes":                        "/api/volumes",
		"DELETE /api/volumes/{id}":                 "/api/volumes/vol-spare",
		"POST /api/vms/{id}/volumes":               "/api/vms/vol-fixture/volumes",
		"DELETE /api/vms/{id}/volumes/{vol}":       "/api/vms/vol-fixture/volumes/data0",
		"POST /api/appvm/vms/{id}/volumes":         "/api/appvm/vms/app-vol-fixture/volumes",
		"DELETE /api/appvm/vms/{id}/volumes/{vol}": "/api/appvm/vms/app-vol-fixture/volumes/data0",

		"GET /api/snapshots":              "/api/snapshots",
		"GET /api/snapshots/{id}":         "/api/snapshots/snap-fixture",
		"DELETE /api/snapshots/{id}":      "/api/snapshots/snap-spare",
		"POST /api/appvm/vms/{id}/exec":   "/api/appvm/vms/app-fixture/exec",
		"GET /api/appvm/vms/{id}/files":   "/api/appvm/vms/app-fixture/files?path=/etc",
		"PUT /api/appvm/vms/{id}/files":   "/api/appvm/vms/app-fixture/files?path=/tmp",
		"POST /api/appvm/vms/{id}/signal": "/api/appvm/vms/app-fixture/signal",
		// Fixtures no route of the table deletes (the deletes come first).
		"GET /api/vms/{id}/wait":          "/api/vms/vol-fixture/wait?for=" + allStates + "&timeout_secs=1",
		"GET /api/appvm/vms/{id}/wait":    "/api/appvm/vms/app-vol-fixture/wait?for=" + allStates + "&timeout_secs=1",
		"GET /api/vms/{id}/console":       "/api/vms/vol-fixture/console",
		"GET /api/appvm/vms/{id}/console": "/api/appvm/vms/app-vol-fixture/console",
		"GET /api/appvm/vms/{id}/logs":    "/api/appvm/vms/app-vol-fixture/logs",

		"DELETE /api/vms/{id}":       "/api/vms/fixture?force=true",
		"DELETE /api/appvm/vms/{id}": "/api/appvm/vms/app-fixture?force=true",
	}
	for _, a := range append(slices.Clone(vm.Actions), "balloon", "suspend", "snapshots", "restore") {
		paths["POST /api/vms/{id}/"+string(a)] = "/api/vms/fixture/" + string(a)
		paths["POST /api/appvm/vms/{id}/"+string(a)] = "/api/appvm/vms/app-fixture/" + string(a)
	}
	// An image no AppVM uses, for the allowed DELETE; a file that is no
	// image, for the allowed POST (its import fails in the background).
	if err := h.apps.Catalog().Put(&appvm.Image{ID: "spare", Status: appvm.StatusReady, CreatedAt: h.e.Now}); err != nil {
		t.Fatal(err)
	}
	notAnImage := filepath.Join(t.TempDir(), "not-an-image.tar")
	if err := os.WriteFile(notAnImage, []byte("junk"), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(h.srv.images.Wait)
	n := 0
	for _, rt := range Routes() {
		method, _, _ := strings.Cut(rt.Pattern, " ")
		path, ok := paths[rt.Pattern]
		if !ok {
			t.Fatalf("no test path for route %s", rt.Pattern)
		}
		// A body that would be a 422 if it were decoded.
		const junk = `{"vcpus":`
		type tc struct {
			name, header string
			status       int
			code         string
		}
		lacking := other
		if rt.Pattern == "GET /api/networks" {
			lacking = otherForNetworks
		}
		cases := []tc{
			{"no header", "", 401, CodeUnauthorized},
			{"basic scheme", "Basic dXNlcjpwYXNz", 401, CodeUnauthorized},
			{"bearer without token", "Bearer", 401, CodeUnauthorized},
			{"bearer with two tokens", "Bearer " + h.rw + " x", 401, CodeUnauthorized},
			{"unknown token", "Bearer vmh_" + strings.Repeat("0", 43), 401, CodeUnauthorized},
			{"allowlist lacks route", "Bearer " + lacking, 403, CodeForbidden},
		}
		if rt.Mutates {
			cases = append(cases, tc{"read key on mutation", "Bearer " + h.ro, 403, CodeForbidden})
		}
		if rt.Pattern != "GET /api/vms/{id}" {
			cases = append(cases, tc{"narrow key elsewhere", "Bearer " + h.narrow, 403, CodeForbidden})
		}
		for _, c := range cases {
			t.Run(rt.Pattern+"/"+c.name, func(t *testing.T) {
				before := h.e.Host.Transcript()
				recs := countRecords(t, h)
				body := &spyBody{r: strings.NewReader(junk)}
				req := httptest.NewRequest(method, path, body)
				if c.header != "" {
					req.Header.Set("Authorization", c.header)
				}
				w := httptest.NewRecorder()
				h.srv.ServeHTTP(w, req)
				h.validate(t, req, w)
				seenMu.Lock()
				seenBodies = append(seenBodies, w.Body.String())
				seenMu.Unlock()
				if w.Code != c.status || !strings.Contains(w.Body.String(), `"code":"`+c.code+`"`) {
					t.Errorf("%s %s with %q = %d %s, want %d %s", method, path, c.name, w.Code, w.Body, c.status, c.code)
				}
				if body.read {
					t.Error("the body was read for a request that failed auth")
				}
				if h.e.Host.Transcript() != before || countRecords(t, h) != recs {
					t.Error("a request that failed auth changed the host or the store")
				}
				if strings.Contains(w.Body.String(), h.rw) {
					t.Error("the response echoes the token")
				}
			})
			n++
		}
		// Allowed: readwrite key for everything; read key for reads; the
		// narrow key on its one route.
		allowed := []string{h.rw}
		if !rt.Mutates {
			allowed = append(allowed, h.ro)
		}
		if rt.Pattern == "GET /api/vms/{id}" {
			allowed = append(allowed, h.narrow)
		}
		for i, tok := range allowed {
			t.Run(fmt.Sprintf("%s/allowed%d", rt.Pattern, i), func(t *testing.T) {
				if rt.Pattern == "GET /api/events" {
					// A stream answers 200 at once and ends with its client.
					ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
					defer cancel()
					req := httptest.NewRequestWithContext(ctx, method, path, nil)
					req.Header.Set("Authorization", "Bearer "+tok)
					w := httptest.NewRecorder()
					h.srv.ServeHTTP(w, req)
					if w.Code != http.StatusOK || w.Header().Get("Content-Type") != "text/event-stream" {
						t.Errorf("%s allowed = %d %q", path, w.Code, w.Header().Get("Content-Type"))
					}
					return
				}
				body := ""
				switch rt.Pattern {
				case "POST /api/vms":
					body = minimalVMBody(h, "ok-vm")
				case "POST /api/appvm/vms":
					body = `{"vm_id":"ok-app","image_id":"plain","vcpus":1,"memory_mb":64,"disk_gib":1}`
				case "POST /api/appvm/images":
					body = `{"id":"ok-image","path":"` + notAnImage + `"}`
				case "PATCH /api/appvm/vms/{id}/spec":
					body = `{"keepalive":true}`
				case "PATCH /api/vms/{id}/labels", "PATCH /api/appvm/vms/{id}/labels":
					body = `{"team":"infra"}`
				case "POST /api/volumes":
					body = `{"volume_id":"ok-vol","size_gib":1}`
				case "POST /api/vms/{id}/volumes":
					body = `{"volume_id":"vol-a"}`
				case "POST /api/appvm/vms/{id}/volumes":
					body = `{"size_gib":1,"mountpoint":"/extra"}`
				}
				st, _, b := h.do(t, method, path, tok, body)
				h.apps.Wait() // a redeploy's background work, before the next case looks
				_, mkfsErr := exec.LookPath("mkfs.ext4")
				attach := strings.HasSuffix(rt.Pattern, "{id}/volumes") && (mkfsErr == nil || rt.Pattern == "POST /api/vms/{id}/volumes")
				if method == http.MethodPost && strings.Contains(rt.Pattern, "{id}/") && !attach || strings.HasSuffix(rt.Pattern, "/files") {
					// Lifecycle actions and guest operations: what follows
					// auth depends on the fixture's state and the fake host
					// (lifecycle_test.go, guestops_linux_test.go).
					if st == http.StatusUnauthorized || st == http.StatusForbidden {
						t.Errorf("%s %s allowed = %d %s", method, path, st, b)
					}
					return
				}
				want := http.StatusOK
				switch {
				case rt.Pattern == "POST /api/appvm/images":
					want = http.StatusAccepted
				case method == http.MethodPatch:
					want = http.StatusOK
				case strings.HasSuffix(rt.Pattern, "/redeploy"):
					want = http.StatusAccepted
				case attach || strings.HasSuffix(rt.Pattern, "/volumes/{vol}"):
					want = http.StatusOK // the VM's view
				case method == http.MethodDelete:
					want = http.StatusNoContent
				case rt.Mutates:
					want = http.StatusCreated
				}
				if st != want {
					t.Errorf("%s %s allowed = %d %s, want %d", method, path, st, b, want)
				}
			})
			n++
		}
	}
	t.Logf("%d auth cases over %d routes", n, len(Routes()))
}

func countRecords(t *testing.T, h *harness) int {
	t.Helper()
	m, err := filepath.Glob(filepath.Join(h.e.StateDir, "vms", "*.json"))
	if err != nil {
		t.Fatal(err)
	}
	ents, _ := os.ReadDir(filepath.Join(h.e.StateDir, "vms"))
	return len(m) + len(ents)
}
