package engine

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"time"

	"vmhost/chclient"
	"vmhost/disk"
	"vmhost/internal/atomicfile"
	"vmhost/jail"
	"vmhost/proc"
	"vmhost/qcow2"
	"vmhost/qmp"
	"vmhost/snapshot"
	"vmhost/vm/record"
)

// Suspend, the start from a saved state, snapshots and their restore
// (docs/api.md, Suspend and snapshots; record/saved.go has the layout).
//
// Cloud Hypervisor saves a paused VM with vm.snapshot into a fresh empty
// directory under the VM's save directory, which it must be able to write
// (with confinement, <state>/vms/<id>/save is the VM's and visible in its
// hypervisor's root); CH syncs nothing, so the agent syncs every file and
// the directory before it renames the directory into place (it has the
// kernel start writing the files out while CH writes them, writebehind.go,
// so that sync finds little left to do). A start
// restores from the suspend directory in a fresh CH process (vm.restore),
// paused; the VM is recorded running, then resumed: a guest that ran on
// disks the record does not know about can never be restored again over
// them. Every step is recorded first (Record.Saving) and recovery
// (recoverSaving) finishes or undoes it.

// saveTimeout bounds a vm.snapshot or vm.restore of a VM of memMB MiB: the
// memory goes through the disk (and, under the simulator's qemu backend,
// through QEMU's migration stream), so the deadline grows with it.
func saveTimeout(memMB uint64) time.Duration {
	return time.Minute + time.Duration(memMB)*time.Minute/1024
}

// Suspend saves rec's memory and device state (rec is running or paused)
// to its suspend directory and stops its processes: it is recorded
// stopped, with Suspended, once that is done. A failure before the state
// is in place resumes a VM that ran and leaves it as it was (500
// CH_ERROR with CH's words, for one CH cannot save).
func (e *Engine) Suspend(ctx context.Context, rec *record.Record) error {
	rec = e.current(rec)
	id, l := rec.ID, e.layout()
	running := rec.State == record.StateRunning
	c, err := e.client(rec)
	if err != nil {
		return err
	}
	defer c.Close()
	if err := e.updateRunning(rec, "suspend", func(r *record.Record) {
		r.Saving = &record.SaveOp{Kind: record.SaveSuspend, Resume: running}
	}); err != nil {
		return err
	}
	testStopAt(HookSuspendStart)
	steps := newStepTimes()
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), saveTimeout(rec.Spec.MemoryMB))
	defer cancel()
	undo := func(err error) error { return e.endSave(ctx, id, c, running, "", err) }
	if running {
		if err := c.PauseVM(ctx); err != nil {
			return undo(&record.HostError{Kind: record.HostHypervisor, Op: "vm.pause of VM " + id, Err: err})
		}
	}
	steps.done("pause")
	testStopAt(HookSuspendPaused)
	if err := os.RemoveAll(l.SuspendDir(id)); err != nil { // a leftover nothing names
		return undo(&record.HostError{Kind: record.HostStorage, Op: "suspending VM " + id, Err: err})
	}
	tmp, err := e.saveState(ctx, c, rec, steps)
	if err != nil {
		return undo(err)
	}
	testStopAt(HookSuspendSaved)
	if err := placeDir(tmp, l.SuspendDir(id)); err != nil {
		os.RemoveAll(tmp)
		return undo(&record.HostError{Kind: record.HostStorage, Op: "suspending VM " + id, Err: err})
	}
	steps.done("place")
	testStopAt(HookSuspendPlaced)
	// The state is saved and the VM has not run since: the suspend is done,
	// whatever stopping its processes brings.
	ch := e.stopForSuspend(rec, steps)
	testStopAt(HookSuspendStopped)
	err = e.recordSuspended(id, ch)
	steps.done("record")
	// Where the time went (the memory's size and the disk's speed make
	// most of it).
	e.log.Info("suspend steps", append([]any{"id", id}, steps.attrs()...)...)
	return err
}

// stepTimes times the steps of an operation for its log line: each
// step's duration in milliseconds, then the total. A nil *stepTimes
// times nothing.
type stepTimes struct {
	start, last time.Time
	took        []any // "<step>_ms", milliseconds, ...
}

func newStepTimes() *stepTimes {
	now := time.Now()
	return &stepTimes{start: now, last: now}
}

// done ends step, which began when the previous one ended.
func (s *stepTimes) done(step string) {
	if s == nil {
		return
	}
	now := time.Now()
	s.took = append(s.took, step+"_ms", now.Sub(s.last).Milliseconds())
	s.last = now
}

// count adds a count of the operation's (not a step's) to its log line.
func (s *stepTimes) count(name string, n int) {
	if s != nil {
		s.took = append(s.took, name, n)
	}
}

// attrs are the steps' durations and the total, as log attributes.
func (s *stepTimes) attrs() []any {
	return append(s.took, "total_ms", s.last.Sub(s.start).Milliseconds())
}

// endSave ends a suspend or snapshot that stops short of its end, or a
// snapshot that is done: a VM it paused runs again (then the crash-test
// hook, when one is named), and the intent is cleared. A VM that cannot be resumed is recorded paused. err is
// returned, or the resume's failure when err is nil.
func (e *Engine) endSave(ctx context.Context, id string, c *chclient.Client, resume bool, hook string, err error) error {
	paused := false
	if resume {
		if rerr := c.ResumeVM(ctx); rerr != nil {
			e.log.Error("resuming a VM after a suspend or snapshot; it stays paused", "id", id, "err", rerr)
			paused = true
			if err == nil {
				err = &record.HostError{Kind: record.HostHypervisor, Op: "vm.resume of VM " + id, Err: rerr}
			}
		}
	}
	if hook != "" {
		testStopAt(hook) // crash tests (recover_hook.go)
	}
	// A monitor that recorded the VM's end meanwhile keeps its verdict.
	watched, uerr := e.updateWatched(id, func(r *record.Record) {
		r.Saving = nil
		if paused && r.State == record.StateRunning {
			r.State, r.DisplayState = record.StatePaused, string(record.StatePaused)
		}
	})
	if uerr == nil && !watched {
		e.clearSaving(id)
	}
	if uerr != nil {
		e.log.Error("recording the end of a suspend or snapshot", "id", id, "err", uerr)
	}
	return err
}

// saveState has CH write the paused VM's state into a fresh directory
// under the VM's save directory and syncs it; it returns the directory.
// steps, if not nil, times the snapshot and the sync.
func (e *Engine) saveState(ctx context.Context, c *chclient.Client, rec *record.Record, steps *stepTimes) (string, error) {
	id := rec.ID
	fail := func(kind record.HostErrorKind, err error) (string, error) {
		return "", &record.HostError{Kind: kind, Op: "saving the state of VM " + id, Err: err}
	}
	save := e.layout().SaveDir(id)
	if err := os.MkdirAll(save, 0o700); err != nil {
		return fail(record.HostStorage, err)
	}
	tmp, err := os.MkdirTemp(save, "state-")
	if err != nil {
		return fail(record.HostStorage, err)
	}
	if jv := e.vmJail(rec); jv != nil {
		// A confined CH writes the state as the VM's uid: it may pass
		// through the save directory and write into tmp alone.
		if err := os.Chmod(save, 0o711); err != nil {
			os.RemoveAll(tmp)
			return fail(record.HostStorage, err)
		}
		if err := jail.Own(jv.UID, jv.GID, tmp); err != nil {
			os.RemoveAll(tmp)
			return fail(record.HostStorage, err)
		}
	}
	url, err := chclient.FileURL(tmp)
	written := 0
	if err == nil {
		stop := writeBehind(tmp)
		err = c.Snapshot(ctx, url)
		written = stop()
	}
	if err != nil {
		os.RemoveAll(tmp)
		return "", &record.HostError{Kind: record.HostHypervisor, Op: "vm.snapshot of VM " + id, Err: err}
	}
	steps.done("snapshot")
	if err := snapshot.SyncTree(tmp); err != nil {
		os.RemoveAll(tmp)
		return fail(record.HostStorage, err)
	}
	steps.done("sync")
	steps.count("written_out_files", written)
	return tmp, nil
}

// placeDir renames the directory from to to (which must not exist) and
// syncs both parents.
func placeDir(from, to string) error {
	if err := os.Rename(from, to); err != nil {
		return err
	}
	if err := atomicfile.SyncDir(filepath.Dir(to)); err != nil {
		return err
	}
	return atomicfile.SyncDir(filepath.Dir(from))
}

// stopForSuspend ends the processes of a VM whose state is saved, as Stop
// does, and returns its CH (nil when it was not watched).
func (e *Engine) stopForSuspend(rec *record.Record, steps *stepTimes) *chclient.Process {
	id := rec.ID
	ch, qsd := e.unwatch(id)
	e.endGuest(rec)
	if ch == nil {
		// Not watched (its monitor concluded as the state was saved):
		// whatever is recorded is ended by its identity.
		if err := e.stopAll(context.Background(), e.current(rec)); err != nil {
			e.log.Error("stopping the processes of a suspended VM", "id", id, "err", err)
		}
		return nil
	}
	e.shutdownVMM(ch)
	steps.done("stop_ch")
	e.stopProcesses(id, ch, qsd)
	steps.done("stop_qsd")
	e.stopHeldQSD(id)
	steps.done("stop_jail")
	return ch
}

// recordSuspended records a suspended VM: stopped, with its saved state;
// ch, when known, gives the exit.
func (e *Engine) recordSuspended(id string, ch *chclient.Process) error {
	d := record.FailureDetail{Kind: record.KindMissingPID}
	if ch != nil {
		if st, ok := ch.Exit(); ok && !st.Signaled() {
			code := st.Code
			d = record.FailureDetail{Kind: record.KindProcessExit, Code: &code}
		}
	}
	now := e.o.Now().UTC()
	_, err := e.update(id, func(r *record.Record) {
		r.State, r.DisplayState = record.StateStopped, string(record.StateStopped)
		r.PID = 0
		r.ShuttingDown = false
		r.Saving = nil
		r.Suspended = &record.Suspension{At: now}
		if r.Runtime != nil {
			r.Runtime.CH, r.Runtime.QSD = nil, nil
		}
		r.FailureReason = &record.FailureReason{DetectedAt: now, Summary: "suspended by the operator: its memory and device state are saved, and a start resumes it",
			Detail: d, Cause: record.CauseOperatorShutdown}
	})
	return err
}

// resumeSaved is Boot for a VM with a saved state: its storage daemon
// (exporting the same disks again) and taps, the guest end of an AppVM
// (its agent redials), a new CH restored from the suspend directory,
// paused, then recorded running and resumed. A state CH cannot restore
// fails the start (CH's words) and is kept, so the operator can try again
// or start cold.
func (e *Engine) resumeSaved(ctx context.Context, rec *record.Record) (err error) {
	id, l := rec.ID, e.layout()
	defer func() {
		if err != nil {
			e.stopHeldQSD(id)
		}
	}()
	steps := newStepTimes()
	rec, qsd, jv, err := e.readyHost(ctx, rec)
	if err != nil {
		return err
	}
	steps.done("ready_host")
	fail := func(op string, err error) error {
		return &record.HostError{Kind: record.HostHypervisor, Op: op + " of VM " + id, Err: err}
	}
	if g := e.guest(rec); g != nil {
		lis, err := e.listenGuest(g, id)
		if err != nil {
			return fail("restoring", err)
		}
		if err := g.Resume(ctx, rec, lis); err != nil {
			return err
		}
	}
	rt, lc := e.chLaunch(id)
	if jv != nil {
		// Confined as a boot confines it, in the VM's cgroup; it reads the
		// saved state as the VM's uid (a restored snapshot's files are
		// hard links made as root, or owned by the VM the snapshot was of).
		if lc.Confine, err = e.prepareRestore(rec, jv); err != nil {
			e.endGuest(rec)
			return err
		}
	}
	p, err := chclient.Launch(ctx, lc)
	if err != nil {
		e.endGuest(rec)
		return fail("launching cloud hypervisor", err)
	}
	rt.Pid, rt.StartTime = p.Pid, p.StartTime
	steps.done("launch_ch")
	e.keepConsole(rec, rt.SerialSocket, p)
	undo := func(err error) error {
		e.shutdownVMM(p)
		if serr := terminate(p.Done(), p.Signal); serr != nil {
			e.log.Error("stopping cloud-hypervisor after a failed restore", "id", id, "pid", p.Pid, "err", serr)
		}
		p.Close()
		e.endGuest(rec)
		return err
	}
	testStopAt(HookResumeCH)
	c := p.Client()
	src, err := chclient.FileURL(l.SuspendDir(id))
	if err != nil {
		return undo(fail("vm.restore", err))
	}
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), saveTimeout(rec.Spec.MemoryMB))
	defer cancel()
	if err := c.Restore(rctx, &chclient.RestoreConfig{SourceURL: src}); err != nil {
		return undo(fail("vm.restore", err))
	}
	if err := expectState(rctx, c, chclient.StatePaused); err != nil {
		return undo(fail("vm.restore", err))
	}
	steps.done("restore")
	testStopAt(HookResumeRestored)
	if _, err := e.update(id, func(r *record.Record) {
		r.Runtime.CH, r.PID = rt, rt.Pid
		if qsd != nil {
			r.Runtime.QSD = qsd
		}
		r.State, r.DisplayState = record.StateRunning, string(record.StateRunning)
		r.FailureReason = nil
		r.ShuttingDown = false
		r.Suspended = nil
		r.Saving = &record.SaveOp{Kind: record.SaveResume}
	}); err != nil {
		return undo(err)
	}
	steps.done("record")
	testStopAt(HookResumeRecorded)
	e.mu.Lock()
	q := e.live[id]
	delete(e.live, id) // the monitor owns both processes from here
	e.mu.Unlock()
	e.watch(id, p, q)
	rerr := c.ResumeVM(rctx)
	testStopAt(HookResumeResumed)
	if rerr != nil {
		rerr = fail("vm.resume after vm.restore", rerr)
	}
	e.endResume(id, rerr != nil)
	steps.done("resume")
	e.log.Info("VM resumed from its saved state", append([]any{"id", id, "ch_pid", p.Pid}, steps.attrs()...)...)
	return rerr
}

// endResume clears the intent of a start from a saved state and removes
// the state it consumed; a VM that could not be resumed is recorded
// paused.
func (e *Engine) endResume(id string, paused bool) {
	if _, err := e.update(id, func(r *record.Record) {
		r.Saving = nil
		if paused && r.State == record.StateRunning {
			r.State, r.DisplayState = record.StatePaused, string(record.StatePaused)
		}
	}); err != nil {
		e.log.Error("recording a VM resumed from its saved state", "id", id, "err", err)
		return
	}
	if err := os.RemoveAll(e.layout().SuspendDir(id)); err != nil {
		e.log.Warn("removing the saved state a start consumed; the next agent start removes it", "id", id, "err", err)
	}
}

// DiscardSaved drops rec's saved state (a start cold): the record first,
// then the files (recovery removes a suspend directory no record names).
func (e *Engine) DiscardSaved(_ context.Context, rec *record.Record) error {
	rec = e.current(rec)
	if rec.Suspended == nil {
		return nil
	}
	if _, err := e.update(rec.ID, func(r *record.Record) { r.Suspended = nil }); err != nil {
		return err
	}
	if err := os.RemoveAll(e.layout().SuspendDir(rec.ID)); err != nil {
		e.log.Warn("removing a discarded saved state; the next agent start removes it", "id", rec.ID, "err", err)
	}
	e.log.Info("saved state discarded", "id", rec.ID)
	return nil
}

// Snapshot writes the files of snapshot sid of rec into dir, its staging
// directory: a copy of each disk the VM owns in dir/disks (the root disk,
// then its own volumes), and, when memory is asked for and the VM runs (or
// is paused, or is suspended), its saved state in dir/memory. A running
// VM is paused for the copies and resumed after; its storage daemon is
// flushed first, so the copies hold every write the guest saw complete.
// It returns the copies (with their final paths) and whether the memory
// was saved.
func (e *Engine) Snapshot(ctx context.Context, rec *record.Record, sid, dir string, memory bool) ([]snapshot.Disk, bool, error) {
	rec = e.current(rec)
	id := rec.ID
	if rec.State != record.StateRunning && rec.State != record.StatePaused {
		// Nothing runs but the daemon provisioning kept, if any.
		e.mu.Lock()
		q := e.live[id]
		e.mu.Unlock()
		if q != nil {
			if err := q.Flush(ctx); err != nil {
				return nil, false, &record.HostError{Kind: record.HostStorage, Op: "snapshot of VM " + id, Err: err}
			}
		}
		saved := false
		if memory && rec.Suspended != nil {
			if err := linkTree(e.layout().SuspendDir(id), filepath.Join(dir, snapshot.MemoryDir)); err != nil {
				return nil, false, &record.HostError{Kind: record.HostStorage, Op: "snapshot of the saved state of VM " + id, Err: err}
			}
			saved = true
		}
		disks, err := e.copyDisks(ctx, rec, sid, dir)
		return disks, saved, err
	}
	running := rec.State == record.StateRunning
	c, err := e.client(rec)
	if err != nil {
		return nil, false, err
	}
	defer c.Close()
	if err := e.updateRunning(rec, "snapshot", func(r *record.Record) {
		r.Saving = &record.SaveOp{Kind: record.SaveSnapshot, Snapshot: sid, Resume: running}
	}); err != nil {
		return nil, false, err
	}
	testStopAt(HookSnapshotStart)
	steps := newStepTimes()
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), saveTimeout(rec.Spec.MemoryMB))
	defer cancel()
	undo := func(err error) ([]snapshot.Disk, bool, error) {
		return nil, false, e.endSave(ctx, id, c, running, "", err)
	}
	if running {
		if err := c.PauseVM(ctx); err != nil {
			return undo(&record.HostError{Kind: record.HostHypervisor, Op: "vm.pause of VM " + id, Err: err})
		}
	}
	steps.done("pause")
	testStopAt(HookSnapshotPaused)
	saved := false
	if memory {
		tmp, err := e.saveState(ctx, c, rec, steps)
		if err != nil {
			return undo(err)
		}
		if err := placeDir(tmp, filepath.Join(dir, snapshot.MemoryDir)); err != nil {
			os.RemoveAll(tmp)
			return undo(&record.HostError{Kind: record.HostStorage, Op: "snapshot of VM " + id, Err: err})
		}
		saved = true
		steps.done("place")
		testStopAt(HookSnapshotMemory)
	}
	if err := e.flushWatched(ctx, id); err != nil {
		return undo(err)
	}
	steps.done("flush")
	disks, err := e.copyDisks(ctx, rec, sid, dir)
	if err != nil {
		return undo(err)
	}
	steps.done("copy_disks")
	testStopAt(HookSnapshotDisks)
	err = e.endSave(ctx, id, c, running, HookSnapshotResume, nil)
	steps.done("resume")
	e.log.Info("snapshot steps", append([]any{"id", id, "snapshot", sid}, steps.attrs()...)...)
	// An error: the copies are whole; the VM stays paused, as recorded.
	return disks, saved, err
}

// flushWatched flushes the storage daemon of the watched VM id.
func (e *Engine) flushWatched(ctx context.Context, id string) error {
	e.mon.mu.Lock()
	var q *qmp.QSD
	if m := e.mon.m[id]; m != nil {
		q = m.qsd
	}
	e.mon.mu.Unlock()
	if q != nil {
		if err := q.Flush(ctx); err != nil {
			return &record.HostError{Kind: record.HostStorage, Op: "snapshot of VM " + id, Err: err}
		}
	}
	return nil
}

// copyDisks copies the root disk and the VM-owned volumes of rec into
// dir/disks.
func (e *Engine) copyDisks(ctx context.Context, rec *record.Record, sid, dir string) ([]snapshot.Disk, error) {
	l, id := e.layout(), rec.ID
	type src struct{ id, path string }
	srcs := []src{{record.RootDiskID, l.RootDisk(id)}}
	for _, v := range rec.Spec.Volumes {
		if v.VolumeID == "" && v.Pending != record.PendingAttach {
			srcs = append(srcs, src{v.ID, l.DataVolume(id, v.ID)})
		}
	}
	var out []snapshot.Disk
	for _, s := range srcs {
		dst := filepath.Join(dir, snapshot.DisksDir, s.id+".qcow2")
		if err := disk.CopyImage(ctx, s.path, dst); err != nil {
			return nil, &record.HostError{Kind: record.HostStorage, Op: "snapshot of VM " + id, Err: err}
		}
		h, err := qcow2.ReadHeaderFile(dst)
		if err != nil {
			return nil, &record.HostError{Kind: record.HostStorage, Op: "snapshot of VM " + id, Err: err}
		}
		out = append(out, snapshot.Disk{ID: s.id, Path: l.SnapshotDisk(sid, s.id), VirtualSizeBytes: h.Size, Backing: h.BackingFile})
	}
	return out, nil
}

// linkTree makes dst, a new directory, with a hard link of every file of
// src (a saved state: its files are never written again), and syncs it.
func linkTree(src, dst string) error {
	if err := os.Mkdir(dst, 0o700); err != nil {
		return err
	}
	ents, err := os.ReadDir(src)
	if err != nil {
		return err
	}
	for _, ent := range ents {
		from, to := filepath.Join(src, ent.Name()), filepath.Join(dst, ent.Name())
		switch {
		case ent.IsDir():
			err = linkTree(from, to)
		case ent.Type().IsRegular():
			err = os.Link(from, to)
		}
		if err != nil {
			return err
		}
	}
	return snapshot.SyncTree(dst)
}

// RestoreSnapshot replaces the disks of rec, a VM that does not run, by
// copies of sn's, and its saved state by sn's (or none, when sn has no
// memory): the copies are staged beside the VM's own, then the commit
// records them (with apply's changes to the record), then they replace
// the VM's. A storage daemon provisioning kept is stopped first (the next
// boot starts one on the new disks).
func (e *Engine) RestoreSnapshot(ctx context.Context, rec *record.Record, sn *snapshot.Snapshot, apply func(*record.Record)) error {
	rec = e.current(rec)
	id, l := rec.ID, e.layout()
	if _, err := e.update(id, func(r *record.Record) {
		r.Saving = &record.SaveOp{Kind: record.SaveRestore, Snapshot: sn.ID}
	}); err != nil {
		return err
	}
	testStopAt(HookRestoreStart)
	e.stopHeldQSD(id)
	undo := func(err error) error {
		e.dropStaged(rec)
		if _, uerr := e.update(id, func(r *record.Record) { r.Saving = nil }); uerr != nil {
			e.log.Error("recording a restore that failed", "id", id, "err", uerr)
		}
		return &record.HostError{Kind: record.HostStorage, Op: fmt.Sprintf("restoring snapshot %s onto VM %s", sn.ID, id), Err: err}
	}
	e.dropStaged(rec)
	for _, d := range sn.Disks {
		target := l.RootDisk(id)
		if d.ID != record.RootDiskID {
			target = l.DataVolume(id, d.ID)
		}
		if err := disk.CopyImage(ctx, d.Path, record.Staged(target)); err != nil {
			return undo(err)
		}
	}
	if sn.Memory {
		if err := linkTree(l.SnapshotMemory(sn.ID), l.SuspendNext(id)); err != nil {
			return undo(err)
		}
	}
	testStopAt(HookRestoreStaged)
	if _, err := e.update(id, func(r *record.Record) {
		r.Saving.Staged = true
		r.Suspended = nil
		if sn.Memory {
			r.Suspended = &record.Suspension{At: sn.CreatedAt, Snapshot: sn.ID}
		}
		if apply != nil {
			apply(r)
		}
	}); err != nil {
		return undo(err)
	}
	testStopAt(HookRestoreCommit)
	e.swapRestored(e.current(rec))
	testStopAt(HookRestoreSwapped)
	if _, err := e.update(id, func(r *record.Record) { r.Saving = nil }); err != nil {
		return err
	}
	return nil
}

// diskFiles are the files of rec's own disks: the root disk and its own
// volumes.
func (e *Engine) diskFiles(rec *record.Record) []string {
	l := e.layout()
	files := []string{l.RootDisk(rec.ID)}
	for _, v := range rec.Spec.Volumes {
		if v.VolumeID == "" {
			files = append(files, l.DataVolume(rec.ID, v.ID))
		}
	}
	return files
}

// dropStaged removes what a restore that did not commit staged.
func (e *Engine) dropStaged(rec *record.Record) {
	for _, f := range e.diskFiles(rec) {
		if err := os.Remove(record.Staged(f)); err != nil && !errors.Is(err, fs.ErrNotExist) {
			e.log.Warn("removing a staged copy", "id", rec.ID, "file", record.Staged(f), "err", err)
		}
	}
	if err := os.RemoveAll(e.layout().SuspendNext(rec.ID)); err != nil {
		e.log.Warn("removing a staged saved state", "id", rec.ID, "err", err)
	}
}

// swapRestored puts a committed restore's copies in place of the VM's own
// disks, and its staged state (or none) in place of the saved state; each
// step can be done again, so recovery finishes it the same way.
func (e *Engine) swapRestored(rec *record.Record) {
	l, id := e.layout(), rec.ID
	for _, f := range e.diskFiles(rec) {
		if err := atomicfile.Rename(record.Staged(f), f); err != nil && !errors.Is(err, fs.ErrNotExist) {
			e.log.Error("putting a restored disk in place", "id", id, "file", f, "err", err)
		}
	}
	next := l.SuspendNext(id)
	if _, err := os.Stat(next); err == nil || rec.Suspended == nil {
		if err := os.RemoveAll(l.SuspendDir(id)); err != nil {
			e.log.Error("removing the saved state a restore replaces", "id", id, "err", err)
		}
	}
	if _, err := os.Stat(next); err == nil {
		if err := placeDir(next, l.SuspendDir(id)); err != nil {
			e.log.Error("putting a restored saved state in place", "id", id, "err", err)
		}
	}
}

// recoverSaving finishes or undoes what rec's recorded Saving says was in
// progress when the agent died, and removes what no record names (a save
// directory's contents, a suspend directory of a VM not suspended, staged
// copies). It returns the record after it.
func (e *Engine) recoverSaving(rec *record.Record) *record.Record {
	id, l := rec.ID, e.layout()
	if op := rec.Saving; op != nil {
		switch op.Kind {
		case record.SaveSuspend:
			if _, err := os.Stat(l.SuspendDir(id)); err == nil {
				e.finishSuspendRecovered(rec)
			} else {
				e.resumeRecovered(rec, op.Resume)
			}
		case record.SaveSnapshot:
			e.resumeRecovered(rec, op.Resume)
		case record.SaveResume:
			e.resumeRecovered(rec, true)
		case record.SaveRestore:
			if op.Staged {
				e.swapRestored(rec)
			} else {
				e.dropStaged(rec)
			}
			e.clearSaving(id)
		}
		e.log.Warn("finished what an agent restart cut short", "id", id, "operation", op.Kind)
	}
	if err := os.RemoveAll(l.SaveDir(id)); err != nil {
		e.log.Warn("removing a save directory", "id", id, "err", err)
	}
	cur := e.recs.Get(id)
	if cur == nil {
		return rec
	}
	if cur.Saving == nil {
		if cur.Suspended == nil {
			e.removeIfThere(id, l.SuspendDir(id), "a saved state no record names")
		}
		e.removeIfThere(id, l.SuspendNext(id), "a staged saved state")
		for _, f := range e.diskFiles(cur) {
			e.removeIfThere(id, record.Staged(f), "a staged copy")
		}
	}
	return cur
}

func (e *Engine) removeIfThere(id, path, what string) {
	if _, err := os.Lstat(path); err != nil {
		return
	}
	if err := os.RemoveAll(path); err != nil {
		e.log.Warn("removing "+what, "id", id, "path", path, "err", err)
		return
	}
	e.log.Warn("removed "+what, "id", id, "path", path)
}

func (e *Engine) clearSaving(id string) {
	if _, err := e.recs.Update(id, func(r *record.Record) { r.Saving = nil }); err != nil && !errors.Is(err, fs.ErrNotExist) {
		e.log.Error("clearing an operation recovery finished", "id", id, "err", err)
	}
}

// resumeRecovered runs again the recorded CH of a VM a suspend, snapshot
// or start paused when the agent died (when resume), and clears the
// intent; the VM is then adopted (or ended) as any running VM.
func (e *Engine) resumeRecovered(rec *record.Record, resume bool) {
	if rt := rec.Runtime; resume && rt != nil && rt.CH != nil && proc.Alive(rt.CH.Pid, rt.CH.StartTime) {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		c := chclient.New(rt.CH.APISocket)
		info, err := c.VMInfo(ctx)
		if err == nil && info.State == chclient.StatePaused {
			err = c.ResumeVM(ctx)
		}
		c.Close()
		cancel()
		if err != nil {
			e.log.Error("resuming a VM an agent restart left paused", "id", rec.ID, "err", err)
		}
	}
	e.clearSaving(rec.ID)
}

// finishSuspendRecovered completes a suspend whose state was in place when
// the agent died: its processes are ended (CH asked to exit first) and it
// is recorded suspended.
func (e *Engine) finishSuspendRecovered(rec *record.Record) {
	id := rec.ID
	if rt := rec.Runtime; rt != nil && rt.CH != nil && proc.Alive(rt.CH.Pid, rt.CH.StartTime) {
		ctx, cancel := context.WithTimeout(context.Background(), e.o.StopGrace)
		c := chclient.New(rt.CH.APISocket)
		if err := c.ShutdownVMM(ctx); err == nil {
			for proc.Alive(rt.CH.Pid, rt.CH.StartTime) && ctx.Err() == nil {
				time.Sleep(20 * time.Millisecond)
			}
		}
		c.Close()
		cancel()
	}
	if err := e.stopAll(context.Background(), rec); err != nil {
		e.log.Error("stopping the processes of a VM whose suspend an agent restart cut short", "id", id, "err", err)
	}
	if err := e.recordSuspended(id, nil); err != nil {
		e.log.Error("recording a suspend an agent restart cut short", "id", id, "err", err)
	}
}
