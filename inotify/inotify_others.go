//go:build !linux

package inotify

import "errors"

// Masks exist for the build; New fails without inotify.
const (
	Modify, Attrib, Create, Delete, DeleteSelf, MoveSelf = 1, 2, 4, 8, 16, 32
	MovedFrom, MovedTo, OnlyDir, Ignored, QOverflow      = 64, 128, 256, 512, 1024
)

// Event is one inotify event.
type Event struct {
	WD   int
	Mask uint32
	Name string
}

// Watcher is unavailable here.
type Watcher struct{}

// New fails: inotify is Linux's.
func New() (*Watcher, error) { return nil, errors.New("inotify: not supported on this system") }

// Add fails.
func (*Watcher) Add(string, uint32) (int, error) { return -1, errors.New("inotify: not supported") }

// Remove does nothing.
func (*Watcher) Remove(int) error { return nil }

// Read fails.
func (*Watcher) Read([]byte) ([]Event, error) { return nil, errors.New("inotify: not supported") }

// Close does nothing.
func (*Watcher) Close() error { return nil }
