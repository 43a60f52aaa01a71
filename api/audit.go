package api

import (
	"context"
	"net/http"
	"strings"
	"time"

	"vmhost/audit"
	"vmhost/auth"
)

// auditWriter notes the status a handler answers, for the audit log.
type auditWriter struct {
	http.ResponseWriter
	status  int
	written bool
	// id is the VM or image a create names (noteID), for routes whose
	// path names none.
	id string
	// argv is an exec's command (noteArgv).
	argv []string
}

type auditKey struct{}

// withAudit returns r carrying w, so that noteID can reach it.
func withAudit(r *http.Request, w *auditWriter) *http.Request {
	return r.WithContext(context.WithValue(r.Context(), auditKey{}, w))
}

// noteID records, for the audit entry of r, the id of the VM or image a
// create names (its body's id, then the created one's).
func noteID(r *http.Request, id string) {
	if w, ok := r.Context().Value(auditKey{}).(*auditWriter); ok {
		w.id = id
	}
}

// noteArgv records, for the audit entry of r, the command an exec runs
// (redacted by the caller).
func noteArgv(r *http.Request, argv []string) {
	if w, ok := r.Context().Value(auditKey{}).(*auditWriter); ok {
		w.argv = argv
	}
}

// noteStatus records the status of an answer the handler wrote on a
// connection it took over (101 Switching Protocols).
func noteStatus(r *http.Request, status int) {
	if w, ok := r.Context().Value(auditKey{}).(*auditWriter); ok && !w.written {
		w.status, w.written = status, true
	}
}

func (w *auditWriter) WriteHeader(code int) {
	if !w.written {
		w.status, w.written = code, true
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *auditWriter) Write(p []byte) (int, error) {
	w.written = true
	return w.ResponseWriter.Write(p)
}

// Unwrap lets http.ResponseController reach the connection.
func (w *auditWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// audited appends the audit entry of a request to a mutating route: the
// key's name (never its token; none when authentication failed), the VM or
// image the route names, the status and the time it took.
func (s *Server) audited(rt Route, r *http.Request, key *auth.Key, w *auditWriter, start time.Time) {
	e := audit.Entry{
		Time:       start.UTC(),
		Method:     r.Method,
		Route:      rt.Pattern,
		Path:       r.URL.Path,
		Status:     w.status,
		DurationMS: float64(time.Since(start).Microseconds()) / 1000,
		Remote:     r.RemoteAddr,
		Argv:       w.argv,
	}
	if key != nil {
		e.Key = key.Name
	}
	id := r.PathValue("id")
	if id == "" {
		id = r.PathValue("digest")
	}
	if id == "" {
		id = w.id
	}
	switch {
	case strings.Contains(rt.Pattern, " /api/volumes"), strings.Contains(rt.Pattern, " /api/snapshots"):
		// A volume's or snapshot's id is neither a VM's nor an image's
		// (audit.Entry has no field for it): Path names it.
	case strings.Contains(rt.Pattern, "/images"):
		e.ImageID = id
	default:
		e.VMID = id
	}
	if err := s.audit.Write(e); err != nil {
		s.log.Error("writing the audit log", "err", err, "route", rt.Pattern, "status", w.status)
	}
}
