package api

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"testing"

	"vmhost/vm"
)

// discardWriter is a reusable ResponseWriter, so the benchmark measures
// the handlers, not httptest.ResponseRecorder.
type discardWriter struct {
	h      http.Header
	status int
	n      int
}

func (d *discardWriter) Header() http.Header { return d.h }
func (d *discardWriter) WriteHeader(s int)   { d.status = s }
func (d *discardWriter) Write(p []byte) (int, error) {
	d.n += len(p)
	return len(p), nil
}

// BenchmarkGetVM reads one VM of 1,000 stored through the whole stack
// (mux, auth, registry, view, encoding): "api" as served (encoded view
// cached per record version for up to 1s), "api-uncached" building and
// encoding the view on every request, "api-encoding-json" doing so with
// encoding/json; beside them "preencoded", the same mux and auth writing
// the same bytes pre-encoded, and "bare", a handler writing them alone.
func BenchmarkGetVM(b *testing.B) {
	h := newHarness(b)
	h.e.Config.HostCPUs = 1 << 20
	h.e.Config.HostMemoryMB = 1 << 40
	for i := range 1000 {
		body := fmt.Sprintf(`{"vm_id":"vm-%04d","vcpus":2,"memory_mb":2048,"kernel_path":%q,"disk":{"base_path":%q,"size_gib":20},
			"volumes":[{"size_gib":10}],"nets":[{"network_id":"lab","ipv4":{"address":"192.0.2.10/24","gateway":"192.0.2.1","dns_servers":["192.0.2.53"]}}],
			"cloud_init":{"user":"ops","ssh_authorized_keys":["ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl ops@example"],"password":"pw"},
			"cpu_affinity":"2-3","disk_iops_total":2000,"auto_boot":true}`, i, h.e.Kernel, h.e.Base)
		if st, _, out := h.do(b, "POST", "/api/vms", h.rw, body); st != http.StatusCreated {
			b.Fatalf("create %d: %d %s", i, st, out)
		}
	}
	req := httptest.NewRequest("GET", "/api/vms/vm-0500", nil)
	req.Header.Set("Authorization", "Bearer "+h.ro)
	_, _, want := h.do(b, "GET", "/api/vms/vm-0500", h.ro, "")
	pre := []byte(want)

	preSrv := &Server{keys: h.srv.keys, log: h.srv.log, mux: http.NewServeMux()}
	preSrv.mux.Handle("GET /api/vms/{id}", preSrv.guard(Route{Pattern: "GET /api/vms/{id}", handle: func(_ *Server, w http.ResponseWriter, _ *http.Request) {
		w.Header()["Content-Type"] = jsonContentType
		w.WriteHeader(http.StatusOK)
		w.Write(pre)
	}}))
	bare := http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header()["Content-Type"] = jsonContentType
		w.WriteHeader(http.StatusOK)
		w.Write(pre)
	})

	// The same route, auth and view, encoded by encoding/json instead.
	reflectSrv := &Server{keys: h.srv.keys, log: h.srv.log, mux: http.NewServeMux()}
	reflectSrv.mux.Handle("GET /api/vms/{id}", reflectSrv.guard(Route{Pattern: "GET /api/vms/{id}", handle: func(_ *Server, w http.ResponseWriter, r *http.Request) {
		rec, err := h.vms.Get(vm.ModeVM, r.PathValue("id"))
		if err != nil {
			writeError(w, http.StatusNotFound, CodeNotFound, "no classic VM has this id")
			return
		}
		writeJSON(w, http.StatusOK, h.vms.View(rec, vm.ViewOptions{DiskBytes: true}))
	}}))
	uncached := New(Config{Keys: h.srv.keys, VMs: h.vms, AppVMs: h.apps, Logger: h.srv.log, NoViewMemo: true})
	for _, bc := range []struct {
		name string
		h    http.Handler
	}{{"api", h.srv}, {"api-no-memo", uncached}, {"api-encoding-json", reflectSrv}, {"preencoded", preSrv}, {"bare", bare}} {
		b.Run(bc.name, func(b *testing.B) {
			w := &discardWriter{h: http.Header{}}
			b.ReportAllocs()
			for b.Loop() {
				clear(w.h)
				w.n = 0
				bc.h.ServeHTTP(w, req)
			}
			if w.status != http.StatusOK || w.n != len(pre) {
				b.Fatalf("status %d, %d bytes, want 200 and %d", w.status, w.n, len(pre))
			}
		})
	}
}
