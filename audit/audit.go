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
	"errors"
	"fmt"
	"io/fs"
	"os"
	"sync"
	"time"

	"path/filepath"
	"vmhost/internal/atomicfile"
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
}

// Log is an audit log file. It is safe for concurrent use.
type Log struct {
	path string
	max  int64

	mu   sync.Mutex
	f    *os.File
	size int64
}

// Open opens (creating, 0600) the audit log at path, rotated once it would
// pass maxBytes.
func Open(path string, maxBytes int64) (*Log, error) {
	f, size, err := openAppend(path)
	if err != nil {
		return nil, err
	}
	return &Log{path: path, max: maxBytes, f: f, size: size}, nil
}

func openAppend(path string) (*os.File, int64, error) {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o600)
	if err != nil {
		return nil, 0, fmt.Errorf("audit log: %w", err)
	}
	fi, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, 0, fmt.Errorf("audit log: %w", err)
	}
	if !fi.Mode().IsRegular() {
		f.Close()
		return nil, 0, fmt.Errorf("audit log: %s is not a regular file", path)
	}
	return f, fi.Size(), nil
}

// Write appends e.
func (l *Log) Write(e Entry) error {
	line, err := json.Marshal(e)
	if err != nil {
		return err
	}
	line = append(line, '\n')
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.size > 0 && l.size+int64(len(line)) > l.max {
		if err := l.rotate(); err != nil {
			return err
		}
	}
	n, err := l.f.Write(line)
	l.size += int64(n)
	if err != nil {
		return fmt.Errorf("audit log: %w", err)
	}
	return nil
}

// rotate moves the full log to path.1 and starts a new one; l.mu is held.
func (l *Log) rotate() error {
	if err := l.f.Sync(); err != nil {
		return fmt.Errorf("audit log: %w", err)
	}
	if err := os.Rename(l.path, l.path+".1"); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("audit log: rotating: %w", err)
	}
	f, size, err := openAppend(l.path)
	if err != nil {
		return err
	}
	if err := atomicfile.SyncDir(filepath.Dir(l.path)); err != nil {
		f.Close()
		return fmt.Errorf("audit log: %w", err)
	}
	l.f.Close()
	l.f, l.size = f, size
	return nil
}

// Close closes the log.
func (l *Log) Close() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.f.Close()
}
