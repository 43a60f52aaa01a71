package engine

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"vmhost/chclient"
	"vmhost/internal/atomicfile"
	"vmhost/proc"
	"vmhost/qmp"
	"vmhost/store"
	"vmhost/tap"
	"vmhost/vm/record"
)

// Recovery after an agent restart (docs/design.md §2: VMs outlive the agent).
//
// Recover reconciles every record with the host before it returns:
//
//   - A running or paused VM whose recorded Cloud Hypervisor still runs
//     (pid and start time match) is adopted: CH and its
//     qemu-storage-daemon through pidfds, and both are watched again
//     (monitor.go). Adoption does only what watching needs: the storage
//     daemon's QMP monitor is dialled on first use, the console keeps its
//     log (console.go). A VM still booting gets the rest of its boot
//     timeout. Nothing is restarted and nothing is written.
//   - If CH is gone, the VM ends: stopped (guest_shutdown) when its event
//     stream shows a clean poweroff, else failed with missing_pid
//     (ch_crash). If CH runs but its storage daemon is gone, the VM fails
//     with a storage summary and CH is stopped. Either way what is left is
//     stopped, since a failed VM runs nothing. A storage daemon whose QMP
//     monitor does not answer (it serves one client at a time) fails only
//     the commands that need it (a hot attach), not the running VM.
//   - A suspend, snapshot, restore or start from a saved state that was
//     cut short (Record.Saving) is finished or undone first (saved.go).
//   - A record whose delete was asked for (Deleting, stored before the
//     teardown began) is deleted: its processes by recorded identity, taps,
//     directories, then the record.
//   - A VM that is not running keeps no CH (the leftover of a boot or stop
//     the agent did not finish is killed); a created VM's live storage
//     daemon is handed back to the engine, otherwise killed. A provisioned
//     VM that is not running (or whose end recovery records) and whose
//     root disk is gone is failed (disk_missing), never shown healthy.
//   - A provision that was cut short is resumed when it ran in the
//     background (a create with an image, answered 202, whose caller polls):
//     a provision records its steps with its result (with the boot's write,
//     for a create with auto_boot), and files of steps not recorded (a
//     partial copy, temp files) are removed first, so the resumed Provision
//     redoes exactly the missing steps. If it fails, it
//     is rolled back and the VM is failed (provision_failed), as any
//     background provision. A synchronous create (no image) whose caller
//     saw the request fail is rolled back and failed (provision_failed);
//     the record stays to say why.
//   - What no record owns is reaped and logged: Cloud Hypervisor and
//     qemu-storage-daemon processes whose command line names an API or QMP
//     socket in <run>/vms/ and that are not a recorded, adopted process;
//     taps marked with this agent's id whose ifalias names a VM (or an
//     interface index) no record has (another agent's taps and unmarked
//     ones are never touched; an unmarked tap a record names is adopted);
//     directories in <run>/vms/ and <state>/vms/ without a record (a
//     directory whose record file exists in any form, damaged included, is
//     kept); first of all, the temp files of interrupted writes
//     (sweepTemps).
//     Processes are only ever matched by those socket paths, so no
//     unrelated process is touched, and they are signalled through a pidfd
//     opened after checking their start time.
//
// Without root, adoption still works for processes of the same user; tap
// reaping is skipped with a warning when the host cannot list taps.

// RecoveryReport says what Recover found on the host and did about it.
type RecoveryReport struct {
	Adopted  []string // running VMs adopted and watched again
	Ended    []string // running VMs whose processes had gone
	Deleted  []string // deletes cut short by the agent's death, finished
	NoDisk   []string // VMs not running whose root disk is gone: failed, disk_missing
	Resumed  []string // interrupted provisions resumed (image creates) or rolled back (synchronous ones)
	Killed   []string // processes no record owned, "pid <n> (<vm id>)"
	Taps     []string // taps no record owned, deleted
	Cgroups  []string // VM cgroups of this agent no record named, removed with what ran in them
	Dirs     []string // directories no record owned, removed
	Temps    []string // temp files of interrupted writes (sweepTemps), removed
	Duration time.Duration
}

// Recovery returns what Recover's reconciliation found and did.
func (e *Engine) Recovery() RecoveryReport {
	e.mon.mu.Lock()
	defer e.mon.mu.Unlock()
	return e.mon.recovery
}

// recoverParallel bounds how many records are reconciled at once.
const recoverParallel = 8

// recoverHost runs at Recover.
func (e *Engine) recoverHost() {
	start := time.Now()
	var (
		mu   sync.Mutex
		rep  RecoveryReport
		keep = map[int]bool{}
	)
	// First, before recovery writes anything: temp files of writes the
	// agent's death interrupted.
	rep.Temps = e.sweepTemps()
	recs := e.recs.All()
	sem := make(chan struct{}, recoverParallel)
	var wg sync.WaitGroup
	var resume []*record.Record
	for _, rec := range recs {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			out := e.recoverRecord(rec)
			mu.Lock()
			defer mu.Unlock()
			for _, p := range out.keep {
				keep[p] = true
			}
			switch out.what {
			case "adopted":
				rep.Adopted = append(rep.Adopted, rec.ID)
			case "ended":
				rep.Ended = append(rep.Ended, rec.ID)
			case "deleted":
				rep.Deleted = append(rep.Deleted, rec.ID)
			case "no_disk":
				rep.NoDisk = append(rep.NoDisk, rec.ID)
			case "resume":
				resume = append(resume, rec)
			}
		}()
	}
	wg.Wait()
	rep.Killed = e.reapProcesses(keep)
	rep.Cgroups = e.reapJails()
	if e.o.Taps == nil {
		e.log.Info("no tap handle (the agent cannot manage taps): orphan taps are not reaped and guest addresses (DHCP snooping, neighbour table) are not gathered")
	}
	rep.Taps = e.reapTaps()
	rep.Dirs = e.reapDirs()
	for _, rec := range resume {
		if e.resumeProvision(rec) {
			rep.Resumed = append(rep.Resumed, rec.ID)
		}
	}
	rep.Duration = time.Since(start)
	e.mon.mu.Lock()
	e.mon.recovery = rep
	e.mon.mu.Unlock()
	if len(recs) > 0 || len(rep.Killed)+len(rep.Taps)+len(rep.Cgroups)+len(rep.Dirs)+len(rep.Temps) > 0 {
		e.log.Info("host reconciled with the records", "records", len(recs), "adopted", len(rep.Adopted),
			"ended", len(rep.Ended), "deleted", len(rep.Deleted), "no_disk", len(rep.NoDisk), "resumed", len(rep.Resumed), "killed", len(rep.Killed),
			"taps_reaped", len(rep.Taps), "cgroups_reaped", len(rep.Cgroups), "dirs_reaped", len(rep.Dirs), "temps_removed", len(rep.Temps), "took", rep.Duration)
	}
}

// recovered is the outcome of one record's reconciliation.
type recovered struct {
	what string // "adopted", "ended", "deleted", "no_disk", "resume" or ""
	keep []int  // pids that belong to the record and stay
}

func (e *Engine) recoverRecord(rec *record.Record) recovered {
	if rec.Deleting {
		return e.finishDelete(rec)
	}
	rec = e.recoverSaving(rec) // saved.go
	rt := rec.Runtime
	running := rec.State == record.StateRunning || rec.State == record.StatePaused
	switch {
	case running && (rt == nil || rt.CH == nil):
		// No process identity recorded. The engine records CH before the
		// state running, and a VM that ends by itself is recorded ended
		// before its identity is cleared; only an operator stop (or
		// forced delete) clears the identity first and then records the
		// end. So this is such a stop cut short by the agent's death:
		// finish it.
		e.finishInterruptedStop(rec)
		e.failMissingDisk(e.recs.Get(rec.ID))
		return recovered{what: "ended"}
	case running:
		out := e.recoverRunning(rec)
		if out.what == "ended" {
			e.failMissingDisk(e.recs.Get(rec.ID))
		}
		return out
	case rt == nil:
	default:
		if rt.CH != nil {
			e.log.Warn("VM is not running but its cloud-hypervisor was recorded; killing what is left", "id", rec.ID, "pid", rt.CH.Pid, "state", rec.State)
			e.killRecorded(rec.ID, "cloud-hypervisor", rt.CH.Pid, rt.CH.StartTime)
			e.clearRuntime(rec.ID, true, false)
		}
		if rt.QSD != nil {
			// A created VM's live storage daemon is kept, unless what it
			// serves is gone (the VM fails below).
			if rec.State == record.StateCreated && e.rootDiskGone(rec) == "" {
				if q := e.holdQSD(rec); q != nil {
					return recovered{what: whatResume(rec), keep: []int{q.Pid}}
				}
			}
			e.stopRecordedQSD(rec.ID, rt.QSD) // quit over QMP, so it flushes
			e.clearRuntime(rec.ID, false, true)
		}
	}
	if rec.State != record.StateCreated {
		e.killJail(rec) // a stopped or failed VM runs nothing
	}
	if e.failMissingDisk(rec) {
		return recovered{what: "no_disk"}
	}
	return recovered{what: whatResume(rec)}
}

func whatResume(rec *record.Record) string {
	if rec.Provisioning() {
		return "resume"
	}
	return ""
}

// finishDelete completes a delete the agent died during: the record says
// the delete was asked for, and part of the VM may be gone already. What
// is left (processes by their recorded identity, taps, directories) is
// removed, then the record. A teardown that fails keeps the record, still
// deleting, for a DELETE or the next start to finish.
func (e *Engine) finishDelete(rec *record.Record) recovered {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := e.teardown(ctx, rec, true); err != nil {
		e.log.Error("finishing a delete interrupted by an agent restart", "id", rec.ID, "err", err)
		return recovered{}
	}
	if err := e.recs.Remove(rec.ID); err != nil && !errors.Is(err, fs.ErrNotExist) {
		e.log.Error("removing the record of a delete interrupted by an agent restart", "id", rec.ID, "err", err)
		return recovered{}
	}
	e.log.Warn("finished a delete interrupted by an agent restart", "id", rec.ID)
	return recovered{what: "deleted"}
}

// failMissingDisk fails (disk_missing) a provisioned VM that is not
// running and whose root disk is gone, or whose root disk is an overlay
// whose build is gone (detail.path names what is missing), so it never
// looks healthy without it. It reports whether it did.
func (e *Engine) failMissingDisk(rec *record.Record) bool {
	if rec == nil || rec.State == record.StateRunning || rec.State == record.StatePaused || rec.Provisioning() || rec.DisplayState == record.DisplayProvisionFailed || !rec.Runtime.Done(record.StepRootDisk) {
		return false
	}
	if fr := rec.FailureReason; rec.State == record.StateFailed && fr != nil && fr.Detail.Kind == record.KindDiskMissing {
		return false // already said
	}
	p := e.rootDiskGone(rec)
	if p == "" {
		return false
	}
	summary := fmt.Sprintf("root disk %s is gone (found at agent start)", p)
	if p == rec.RootBacking() {
		summary = fmt.Sprintf("the build %s that root disk %s is an overlay of is gone (found at agent start)", p, e.layout().RootDisk(rec.ID))
	}
	_, err := e.recs.Update(rec.ID, func(r *record.Record) {
		r.State, r.DisplayState = record.StateFailed, string(record.StateFailed)
		r.FailureReason = &record.FailureReason{
			DetectedAt: e.o.Now().UTC(),
			Summary:    summary,
			Detail:     record.FailureDetail{Kind: record.KindDiskMissing, Path: p},
			Cause:      record.CauseDiskMissing,
		}
	})
	if err != nil {
		e.log.Error("recording a missing root disk", "id", rec.ID, "err", err)
		return false
	}
	e.log.Error("VM's root disk is gone; VM failed", "id", rec.ID, "missing", p)
	return true
}

// recoverRunning adopts the processes of a running VM, or ends it.
func (e *Engine) recoverRunning(rec *record.Record) recovered {
	id, rt := rec.ID, rec.Runtime
	ch, chErr := chclient.Adopt(rt.CH.Pid, rt.CH.StartTime, rt.CH.APISocket)
	if chErr != nil {
		e.endRecovered(rec, chErr)
		return recovered{what: "ended"}
	}
	var qsd *qmp.QSD
	keep := []int{ch.Pid}
	if q := rt.QSD; q != nil {
		// Watched by pid from now on; its monitor (which serves one
		// client at a time) is dialled when first needed.
		var err error
		if qsd, err = qmp.AdoptQSD(q.QMPSocket, q.Pid, q.StartTime); err != nil {
			e.failStorageRecovered(rec, ch, err)
			return recovered{what: "ended"}
		}
		keep = append(keep, q.Pid)
	}
	if rt.CH.SerialSocket != "" {
		e.keepConsole(rec, rt.CH.SerialSocket, ch)
	}
	e.verifyAdopted(rec, keep)
	e.supervise(id, ch, qsd)
	if rec.DisplayState == record.DisplayBooting {
		e.rearmBootDeadline(id, ch)
	}
	if rec.Mode == record.ModeAppVM {
		e.adoptGuest(id)
	}
	e.log.Info("VM adopted", "id", id, "ch_pid", ch.Pid, "qsd_pid", keep[len(keep)-1])
	return recovered{what: "adopted", keep: keep}
}

// endRecovered records a running VM whose CH is gone and stops what is
// left.
func (e *Engine) endRecovered(rec *record.Record, chErr error) {
	id := rec.ID
	now := e.o.Now().UTC()
	v := verdict{state: record.StateFailed}
	events := e.layout().Events(id)
	pid := 0
	if rt := rec.Runtime; rt != nil && rt.CH != nil {
		pid = rt.CH.Pid
		if rt.CH.EventsPath != "" {
			events = rt.CH.EventsPath
		}
	}
	if scanEvents(events).poweredOff() {
		zero := 0
		v = verdict{state: record.StateStopped, reason: &record.FailureReason{DetectedAt: now,
			Summary: "the guest powered off while the agent was down",
			Detail:  record.FailureDetail{Kind: record.KindProcessExit, Code: &zero}, Cause: record.CauseGuestShutdown}}
		if rec.ShuttingDown {
			v.reason.Cause = record.CauseOperatorShutdown
		}
	} else {
		summary := fmt.Sprintf("cloud-hypervisor pid %d ended while the agent was down (%v)", pid, chErr)
		v.reason = &record.FailureReason{DetectedAt: now, Summary: summary, Detail: record.FailureDetail{Kind: record.KindMissingPID}, Cause: record.CauseCHCrash}
	}
	e.recordEnd(id, v)
	if q := rec.Runtime.StorageDaemon(); q != nil {
		e.stopRecordedQSD(id, q)
	}
	e.clearRuntime(id, true, true)
}

// finishInterruptedStop records as stopped a running VM whose operator
// stop had ended its processes and cleared their identity when the agent
// died, and stops a storage daemon still recorded.
func (e *Engine) finishInterruptedStop(rec *record.Record) {
	e.recordEnd(rec.ID, verdict{state: record.StateStopped, reason: &record.FailureReason{
		DetectedAt: e.o.Now().UTC(),
		Summary:    "stopped by the operator; the agent restarted before the stop was recorded",
		Detail:     record.FailureDetail{Kind: record.KindMissingPID},
		Cause:      record.CauseOperatorShutdown,
	}})
	if q := rec.Runtime.StorageDaemon(); q != nil {
		e.stopRecordedQSD(rec.ID, q)
		e.clearRuntime(rec.ID, false, true)
	}
}

// failStorageRecovered records a running VM whose storage daemon is gone
// (or unreachable) while CH runs, and stops CH.
func (e *Engine) failStorageRecovered(rec *record.Record, ch *chclient.Process, err error) {
	q := rec.Runtime.QSD
	e.recordEnd(rec.ID, verdict{state: record.StateFailed, reason: &record.FailureReason{
		DetectedAt: e.o.Now().UTC(),
		Summary: fmt.Sprintf("storage failed: qemu-storage-daemon pid %d is gone or unreachable after the agent restarted (%v), so the VM lost its disks",
			q.Pid, err),
		Detail: record.FailureDetail{Kind: record.KindMissingPID},
		Cause:  record.CauseUnknown,
	}})
	e.killRecorded(rec.ID, "qemu-storage-daemon", q.Pid, q.StartTime)
	e.stopProcesses(rec.ID, ch, nil)
	e.clearRuntime(rec.ID, true, true)
}

// recordEnd stores the end of a running VM.
func (e *Engine) recordEnd(id string, v verdict) {
	_, err := e.recs.Update(id, func(r *record.Record) {
		r.State = v.state
		r.DisplayState = string(v.state)
		r.FailureReason = v.reason
		r.PID = 0
		r.ShuttingDown = false
	})
	if err != nil {
		e.log.Error("recording VM end", "id", id, "err", err)
		return
	}
	lvl := e.log.Error
	if v.state == record.StateStopped {
		lvl = e.log.Info
	}
	lvl("VM ended while the agent was down", "id", id, "state", v.state, "kind", v.reason.Detail.Kind, "cause", v.reason.Cause, "summary", v.reason.Summary)
}

// clearRuntime forgets the recorded CH and/or QSD of id.
func (e *Engine) clearRuntime(id string, ch, qsd bool) {
	_, err := e.recs.Update(id, func(r *record.Record) {
		if rt := r.Runtime; rt != nil {
			if ch {
				rt.CH, r.PID = nil, 0
			}
			if qsd {
				rt.QSD = nil
			}
		}
	})
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		e.log.Error("clearing process identity", "id", id, "err", err)
	}
}

// killRecorded SIGKILLs a recorded process if pid and start time still
// identify it.
func (e *Engine) killRecorded(id, what string, pid int, start uint64) {
	if err := killRecorded(pid, start); err != nil {
		e.log.Error("killing leftover process", "id", id, "what", what, "pid", pid, "err", err)
	}
}

// stopRecordedQSD quits a recorded storage daemon over QMP (so it flushes
// its images), or kills it when that fails.
func (e *Engine) stopRecordedQSD(id string, q *record.QSDRuntime) {
	if !proc.Alive(q.Pid, q.StartTime) {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*stopGrace)
	defer cancel()
	a, err := qmp.AttachQSD(ctx, q.QMPSocket, q.Pid, q.StartTime)
	if err == nil {
		if err := a.Quit(ctx); err != nil {
			e.log.Warn("stopping qemu-storage-daemon", "id", id, "pid", q.Pid, "err", err)
		}
		return
	}
	e.killRecorded(id, "qemu-storage-daemon", q.Pid, q.StartTime)
}

// holdQSD adopts the live recorded storage daemon of a created VM and
// keeps it, as provisioning does (its monitor is dialled when the boot
// needs it). It returns nil when the daemon is gone.
func (e *Engine) holdQSD(rec *record.Record) *qmp.QSD {
	q := rec.Runtime.QSD
	a, err := qmp.AdoptQSD(q.QMPSocket, q.Pid, q.StartTime)
	if err != nil {
		return nil
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if old := e.live[rec.ID]; old != nil {
		old.Close()
	}
	e.live[rec.ID] = a
	return a
}

// rearmBootDeadline gives a VM adopted while booting the rest of its boot
// timeout, counted from its CH's start.
func (e *Engine) rearmBootDeadline(id string, ch *chclient.Process) {
	timeout := time.Duration(e.o.Config.BootTimeoutSecs) * time.Second
	left := timeout - time.Since(processStartWall(ch.StartTime))
	time.AfterFunc(max(left, 0), func() { e.bootDeadline(id, ch, timeout) })
}

// resumeProvision continues an interrupted provision in the background,
// after removing the files of steps that were not recorded as done. It
// reports whether the resume started.
func (e *Engine) resumeProvision(rec *record.Record) bool {
	rec = e.recs.Get(rec.ID)
	if rec == nil || !rec.Provisioning() {
		return false
	}
	e.removeUnrecordedFiles(rec)
	// Only a create with an image provisions in the background (202);
	// any other was synchronous, and its caller saw the request fail.
	resume := rec.Spec.Image != nil
	if resume {
		e.log.Warn("resuming a provision interrupted by an agent restart", "id", rec.ID, "steps_done", steps(rec.Runtime))
	} else {
		e.log.Warn("rolling back a synchronous create interrupted by an agent restart", "id", rec.ID, "steps_done", steps(rec.Runtime))
	}
	e.bg.Add(1)
	go func() {
		defer e.bg.Done()
		cur := e.recs.Get(rec.ID)
		switch {
		case cur == nil:
		case resume:
			e.resumeInBackground(cur)
		default:
			e.rollBackInterrupted(cur)
		}
	}()
	return true
}

// resumeInBackground finishes an interrupted background provision as the
// create that started it would have: a failure rolls back and fails the
// VM (provision_failed); success records display created and boots the
// VM, under its action lock, if the create asked for it and nothing else
// got to it first.
func (e *Engine) resumeInBackground(rec *record.Record) {
	ctx := context.Background()
	if err := e.Provision(ctx, rec); err != nil {
		if errors.Is(err, record.ErrDeleted) { // the delete removes what it made
			e.log.Info("provisioning cancelled by a delete", "id", rec.ID)
			return
		}
		e.log.Error("background provisioning failed", "id", rec.ID, "err", err)
		if rerr := e.Rollback(ctx, rec); rerr != nil {
			e.log.Error("rolling back failed provision", "id", rec.ID, "err", rerr)
		}
		e.failProvision(rec.ID, oneLine(err.Error()), false)
		return
	}
	if !rec.Spec.AutoBoot { // Provision recorded display created
		return
	}
	unlock := e.recs.Lock(rec.ID)
	defer unlock()
	if cur := e.recs.Get(rec.ID); cur != nil && cur.State == record.StateCreated {
		if err := e.Boot(ctx, cur); err != nil {
			e.log.Error("booting new VM failed; VM kept", "id", rec.ID, "err", err)
		}
	}
}

// failProvision records a failed provision (provision_failed); clearSteps
// forgets the steps, which a rollback removed.
func (e *Engine) failProvision(id, summary string, clearSteps bool) {
	_, err := e.recs.Update(id, func(r *record.Record) {
		r.State = record.StateFailed
		r.DisplayState = record.DisplayProvisionFailed
		r.FailureReason = &record.FailureReason{
			DetectedAt: e.o.Now().UTC(),
			Summary:    summary,
			Detail:     record.FailureDetail{Kind: record.KindProvisionFailed},
			Cause:      record.CauseProvisionFailed,
		}
		if clearSteps && r.Runtime != nil {
			r.Runtime.Steps = nil
		}
	})
	if err != nil {
		e.log.Error("recording provision failure", "id", id, "err", err)
	}
}

// rollBackInterrupted undoes what an interrupted synchronous create made
// and fails the VM (provision_failed), as a create that fails does (DESIGN
// §4), keeping the record so the caller can see why. A provision records
// its steps only with its result, so everything a provision of rec can
// make is removed by name.
func (e *Engine) rollBackInterrupted(rec *record.Record) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	all := rec.Clone()
	addSteps(all, record.StepRootDisk, record.StepSeed, record.StepRunDir)
	for i := range all.Spec.Volumes {
		addSteps(all, record.StepData(i))
	}
	for i := range all.NICs {
		addSteps(all, record.StepTap(i))
	}
	e.endGuest(all)
	if err := e.teardown(ctx, all, false); err != nil {
		e.log.Error("rolling back an interrupted create", "id", rec.ID, "err", err)
	}
	e.failProvision(rec.ID, "the agent restarted during this synchronous create; what it had made was rolled back (delete the VM and create it again)", true)
}

func steps(rt *record.Runtime) []string {
	if rt == nil {
		return nil
	}
	return rt.Steps
}

// removeUnrecordedFiles removes, from the VM directory of an interrupted
// provision, the targets of steps not recorded as done (a copy or a
// volume may be partial, and their writers refuse to overwrite); the temp
// files of interrupted writes went with the startup sweep (sweepTemps).
func (e *Engine) removeUnrecordedFiles(rec *record.Record) {
	l, id, rt := e.layout(), rec.ID, rec.Runtime
	var targets []string
	if !rt.Done(record.StepRootDisk) {
		targets = append(targets, l.RootDisk(id))
	}
	for i, v := range rec.Spec.Volumes {
		if v.VolumeID == "" && !rt.Done(record.StepData(i)) {
			targets = append(targets, l.DataVolume(id, v.ID))
		}
	}
	if !rt.Done(record.StepSeed) {
		targets = append(targets, l.Seed(id))
	}
	for _, p := range targets {
		err := os.Remove(p)
		switch {
		case err == nil:
			e.log.Warn("removed a file of an unfinished provisioning step", "id", id, "file", p)
		case !errors.Is(err, fs.ErrNotExist):
			e.log.Error("removing a file of an unfinished provisioning step", "id", id, "file", p, "err", err)
		}
	}
}

// reapProcesses kills the CH and QSD processes of <run>/vms/ that are not
// in keep, and returns them as "pid <n> (<vm id>)".
func (e *Engine) reapProcesses(keep map[int]bool) []string {
	ents, err := os.ReadDir("/proc")
	if err != nil {
		e.log.Warn("cannot list processes; orphan VM processes are not reaped", "err", err)
		return nil
	}
	prefix := []byte("path=" + e.layout().RunDir + "/vms/")
	self := os.Getpid()
	var killed []string
	for _, ent := range ents {
		pid, err := strconv.Atoi(ent.Name())
		if err != nil || pid == self || keep[pid] {
			continue
		}
		// The command line first: most processes of a host are not a VM's,
		// and need no more reading. A match is read again after its start
		// time, so the identity the kill checks is the process whose
		// command line matched (a pid reused in between no longer does).
		cmd, err := os.ReadFile("/proc/" + ent.Name() + "/cmdline")
		if err != nil {
			continue
		}
		if _, ok := vmProcessOf(cmd, prefix); !ok {
			continue
		}
		start, err := proc.StartTime(pid)
		if err != nil {
			continue
		}
		if cmd, err = os.ReadFile("/proc/" + ent.Name() + "/cmdline"); err != nil {
			continue
		}
		id, ok := vmProcessOf(cmd, prefix)
		if !ok {
			continue
		}
		if err := killRecorded(pid, start); err != nil {
			e.log.Error("killing an orphan VM process", "pid", pid, "vm", id, "err", err)
			continue
		}
		e.log.Warn("killed a VM process no record owns", "pid", pid, "vm", id)
		killed = append(killed, fmt.Sprintf("pid %d (%s)", pid, id))
	}
	return killed
}

// vmProcessOf reports whether a NUL-separated command line is a CH or QSD
// of a VM under the run directory: an argument holding prefix (path=<run>/
// vms/) followed by <id>/ch.sock (CH's --api-socket) or <id>/qsd.qmp (QSD's
// QMP chardev). It returns the id.
func vmProcessOf(cmdline, prefix []byte) (string, bool) {
	for arg := range bytes.SplitSeq(cmdline, []byte{0}) {
		i := bytes.Index(arg, prefix)
		if i < 0 {
			continue
		}
		rest := arg[i+len(prefix):]
		if j := bytes.IndexByte(rest, ','); j >= 0 {
			rest = rest[:j]
		}
		id, file, ok := bytes.Cut(rest, []byte("/"))
		if ok && store.ValidID(string(id)) && (string(file) == "ch.sock" || string(file) == "qsd.qmp") {
			return string(id), true
		}
	}
	return "", false
}

// reapTaps reconciles the vmhost taps of the namespace with the records
// (docs/design.md §2, several agents on one host): a tap marked with this
// agent's id that no record names (a VM or interface index no record has)
// is deleted; an unmarked tap one of the records names (made before the
// agent had an id) is adopted, marked as this agent's, and guarded again,
// which moves its anti-spoof chain into this agent's table; every other tap
// (another agent's, an unmarked stranger) is left alone.
func (e *Engine) reapTaps() []string {
	h := e.o.Taps
	if h == nil {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	marked, err := h.ListMarked(ctx)
	if err != nil {
		e.log.Warn("cannot list taps; orphan taps are not reaped", "err", err)
		return nil
	}
	var reaped []string
	for _, t := range marked {
		r := e.recs.Get(t.VMID)
		named := r != nil && t.Index < len(r.NICs) && r.NICs[t.Index].Tap == t.Name
		switch {
		case t.Whose == tap.Mine && !named:
			if err := h.Delete(ctx, t.Name); err != nil && !errors.Is(err, fs.ErrNotExist) {
				e.log.Error("deleting an orphan tap", "tap", t.Name, "vm", t.VMID, "err", err)
				continue
			}
			e.log.Warn("deleted a tap no record owns", "tap", t.Name, "vm", t.VMID, "index", t.Index)
			reaped = append(reaped, t.Name)
		case t.Whose == tap.Unmarked && named:
			e.adoptTap(ctx, r, t)
		}
	}
	return reaped
}

// adoptTap marks the unmarked tap t, which interface t.Index of rec
// names, as this agent's, and guards it again (with the address DHCP
// snooping learned, if any) when its network guards it: the new chain
// goes to this agent's table and the unmarked table's goes.
func (e *Engine) adoptTap(ctx context.Context, rec *record.Record, t tap.Owned) {
	h := e.o.Taps
	if err := h.Adopt(ctx, t.Name, t.VMID, t.Index); err != nil {
		e.log.Error("adopting an unmarked tap of this agent's VM", "tap", t.Name, "vm", t.VMID, "err", err)
		return
	}
	if g := e.dhcpGuard(rec, t.Index); g != nil {
		if snooped := rec.NICs[t.Index].DHCPSnoopedIPv4; !g.IPv4.IsValid() && snooped != "" {
			if a, err := netip.ParseAddr(snooped); err == nil {
				g.IPv4 = a
			}
		}
		if err := h.Guard(ctx, *g); err != nil {
			e.log.Error("guarding an adopted tap", "tap", t.Name, "vm", t.VMID, "err", err)
			return
		}
	}
	e.log.Info("adopted an unmarked tap of this agent's VM", "tap", t.Name, "vm", t.VMID, "index", t.Index)
}

// reapDirs removes run directories and VM directories without a record.
func (e *Engine) reapDirs() []string {
	var reaped []string
	storeDir := e.layout().StateDir + "/vms"
	for _, base := range []string{e.layout().RunDir + "/vms", e.layout().RunDir + "/jail", storeDir} {
		ents, err := os.ReadDir(base)
		if err != nil {
			continue
		}
		for _, ent := range ents {
			name := ent.Name()
			if !ent.IsDir() || e.recs.Get(name) != nil || hasRecordFile(storeDir, name) {
				continue
			}
			p := filepath.Join(base, name)
			if err := os.RemoveAll(p); err != nil {
				e.log.Error("removing a directory no record owns", "dir", p, "err", err)
				continue
			}
			e.log.Warn("removed a directory no record owns", "dir", p)
			reaped = append(reaped, p)
		}
	}
	return reaped
}

// sweepTemps removes the temp files (atomicfile.IsTemp) that writes the
// agent's death interrupted, from every directory the VMs' steps write in:
// the records' (<state>/vms), each VM's (disk copies, overlays, data
// volumes, seeds, a redeploy's staged disk), the first-class volumes', the
// spool of AppVM files puts, the run directory (an AppVM initramfs) and
// each VM's run directory. It runs
// first at Recover, with the state directory locked by this agent, so no
// write is in flight.
func (e *Engine) sweepTemps() []string {
	l := e.layout()
	dirs := []string{l.StateDir + "/vms", l.VolumesDir(), l.SpoolDir(), l.RunDir}
	for _, base := range []string{l.StateDir + "/vms", l.RunDir + "/vms"} {
		ents, _ := os.ReadDir(base)
		for _, ent := range ents {
			if ent.IsDir() && !atomicfile.IsTemp(ent.Name()) {
				dirs = append(dirs, filepath.Join(base, ent.Name()))
			}
		}
	}
	var swept []string
	for _, dir := range dirs {
		removed, err := atomicfile.RemoveTemps(dir)
		if err != nil {
			e.log.Error("removing temp files of interrupted writes", "dir", dir, "err", err)
		}
		for _, p := range removed {
			e.log.Warn("removed a temp file of an interrupted write", "file", p)
		}
		swept = append(swept, removed...)
	}
	return swept
}

// hasRecordFile reports whether the store directory holds a record file of
// id in any form (<id>.json, <id>.json.damaged, ...).
func hasRecordFile(dir, id string) bool {
	m, _ := filepath.Glob(filepath.Join(dir, globEscape(id)+".json*"))
	return len(m) > 0
}

func globEscape(s string) string {
	var b strings.Builder
	for _, r := range s {
		if strings.ContainsRune(`*?[\`, r) {
			b.WriteByte('\\')
		}
		b.WriteRune(r)
	}
	return b.String()
}
