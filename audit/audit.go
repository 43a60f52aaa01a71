// Package audit appends one JSON line per API mutation to the agent's
// audit log (<state>/audit.log, 0600): who (the key's name, never its
// token), what (method, route, path, the VM or image id), the outcome
// (status) and how long it took, and from where (remote address).
//
// Each entry is one write(2) in O_APPEND mode, so an agent killed at any
// point leaves whole lines only (a torn line needs a power cut mid-write),
// and entries are never fsynced one by one: the mutation itself is made
// durable by its own record, and the audit log is a trail, not a journal.
// When the file would grow past MaxBytes it is renamed to audit.log.1
// (replacing the one before) and a new one starts, so the log holds at
// most about twice MaxBytes.
package audit

import (
	"encoding/json"
	"fmt"
	"time"

	"vmhost/internal/rotlog"
)

// Entry is one audited request.
type Entry struct {
	Time   time.Time `json:"time"`
	Method string    `json:"method"`
	// Route is the API route's pattern ("DELETE /api/vms/{id}"), empty for
	// a request that matched none.
	Route string `json:"route"`
	Path  string `json:"path"`
	// VMID and ImageID are the route's {id} (or {digest}) as the route
	// names a VM or an image.
	VMID    string `json:"vm_id,omitempty"`
	ImageID string `json:"image_id,omitempty"`
	// Key is the API key's name; empty when authentication failed.
	Key        string  `json:"key,omitempty"`
	Status     int     `json:"status"`
	DurationMS float64 `json:"duration_ms"`
	Remote     string  `json:"remote"`
	// Argv is the command of an exec (its secret values redacted); the
	// exec's input and output are never logged.
	Argv []string `json:"argv,omitempty"`
}

// Log is an audit log file. It is safe for concurrent use.
type Log struct {
	f *rotlog.File
}

// Open opens (creating, 0600) the audit log at path, rotated once it would
// pass maxBytes.
func Open(path string, maxBytes int64) (*Log, error) {
	// Sync: the rotation's rename is made durable with the lines it moves;
	// the entries themselves are not fsynced (see the package doc).
	f, err := rotlog.Open(path, rotlog.Options{MaxBytes: maxBytes, Sync: true})
	if err != nil {
		return nil, fmt.Errorf("audit log: %w", err)
	}
	return &Log{f: f}, nil
}

// Write appends e, as one write(2).
func (l *Log) Write(e Entry) error {
	line, err := json.Marshal(e)
	if err != nil {
		return err
	}
	if _, err := l.f.Write(append(line, '\n')); err != nil {
		return fmt.Errorf("audit log: %w", err)
	}
	return nil
}

// Close closes the log.
func (l *Log) Close() error { return l.f.Close() }
