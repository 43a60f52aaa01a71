package records

import (
	"fmt"
	"hash/fnv"
	"io/fs"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"time"

	"vmhost/store"
	"vmhost/vm/record"
)

// ErrNotFound is wrapped by the error of a change of a record that does
// not exist; errors.Is(err, fs.ErrNotExist) holds.
var ErrNotFound = fmt.Errorf("no such VM: %w", fs.ErrNotExist)

// Store is where the records persist: *store.Store, opened on
// <state>/vms. It is an interface so that tests can count or slow down the
// writes.
type Store interface {
	Load() (*store.Loaded, error)
	Put(id string, data []byte) error
	Delete(id string) error
}

// Options configure a Registry; every field may be left zero.
type Options struct {
	// Logger gets what Open found that is not a healthy record.
	Logger *slog.Logger
	// Now is the time of the failure of a record loaded with an invalid
	// id; default time.Now.
	Now func() time.Time
}

// LoadReport says what Open found in the store.
type LoadReport struct {
	Loaded       int
	Invalid      []string        // file names that are not valid ids: loaded as failed VMs
	Damaged      []store.Damaged // moved aside by the store
	Undecodable  []string        // JSON objects that are not records: left in place
	RemovedTemps []string
}

// Registry holds every record of both families in one id namespace. It is
// safe for concurrent use.
type Registry struct {
	st     Store
	report LoadReport

	// wmu serializes the writes (Create, Update, Stage, Remove) of each
	// record, so the fsyncs of a write never happen under mu and never
	// block readers, and writes of different records, striped by id, run
	// side by side. Watchers are told under it.
	wmu [64]sync.Mutex

	mu sync.RWMutex
	// recs are the stored records by id.
	recs map[string]*record.Record
	// pending are creates that passed admission but are not stored yet;
	// they hold their id and count in later admissions.
	pending map[string]*record.Record
	// unsaved are the ids of records with staged changes (Stage) that
	// their file does not hold yet.
	unsaved map[string]bool

	watchMu  sync.RWMutex
	watchers []func(Change)

	locks vmLocks
}

// Open loads the records of st into a new Registry. Damaged records have
// been moved aside by the store and are logged; a JSON object that is not
// a record is logged and left in place; a record whose file name is not a
// valid id loads as a failed VM (detail.kind invalid_vm_id, cause
// record_invalid). Report says what was found.
func Open(st Store, o Options) (*Registry, error) {
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	g := &Registry{st: st, recs: map[string]*record.Record{}, pending: map[string]*record.Record{}, unsaved: map[string]bool{}}
	if err := g.load(o.Logger, o.Now); err != nil {
		return nil, err
	}
	return g, nil
}

func (g *Registry) load(log *slog.Logger, now func() time.Time) error {
	l, err := g.st.Load()
	if err != nil {
		return fmt.Errorf("loading VM records: %w", err)
	}
	rep := &g.report
	rep.RemovedTemps = l.RemovedTemps
	for _, t := range l.RemovedTemps {
		log.Warn("removed leftover temp file of an interrupted record write", "file", t)
	}
	rep.Damaged = l.Damaged
	for _, d := range l.Damaged {
		log.Error("damaged VM record moved aside", "id", d.ID, "moved_to", d.MovedTo, "err", d.Err)
	}
	for _, r := range l.Records {
		rec, err := record.Decode(r.Data)
		if err == nil && rec.ID != r.ID {
			err = fmt.Errorf("record holds id %q", rec.ID)
		}
		if err != nil {
			rep.Undecodable = append(rep.Undecodable, r.ID)
			log.Error("VM record is not a valid record; left in place", "id", r.ID, "err", err)
			continue
		}
		g.recs[rec.ID] = rec
		rep.Loaded++
	}
	for _, r := range l.Invalid {
		rec, err := record.Decode(r.Data)
		if err != nil {
			rec = &record.Record{Mode: record.ModeVM}
		}
		rec.ID = r.ID
		rec.State = record.StateFailed
		rec.DisplayState = string(record.StateFailed)
		rec.PID = 0
		rec.FailureReason = &record.FailureReason{
			DetectedAt: now().UTC(),
			Summary:    fmt.Sprintf("record file name %q is not a valid VM id", r.ID),
			Detail:     record.FailureDetail{Kind: "invalid_vm_id", ID: r.ID},
			Cause:      "record_invalid",
		}
		g.recs[rec.ID] = rec
		rep.Invalid = append(rep.Invalid, r.ID)
		log.Error("VM record has an invalid id; loaded as failed", "id", r.ID)
	}
	return nil
}

// Report returns what Open found in the store.
func (g *Registry) Report() LoadReport { return g.report }

// writeLock is the lock that serializes the writes of record id.
func (g *Registry) writeLock(id string) *sync.Mutex {
	h := fnv.New32a()
	h.Write([]byte(id))
	return &g.wmu[h.Sum32()%uint32(len(g.wmu))]
}

// Get returns the stored record of id, or nil (a create still in flight
// has none yet).
func (g *Registry) Get(id string) *record.Record {
	g.mu.RLock()
	defer g.mu.RUnlock()
	return g.recs[id]
}

// List returns every stored record of family mode, sorted by id.
func (g *Registry) List(mode record.Mode) []*record.Record {
	g.mu.RLock()
	out := make([]*record.Record, 0, len(g.recs))
	for _, r := range g.recs {
		if r.Mode == mode {
			out = append(out, r)
		}
	}
	g.mu.RUnlock()
	slices.SortFunc(out, func(a, b *record.Record) int { return strings.Compare(a.ID, b.ID) })
	return out
}

// All returns every stored record of both families, in no order.
func (g *Registry) All() []*record.Record {
	g.mu.RLock()
	defer g.mu.RUnlock()
	out := make([]*record.Record, 0, len(g.recs))
	for _, r := range g.recs {
		out = append(out, r)
	}
	return out
}

// Each calls f for every stored record and every create in flight, in
// no order. f runs under the registry's read lock: it must only look at
// the record.
func (g *Registry) Each(f func(*record.Record)) {
	g.mu.RLock()
	defer g.mu.RUnlock()
	for _, m := range []map[string]*record.Record{g.recs, g.pending} {
		for _, r := range m {
			f(r)
		}
	}
}

// View calls f once with every stored record and every create in flight,
// under the registry's read lock: no record is stored, reserved or
// released while f runs. f must not call the registry.
func (g *Registry) View(f func(recs []*record.Record)) {
	g.mu.RLock()
	defer g.mu.RUnlock()
	recs := make([]*record.Record, 0, len(g.recs)+len(g.pending))
	for _, m := range []map[string]*record.Record{g.recs, g.pending} {
		for _, r := range m {
			recs = append(recs, r)
		}
	}
	f(recs)
}

// Reserve claims rec.ID for a create in flight once admit, called with
// every other stored and pending record under the registry lock, accepts
// (admit may be nil). Of any number of concurrent reserves of one id
// exactly one succeeds; the others get *record.ExistsError. The caller must
// Create or Release the reservation.
func (g *Registry) Reserve(rec *record.Record, admit func(others []*record.Record) error) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	if _, ok := g.recs[rec.ID]; ok {
		return &record.ExistsError{ID: rec.ID}
	}
	if _, ok := g.pending[rec.ID]; ok {
		return &record.ExistsError{ID: rec.ID}
	}
	if admit != nil {
		others := make([]*record.Record, 0, len(g.recs)+len(g.pending))
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

// Release drops a reservation whose record was never stored.
func (g *Registry) Release(id string) {
	g.mu.Lock()
	delete(g.pending, id)
	g.mu.Unlock()
}

// Create stores rec as it is (writing it first) and ends its reservation,
// if any. A record of that id already stored is replaced.
func (g *Registry) Create(rec *record.Record) error {
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
	g.tell(Change{Old: old, New: rec})
	return nil
}

// Remove deletes the record of id from the store and memory, and its
// reservation if any.
func (g *Registry) Remove(id string) error {
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
		g.tell(Change{Old: old})
	}
	return nil
}

// Update stores f applied to a copy of the record of id (with the changes
// staged since it was last stored) and returns the new version;
// errors.Is(err, fs.ErrNotExist) when id has no stored record.
func (g *Registry) Update(id string, f func(*record.Record)) (*record.Record, error) {
	return g.change(id, f, true)
}

// Stage applies f to a copy of the record of id in memory only, as Update
// does, and leaves the record's file as it is: the next Update, or Save,
// stores the change. Readers, watchers and the record's next change see it
// at once; an agent that dies before finds the record as last stored.
func (g *Registry) Stage(id string, f func(*record.Record)) (*record.Record, error) {
	return g.change(id, f, false)
}

// Save stores the record of id if it has staged changes no write stored
// yet; it does nothing otherwise.
func (g *Registry) Save(id string) error {
	g.mu.RLock()
	staged := g.unsaved[id]
	g.mu.RUnlock()
	if !staged {
		return nil
	}
	_, err := g.Update(id, func(*record.Record) {})
	return err
}

// change applies f to a copy of the record of id and, with store, writes
// it first; without, it marks the record unsaved.
func (g *Registry) change(id string, f func(*record.Record), store bool) (*record.Record, error) {
	w := g.writeLock(id)
	w.Lock()
	defer w.Unlock()
	old := g.Get(id)
	if old == nil {
		return nil, fmt.Errorf("updating record %q: %w", id, ErrNotFound)
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
	g.recs[id] = rec
	if store {
		delete(g.unsaved, id)
	} else {
		g.unsaved[id] = true
	}
	g.mu.Unlock()
	g.tell(Change{Old: old, New: rec})
	return rec, nil
}
