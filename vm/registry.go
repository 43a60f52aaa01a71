package vm

import (
	"fmt"
	"hash/fnv"
	"slices"
	"strings"
	"sync"

	"vmhost/events"
	"vmhost/store"
	"vmhost/vm/record"
)

// ExistsError is a create whose id is taken by a VM of either family, or
// by a create still in flight.
type ExistsError struct {
	ID   string
	What string // what has the id: "" for a VM, "volume"
}

// Error names the taken id.
func (e *ExistsError) Error() string {
	what := e.What
	if what == "" {
		what = "VM"
	}
	return fmt.Sprintf("a %s with id %q already exists", what, e.ID)
}

// registry holds every record of both families in one id namespace. It is
// safe for concurrent use. Records are copy-on-write, so readers use a
// *Record without holding the lock.
type registry struct {
	st *store.Store
	// pub gets the events of every stored change (vm/events.go); nil
	// publishes nothing.
	pub events.Publisher

	// wmu serializes the writes (put, update, remove) of each record, so
	// the fsyncs of a write never happen under mu and never block readers,
	// and writes of different records, striped by id, run side by side:
	// their fsyncs then share the file system's journal commits.
	wmu [64]sync.Mutex

	mu sync.RWMutex
	// recs are the stored records by id.
	recs map[string]*Record
	// pending are creates that passed admission but are not stored yet;
	// they hold their id and count in later admissions.
	pending map[string]*Record
	// unsaved are the ids of records with staged changes (stage) that
	// their file does not hold yet.
	unsaved map[string]bool
}

func newRegistry(st *store.Store, pub events.Publisher) *registry {
	return &registry{st: st, pub: pub, recs: map[string]*Record{}, pending: map[string]*Record{}, unsaved: map[string]bool{}}
}

// publish hands evs to the publisher; the record's write lock is held, so
// a VM's events come in the order its changes were stored.
func (g *registry) publish(evs ...events.Event) {
	if g.pub == nil {
		return
	}
	for _, e := range evs {
		g.pub.Publish(e)
	}
}

// writeLock is the lock that serializes the writes of record id.
func (g *registry) writeLock(id string) *sync.Mutex {
	h := fnv.New32a()
	h.Write([]byte(id))
	return &g.wmu[h.Sum32()%uint32(len(g.wmu))]
}

// get returns the record of id, or nil.
func (g *registry) get(id string) *Record {
	g.mu.RLock()
	defer g.mu.RUnlock()
	return g.recs[id]
}

// list returns every stored record of mode, sorted by id.
func (g *registry) list(mode Mode) []*Record {
	g.mu.RLock()
	out := make([]*Record, 0, len(g.recs))
	for _, r := range g.recs {
		if r.Mode == mode {
			out = append(out, r)
		}
	}
	g.mu.RUnlock()
	slices.SortFunc(out, func(a, b *Record) int { return strings.Compare(a.ID, b.ID) })
	return out
}

// all returns every stored record of both families, in no order.
func (g *registry) all() []*Record {
	g.mu.RLock()
	defer g.mu.RUnlock()
	out := make([]*Record, 0, len(g.recs))
	for _, r := range g.recs {
		out = append(out, r)
	}
	return out
}

// reserve claims rec.ID for an in-flight create once admit, called with
// every other stored and pending record under the lock, accepts. Of any
// number of concurrent reserves of one id exactly one succeeds; the others
// get *ExistsError. The caller must store or release the reservation.
func (g *registry) reserve(rec *Record, admit func(others []*Record) error) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	if _, ok := g.recs[rec.ID]; ok {
		return &ExistsError{ID: rec.ID}
	}
	if _, ok := g.pending[rec.ID]; ok {
		return &ExistsError{ID: rec.ID}
	}
	if admit != nil {
		others := make([]*Record, 0, len(g.recs)+len(g.pending))
		for _, r := range g.recs {
			others = append(others, r)
		}
		for _, r := range g.pending {
			others = append(others, r)
		}
		if err := admit(others); err != nil {
			return err
		}
	}
	g.pending[rec.ID] = rec
	return nil
}

// release drops a reservation that was never stored.
func (g *registry) release(id string) {
	g.mu.Lock()
	delete(g.pending, id)
	g.mu.Unlock()
}

// put stores rec (persisting it first) and ends its reservation, if any.
func (g *registry) put(rec *Record) error {
	data, err := record.Encode(rec)
	if err != nil {
		return err
	}
	w := g.writeLock(rec.ID)
	w.Lock()
	defer w.Unlock()
	if err := g.st.Put(rec.ID, data); err != nil {
		return fmt.Errorf("storing record %q: %w", rec.ID, err)
	}
	g.mu.Lock()
	old := g.recs[rec.ID]
	g.recs[rec.ID] = rec
	delete(g.pending, rec.ID)
	delete(g.unsaved, rec.ID)
	g.mu.Unlock()
	if old == nil {
		g.publish(vmEvent(events.Created, rec))
	} else {
		g.publish(changeEvents(old, rec)...)
	}
	return nil
}

// adopt puts a loaded record into memory without writing it.
func (g *registry) adopt(rec *Record) {
	g.mu.Lock()
	g.recs[rec.ID] = rec
	g.mu.Unlock()
}

// remove deletes the record of id from disk and memory, and its
// reservation if any.
func (g *registry) remove(id string) error {
	w := g.writeLock(id)
	w.Lock()
	defer w.Unlock()
	if err := g.st.Delete(id); err != nil {
		return fmt.Errorf("deleting record %q: %w", id, err)
	}
	g.mu.Lock()
	old := g.recs[id]
	delete(g.pending, id)
	delete(g.recs, id)
	delete(g.unsaved, id)
	g.mu.Unlock()
	if old != nil {
		g.publish(vmEvent(events.Deleted, old))
	}
	return nil
}

// update replaces the stored record of id with f applied to a copy of it
// (and to the changes staged since it was last stored).
func (g *registry) update(id string, f func(*Record)) (*Record, error) {
	return g.change(id, f, true)
}

// stage applies f to a copy of the record of id in memory only, as update
// does, and leaves the record's file as it is: the next update, or save,
// stores the change. Readers, the events and the record's next change see
// it at once; an agent that dies before finds the record as last stored.
// The record must be stored (not a create still in flight).
func (g *registry) stage(id string, f func(*Record)) (*Record, error) {
	return g.change(id, f, false)
}

// save stores the record of id if it has changes stage made and no write
// stored yet; it does nothing otherwise.
func (g *registry) save(id string) error {
	g.mu.RLock()
	staged := g.unsaved[id]
	g.mu.RUnlock()
	if !staged {
		return nil
	}
	_, err := g.update(id, func(*Record) {})
	return err
}

// change applies f to a copy of the record of id and, with store, writes
// it to disk first; without, it marks the record unsaved.
func (g *registry) change(id string, f func(*Record), store bool) (*Record, error) {
	w := g.writeLock(id)
	w.Lock()
	defer w.Unlock()
	g.mu.RLock()
	old, ok := g.recs[id]
	if !ok && store {
		old, ok = g.pending[id]
	}
	g.mu.RUnlock()
	if !ok {
		return nil, fmt.Errorf("updating record %q: %w", id, errNotFound)
	}
	rec := old.Clone()
	f(rec)
	if store {
		data, err := record.Encode(rec)
		if err != nil {
			return nil, err
		}
		if err := g.st.Put(id, data); err != nil {
			return nil, fmt.Errorf("storing record %q: %w", id, err)
		}
	}
	g.mu.Lock()
	_, stored := g.recs[id]
	g.recs[id] = rec
	delete(g.pending, id)
	if store {
		delete(g.unsaved, id)
	} else {
		g.unsaved[id] = true
	}
	g.mu.Unlock()
	if stored {
		g.publish(changeEvents(old, rec)...)
	} else {
		g.publish(vmEvent(events.Created, rec))
	}
	return rec, nil
}
