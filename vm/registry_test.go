package vm

import (
	"testing"
	"time"

	"vmhost/store"
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
