package api

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"vmhost/ociimage/ocitest"
)

// waitImports waits for the background imports, failing the test (after
// unblock) if they have not ended within a minute.
func waitImports(t *testing.T, h *harness, unblock func()) {
	t.Helper()
	done := make(chan struct{})
	go func() { h.srv.images.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(time.Minute):
		unblock()
		<-done
		t.Fatal("the import is still running a minute later: blocked on its source")
	}
}

// TestImageImportFIFOInLayout: a fifo where a layout has a blob fails the
// import at once (it is never opened), so the image does not stay
// importing, and can be deleted.
func TestImageImportFIFOInLayout(t *testing.T) {
	h := newHarness(t)
	h.withImporter(t, "")
	src := filepath.Join(t.TempDir(), "layout")
	img := appImage(t, "v1")
	img.WriteDir(t, src)
	layer := filepath.Join(src, "blobs", "sha256", strings.TrimPrefix(ocitest.Digest(img.Layers[0]), "sha256:"))
	if err := os.Remove(layer); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Mkfifo(layer, 0o644); err != nil {
		t.Fatal(err)
	}
	if st, _, b := h.do(t, "POST", "/api/appvm/images", h.rw, fmt.Sprintf(`{"id":"piped","path":%q}`, src)); st != 202 {
		t.Fatalf("POST = %d %s, want 202", st, b)
	}
	waitImports(t, h, func() {
		if f, err := os.OpenFile(layer, os.O_WRONLY|syscall.O_NONBLOCK, 0); err == nil {
			f.Close()
		}
	})
	st, _, b := h.do(t, "GET", "/api/appvm/images/piped", h.ro, "")
	if m := decodeImage(t, b); st != 200 || m["status"] != "failed" || !strings.Contains(fmt.Sprint(m["failure"]), "is a named pipe (fifo), not a regular file") {
		t.Errorf("GET = %d %s, want failed naming the fifo", st, b)
	}
	if st, _, b := h.do(t, "DELETE", "/api/appvm/images/piped", h.rw, ""); st != 204 {
		t.Errorf("DELETE = %d %s, want 204", st, b)
	}
}

// TestImageImportConfigLimits: the API's own Importer takes its limits
// from the host config, and a failed import names the limit.
func TestImageImportConfigLimits(t *testing.T) {
	h := newHarness(t)
	h.e.Config.ImageImportMaxEntries = 3
	h.start(t)
	uid, gid := os.Getuid(), os.Getgid()
	src := filepath.Join(t.TempDir(), "layout")
	ocitest.Image{Layers: [][]byte{ocitest.Layer(t,
		ocitest.File("a", "1", 0o644, uid, gid),
		ocitest.File("b", "2", 0o644, uid, gid),
		ocitest.File("c", "3", 0o644, uid, gid),
		ocitest.File("d", "4", 0o644, uid, gid),
	)}}.WriteDir(t, src)
	if st, _, b := h.do(t, "POST", "/api/appvm/images", h.rw, fmt.Sprintf(`{"id":"many","path":%q}`, src)); st != 202 {
		t.Fatalf("POST = %d %s, want 202", st, b)
	}
	waitImports(t, h, func() {})
	st, _, b := h.do(t, "GET", "/api/appvm/images/many", h.ro, "")
	if m := decodeImage(t, b); st != 200 || m["status"] != "failed" ||
		!strings.Contains(fmt.Sprint(m["failure"]), "over an import limit: more than image_import_max_entries (3) entries") {
		t.Errorf("GET = %d %s, want failed naming image_import_max_entries", st, b)
	}
}
