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

// benchHarness is a harness with 1,000 classic VMs, each with a volume,
// an interface and cloud-init.
func benchHarness(b *testing.B) *harness {
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
	return h
}

// runRead serves req through each handler in turn: "api" as served
// (encoded views memoized per record version), "api-encoding-json"
// building and encoding the views on every request; beside them
// "preencoded", the same mux and auth writing the same bytes pre-encoded,
// and "bare", a handler writing them alone.
func runRead(b *testing.B, h *harness, pattern string, req *http.Request, fresh func(*Server, http.ResponseWriter, *http.Request)) {
	_, _, want := h.do(b, "GET", req.URL.Path, h.ro, "")
	pre := []byte(want)
	write := func(w http.ResponseWriter) {
		w.Header()["Content-Type"] = jsonContentType
		w.WriteHeader(http.StatusOK)
		w.Write(pre)
	}
	preSrv := &Server{keys: h.srv.keys, log: h.srv.log, mux: http.NewServeMux()}
	preSrv.mux.Handle(pattern, preSrv.guard(Route{Pattern: pattern, handle: func(_ *Server, w http.ResponseWriter, _ *http.Request) { write(w) }}))
	freshSrv := &Server{keys: h.srv.keys, vms: h.vms, log: h.srv.log, mux: http.NewServeMux()}
	freshSrv.mux.Handle(pattern, freshSrv.guard(Route{Pattern: pattern, handle: fresh}))
	bare := http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { write(w) })
	for _, bc := range []struct {
		name string
		h    http.Handler
	}{{"api", h.srv}, {"api-encoding-json", freshSrv}, {"preencoded", preSrv}, {"bare", bare}} {
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

// BenchmarkGetVM reads one VM of 1,000 through the whole stack (mux,
// auth, registry, view, encoding).
func BenchmarkGetVM(b *testing.B) {
	h := benchHarness(b)
	req := httptest.NewRequest("GET", "/api/vms/vm-0500", nil)
	req.Header.Set("Authorization", "Bearer "+h.ro)
	runRead(b, h, "GET /api/vms/{id}", req, func(s *Server, w http.ResponseWriter, r *http.Request) {
		rec, err := s.vms.Get(vm.ModeVM, r.PathValue("id"))
		if err != nil {
			writeError(w, http.StatusNotFound, CodeNotFound, "no classic VM has this id")
			return
		}
		writeJSON(w, http.StatusOK, s.vms.View(rec, vm.ViewOptions{DiskBytes: true}))
	})
}

// BenchmarkListVMs lists 1,000 VMs through the whole stack.
func BenchmarkListVMs(b *testing.B) {
	h := benchHarness(b)
	req := httptest.NewRequest("GET", "/api/vms", nil)
	req.Header.Set("Authorization", "Bearer "+h.ro)
	runRead(b, h, "GET /api/vms", req, func(s *Server, w http.ResponseWriter, r *http.Request) {
		out := struct {
			VMs []*vm.View `json:"vms"`
		}{VMs: []*vm.View{}}
		for _, rec := range s.vms.List(vm.ModeVM) {
			out.VMs = append(out.VMs, s.vms.View(rec, vm.ViewOptions{}))
		}
		writeJSON(w, http.StatusOK, out)
	})
}
