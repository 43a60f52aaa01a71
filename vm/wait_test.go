package vm_test

import (
	"context"
	"errors"
	"io/fs"
	"runtime"
	"sync"
	"testing"
	"time"

	"vmhost/vm"
	"vmhost/vm/vmtest"
)

// awaitAsync runs Await in a goroutine and returns once it is registered
// (its match has looked at the record as it is now).
func awaitAsync(t *testing.T, svc *vm.Service, ctx context.Context, mode vm.Mode, id string, states ...string) <-chan awaitResult {
	t.Helper()
	want := map[string]bool{}
	for _, s := range states {
		want[s] = true
	}
	first := make(chan struct{})
	var once sync.Once
	out := make(chan awaitResult, 1)
	go func() {
		rec, err := svc.Await(ctx, mode, id, func(r *vm.Record) bool {
			once.Do(func() { close(first) })
			if r == nil {
				return want["deleted"]
			}
			return want[r.DisplayState]
		})
		out <- awaitResult{rec, err}
	}()
	select {
	case <-first:
	case <-time.After(10 * time.Second):
		t.Fatal("Await never looked at the record")
	}
	return out
}

type awaitResult struct {
	rec *vm.Record
	err error
}

func recv(t *testing.T, c <-chan awaitResult) awaitResult {
	t.Helper()
	select {
	case r := <-c:
		return r
	case <-time.After(10 * time.Second):
		t.Fatal("Await did not return")
		return awaitResult{}
	}
}

func setDisplay(t *testing.T, e *vmtest.Env, id, state, display string) {
	t.Helper()
	if _, err := e.Records.Update(id, func(r *vm.Record) { r.State, r.DisplayState = vm.State(state), display }); err != nil {
		t.Fatal(err)
	}
}

func newWaitVM(t *testing.T) (*vmtest.Env, *vm.Service) {
	e := vmtest.NewEnv(t)
	svc := e.Service(t)
	s := baseSpec(e)
	s.VMID = "w"
	if _, _, err := svc.CreateVM(context.Background(), &s); err != nil {
		t.Fatal(err)
	}
	return e, svc
}

// TestAwaitSeesEveryState: a waiter gets the version the change made,
// even when the VM moves on at once; a state it is already in answers at
// once.
func TestAwaitSeesEveryState(t *testing.T) {
	e, svc := newWaitVM(t)
	ctx := context.Background()
	r := recv(t, awaitAsync(t, svc, ctx, vm.ModeVM, "w", "created", "running"))
	if r.err != nil || r.rec.DisplayState != "created" {
		t.Fatalf("already created: %v %v", r.rec, r.err)
	}
	c := awaitAsync(t, svc, ctx, vm.ModeVM, "w", "booting")
	setDisplay(t, e, "w", "running", "booting")
	setDisplay(t, e, "w", "running", "running") // booting lasted one change
	if r := recv(t, c); r.err != nil || r.rec.DisplayState != "booting" {
		t.Fatalf("waiting for booting: %+v", r)
	}
	if n := svc.WaitersOf("w"); n != 0 {
		t.Errorf("%d waiters left", n)
	}
}

func TestAwaitDeletedAndGone(t *testing.T) {
	e, svc := newWaitVM(t)
	ctx := context.Background()
	running := awaitAsync(t, svc, ctx, vm.ModeVM, "w", "running")
	deleted := awaitAsync(t, svc, ctx, vm.ModeVM, "w", "deleted")
	if err := e.Records.Remove("w"); err != nil {
		t.Fatal(err)
	}
	if r := recv(t, running); !errors.Is(r.err, fs.ErrNotExist) {
		t.Errorf("waiting for running on a deleted VM: %+v", r)
	}
	if r := recv(t, deleted); r.err != nil || r.rec != nil {
		t.Errorf("waiting for deleted: %+v", r)
	}
	// Gone already: deleted answers at once, anything else is not found.
	if rec, err := svc.Await(ctx, vm.ModeVM, "w", func(r *vm.Record) bool { return r == nil }); rec != nil || err != nil {
		t.Errorf("gone, deleted asked: %v %v", rec, err)
	}
	if _, err := svc.Await(ctx, vm.ModeVM, "w", func(r *vm.Record) bool { return r != nil }); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("gone: %v", err)
	}
}

func TestAwaitOtherFamilyAndTimeout(t *testing.T) {
	_, svc := newWaitVM(t)
	if _, err := svc.Await(context.Background(), vm.ModeAppVM, "w", func(*vm.Record) bool { return true }); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("a classic VM awaited as an AppVM: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if _, err := svc.Await(ctx, vm.ModeVM, "w", func(r *vm.Record) bool { return r != nil && r.DisplayState == "paused" }); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("timeout: %v", err)
	}
	if n := svc.WaitersOf("w"); n != 0 {
		t.Errorf("%d waiters left after the timeout", n)
	}
}

// TestManyWaitersNoGoroutines: a thousand waiters on one VM add no
// goroutine beyond their own, and one change wakes every one of them.
func TestManyWaitersNoGoroutines(t *testing.T) {
	e, svc := newWaitVM(t)
	const n = 1000
	ctx := context.Background()
	before := runtime.NumGoroutine()
	var registered sync.WaitGroup
	results := make(chan error, n)
	for range n {
		registered.Add(1)
		var once sync.Once
		go func() {
			_, err := svc.Await(ctx, vm.ModeVM, "w", func(r *vm.Record) bool {
				once.Do(registered.Done)
				return r != nil && r.DisplayState == "paused"
			})
			results <- err
		}()
	}
	registered.Wait()
	if got := runtime.NumGoroutine() - before; got > n {
		t.Errorf("%d goroutines for %d waiters", got, n)
	}
	if w := svc.WaitersOf("w"); w != n {
		t.Fatalf("%d waiters registered, want %d", w, n)
	}
	setDisplay(t, e, "w", "paused", "paused")
	for range n {
		if err := <-results; err != nil {
			t.Fatal(err)
		}
	}
	if w := svc.WaitersOf("w"); w != 0 {
		t.Errorf("%d waiters left", w)
	}
}

func TestFollowIsPokedByChangesAndRemoval(t *testing.T) {
	e, svc := newWaitVM(t)
	changed, stop := svc.Follow("w")
	defer stop()
	setDisplay(t, e, "w", "running", "booting")
	setDisplay(t, e, "w", "running", "running") // coalesced with the one before
	select {
	case <-changed:
	case <-time.After(10 * time.Second):
		t.Fatal("no poke after a change")
	}
	if err := e.Records.Remove("w"); err != nil {
		t.Fatal(err)
	}
	select {
	case <-changed:
	case <-time.After(10 * time.Second):
		t.Fatal("no poke after the removal")
	}
	stop()
	if w := svc.WaitersOf("w"); w != 0 {
		t.Errorf("%d waiters after stop", w)
	}
}
