package api

import (
	"net/http"
	"strings"
	"testing"
)

// TestLifecycleRoutes checks the API side of lifecycle actions over the
// recording host: 204 for an allowed start and delete, 409 INVALID_STATE
// with the state named, 404 for an unknown id and for an id of the other
// family, 400 for a bad force value. The engine's side is tested end to end
// in package e2e.
func TestLifecycleRoutes(t *testing.T) {
	h := newHarness(t)
	if st, _, b := h.do(t, "POST", "/api/vms", h.rw, minimalVMBody(h, "lc")); st != http.StatusCreated {
		t.Fatalf("create = %d %s", st, b)
	}
	if st, _, b := h.do(t, "POST", "/api/appvm/vms", h.rw, `{"vm_id":"lc-app","image_id":"plain","vcpus":1,"memory_mb":64,"disk_gib":1,"auto_boot":false}`); st != http.StatusCreated {
		t.Fatalf("create AppVM = %d %s", st, b)
	}
	tests := []struct {
		method, path string
		status       int
		code, msg    string
	}{
		{"POST", "/api/vms/lc/resume", http.StatusConflict, CodeInvalidState, "cannot resume VM"},
		{"POST", "/api/vms/lc/stop", http.StatusConflict, CodeInvalidState, "while it is created"},
		{"POST", "/api/vms/nope/start", http.StatusNotFound, CodeNotFound, "no classic VM"},
		{"POST", "/api/vms/lc-app/start", http.StatusNotFound, CodeNotFound, "no classic VM"},
		{"POST", "/api/appvm/vms/lc/start", http.StatusNotFound, CodeNotFound, "no AppVM"},
		{"DELETE", "/api/vms/lc?force=yes", http.StatusBadRequest, CodeBadRequest, "force"},
		{"POST", "/api/vms/lc/start", http.StatusNoContent, "", ""},
		{"POST", "/api/vms/lc/start", http.StatusConflict, CodeInvalidState, "while it is booting"},
		{"DELETE", "/api/vms/lc", http.StatusConflict, CodeInvalidState, `cannot delete VM \"lc\" while it is booting; stop it first, or delete with ?force=true`},
		{"DELETE", "/api/vms/lc?force=true", http.StatusNoContent, "", ""},
		{"GET", "/api/vms/lc", http.StatusNotFound, CodeNotFound, ""},
		{"DELETE", "/api/appvm/vms/lc-app", http.StatusNoContent, "", ""},
		{"GET", "/api/appvm/vms/lc-app", http.StatusNotFound, CodeNotFound, ""},
	}
	for _, tt := range tests {
		st, _, body := h.do(t, tt.method, tt.path, h.rw, "")
		if st != tt.status {
			t.Errorf("%s %s = %d %s, want %d", tt.method, tt.path, st, body, tt.status)
			continue
		}
		if tt.status == http.StatusNoContent && body != "" {
			t.Errorf("%s %s: 204 with body %q", tt.method, tt.path, body)
		}
		if tt.code != "" && (!strings.Contains(body, `"code":"`+tt.code+`"`) || !strings.Contains(body, tt.msg)) {
			t.Errorf("%s %s body = %s, want code %s and %q", tt.method, tt.path, body, tt.code, tt.msg)
		}
	}
	if got := h.e.Host.Transcript(); !strings.Contains(got, "boot lc") || !strings.Contains(got, "rollback lc") {
		t.Errorf("host transcript lacks the boot and the delete's rollback:\n%s", got)
	}
}
