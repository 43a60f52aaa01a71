package vm

import (
	"vmhost/events"
	"vmhost/vm/record"
)

// The registry publishes an event for each change of a stored record that
// extensions.md §6 names, after the change is stored and in the order the
// changes were stored: every writer of records (the Service, the engine
// through HostRecords, package appvm) goes through the registry, so no
// change is missed and none is told twice.

// vmEvent is an event of rec with its state after the change.
func vmEvent(t events.Type, rec *Record) events.Event {
	return events.Event{Type: t, VMID: rec.ID, Mode: string(rec.Mode), State: string(rec.State), DisplayState: rec.DisplayState}
}

// changeEvents are the events of the change from old to cur.
func changeEvents(old, cur *Record) []events.Event {
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
	og, cg := guestOf(old), guestOf(cur)
	if exited(cg) && (!exited(og) || !sameExit(og, cg)) {
		e := vmEvent(events.WorkloadExit, cur)
		e.ExitCode, e.ExitSignal, e.Fatal = cg.ExitCode, cg.ExitSignal, cg.Fatal
		out = append(out, e)
	}
	if cg.Health != "" && cg.Health != og.Health {
		e := vmEvent(events.HealthChanged, cur)
		e.Health = cg.Health
		out = append(out, e)
	}
	out = append(out, volumeEvents(old, cur, events.VolumeDetached)...)
	return append(out, volumeEvents(cur, old, events.VolumeAttached)...)
}

// volumeEvents are events of type t for the volumes a has attached (a hot
// attach counts once it is done) and b does not, named by their
// first-class volume id, else their per-VM id, with a's device.
func volumeEvents(a, b *Record, t events.Type) []events.Event {
	var out []events.Event
	for i, v := range a.Spec.Volumes {
		if v.Pending == record.PendingAttach {
			continue
		}
		if j := b.Spec.VolumeIndex(v.ID); j >= 0 && b.Spec.Volumes[j].Pending != record.PendingAttach {
			continue
		}
		e := vmEvent(t, cur(a, b, t))
		e.VolumeID, e.Device = v.ID, VolumeDevice(a, i)
		if v.VolumeID != "" {
			e.VolumeID = v.VolumeID
		}
		out = append(out, e)
	}
	return out
}

// cur is the record after the change: volumeEvents gets (old, cur) for
// detaches and (cur, old) for attaches.
func cur(a, b *Record, t events.Type) *Record {
	if t == events.VolumeAttached {
		return a
	}
	return b
}

func guestOf(r *Record) record.AppVMGuest {
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
