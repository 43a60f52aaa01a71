package server

import (
	"log"
	"log/slog"
	"strings"
	"sync"
	"time"
)

// The HTTP server logs what goes wrong with connections (a failed TLS
// handshake, a bad request line) one line each. A flood of bad clients
// must not flood the agent's log: at most errorLogBurst lines per
// errorLogWindow are logged, and how many more were dropped is logged
// when the next window starts.
const (
	errorLogBurst  = 20
	errorLogWindow = time.Minute
)

// newErrorLog is the HTTP server's ErrorLog: warnings in log, limited.
func newErrorLog(l *slog.Logger) *log.Logger {
	return log.New(&limitedLog{log: l, now: time.Now}, "", 0)
}

type limitedLog struct {
	log *slog.Logger
	now func() time.Time

	mu      sync.Mutex
	start   time.Time // of the current window
	n       int       // lines logged in it
	dropped int       // lines dropped in it
}

func (w *limitedLog) Write(p []byte) (int, error) {
	now := w.now()
	w.mu.Lock()
	if now.Sub(w.start) >= errorLogWindow {
		if w.dropped > 0 {
			w.log.Warn("HTTP server messages dropped: too many in a minute", "dropped", w.dropped)
		}
		w.start, w.n, w.dropped = now, 0, 0
	}
	if w.n >= errorLogBurst {
		w.dropped++
		w.mu.Unlock()
		return len(p), nil
	}
	w.n++
	w.mu.Unlock()
	w.log.Warn(strings.TrimSpace(string(p)))
	return len(p), nil
}
