package server

import (
	"io"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"
)

// TestStartGate: over a real server, /healthz is 503 while the agent
// starts and 200 after; an API request made during the start is held and
// answered by the API once the gate opens, not refused.
func TestStartGate(t *testing.T) {
	gate := newStartGate()
	srv := httptest.NewServer(gate)
	defer srv.Close()
	get := func(path string) (int, string) {
		t.Helper()
		resp, err := http.Get(srv.URL + path)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	if st, b := get("/healthz"); st != http.StatusServiceUnavailable || b != "starting: loading records and reconciling VMs\n" {
		t.Errorf("healthz while starting = %d %q", st, b)
	}
	held := make(chan string, 1)
	go func() {
		st, b := get("/api/vms")
		held <- http.StatusText(st) + " " + b
	}()
	select {
	case got := <-held:
		t.Fatalf("a request during the start was answered before the gate opened: %s", got)
	case <-time.After(100 * time.Millisecond):
	}
	gate.open(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "api "+r.URL.Path) }))
	if got := <-held; got != "OK api /api/vms" {
		t.Errorf("held request = %q, want the API's answer", got)
	}
	if st, b := get("/healthz"); st != http.StatusOK || b != "ok\n" {
		t.Errorf("healthz once started = %d %q", st, b)
	}
	resp, err := http.Post(srv.URL+"/healthz", "text/plain", nil)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusMethodNotAllowed {
		t.Errorf("POST /healthz = %d, want 405", resp.StatusCode)
	}
}
