package engine

import (
	"bytes"
	"context"
	"errors"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"vmhost/chclient"
	"vmhost/snapshot"
	"vmhost/vm/record"
)

// The caller of the saved-state operations, as package vm makes them:
// under the VM's action lock.

func (s *testService) suspend(ctx context.Context, id string) (*record.Record, error) {
	unlock := s.recs.Lock(id)
	defer unlock()
	if err := s.Suspend(ctx, s.recs.Get(id)); err != nil {
		return nil, err
	}
	return s.recs.Get(id), nil
}

// takeSnapshot takes snapshot sid of VM id into a staging directory and
// publishes it as the snapshot store does (the files renamed into place);
// it returns the snapshot.
func (s *testService) takeSnapshot(t *testing.T, id, sid string, memory bool) *snapshot.Snapshot {
	t.Helper()
	st, err := snapshot.Open(s.lay.SnapshotsDir(), nil)
	if err != nil {
		t.Fatal(err)
	}
	release, err := st.Reserve(sid)
	if err != nil {
		t.Fatal(err)
	}
	defer release()
	unlock := s.recs.Lock(id)
	rec := s.recs.Get(id)
	disks, saved, err := s.Snapshot(context.Background(), rec, sid, st.Staging(sid), memory)
	unlock()
	if err != nil {
		t.Fatalf("snapshot %s of %s: %v", sid, id, err)
	}
	sn := &snapshot.Snapshot{ID: sid, VMID: id, Mode: string(rec.Mode), CreatedAt: time.Now().UTC(), Memory: saved, Disks: disks}
	if err := st.Commit(sn); err != nil {
		t.Fatal(err)
	}
	return sn
}

func (s *testService) restoreSnapshot(ctx context.Context, id string, sn *snapshot.Snapshot) error {
	unlock := s.recs.Lock(id)
	defer unlock()
	return s.RestoreSnapshot(ctx, s.recs.Get(id), sn, nil)
}

// eventsOf is what CH's event stream of VM id holds, as "source event"
// lines.
func eventsOf(t *testing.T, s *testService, id string) []string {
	t.Helper()
	f, err := os.Open(s.lay.Events(id))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var out []string
	r := chclient.NewEventReader(f)
	for {
		ev, err := r.Next()
		if errors.Is(err, io.EOF) {
			return out
		}
		if err != nil {
			continue
		}
		out = append(out, ev.Source+" "+ev.Event)
	}
}

func names(t *testing.T, dir string) []string {
	t.Helper()
	ents, _ := os.ReadDir(dir)
	var out []string
	for _, e := range ents {
		out = append(out, e.Name())
	}
	return out
}

// TestEngineSuspendAndResume: a running VM's suspend saves its state in
// its suspend directory (CH's three files, synced, the save directory
// left empty), ends both its processes and records it stopped with
// Suspended; its start runs a new CH restored from there (vm restored,
// no vm booted), recorded running at once, the state consumed. A paused
// VM suspends too.
func TestEngineSuspendAndResume(t *testing.T) {
	s := simService(t, nil)
	ctx := context.Background()
	sp := baseSpec(t, s.root, "s")
	sp.AutoBoot = true
	before := s.mustCreate(t, sp)
	chPid, qsdPid := before.Runtime.CH.Pid, before.Runtime.QSD.Pid
	rec, err := s.suspend(ctx, "s")
	if err != nil {
		t.Fatal(err)
	}
	if rec.State != record.StateStopped || rec.Suspended == nil || rec.Saving != nil || rec.Runtime.CH != nil || rec.Runtime.QSD != nil || rec.PID != 0 ||
		rec.FailureReason == nil || rec.FailureReason.Cause != record.CauseOperatorShutdown {
		t.Fatalf("after suspend: %s", describe(rec))
	}
	if got := names(t, s.lay.SuspendDir("s")); !slices.Equal(got, []string{"config.json", "memory-ranges", "state.json"}) {
		t.Errorf("suspend directory holds %v", got)
	}
	if got := names(t, s.lay.SaveDir("s")); len(got) != 0 {
		t.Errorf("save directory holds %v", got)
	}
	if got := processesNaming(s.lay.RunVMDir("s") + "/"); len(got) != 0 {
		t.Errorf("processes of the VM (CH was %d, QSD %d) still run after the suspend: %v", chPid, qsdPid, got)
	}
	// One log line tells where the suspend's time went, step by step.
	// Every file of the saved state was written out while CH wrote it
	// (or right after), before the sync.
	stepsLine := regexp.MustCompile(`msg="suspend steps" id=s pause_ms=\d+ snapshot_ms=\d+ sync_ms=\d+ written_out_files=3 place_ms=\d+ ` +
		`stop_ch_ms=\d+ stop_qsd_ms=\d+ stop_jail_ms=\d+ record_ms=\d+ total_ms=\d+\n`)
	if logs := s.logs.String(); len(stepsLine.FindAllString(logs, -1)) != 1 {
		t.Errorf("the log has no single line of the suspend's steps:\n%s", logs)
	}
	rec, err = s.act(ctx, "s", "start")
	if err != nil {
		t.Fatal(err)
	}
	if rec.State != record.StateRunning || rec.DisplayState != string(record.StateRunning) || rec.Suspended != nil || rec.Saving != nil ||
		rec.Runtime.CH == nil || rec.Runtime.CH.Pid == chPid || rec.FailureReason != nil {
		t.Fatalf("after the start: %s", describe(rec))
	}
	if _, err := os.Stat(s.lay.SuspendDir("s")); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("the consumed state is still there: %v", err)
	}
	resumeLine := regexp.MustCompile(`msg="VM resumed from its saved state" id=s ch_pid=\d+ ready_host_ms=\d+ launch_ch_ms=\d+ ` +
		`restore_ms=\d+ record_ms=\d+ resume_ms=\d+ total_ms=\d+\n`)
	if logs := s.logs.String(); len(resumeLine.FindAllString(logs, -1)) != 1 {
		t.Errorf("the log has no single line of the start's steps:\n%s", logs)
	}
	evs := eventsOf(t, s, "s")
	if !slices.Contains(evs, "vm restored") || !slices.Contains(evs, "vm resumed") || slices.Contains(evs, "vm booted") {
		t.Errorf("the restarted CH's events: %v, want a restore and no boot", evs)
	}
	c := chclient.New(rec.Runtime.CH.APISocket)
	defer c.Close()
	if info, err := c.VMInfo(ctx); err != nil || info.State != chclient.StateRunning {
		t.Errorf("vm.info after the start: %+v %v", info, err)
	}
	// Paused, then suspended: the start resumes it running.
	if _, err := s.act(ctx, "s", "pause"); err != nil {
		t.Fatal(err)
	}
	if rec, err = s.suspend(ctx, "s"); err != nil || rec.Suspended == nil {
		t.Fatalf("suspend of a paused VM: %v %s", err, describe(rec))
	}
	if rec, err = s.act(ctx, "s", "start"); err != nil || rec.State != record.StateRunning {
		t.Fatalf("start after a paused suspend: %v %s", err, describe(rec))
	}
	if err := s.remove(ctx, "s"); err != nil {
		t.Fatal(err)
	}
}

// TestEngineSuspendFailureLeavesTheVMRunning: a state that cannot be
// saved (its save directory cannot be made) fails the suspend with the
// reason, and the VM runs on, resumed, with nothing left of the attempt.
func TestEngineSuspendFailureLeavesTheVMRunning(t *testing.T) {
	s := simService(t, nil)
	ctx := context.Background()
	sp := baseSpec(t, s.root, "f")
	sp.AutoBoot = true
	before := s.mustCreate(t, sp)
	if err := os.WriteFile(s.lay.SaveDir("f"), []byte("in the way"), 0o600); err != nil {
		t.Fatal(err)
	}
	_, err := s.suspend(ctx, "f")
	var he *record.HostError
	if !errors.As(err, &he) || he.Kind != record.HostStorage {
		t.Fatalf("suspend = %v, want a storage error", err)
	}
	rec := s.recs.Get("f")
	if rec.State != record.StateRunning || rec.Suspended != nil || rec.Saving != nil || rec.Runtime.CH.Pid != before.Runtime.CH.Pid {
		t.Errorf("after a failed suspend: %s", describe(rec))
	}
	c := chclient.New(rec.Runtime.CH.APISocket)
	defer c.Close()
	if info, err := c.VMInfo(ctx); err != nil || info.State != chclient.StateRunning {
		t.Errorf("vm.info after a failed suspend: %+v %v, want it running again", info, err)
	}
	if _, err := os.Stat(s.lay.SuspendDir("f")); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("a failed suspend left its directory: %v", err)
	}
}

// TestEngineUnrestorableStateIsKept: a saved state CH refuses fails the
// start with CH's words and is kept, the VM still suspended and nothing
// left running; DiscardSaved (a start cold) then boots it.
func TestEngineUnrestorableStateIsKept(t *testing.T) {
	s := simService(t, nil)
	ctx := context.Background()
	sp := baseSpec(t, s.root, "u")
	sp.AutoBoot = true
	s.mustCreate(t, sp)
	if _, err := s.suspend(ctx, "u"); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(s.lay.SuspendDir("u"), "state.json"), []byte("{broken"), 0o600); err != nil {
		t.Fatal(err)
	}
	_, err := s.act(ctx, "u", "start")
	var he *record.HostError
	if !errors.As(err, &he) || he.Kind != record.HostHypervisor || !strings.Contains(err.Error(), "vm.restore") || !strings.Contains(err.Error(), "Error deserialising VM state snapshot") {
		t.Fatalf("start from a damaged state = %v, want CH's refusal", err)
	}
	rec := s.recs.Get("u")
	if rec.State != record.StateStopped || rec.Suspended == nil || rec.Runtime.CH != nil || rec.Runtime.QSD != nil {
		t.Errorf("after the failed start: %s", describe(rec))
	}
	if got := processesNaming(s.lay.RunVMDir("u") + "/"); len(got) != 0 {
		t.Errorf("processes of the VM left after the failed start: %v", got)
	}
	if _, err := os.Stat(filepath.Join(s.lay.SuspendDir("u"), "config.json")); err != nil {
		t.Errorf("the saved state was not kept: %v", err)
	}
	unlock := s.recs.Lock("u")
	err = s.DiscardSaved(ctx, s.recs.Get("u"))
	unlock()
	if err != nil {
		t.Fatal(err)
	}
	if rec, err = s.act(ctx, "u", "start"); err != nil || rec.State != record.StateRunning || rec.DisplayState != record.DisplayBooting {
		t.Fatalf("cold start: %v %s", err, describe(rec))
	}
	if evs := eventsOf(t, s, "u"); !slices.Contains(evs, "vm booted") {
		t.Errorf("cold start's events %v, want a boot", evs)
	}
}

// TestEngineSnapshotAndRestore: a snapshot with memory of a running VM
// holds CH's saved state and a copy of each disk the VM owns, byte for
// byte, and the VM runs on in the same process; a restore onto the VM,
// stopped and changed meanwhile, puts the copies back and the state in
// its suspend directory, so the next start resumes from it.
func TestEngineSnapshotAndRestore(t *testing.T) {
	s := simService(t, nil)
	ctx := context.Background()
	sp := baseSpec(t, s.root, "v")
	sp.AutoBoot = true
	before := s.mustCreate(t, sp)
	root := s.lay.RootDisk("v")
	want, _ := os.ReadFile(root)
	sn := s.takeSnapshot(t, "v", "s1", true)
	rec := s.recs.Get("v")
	if rec.State != record.StateRunning || rec.Saving != nil || rec.Runtime.CH.Pid != before.Runtime.CH.Pid {
		t.Errorf("after the snapshot: %s", describe(rec))
	}
	var ids []string
	for _, d := range sn.Disks {
		ids = append(ids, d.ID)
		if d.Path != s.lay.SnapshotDisk("s1", d.ID) || d.VirtualSizeBytes == 0 {
			t.Errorf("disk %+v", d)
		}
	}
	if !sn.Memory || !slices.Equal(ids, []string{"root", "data0"}) {
		t.Fatalf("snapshot %+v", sn)
	}
	if got, _ := os.ReadFile(s.lay.SnapshotDisk("s1", "root")); !bytes.Equal(got, want) {
		t.Error("the root disk's copy differs from the disk")
	}
	if got := names(t, s.lay.SnapshotMemory("s1")); !slices.Equal(got, []string{"config.json", "memory-ranges", "state.json"}) {
		t.Errorf("the snapshot's memory holds %v", got)
	}
	stepsLine := regexp.MustCompile(`msg="snapshot steps" id=v snapshot=s1 pause_ms=\d+ snapshot_ms=\d+ sync_ms=\d+ written_out_files=3 ` +
		`place_ms=\d+ flush_ms=\d+ copy_disks_ms=\d+ resume_ms=\d+ total_ms=\d+\n`)
	if logs := s.logs.String(); len(stepsLine.FindAllString(logs, -1)) != 1 {
		t.Errorf("the log has no single line of the snapshot's steps:\n%s", logs)
	}
	// The VM changes after the snapshot; a restore takes it back.
	if _, err := s.act(ctx, "v", "stop"); err != nil {
		t.Fatal(err)
	}
	f, err := os.OpenFile(root, os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		t.Fatal(err)
	}
	f.Write([]byte("written after the snapshot"))
	f.Close()
	if err := s.restoreSnapshot(ctx, "v", sn); err != nil {
		t.Fatal(err)
	}
	rec = s.recs.Get("v")
	if rec.Suspended == nil || rec.Suspended.Snapshot != "s1" || rec.Saving != nil || rec.State != record.StateStopped {
		t.Fatalf("after the restore: %s", describe(rec))
	}
	if got, _ := os.ReadFile(root); !bytes.Equal(got, want) {
		t.Error("the root disk is not the snapshot's after the restore")
	}
	for _, f := range []string{record.Staged(root), s.lay.SuspendNext("v")} {
		if _, err := os.Stat(f); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("%s left after the restore", f)
		}
	}
	if rec, err = s.act(ctx, "v", "start"); err != nil || rec.State != record.StateRunning {
		t.Fatalf("start after a restore with memory: %v %s", err, describe(rec))
	}
	if evs := eventsOf(t, s, "v"); !slices.Contains(evs, "vm restored") || slices.Contains(evs, "vm booted") {
		t.Errorf("events after the restore's start: %v", evs)
	}
	// The snapshot is untouched by all that: the state was linked.
	if got := names(t, s.lay.SnapshotMemory("s1")); len(got) != 3 {
		t.Errorf("the snapshot's memory after the start: %v", got)
	}
}

// TestEngineRecoverSaving: what recovery makes of each step the record
// says was in progress when the agent died: a suspend whose state was not
// in place is undone (the VM paused for it runs again); one whose state
// was in place is finished (processes ended, recorded suspended); a
// restore not staged is rolled back, one staged is rolled forward; a
// start from a saved state recorded running but not resumed is resumed.
func TestEngineRecoverSaving(t *testing.T) {
	s := simService(t, nil)
	ctx := context.Background()
	for _, id := range []string{"undo", "finish", "back", "fwd", "resume"} {
		sp := baseSpec(t, s.root, id)
		sp.AutoBoot = id != "back" && id != "fwd"
		s.mustCreate(t, sp)
	}
	pause := func(id string) {
		c := chclient.New(s.recs.Get(id).Runtime.CH.APISocket)
		defer c.Close()
		if err := c.PauseVM(ctx); err != nil {
			t.Fatal(err)
		}
	}
	// undo: paused for a suspend, a half-written state in the save dir.
	pause("undo")
	s.recs.Update("undo", func(r *record.Record) { r.Saving = &record.SaveOp{Kind: record.SaveSuspend, Resume: true} })
	os.MkdirAll(s.lay.SaveDir("undo")+"/state-x", 0o700)
	// finish: its state in place.
	pause("finish")
	s.recs.Update("finish", func(r *record.Record) { r.Saving = &record.SaveOp{Kind: record.SaveSuspend, Resume: true} })
	os.MkdirAll(s.lay.SuspendDir("finish"), 0o700)
	os.WriteFile(s.lay.SuspendDir("finish")+"/config.json", []byte("{}"), 0o600)
	// back and fwd: a restore's copy staged, then recorded staged or not.
	for _, id := range []string{"back", "fwd"} {
		os.WriteFile(record.Staged(s.lay.RootDisk(id)), []byte("restored"), 0o600)
		os.MkdirAll(s.lay.SuspendNext(id), 0o700)
		staged := id == "fwd"
		s.recs.Update(id, func(r *record.Record) {
			r.Saving = &record.SaveOp{Kind: record.SaveRestore, Snapshot: "x", Staged: staged}
			if staged {
				r.Suspended = &record.Suspension{Snapshot: "x"}
			}
		})
	}
	// resume: recorded running from a saved state, CH still paused.
	pause("resume")
	s.recs.Update("resume", func(r *record.Record) { r.Saving = &record.SaveOp{Kind: record.SaveResume} })
	os.MkdirAll(s.lay.SuspendDir("resume"), 0o700)

	b := s.restart(t)
	state := func(id string) string {
		c := chclient.New(b.recs.Get(id).Runtime.CH.APISocket)
		defer c.Close()
		info, err := c.VMInfo(ctx)
		if err != nil {
			return err.Error()
		}
		return info.State
	}
	for _, id := range []string{"undo", "resume"} {
		rec := b.recs.Get(id)
		if rec.Saving != nil || rec.State != record.StateRunning || rec.Suspended != nil || !b.watched(id) || state(id) != chclient.StateRunning {
			t.Errorf("%s after recovery: %s, CH %s", id, describe(rec), state(id))
		}
	}
	if _, err := os.Stat(b.lay.SaveDir("undo")); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("the undone suspend's save directory is left: %v", err)
	}
	if _, err := os.Stat(b.lay.SuspendDir("resume")); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("the consumed state of the resumed VM is left: %v", err)
	}
	if rec := b.recs.Get("finish"); rec.Saving != nil || rec.State != record.StateStopped || rec.Suspended == nil || rec.Runtime.CH != nil || b.watched("finish") {
		t.Errorf("finish after recovery: %s", describe(rec))
	}
	if got := processesNaming(b.lay.RunVMDir("finish") + "/"); len(got) != 0 {
		t.Errorf("the finished suspend's processes run on: %v", got)
	}
	if rec := b.recs.Get("back"); rec.Saving != nil || rec.Suspended != nil {
		t.Errorf("back after recovery: %s", describe(rec))
	}
	if got, _ := os.ReadFile(b.lay.RootDisk("back")); string(got) == "restored" {
		t.Error("a restore that was not staged replaced the disk")
	}
	if got, _ := os.ReadFile(b.lay.RootDisk("fwd")); string(got) != "restored" {
		t.Error("a staged restore was not rolled forward")
	}
	if rec := b.recs.Get("fwd"); rec.Saving != nil || rec.Suspended == nil {
		t.Errorf("fwd after recovery: %s", describe(rec))
	}
	if _, err := os.Stat(b.lay.SuspendDir("fwd")); err != nil {
		t.Errorf("the staged state of a staged restore is not in place: %v", err)
	}
	for _, id := range []string{"back", "fwd"} {
		for _, f := range []string{record.Staged(b.lay.RootDisk(id)), b.lay.SuspendNext(id)} {
			if _, err := os.Stat(f); !errors.Is(err, fs.ErrNotExist) {
				t.Errorf("%s left after recovery", f)
			}
		}
	}
}
