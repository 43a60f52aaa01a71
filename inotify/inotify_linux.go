package inotify

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Masks, as inotify(7) names them.
const (
	Modify     = unix.IN_MODIFY
	Attrib     = unix.IN_ATTRIB
	Create     = unix.IN_CREATE
	Delete     = unix.IN_DELETE
	DeleteSelf = unix.IN_DELETE_SELF
	MoveSelf   = unix.IN_MOVE_SELF
	MovedFrom  = unix.IN_MOVED_FROM
	MovedTo    = unix.IN_MOVED_TO
	OnlyDir    = unix.IN_ONLYDIR
	Ignored    = unix.IN_IGNORED
	QOverflow  = unix.IN_Q_OVERFLOW
)

// Event is one inotify event: the watch it belongs to (-1 for a queue
// overflow), its mask, and for a watched directory the name of the entry.
type Event struct {
	WD   int
	Mask uint32
	Name string
}

// Watcher is one inotify instance. Add, Remove and Close are safe to call
// while another goroutine reads.
type Watcher struct {
	f  *os.File
	fd int
}

// New creates an inotify instance.
func New() (*Watcher, error) {
	fd, err := unix.InotifyInit1(unix.IN_CLOEXEC | unix.IN_NONBLOCK)
	if err != nil {
		return nil, fmt.Errorf("inotify_init1: %w", err)
	}
	return &Watcher{f: os.NewFile(uintptr(fd), "inotify"), fd: fd}, nil
}

// Add watches path for the events of mask and returns the watch
// descriptor. Watching an inode that is already watched returns its
// descriptor and replaces its mask.
func (w *Watcher) Add(path string, mask uint32) (int, error) {
	wd, err := unix.InotifyAddWatch(w.fd, path, mask)
	if err != nil {
		return -1, fmt.Errorf("inotify_add_watch %s: %w", path, err)
	}
	return wd, nil
}

// Remove ends the watch wd. A watch the kernel already dropped (its file
// gone) is not an error.
func (w *Watcher) Remove(wd int) error {
	if _, err := unix.InotifyRmWatch(w.fd, uint32(wd)); err != nil && !errors.Is(err, unix.EINVAL) {
		return fmt.Errorf("inotify_rm_watch: %w", err)
	}
	return nil
}

// Read blocks until events arrive and returns them; buf must hold at
// least one event with a name (unix.SizeofInotifyEvent + NAME_MAX + 1).
// After Close it returns os.ErrClosed.
func (w *Watcher) Read(buf []byte) ([]Event, error) {
	n, err := w.f.Read(buf)
	if err != nil {
		return nil, err
	}
	var out []Event
	for off := 0; off+unix.SizeofInotifyEvent <= n; {
		raw := (*unix.InotifyEvent)(unsafe.Pointer(&buf[off]))
		e := Event{WD: int(raw.Wd), Mask: raw.Mask}
		nameStart := off + unix.SizeofInotifyEvent
		nameEnd := nameStart + int(raw.Len)
		if nameEnd > n {
			break
		}
		if raw.Len > 0 {
			name := buf[nameStart:nameEnd]
			if i := bytes.IndexByte(name, 0); i >= 0 {
				name = name[:i]
			}
			e.Name = string(name)
		}
		out = append(out, e)
		off = nameEnd
	}
	return out, nil
}

// Close ends the instance and every watch; a blocked Read returns.
func (w *Watcher) Close() error { return w.f.Close() }
