package engine

import (
	"errors"
	"os"
	"path/filepath"
	"sync"

	"vmhost/inotify"
)

// One inotify instance watches the files of every running VM, so an idle
// VM costs the agent no wake-ups (issue 15): its run directory (the API
// socket removed or replaced, the event file created or appended to) and
// its root disk (unlinked, which shows as a link count change while
// qemu-storage-daemon holds it open; moved; deleted). Each event pokes the
// VM's monitor, which then checks its files and reads new events. What
// inotify cannot see (a file system that sends no events, a queue that
// overflowed: every monitor is poked then) is caught by each monitor's
// slow sweep. A VM whose watches could not be added (the inotify limits)
// is polled instead, as before.

// dirMask and diskMask are what a monitor's two watches ask for.
const (
	dirMask  = inotify.Create | inotify.Delete | inotify.MovedFrom | inotify.MovedTo | inotify.Modify | inotify.DeleteSelf | inotify.MoveSelf | inotify.OnlyDir
	diskMask = inotify.Attrib | inotify.DeleteSelf | inotify.MoveSelf
)

// fileWatch routes inotify events to monitors.
type fileWatch struct {
	w *inotify.Watcher

	mu   sync.Mutex
	byWD map[int]map[*monitor]bool
	all  map[*monitor][]int
}

// newFileWatch starts the shared watcher, or returns nil (every monitor
// polls) when inotify is unavailable.
func newFileWatch() (*fileWatch, error) {
	w, err := inotify.New()
	if err != nil {
		return nil, err
	}
	fw := &fileWatch{w: w, byWD: map[int]map[*monitor]bool{}, all: map[*monitor][]int{}}
	go fw.run()
	return fw, nil
}

// add watches paths for m (a directory or a file each, with its mask); on
// failure nothing stays watched for m and m must poll.
func (fw *fileWatch) add(m *monitor, watches map[string]uint32) error {
	var wds []int
	for path, mask := range watches {
		wd, err := fw.w.Add(path, mask)
		if err != nil {
			fw.drop(m, wds)
			return err
		}
		wds = append(wds, wd)
	}
	fw.mu.Lock()
	defer fw.mu.Unlock()
	for _, wd := range wds {
		if fw.byWD[wd] == nil {
			fw.byWD[wd] = map[*monitor]bool{}
		}
		fw.byWD[wd][m] = true
	}
	fw.all[m] = wds
	return nil
}

// remove ends m's watches.
func (fw *fileWatch) remove(m *monitor) {
	fw.mu.Lock()
	wds := fw.all[m]
	delete(fw.all, m)
	fw.mu.Unlock()
	fw.drop(m, wds)
}

// drop removes m from wds, and a watch nobody else uses from the kernel.
func (fw *fileWatch) drop(m *monitor, wds []int) {
	fw.mu.Lock()
	var unused []int
	for _, wd := range wds {
		delete(fw.byWD[wd], m)
		if len(fw.byWD[wd]) == 0 {
			delete(fw.byWD, wd)
			unused = append(unused, wd)
		}
	}
	fw.mu.Unlock()
	for _, wd := range unused {
		fw.w.Remove(wd)
	}
}

// run delivers events until Close.
func (fw *fileWatch) run() {
	buf := make([]byte, 64<<10)
	for {
		evs, err := fw.w.Read(buf)
		if errors.Is(err, os.ErrClosed) {
			return
		}
		if err != nil { // not expected; what it hid is checked by everyone
			evs = []inotify.Event{{WD: -1, Mask: inotify.QOverflow}}
		}
		fw.mu.Lock()
		for _, e := range evs {
			if e.Mask&inotify.QOverflow != 0 {
				for m := range fw.all {
					m.poke()
				}
				continue
			}
			for m := range fw.byWD[e.WD] {
				if e.Name == "" || m.cares(e.Name) {
					m.poke()
				}
			}
			if e.Mask&inotify.Ignored != 0 {
				// The kernel dropped the watch (its file is gone): a
				// reused descriptor must not reach these monitors.
				delete(fw.byWD, e.WD)
			}
		}
		fw.mu.Unlock()
	}
}

// close stops the watcher.
func (fw *fileWatch) close() { fw.w.Close() }

// cares reports whether an event about name in the monitor's run
// directory concerns it: its API socket or its event file (not the
// console log the agent itself appends to).
func (m *monitor) cares(name string) bool {
	return name == filepath.Base(m.apiSocket) || name == filepath.Base(m.events)
}

// poke wakes the monitor's loop without blocking.
func (m *monitor) poke() {
	select {
	case m.poked <- struct{}{}:
	default:
	}
}
