package vm

import (
	"context"
	"fmt"
	"sync"

	"vmhost/vm/records"
)

// changeHub fans the records' change events out to the requests that wait
// on one VM: one records watcher for the service (records.Registry.Watch
// cannot be undone, and must stay quick), and per VM the waiters of the
// moment, each told in the watcher's call. A waiter costs a map entry and
// a channel, no goroutine: the request's own goroutine waits on it.
type changeHub struct {
	mu   sync.Mutex
	byID map[string]map[*waiter]struct{}
}

// waiter is one request waiting on a VM. With match, it is told once:
// the first record version match accepts, or nil when the VM is removed.
// Without, it is poked after every change.
type waiter struct {
	match func(*Record) bool
	hit   chan *Record  // capacity 1, written once
	poked chan struct{} // capacity 1
}

// tell runs as a records watcher, under the record's write lock: it only
// compares and sends on buffered channels.
func (h *changeHub) tell(c records.Change) {
	rec := c.New
	if rec == nil && c.Old == nil {
		return
	}
	id := ""
	if rec != nil {
		id = rec.ID
	} else {
		id = c.Old.ID
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	ws := h.byID[id]
	for w := range ws {
		if w.match == nil {
			select {
			case w.poked <- struct{}{}:
			default:
			}
			continue
		}
		if rec == nil || w.match(rec) {
			w.hit <- rec
			delete(ws, w)
		}
	}
	if len(ws) == 0 {
		delete(h.byID, id)
	}
}

func (h *changeHub) add(id string, w *waiter) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.byID == nil {
		h.byID = map[string]map[*waiter]struct{}{}
	}
	if h.byID[id] == nil {
		h.byID[id] = map[*waiter]struct{}{}
	}
	h.byID[id][w] = struct{}{}
}

func (h *changeHub) remove(id string, w *waiter) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if ws := h.byID[id]; ws != nil {
		delete(ws, w)
		if len(ws) == 0 {
			delete(h.byID, id)
		}
	}
}

// waiting is how many waiters VM id has (tests).
func (h *changeHub) waiting(id string) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return len(h.byID[id])
}

// Await waits until the record of VM id, of family mode, satisfies match,
// and returns it: at once when it does now, else the first version a
// change makes that does, as the change is made (a state passed through
// is seen, however short). A VM that is gone, or goes while waited on,
// returns (nil, nil) when match(nil) accepts that, and an error that
// satisfies errors.Is(err, fs.ErrNotExist) otherwise; a VM of the other
// family is not found. ctx ending returns its error. No lock is held
// while waiting. match runs on the writer's goroutine under the record's
// write lock: it must be quick.
func (s *Service) Await(ctx context.Context, mode Mode, id string, match func(*Record) bool) (*Record, error) {
	w := &waiter{match: match, hit: make(chan *Record, 1)}
	// Registered before the record is read: a change after the read is
	// told to w; one before it shows in the read.
	s.changes.add(id, w)
	defer s.changes.remove(id, w)
	rec := s.recs.Get(id)
	if rec != nil && rec.Mode != mode {
		return nil, fmt.Errorf("VM %q: %w", id, errNotFound)
	}
	if match(rec) {
		return rec, nil
	}
	if rec == nil {
		return nil, fmt.Errorf("VM %q: %w", id, errNotFound)
	}
	select {
	case rec := <-w.hit:
		if rec == nil && !match(nil) {
			return nil, fmt.Errorf("VM %q was deleted: %w", id, errNotFound)
		}
		return rec, nil
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// Follow returns a channel that receives a value after each change of VM
// id's record (its removal included) from now on, coalesced: a reader
// that was busy finds one value for several changes, and reads the record
// again. stop ends it.
func (s *Service) Follow(id string) (changed <-chan struct{}, stop func()) {
	w := &waiter{poked: make(chan struct{}, 1)}
	s.changes.add(id, w)
	return w.poked, func() { s.changes.remove(id, w) }
}
