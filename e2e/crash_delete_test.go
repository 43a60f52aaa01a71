//go:build linux

package e2e

import (
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"testing"
	"time"
)

// stalledImageServer answers with headers and then nothing, until the test
// ends: a download that never progresses.
func stalledImageServer(t *testing.T) string {
	t.Helper()
	stop := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", "1048576")
		w.WriteHeader(http.StatusOK)
		w.(http.Flusher).Flush()
		select {
		case <-stop:
		case <-r.Context().Done():
		}
	}))
	t.Cleanup(func() { close(stop); srv.Close() })
	return srv.URL + "/image.qcow2"
}

// TestDeleteStalledDownload: a VM whose image download stalls stays
// downloading; DELETE without force is 409, DELETE ?force=true cancels the
// download and answers 204 with nothing left (image cache temp included).
// After an agent restart the provision resumes and stalls again, and the
// forced delete still works.
func TestDeleteStalledDownload(t *testing.T) {
	s := startServer(t, serverOpts{})
	f := newFixture(t)
	url := stalledImageServer(t)
	body := func(id string) string {
		return `{"vm_id":"` + id + `","vcpus":1,"memory_mb":128,"kernel_path":"` + f.kernel + `","disk":{"size_gib":3},` +
			`"image":{"image_id":"img","content_sha256":"` + strings.Repeat("cd", 32) + `","fetch_url":"` + url + `"},"auto_boot":true}`
	}
	downloading := func() {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for {
			if ents, _ := os.ReadDir(s.stateDir + "/images"); len(ents) > 0 {
				return
			}
			if time.Now().After(deadline) {
				t.Fatal("the download never began")
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	deleted := func(id string) {
		t.Helper()
		if st, b := s.do("DELETE", "/api/vms/"+id, ""); st != http.StatusConflict {
			t.Errorf("DELETE without force while downloading = %d %s, want 409", st, b)
		}
		start := time.Now()
		if st, b := s.do("DELETE", "/api/vms/"+id+"?force=true", ""); st != http.StatusNoContent {
			t.Fatalf("DELETE ?force=true while downloading = %d %s, want 204", st, b)
		}
		t.Logf("forced delete of %s took %v", id, time.Since(start))
		checkGone(t, s, id)
		if ents, _ := os.ReadDir(s.stateDir + "/images"); len(ents) != 0 {
			t.Errorf("image cache holds %v after the cancelled download", ents)
		}
	}

	s.create(body("stall1"), http.StatusAccepted)
	downloading()
	deleted("stall1")

	s.create(body("stall2"), http.StatusAccepted)
	downloading()
	s.kill()
	s.restart()
	if v, ok := s.get("stall2"); !ok || v.DisplayState != "downloading" {
		t.Fatalf("after a restart: %+v, want the provision resumed (downloading)", v)
	}
	downloading()
	deleted("stall2")
}
