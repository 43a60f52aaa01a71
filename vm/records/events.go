package records

import (
	"vmhost/events"
	"vmhost/vm/record"
)

// Change is one change of a record, as watchers are told it: Old is the
// record before (nil for a new one), New the record after (nil for a
// removed one). Both are never modified.
type Change struct {
	Old, New *record.Record
}

// Watch has f told every change of every record from now on, after the
// change is made (stored, or staged), in the order the changes of one
// record were made. f runs with the record's write lock held: it must be
// quick, must not change records and must not wait for anything a writer
// may hold; work that takes time goes to a goroutine of its own.
func (g *Registry) Watch(f func(Change)) {
	g.watchMu.Lock()
	g.watchers = append(g.watchers, f)
	g.watchMu.Unlock()
}

// tell hands c to the watchers; the record's write lock is held.
func (g *Registry) tell(c Change) {
	g.watchMu.RLock()
	ws := g.watchers
	g.watchMu.RUnlock()
	for _, f := range ws {
		f(c)
	}
}

// Publish returns a watcher that publishes the events of each change to p
// (the event log): every writer of records goes through the Registry, so
// no change is missed and none is told twice.
func Publish(p events.Publisher) func(Change) {
	return func(c Change) {
		for _, e := range Events(c) {
			p.Publish(e)
		}
	}
}

// Events are the events of docs/api.md, Events that c makes, with the state
// after the change: created, deleted, state and display changes, a new
// failure, a guest panic, a workload exit, a health change, a suspend, a
// snapshot restored, and volumes attached and detached.
func Events(c Change) []events.Event {
	switch {
	case c.Old == nil && c.New != nil:
		return []events.Event{vmEvent(events.Created, c.New)}
	case c.New == nil && c.Old != nil:
		return []events.Event{vmEvent(events.Deleted, c.Old)}
	case c.Old == nil:
		return nil
	}
	old, cur := c.Old, c.New
	var out []events.Event
	if old.State != cur.State {
		e := vmEvent(events.StateChanged, cur)
		e.PreviousState = string(old.State)
		out = append(out, e)
	}
	if old.DisplayState != cur.DisplayState {
		e := vmEvent(events.DisplayStateChanged, cur)
		e.PreviousDisplayState = old.DisplayState
		out = append(out, e)
	}
	if f := cur.FailureReason; f != nil && (old.FailureReason == nil || !old.FailureReason.DetectedAt.Equal(f.DetectedAt) || old.FailureReason.Cause != f.Cause) {
		e := vmEvent(events.Failed, cur)
		e.Failure = &events.Failure{Summary: f.Summary, Cause: f.Cause, DetectedAt: f.DetectedAt}
		out = append(out, e)
	}
	if p := cur.GuestPanickedAt; p != nil && (old.GuestPanickedAt == nil || !old.GuestPanickedAt.Equal(*p)) {
		out = append(out, vmEvent(events.GuestPanic, cur))
	}
	if WorkloadExited(c) {
		cg := cur.AppVM.Guest
		e := vmEvent(events.WorkloadExit, cur)
		e.ExitCode, e.ExitSignal, e.Fatal = cg.ExitCode, cg.ExitSignal, cg.Fatal
		out = append(out, e)
	}
	og, cg := guestOf(old), guestOf(cur)
	if cg.Health != "" && cg.Health != og.Health {
		e := vmEvent(events.HealthChanged, cur)
		e.Health = cg.Health
		out = append(out, e)
	}
	if cur.Suspended != nil && cur.Suspended.Snapshot == "" && old.Suspended == nil {
		out = append(out, vmEvent(events.Suspended, cur))
	}
	if op := cur.Saving; op != nil && op.Kind == record.SaveRestore && op.Staged && (old.Saving == nil || !old.Saving.Staged) {
		e := vmEvent(events.SnapshotRestored, cur) // the restore's commit point
		e.SnapshotID = op.Snapshot
		out = append(out, e)
	}
	out = append(out, volumeEvents(old, cur, events.VolumeDetached)...)
	return append(out, volumeEvents(cur, old, events.VolumeAttached)...)
}

// WorkloadExited reports whether c records a new end of an AppVM's
// workload (an exit code, a signal or a fatal setup error its guest agent
// reported).
func WorkloadExited(c Change) bool {
	if c.Old == nil || c.New == nil {
		return false
	}
	og, cg := guestOf(c.Old), guestOf(c.New)
	return exited(cg) && (!exited(og) || !sameExit(og, cg))
}

// VMEvent is an event of type t of rec, for the VM events published
// outside the registry's changes (appvm's heartbeat_stale): every VM event
// is made by vmEvent, so all carry the same fields.
func VMEvent(t events.Type, rec *record.Record) events.Event { return vmEvent(t, rec) }

// vmEvent is an event of rec with its id, family, state and labels as
// they are after the change.
func vmEvent(t events.Type, rec *record.Record) events.Event {
	return events.Event{Type: t, VMID: rec.ID, Mode: string(rec.Mode), State: string(rec.State), DisplayState: rec.DisplayState,
		Labels: rec.Spec.Labels}
}

// volumeEvents are events of type t for the volumes a has attached (a hot
// attach counts once it is done) and b does not, named by their
// first-class volume id, else their per-VM id, with a's device.
func volumeEvents(a, b *record.Record, t events.Type) []events.Event {
	after := b // the record after the change: (old, cur) for detaches
	if t == events.VolumeAttached {
		after = a // and (cur, old) for attaches
	}
	var out []events.Event
	for i, v := range a.Spec.Volumes {
		if v.Pending == record.PendingAttach {
			continue
		}
		if j := b.Spec.VolumeIndex(v.ID); j >= 0 && b.Spec.Volumes[j].Pending != record.PendingAttach {
			continue
		}
		e := vmEvent(t, after)
		e.VolumeID, e.Device = v.ID, record.VolumeDevice(a, i)
		if v.VolumeID != "" {
			e.VolumeID = v.VolumeID
		}
		out = append(out, e)
	}
	return out
}

func guestOf(r *record.Record) record.AppVMGuest {
	if r.AppVM == nil || r.AppVM.Guest == nil {
		return record.AppVMGuest{}
	}
	return *r.AppVM.Guest
}

func exited(g record.AppVMGuest) bool { return g.ExitCode != nil || g.ExitSignal != 0 || g.Fatal != "" }

func sameExit(a, b record.AppVMGuest) bool {
	return (a.ExitCode == nil) == (b.ExitCode == nil) && (a.ExitCode == nil || *a.ExitCode == *b.ExitCode) &&
		a.ExitSignal == b.ExitSignal && a.Fatal == b.Fatal
}
