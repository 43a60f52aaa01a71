package api

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

// FuzzCreate sends arbitrary bodies to both create endpoints through the
// whole handler: no panic, and every answer is 201, 202, 400, 409 or 422.
func FuzzCreate(f *testing.F) {
	h := newHarness(f)
	for _, s := range []string{
		minimalVMBody(h, "seed-vm"), fullVMBody(h), minimalAppVMBody, fullAppVMBody,
		`{"vcpus":-1}`, `{"vcpus":1.5,"memory_mb":64}`, `{}`, `[]`, `null`, `{"cloud_init":{"raw_user_data":{}}}`,
		`{"image_id":"web","vcpus":1,"memory_mb":64,"disk_gib":1,"ip":"10.0.0.2"}`,
		`{"image_id":"pending","vcpus":1,"memory_mb":64,"disk_gib":1}`,
	} {
		f.Add(false, []byte(s))
		f.Add(true, []byte(s))
	}
	f.Fuzz(func(t *testing.T, appvm bool, body []byte) {
		path := "/api/vms"
		if appvm {
			path = "/api/appvm/vms"
		}
		req := httptest.NewRequest("POST", path, strings.NewReader(string(body)))
		req.Header.Set("Authorization", "Bearer "+h.rw)
		w := httptest.NewRecorder()
		h.srv.ServeHTTP(w, req)
		switch w.Code {
		case http.StatusCreated, http.StatusAccepted, http.StatusBadRequest, http.StatusConflict, http.StatusUnprocessableEntity:
		default:
			t.Fatalf("POST %s %q = %d %s", path, body, w.Code, w.Body)
		}
		if w.Code == http.StatusUnprocessableEntity && strings.Count(w.Body.String(), "\n") != 1 {
			t.Fatalf("422 body is not one line: %q", w.Body)
		}
	})
}
