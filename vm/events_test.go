package vm_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"vmhost/events"
	"vmhost/vm"
	"vmhost/vm/vmtest"
)

// collector keeps published events in order.
type collector struct {
	mu  sync.Mutex
	evs []events.Event
}

func (c *collector) Publish(e events.Event) {
	c.mu.Lock()
	c.evs = append(c.evs, e)
	c.mu.Unlock()
}

// take returns "type vm state/display" lines of the events so far and
// forgets them.
func (c *collector) take() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	var b strings.Builder
	for _, e := range c.evs {
		fmt.Fprintf(&b, "%s %s %s/%s\n", e.Type, e.VMID, e.State, e.DisplayState)
	}
	c.evs = nil
	return b.String()
}

// TestRecordChangesPublishEvents: a create, a boot, a stop, a failure and
// a delete each publish their events, once, in the order they were stored,
// with the state after the change.
func TestRecordChangesPublishEvents(t *testing.T) {
	e := vmtest.NewEnv(t)
	c := &collector{}
	e.Events = c
	svc := e.Service(t)
	s := baseSpec(e)
	s.VMID = "a"
	ctx := context.Background()
	if _, _, err := svc.CreateVM(ctx, &s); err != nil {
		t.Fatal(err)
	}
	want := "created a created/creating\ndisplay_state_changed a created/created\n"
	if got := c.take(); got != want {
		t.Fatalf("create published\n%s\nwant\n%s", got, want)
	}
	if _, err := svc.Act(ctx, vm.ModeVM, "a", vm.ActionStart); err != nil {
		t.Fatal(err)
	}
	want = "state_changed a running/booting\ndisplay_state_changed a running/booting\n"
	if got := c.take(); got != want {
		t.Fatalf("start published\n%s\nwant\n%s", got, want)
	}
	at := e.Now.Add(time.Minute)
	if _, err := e.Records.Update("a", func(r *vm.Record) {
		r.State, r.DisplayState = vm.StateFailed, string(vm.StateFailed)
		r.FailureReason = &vm.FailureReason{DetectedAt: at, Summary: "exit 1", Cause: "exited", Detail: vm.FailureDetail{Kind: "exited"}}
		r.GuestPanickedAt = &at
	}); err != nil {
		t.Fatal(err)
	}
	c.mu.Lock()
	evs := append([]events.Event(nil), c.evs...)
	c.mu.Unlock()
	want = "state_changed a failed/failed\ndisplay_state_changed a failed/failed\nfailed a failed/failed\nguest_panic a failed/failed\n"
	if got := c.take(); got != want {
		t.Fatalf("failure published\n%s\nwant\n%s", got, want)
	}
	if evs[0].PreviousState != "running" || evs[1].PreviousDisplayState != "booting" {
		t.Errorf("previous state %q/%q, want running/booting", evs[0].PreviousState, evs[1].PreviousDisplayState)
	}
	if f := evs[2].Failure; f == nil || f.Summary != "exit 1" || f.Cause != "exited" || !f.DetectedAt.Equal(at) {
		t.Errorf("failed event's failure = %+v", f)
	}
	// Rewriting the same failure is no new event.
	if _, err := e.Records.Update("a", func(r *vm.Record) { r.BalloonMB = 1 }); err != nil {
		t.Fatal(err)
	}
	if got := c.take(); got != "" {
		t.Fatalf("a change no event names published\n%s", got)
	}
	if err := svc.Delete(ctx, vm.ModeVM, "a", false); err != nil {
		t.Fatal(err)
	}
	if got, want := c.take(), "deleted a failed/failed\n"; got != want {
		t.Fatalf("delete published\n%s\nwant\n%s", got, want)
	}
}

// TestAppVMGuestEvents: a workload exit and a health change of an AppVM's
// guest publish workload_exit and health_changed once each.
func TestAppVMGuestEvents(t *testing.T) {
	e := vmtest.NewEnv(t)
	c := &collector{}
	e.Events = c
	svc := e.Service(t)
	s := baseSpec(e)
	s.VMID = "w"
	if _, _, err := svc.CreateVM(context.Background(), &s); err != nil {
		t.Fatal(err)
	}
	c.take()
	// Give the record an AppVM part, as appvm's create would.
	if _, err := e.Records.Update("w", func(r *vm.Record) { r.AppVM = &vm.AppVMSpec{Guest: &vm.AppVMGuest{}} }); err != nil {
		t.Fatal(err)
	}
	code := 3
	for range 2 { // the second write of the same outcome publishes nothing
		if _, err := e.Records.Update("w", func(r *vm.Record) { r.AppVM.Guest.ExitCode = &code; r.AppVM.Guest.Health = "unhealthy" }); err != nil {
			t.Fatal(err)
		}
	}
	c.mu.Lock()
	evs := append([]events.Event(nil), c.evs...)
	c.mu.Unlock()
	if got, want := c.take(), "workload_exit w created/created\nhealth_changed w created/created\n"; got != want {
		t.Fatalf("guest changes published\n%s\nwant\n%s", got, want)
	}
	if evs[0].ExitCode == nil || *evs[0].ExitCode != 3 || evs[1].Health != "unhealthy" {
		t.Errorf("exit %v, health %q", evs[0].ExitCode, evs[1].Health)
	}
}

// TestFailedCreatePublishesDelete: a create rolled back after its record
// was stored says so: created, then deleted.
func TestFailedCreatePublishesDelete(t *testing.T) {
	e := vmtest.NewEnv(t)
	c := &collector{}
	e.Events = c
	e.Host.FailProvision = errors.New("no space")
	svc := e.Service(t)
	s := baseSpec(e)
	s.VMID = "f"
	if _, _, err := svc.CreateVM(context.Background(), &s); err == nil {
		t.Fatal("create with a failing provision succeeded")
	}
	if got, want := c.take(), "created f created/creating\ndeleted f created/creating\n"; got != want {
		t.Fatalf("failed create published\n%s\nwant\n%s", got, want)
	}
}
