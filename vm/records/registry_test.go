package records

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"vmhost/store"
	"vmhost/vm/record"
)

// openTemp opens a Registry on a store in a temp directory.
func openTemp(t *testing.T) (*Registry, *store.Store) {
	t.Helper()
	st, err := store.Open(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	g, err := Open(st, Options{})
	if err != nil {
		t.Fatal(err)
	}
	return g, st
}

// stored reads the record of id as its file holds it.
func stored(t *testing.T, st *store.Store, id string) *record.Record {
	t.Helper()
	data, err := st.Get(id)
	if err != nil {
		t.Fatal(err)
	}
	rec, err := record.Decode(data)
	if err != nil {
		t.Fatal(err)
	}
	return rec
}

// TestRegistryWritesOfDifferentRecordsOverlap: a write of one record does
// not wait for a slow write of another (their fsyncs can share the file
// system's commits), while writes of one record stay in order.
func TestRegistryWritesOfDifferentRecordsOverlap(t *testing.T) {
	g, _ := openTemp(t)
	a, b := "a", "b"
	if g.writeLock(a) == g.writeLock(b) {
		t.Fatal("the test's ids share a write lock; pick others")
	}
	for _, id := range []string{a, b} {
		if err := g.Create(&record.Record{ID: id, Mode: record.ModeVM}); err != nil {
			t.Fatal(err)
		}
	}
	inA, release := make(chan struct{}), make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		g.Update(a, func(r *record.Record) { close(inA); <-release; r.DisplayState = "slow" })
	}()
	<-inA
	other := make(chan error, 1)
	go func() {
		_, err := g.Update(b, func(r *record.Record) { r.DisplayState = "quick" })
		other <- err
	}()
	select {
	case err := <-other:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("a write of b waited for a write of a")
	}
	same := make(chan struct{})
	go func() {
		g.Update(a, func(r *record.Record) { r.DisplayState += "+second" })
		close(same)
	}()
	select {
	case <-same:
		t.Fatal("a second write of a did not wait for the first")
	case <-time.After(100 * time.Millisecond):
	}
	close(release)
	<-done
	<-same
	if got := g.Get(a).DisplayState; got != "slow+second" {
		t.Errorf("a's writes: display %q, want slow+second (in order)", got)
	}
}

// TestRegistryStagedChangeIsStoredByTheNextWrite: a staged change is seen
// in memory at once and left out of the file; the record's next update
// stores it with its own change, Save stores it alone, and Save with
// nothing staged writes nothing.
func TestRegistryStagedChangeIsStoredByTheNextWrite(t *testing.T) {
	g, st := openTemp(t)
	for _, id := range []string{"a", "b"} {
		if err := g.Create(&record.Record{ID: id, Mode: record.ModeVM, State: record.StateCreated, DisplayState: record.DisplayCreating}); err != nil {
			t.Fatal(err)
		}
		if _, err := g.Stage(id, func(r *record.Record) { r.DisplayState = string(record.StateCreated) }); err != nil {
			t.Fatal(err)
		}
		if got := g.Get(id).DisplayState; got != string(record.StateCreated) {
			t.Errorf("%s in memory: display %q, want the staged created", id, got)
		}
		if got := stored(t, st, id).DisplayState; got != record.DisplayCreating {
			t.Errorf("%s stored: display %q, want creating (staged is not stored)", id, got)
		}
	}
	if _, err := g.Update("a", func(r *record.Record) { r.State = record.StateRunning }); err != nil {
		t.Fatal(err)
	}
	if got := stored(t, st, "a"); got.State != record.StateRunning || got.DisplayState != string(record.StateCreated) {
		t.Errorf("a stored after an update: %s/%s, want running/created (the staged change with it)", got.State, got.DisplayState)
	}
	if err := g.Save("b"); err != nil {
		t.Fatal(err)
	}
	if got := stored(t, st, "b").DisplayState; got != string(record.StateCreated) {
		t.Errorf("b stored after save: display %q, want created", got)
	}
	// Nothing is staged any more: Save leaves the file alone.
	before, _ := os.Stat(filepath.Join(st.Dir(), "a.json"))
	if err := g.Save("a"); err != nil {
		t.Fatal(err)
	}
	after, _ := os.Stat(filepath.Join(st.Dir(), "a.json"))
	if before == nil || after == nil || !os.SameFile(before, after) {
		t.Error("save with nothing staged rewrote the record")
	}
	if _, err := g.Stage("nobody", func(*record.Record) {}); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("staging a change of a record that does not exist = %v, want fs.ErrNotExist", err)
	}
}

// TestRegistryReserveOneWinner: of concurrent reserves of one id exactly
// one wins, the others get *record.ExistsError; a reservation holds the id
// against a stored record's id too, counts in later admissions, and is
// gone once released or created.
func TestRegistryReserveOneWinner(t *testing.T) {
	g, _ := openTemp(t)
	var wins atomic.Int32
	var wg sync.WaitGroup
	for range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			err := g.Reserve(&record.Record{ID: "x", Mode: record.ModeVM}, nil)
			var ee *record.ExistsError
			switch {
			case err == nil:
				wins.Add(1)
			case !errors.As(err, &ee) || ee.ID != "x":
				t.Errorf("losing reserve = %v, want *ExistsError", err)
			}
		}()
	}
	wg.Wait()
	if n := wins.Load(); n != 1 {
		t.Fatalf("%d reserves of one id won, want 1", n)
	}
	var others []string
	if err := g.Reserve(&record.Record{ID: "y"}, func(o []*record.Record) error {
		for _, r := range o {
			others = append(others, r.ID)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if len(others) != 1 || others[0] != "x" {
		t.Errorf("admission of y saw %v, want the pending x", others)
	}
	held := false
	g.Each(func(r *record.Record) { held = held || r.ID == "x" })
	if g.Get("x") != nil || !held {
		t.Error("a pending create is read as stored, or not held")
	}
	g.Release("y")
	if err := g.Create(&record.Record{ID: "x", Mode: record.ModeVM}); err != nil {
		t.Fatal(err)
	}
	if err := g.Reserve(&record.Record{ID: "x"}, nil); err == nil {
		t.Error("a stored id was reserved again")
	}
	if err := g.Reserve(&record.Record{ID: "y"}, nil); err != nil {
		t.Errorf("a released id cannot be reserved: %v", err)
	}
}

// TestRegistryLockSerializesOneVM: Lock excludes other holders of the
// same VM's lock, not those of another VM, and leaves no entry behind.
func TestRegistryLockSerializesOneVM(t *testing.T) {
	g, _ := openTemp(t)
	unlock := g.Lock("a")
	other := make(chan struct{})
	go func() { g.Lock("b")(); close(other) }()
	select {
	case <-other:
	case <-time.After(5 * time.Second):
		t.Fatal("the lock of b waited for the lock of a")
	}
	second := make(chan struct{})
	go func() { g.Lock("a")(); close(second) }()
	select {
	case <-second:
		t.Fatal("a second holder of a's lock did not wait")
	case <-time.After(100 * time.Millisecond):
	}
	unlock()
	<-second
	g.locks.mu.Lock()
	n := len(g.locks.m)
	g.locks.mu.Unlock()
	if n != 0 {
		t.Errorf("%d lock entries left after every holder unlocked", n)
	}
}

// TestRegistryWatchersSeeEachChangeInOrder: watchers are told every
// change of a record, staged ones included, in order, with the versions
// before and after; a removal has no after.
func TestRegistryWatchersSeeEachChangeInOrder(t *testing.T) {
	g, _ := openTemp(t)
	var got []string
	g.Watch(func(c Change) {
		switch {
		case c.Old == nil:
			got = append(got, "new "+c.New.DisplayState)
		case c.New == nil:
			got = append(got, "removed "+c.Old.DisplayState)
		default:
			got = append(got, c.Old.DisplayState+">"+c.New.DisplayState)
		}
	})
	if err := g.Create(&record.Record{ID: "a", Mode: record.ModeVM, DisplayState: "1"}); err != nil {
		t.Fatal(err)
	}
	g.Stage("a", func(r *record.Record) { r.DisplayState = "2" })
	g.Update("a", func(r *record.Record) { r.DisplayState = "3" })
	if err := g.Remove("a"); err != nil {
		t.Fatal(err)
	}
	want := []string{"new 1", "1>2", "2>3", "removed 3"}
	if len(got) != len(want) {
		t.Fatalf("watcher saw %q, want %q", got, want)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("watcher saw %q, want %q", got, want)
		}
	}
}

// TestOpenMigratesOldRecords: a store holding an AppVM record written by
// the previous version (its mountpoints in appvm.data_volumes) loads with
// the mountpoints on its volumes, and the record's next write stores the
// new shape.
func TestOpenMigratesOldRecords(t *testing.T) {
	old, err := os.ReadFile("../record/testdata/appvm-v1-data-volumes.json")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "old-app.json"), old, 0o600); err != nil {
		t.Fatal(err)
	}
	st, err := store.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	g, err := Open(st, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if rep := g.Report(); rep.Loaded != 1 || len(rep.Undecodable)+len(rep.Damaged) != 0 {
		t.Fatalf("load report %+v", rep)
	}
	r := g.Get("old-app")
	if r == nil || len(r.Spec.Volumes) != 2 || r.Spec.Volumes[0].Mountpoint != "/var/lib/data" || r.Spec.Volumes[1].Mountpoint != "/srv/cache" {
		t.Fatalf("loaded record: %+v", r)
	}
	if _, err := g.Update("old-app", func(r *record.Record) { r.AppVM.SpecGen++ }); err != nil {
		t.Fatal(err)
	}
	data, err := st.Get("old-app")
	if err != nil {
		t.Fatal(err)
	}
	if s := string(data); strings.Contains(s, "data_volumes") || !strings.Contains(s, `"mountpoint": "/var/lib/data"`) {
		t.Errorf("stored after a write:\n%s", s)
	}
}
