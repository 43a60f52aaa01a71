// Package rotlog is the agent's size-capped log file: appended to, and
// when full moved to the previous generation's name (replacing the one
// before) and started again, so a log never holds much more than twice its
// cap. The audit log, the AppVM workload logs, the console logs and the
// event log's segments are all written through it.
//
// Writes are plain appends (O_APPEND), not atomicfile replacements: a log
// grows continuously, and after a crash a torn last line is the most it
// can lose. Files are 0600, also forced on an existing file, since logs
// may show what a guest printed.
//
// Two ways to cut, one per kind of content:
//   - records (Split false): a write that would take a non-empty file past
//     MaxBytes goes whole into the next file, so a line or a chunk is
//     never cut in two (audit lines, workload output chunks);
//   - a byte stream (Split true): a write is cut at exactly MaxBytes, so
//     the file never passes it; a reader joins the two generations in
//     order (the serial console).
//
// When a rotation fails (the directory is not writable, the disk is
// full), the write still goes to the file in hand, which then grows past
// its cap until a later rotation succeeds: a log loses nothing to a failed
// rotation. The write reports the rotation's error with every byte
// written.
package rotlog

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sync"
	"syscall"

	"vmhost/internal/atomicfile"
)

// Options say when and how a File rotates.
type Options struct {
	// MaxBytes is the size cap. Zero or less: no cap (the owner rotates
	// with Rotate, as the event log does by count of events).
	MaxBytes int64
	// Previous is the previous generation's path; empty means path+".1".
	Previous string
	// Split cuts a write at MaxBytes (a byte stream) instead of starting
	// the next file with it whole (records).
	Split bool
	// Sync fsyncs the full file and the directory at each rotation, so
	// the rename survives a power cut with the data it moved.
	Sync bool
}

// File is one size-capped log. It is safe for concurrent use.
type File struct {
	path string
	o    Options

	mu   sync.Mutex
	f    *os.File // nil once closed
	size int64
}

// Open opens path for appending, creating it (0600) if missing. An
// existing file is kept and appended to; its mode is forced to 0600, and
// a path that is not a regular file is refused.
func Open(path string, o Options) (*File, error) {
	if o.Previous == "" {
		o.Previous = path + ".1"
	}
	l := &File{path: path, o: o}
	f, size, err := openAppend(path, 0)
	if err != nil {
		return nil, err
	}
	l.f, l.size = f, size
	return l, nil
}

func openAppend(path string, flag int) (*os.File, int64, error) {
	// O_NOFOLLOW: a log may be in a directory a confined VM owns (the
	// console's), where a link would make the agent write elsewhere.
	f, err := os.OpenFile(path, os.O_RDWR|os.O_APPEND|os.O_CREATE|syscall.O_NOFOLLOW|flag, 0o600)
	if err != nil {
		return nil, 0, err
	}
	fi, err := f.Stat()
	if err == nil && !fi.Mode().IsRegular() {
		err = fmt.Errorf("%s is not a regular file", path)
	}
	if err == nil && fi.Mode().Perm() != 0o600 {
		err = f.Chmod(0o600)
	}
	if err != nil {
		f.Close()
		return nil, 0, err
	}
	return f, fi.Size(), nil
}

// Write appends p, rotating first when p would take the file past its cap
// (Split: as often as needed, cutting p at the cap). It returns len(p)
// with the rotation's error when a rotation failed but p was written (to
// the file in hand), and less with the write's error when a write failed.
func (l *File) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.f == nil {
		return 0, os.ErrClosed
	}
	var rotErr error
	max := l.o.MaxBytes
	if !l.o.Split {
		if max > 0 && l.size > 0 && l.size+int64(len(p)) > max {
			rotErr = l.rotateLocked()
		}
		n, err := l.f.Write(p)
		l.size += int64(n)
		if err != nil {
			return n, err
		}
		return n, rotErr
	}
	written := 0
	for len(p) > 0 {
		chunk := p
		if max > 0 {
			if l.size >= max && rotErr == nil {
				rotErr = l.rotateLocked()
			}
			if room := max - l.size; room > 0 && int64(len(chunk)) > room {
				chunk = chunk[:room]
			}
		}
		n, err := l.f.Write(chunk)
		written += n
		l.size += int64(n)
		if err != nil {
			return written, err
		}
		p = p[n:]
	}
	return written, rotErr
}

// Rotate moves the file to the previous generation's name and starts an
// empty one, whatever its size. On error the file in hand stays in use.
func (l *File) Rotate() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.f == nil {
		return os.ErrClosed
	}
	return l.rotateLocked()
}

func (l *File) rotateLocked() error {
	if l.o.Sync {
		if err := l.f.Sync(); err != nil {
			return fmt.Errorf("rotating %s: %w", l.path, err)
		}
	}
	if err := os.Rename(l.path, l.o.Previous); err != nil {
		// Only a log file that is gone (removed by hand) has nothing to
		// move; any other failure keeps the file in hand.
		if _, serr := os.Lstat(l.path); !errors.Is(err, fs.ErrNotExist) || !errors.Is(serr, fs.ErrNotExist) {
			return fmt.Errorf("rotating %s: %w", l.path, err)
		}
	}
	// O_TRUNC: if the rename found no file to move, whatever is there
	// now is not this log's to append to.
	f, size, err := openAppend(l.path, os.O_TRUNC)
	if err != nil {
		return fmt.Errorf("rotating %s: %w", l.path, err)
	}
	if l.o.Sync {
		if err := atomicfile.SyncDir(filepath.Dir(l.path)); err != nil {
			f.Close()
			return fmt.Errorf("rotating %s: %w", l.path, err)
		}
	}
	l.f.Close()
	l.f, l.size = f, size
	return nil
}

// Size is the current file's size.
func (l *File) Size() int64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.size
}

// LastByte returns the current file's last byte, read through the open
// file; ok is false when it is empty.
func (l *File) LastByte() (b byte, ok bool, err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.f == nil {
		return 0, false, os.ErrClosed
	}
	if l.size == 0 {
		return 0, false, nil
	}
	var p [1]byte
	if _, err := l.f.ReadAt(p[:], l.size-1); err != nil {
		return 0, false, err
	}
	return p[0], true, nil
}

// Truncate cuts the current file to size bytes (a torn last record found
// when a log is opened); writes go on at the new end.
func (l *File) Truncate(size int64) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.f == nil {
		return os.ErrClosed
	}
	if err := l.f.Truncate(size); err != nil {
		return err
	}
	l.size = size
	return nil
}

// Sync fsyncs the current file. The fsync runs without the lock, so
// writers never wait for it; a rotation meanwhile has synced the file it
// moved (with Options.Sync) and the Sync reports os.ErrClosed.
func (l *File) Sync() error {
	l.mu.Lock()
	f := l.f
	l.mu.Unlock()
	if f == nil {
		return os.ErrClosed
	}
	return f.Sync()
}

// Close closes the file; later writes fail with os.ErrClosed. It may be
// called more than once.
func (l *File) Close() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.f == nil {
		return nil
	}
	err := l.f.Close()
	l.f = nil
	return err
}
