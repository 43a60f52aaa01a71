package records

import (
	"maps"
	"slices"
	"testing"
	"time"

	"vmhost/events"
	"vmhost/vm/record"
)

// TestEveryVMEventCarriesLabels: each event type a record change makes,
// and heartbeat_stale made by VMEvent, carries the VM's labels as they are
// after the change (before it, for deleted); a change of the labels alone
// makes no event.
func TestEveryVMEventCarriesLabels(t *testing.T) {
	l1 := map[string]string{"team": "infra"}
	l2 := map[string]string{"team": "web", "job": "j-1"}
	base := &record.Record{ID: "a", Mode: record.ModeAppVM, State: record.StateCreated, DisplayState: record.DisplayCreating,
		Spec: record.Spec{Labels: l1}, AppVM: &record.AppVMSpec{}}
	relabelled := base.Clone()
	relabelled.Spec.Labels = l2
	now := time.Now()
	code := 3
	changed := relabelled.Clone()
	changed.State, changed.DisplayState = record.StateFailed, string(record.StateFailed)
	changed.FailureReason = &record.FailureReason{DetectedAt: now, Summary: "x", Cause: "ch_crash"}
	changed.GuestPanickedAt = &now
	changed.AppVM.Guest = &record.AppVMGuest{ExitCode: &code, Health: "unhealthy"}
	changed.Spec.Volumes = []record.VolumeSpec{{ID: "data0", SizeGiB: 1}}
	detached := changed.Clone()
	detached.Spec.Volumes = nil

	var got []events.Event
	for _, c := range []Change{{New: base}, {Old: base, New: relabelled}, {Old: relabelled, New: changed}, {Old: changed, New: detached}, {Old: detached}} {
		got = append(got, Events(c)...)
	}
	got = append(got, VMEvent(events.HeartbeatStale, detached))
	var types []events.Type
	for i, e := range got {
		types = append(types, e.Type)
		want := l2
		if i == 0 {
			want = l1 // created before the edit
		}
		if !maps.Equal(e.Labels, want) {
			t.Errorf("event %d (%s) carries labels %v, want %v", i, e.Type, e.Labels, want)
		}
	}
	wantTypes := []events.Type{events.Created, events.StateChanged, events.DisplayStateChanged, events.Failed, events.GuestPanic,
		events.WorkloadExit, events.HealthChanged, events.VolumeAttached, events.VolumeDetached, events.Deleted, events.HeartbeatStale}
	if !slices.Equal(types, wantTypes) {
		t.Errorf("event types %v, want %v (the labels edit alone makes none)", types, wantTypes)
	}
}
