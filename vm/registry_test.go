package vm

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"vmhost/store"
	"vmhost/vm/record"
)

// TestRegistryWritesOfDifferentRecordsOverlap: a write of one record does
// not wait for a slow write of another (their fsyncs can share the file
// system's commits), while writes of one record stay in order.
func TestRegistryWritesOfDifferentRecordsOverlap(t *testing.T) {
	st, err := store.Open(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	g := newRegistry(st, nil)
	a, b := "a", "b"
	if g.writeLock(a) == g.writeLock(b) {
		t.Fatal("the test's ids share a write lock; pick others")
	}
	for _, id := range []string{a, b} {
		if err := g.put(&Record{ID: id, Mode: ModeVM}); err != nil {
			t.Fatal(err)
		}
	}
	inA, release := make(chan struct{}), make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		g.update(a, func(r *Record) { close(inA); <-release; r.DisplayState = "slow" })
	}()
	<-inA
	other := make(chan error, 1)
	go func() {
		_, err := g.update(b, func(r *Record) { r.DisplayState = "quick" })
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
		g.update(a, func(r *Record) { r.DisplayState += "+second" })
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
	if got := g.get(a).DisplayState; got != "slow+second" {
		t.Errorf("a's writes: display %q, want slow+second (in order)", got)
	}
}

// TestRegistryStagedChangeIsStoredByTheNextWrite: a staged change is seen
// in memory at once and left out of the file; the record's next update
// stores it with its own change, save stores it alone, and save with
// nothing staged writes nothing.
func TestRegistryStagedChangeIsStoredByTheNextWrite(t *testing.T) {
	st, err := store.Open(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	g := newRegistry(st, nil)
	stored := func(id string) *Record {
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
	for _, id := range []string{"a", "b"} {
		if err := g.put(&Record{ID: id, Mode: ModeVM, State: StateCreated, DisplayState: DisplayCreating}); err != nil {
			t.Fatal(err)
		}
		if _, err := g.stage(id, func(r *Record) { r.DisplayState = string(StateCreated) }); err != nil {
			t.Fatal(err)
		}
		if got := g.get(id).DisplayState; got != string(StateCreated) {
			t.Errorf("%s in memory: display %q, want the staged created", id, got)
		}
		if got := stored(id).DisplayState; got != DisplayCreating {
			t.Errorf("%s stored: display %q, want creating (staged is not stored)", id, got)
		}
	}
	if _, err := g.update("a", func(r *Record) { r.State = StateRunning }); err != nil {
		t.Fatal(err)
	}
	if got := stored("a"); got.State != StateRunning || got.DisplayState != string(StateCreated) {
		t.Errorf("a stored after an update: %s/%s, want running/created (the staged change with it)", got.State, got.DisplayState)
	}
	if err := g.save("b"); err != nil {
		t.Fatal(err)
	}
	if got := stored("b").DisplayState; got != string(StateCreated) {
		t.Errorf("b stored after save: display %q, want created", got)
	}
	// Nothing is staged any more: save leaves the file alone.
	before, _ := os.Stat(filepath.Join(st.Dir(), "a.json"))
	if err := g.save("a"); err != nil {
		t.Fatal(err)
	}
	after, _ := os.Stat(filepath.Join(st.Dir(), "a.json"))
	if before == nil || after == nil || !os.SameFile(before, after) {
		t.Error("save with nothing staged rewrote the record")
	}
	if _, err := g.stage("nobody", func(*Record) {}); err == nil {
		t.Error("staging a change of a record that does not exist succeeded")
	}
}
