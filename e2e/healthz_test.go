//go:build linux

package e2e

import (
	"io"
	"net/http"
	"testing"
)

// TestHealthz: the real agent answers GET /healthz without a key, 200 ok
// once it serves the API.
func TestHealthz(t *testing.T) {
	s := startServer(t, serverOpts{})
	resp, err := s.hc.Get("http://vmhost/healthz") // no Authorization header
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK || string(b) != "ok\n" {
		t.Errorf("GET /healthz = %d %q, want 200 ok", resp.StatusCode, b)
	}
}
