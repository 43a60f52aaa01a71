package vm

import (
	"context"
	"fmt"
	"io"

	"vmhost/follow"
	"vmhost/internal/redact"
)

// Limits of GET /api/{family}/{id}/console (docs/api.md, Console log).
const (
	DefaultConsoleTail = 64 << 10
	MaxConsoleTail     = 16 << 20
)

// OpenLog opens a log the agent keeps (a rotated pair: path.1, then path)
// for reading and following (package follow), on the one inotify
// instance of the service's log readers. The caller closes it.
func (s *Service) OpenLog(path string) (*follow.Reader, error) {
	s.logsOnce.Do(func() { s.logs = follow.NewWatcher() })
	return s.logs.Open(path)
}

// Console writes the last tail bytes of the serial console log of VM id,
// of family mode, to w (nothing for a VM that never started), and calls
// flush; with follow it goes on with what the guest prints next until ctx
// ends or the VM is deleted, flushing after each piece. The log has the
// VM's secrets replaced when it is written (package console); they are
// replaced again on the way out, for a log kept before that. An unknown
// id (or one of the other family) is an error that satisfies
// errors.Is(err, fs.ErrNotExist), before anything is written.
func (s *Service) Console(ctx context.Context, mode Mode, id string, tail int64, follow bool, w io.Writer, flush func()) error {
	var changed <-chan struct{}
	if follow {
		// Before the record is read: a deletion after it is told.
		c, stop := s.Follow(id)
		defer stop()
		changed = c
	}
	rec, err := s.Get(mode, id)
	if err != nil {
		return err
	}
	r, err := s.OpenLog(s.layout.ConsoleLog(id))
	if err != nil {
		return fmt.Errorf("opening the console log: %w", err)
	}
	defer r.Close()
	secrets := rec.Secrets.Redactor()
	start, err := startOutsideSecrets(r, max(0, r.Size()-tail), secrets)
	if err != nil {
		return fmt.Errorf("reading the console log: %w", err)
	}
	r.SetPos(start)
	red := secrets.NewStream(w)
	buf := make([]byte, 32<<10)
	for {
		for {
			n, err := r.Read(buf)
			if n > 0 {
				if _, err := red.Write(buf[:n]); err != nil {
					return err // the client went away
				}
			}
			if err == io.EOF {
				break
			}
			if err != nil {
				return fmt.Errorf("reading the console log: %w", err)
			}
		}
		if !follow {
			err := red.Flush()
			flush()
			return err
		}
		flush()
		select {
		case <-ctx.Done():
			return nil
		case <-r.Changed():
		case <-changed:
			if s.recs.Get(id) == nil {
				follow = false // deleted: what is left, then the end
				continue
			}
			// The run directory may have been made since (a VM that
			// had never booted).
			r.Rewatch()
		}
	}
}

// startOutsideSecrets moves start back to the beginning of a secret it
// would cut, so that the answer starts with the secret's replacement
// rather than its end.
func startOutsideSecrets(r *follow.Reader, start int64, secrets *redact.Set) (int64, error) {
	back := int64(secrets.Longest() - 1)
	if start == 0 || back <= 0 {
		return start, nil
	}
	from := max(0, start-back)
	window := make([]byte, start+back-from)
	n, err := r.ReadAt(window, from)
	if err != nil && err != io.EOF {
		return 0, err
	}
	for _, sp := range secrets.Spans(window[:n]) {
		if at := from + int64(sp.Start); at < start && start < from+int64(sp.End) {
			return at, nil
		}
	}
	return start, nil
}
