package server

import (
	"io"
	"net/http"
)

// startGate is the server's handler while the agent starts: GET /healthz
// (no auth) answers 503 "starting" until open, 200 "ok" after; every other
// request waits for open (or for its client to go) and then goes to the
// API. So a client that connects during recovery is answered late rather
// than refused, and a load balancer or systemd probe can tell the two
// apart.
type startGate struct {
	ready   chan struct{}
	handler http.Handler // set before ready is closed
}

func newStartGate() *startGate { return &startGate{ready: make(chan struct{})} }

// open lets requests through to h.
func (g *startGate) open(h http.Handler) {
	g.handler = h
	close(g.ready)
}

func (g *startGate) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path == "/healthz" {
		if r.Method != http.MethodGet && r.Method != http.MethodHead {
			w.Header().Set("Allow", "GET, HEAD")
			http.Error(w, "method not allowed", http.StatusMethodNotAllowed)
			return
		}
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		w.Header().Set("Cache-Control", "no-store")
		select {
		case <-g.ready:
			io.WriteString(w, "ok\n")
		default:
			w.WriteHeader(http.StatusServiceUnavailable)
			io.WriteString(w, "starting: loading records and reconciling VMs\n")
		}
		return
	}
	select {
	case <-g.ready:
		g.handler.ServeHTTP(w, r)
	case <-r.Context().Done():
	}
}
