package appvm

import (
	"bytes"
	"fmt"
	"os"
	"sync"
)

// DefaultLogMaxBytes is the size at which a workload log is rotated.
const DefaultLogMaxBytes = 1 << 20

// workloadLog is an AppVM's workload output: <state>/vms/<id>/workload.log,
// rotated to workload.log.1 when a write would take it past max bytes, so
// at most about 2×max bytes are kept. Files are 0600. Secret values are
// replaced by "[redacted]" before a write (the guest agent never sends
// them, but a workload may print its own environment); a value split
// across two chunks of output is not caught.
type workloadLog struct {
	path    string
	max     int64
	secrets [][]byte

	mu   sync.Mutex
	f    *os.File
	size int64
}

// minScrubbed is the shortest secret value scrubbed from logs: shorter
// ones would mangle ordinary output.
const minScrubbed = 4

func openWorkloadLog(path string, max int64, secrets []string) (*workloadLog, error) {
	if max <= 0 {
		max = DefaultLogMaxBytes
	}
	l := &workloadLog{path: path, max: max}
	for _, s := range secrets {
		if len(s) >= minScrubbed {
			l.secrets = append(l.secrets, []byte(s))
		}
	}
	if err := l.open(); err != nil {
		return nil, err
	}
	return l, nil
}

func (l *workloadLog) open() error {
	f, err := os.OpenFile(l.path, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		return fmt.Errorf("opening workload log: %w", err)
	}
	fi, err := f.Stat()
	if err != nil {
		f.Close()
		return fmt.Errorf("opening workload log: %w", err)
	}
	l.f, l.size = f, fi.Size()
	return nil
}

// Write appends p (scrubbed), rotating first when it would not fit.
func (l *workloadLog) Write(p []byte) (int, error) {
	n := len(p)
	for _, s := range l.secrets {
		if bytes.Contains(p, s) {
			p = bytes.ReplaceAll(p, s, []byte("[redacted]"))
		}
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.f == nil {
		return 0, os.ErrClosed
	}
	if l.size > 0 && l.size+int64(len(p)) > l.max {
		l.f.Close()
		l.f = nil
		if err := os.Rename(l.path, l.path+".1"); err != nil {
			return 0, fmt.Errorf("rotating workload log: %w", err)
		}
		if err := l.open(); err != nil {
			return 0, err
		}
	}
	m, err := l.f.Write(p)
	l.size += int64(m)
	if err != nil {
		return 0, fmt.Errorf("writing workload log: %w", err)
	}
	return n, nil
}

// Close closes the file.
func (l *workloadLog) Close() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.f == nil {
		return nil
	}
	err := l.f.Close()
	l.f = nil
	return err
}
