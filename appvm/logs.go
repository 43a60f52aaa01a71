package appvm

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"sync"

	"vmhost/internal/rotlog"
)

// DefaultLogMaxBytes is the size at which a workload log is rotated.
const DefaultLogMaxBytes = 1 << 20

// workloadLog is an AppVM's workload output: <state>/vms/<id>/workload.log,
// rotated to workload.log.1 when a write would take it past max bytes, so
// at most about 2×max bytes are kept. Files are 0600. Secret values are
// replaced by "[redacted]" before a write (the guest agent never sends
// them, but a workload may print its own environment). Output arrives in
// chunks, so a chunk that ends with the start of a secret value keeps that
// tail back until the next chunk shows whether the value completes; Flush
// (at the workload's exit) and Close write what is still held.
type workloadLog struct {
	secrets [][]byte

	mu sync.Mutex
	f  *rotlog.File // nil once closed
	// held is the end of the output so far that may begin a secret value.
	held []byte
}

// minScrubbed is the shortest secret value scrubbed from logs: shorter
// ones would mangle ordinary output.
const minScrubbed = 4

func openWorkloadLog(path string, max int64, secrets []string) (*workloadLog, error) {
	if max <= 0 {
		max = DefaultLogMaxBytes
	}
	l := &workloadLog{}
	for _, s := range secrets {
		if len(s) >= minScrubbed {
			l.secrets = append(l.secrets, []byte(s))
		}
	}
	// Chunks are records: one goes whole into the next file rather than
	// be cut at the cap.
	f, err := rotlog.Open(path, rotlog.Options{MaxBytes: max})
	if err != nil {
		return nil, fmt.Errorf("opening workload log: %w", err)
	}
	l.f = f
	return l, nil
}

// Write appends p (scrubbed), rotating first when it would not fit.
func (l *workloadLog) Write(p []byte) (int, error) {
	n := len(p)
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.f == nil {
		return 0, os.ErrClosed
	}
	if len(l.secrets) > 0 {
		p = append(l.held, p...)
		for _, s := range l.secrets {
			if bytes.Contains(p, s) {
				p = bytes.ReplaceAll(p, s, []byte("[redacted]"))
			}
		}
		keep := l.secretPrefixAtEnd(p)
		l.held = append([]byte(nil), p[len(p)-keep:]...)
		p = p[:len(p)-keep]
	}
	if err := l.write(p); err != nil {
		return 0, err
	}
	return n, nil
}

// secretPrefixAtEnd returns the length of the longest end of p that is a
// proper prefix of a secret value.
func (l *workloadLog) secretPrefixAtEnd(p []byte) int {
	longest := 0
	for _, s := range l.secrets {
		for i := max(len(p)-len(s)+1, 0); i < len(p)-longest; i++ {
			if p[i] == s[0] && bytes.HasPrefix(s, p[i:]) {
				longest = len(p) - i
				break
			}
		}
	}
	return longest
}

// write appends p, rotating first when it would not fit. mu must be held.
func (l *workloadLog) write(p []byte) error {
	if len(p) == 0 {
		return nil
	}
	if _, err := l.f.Write(p); err != nil {
		return fmt.Errorf("writing workload log: %w", err)
	}
	return nil
}

// Flush writes the output held back: the stream it might continue has
// ended (the workload exited).
func (l *workloadLog) Flush() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.flushLocked()
}

func (l *workloadLog) flushLocked() error {
	if l.f == nil {
		return os.ErrClosed
	}
	err := l.write(l.held)
	l.held = nil
	return err
}

// Close writes the output still held back and closes the file.
func (l *workloadLog) Close() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.f == nil {
		return nil
	}
	werr := l.flushLocked()
	err := l.f.Close()
	l.f = nil
	return errors.Join(werr, err)
}
