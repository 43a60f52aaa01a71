package engine

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"syscall"
	"time"

	"vmhost/chclient"
	"vmhost/jail"
	"vmhost/proc"
	"vmhost/vm/record"
)

// Boot starts the VM (a VM with a saved state resumes from it instead:
// resumeSaved): qemu-storage-daemon unless it runs, then Cloud
// Hypervisor, vm.create with CHConfig and vm.boot, checking CH's state
// after each step. It records the processes and state running, display
// booting, in one write once the guest boots (an agent that dies before
// leaves processes no record names, which its next start reaps), hands
// both processes to the VM's monitor (monitor.go) and arms the boot
// timeout. On error CH is stopped and the VM keeps its state; a stopped or
// failed VM runs nothing, so its storage daemon is stopped too (a created
// VM keeps the one provisioning started). A provision's result staged for
// the boot (auto_boot) is stored with its write, or alone when it fails.
func (e *Engine) Boot(ctx context.Context, rec *record.Record) (err error) {
	rec = e.current(rec)
	if rec.Suspended != nil {
		return e.resumeSaved(ctx, rec) // saved.go
	}
	id, l := rec.ID, e.layout()
	defer func() {
		// A failed boot stores the provision's result it was to store
		// (a create with auto_boot stages it): the VM is kept, created.
		if err == nil {
			return
		}
		if serr := e.recs.Save(id); serr != nil {
			e.log.Error("recording provisioned VM after a failed boot", "id", id, "err", serr)
		}
	}()
	if rec.State != record.StateCreated {
		defer func() {
			if err != nil {
				e.stopHeldQSD(id)
			}
		}()
	}
	rec, qsd, jv, err := e.readyHost(ctx, rec)
	if err != nil {
		return err
	}
	fail := func(op string, err error) error {
		return &record.HostError{Kind: record.HostHypervisor, Op: op + " of VM " + id, Err: err}
	}
	cfg, err := CHConfig(rec, e.o.Config, l, CHConfigHost{CPUs: e.o.HostCPUs})
	if err != nil {
		return &record.HostError{Kind: record.HostInternal, Op: "booting VM " + id, Err: err}
	}
	if e.o.SimGuestRoot != nil && rec.Mode == record.ModeAppVM {
		if err := e.unpackSimRoot(ctx, rec); err != nil {
			return &record.HostError{Kind: record.HostStorage, Op: "unpacking the root file system of AppVM " + id + " for the simulator", Err: err}
		}
	}
	if g := e.guest(rec); g != nil {
		if err := e.bootGuest(ctx, g, rec, cfg); err != nil {
			return &record.HostError{Kind: record.HostInternal, Op: "preparing the boot of AppVM " + id, Err: err}
		}
	}
	rt, lc := e.chLaunch(id)
	if jv != nil {
		if lc.Confine, err = e.prepareCH(rec, jv, cfg); err != nil {
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
	e.keepConsole(rec, rt.SerialSocket, p)
	undo := func(err error) error {
		// As Stop does: vmm.shutdown, then signals up to SIGKILL with no
		// deadline that could end the wait before SIGKILL is sent (no
		// record names this process, so nothing else would end it).
		e.shutdownVMM(p)
		if serr := terminate(p.Done(), p.Signal); serr != nil {
			e.o.Logger.Error("stopping cloud-hypervisor after a failed boot", "id", id, "pid", p.Pid, "err", serr)
		}
		p.Close()
		e.endGuest(rec)
		return err
	}
	testStopAt(HookCH) // crash tests (recover_hook.go): running, not recorded
	c := p.Client()
	if err := c.CreateVM(ctx, cfg); err != nil {
		return undo(fail("vm.create", err))
	}
	if err := expectState(ctx, c, chclient.StateCreated); err != nil {
		return undo(fail("vm.create", err))
	}
	if err := c.BootVM(ctx); err != nil {
		return undo(fail("vm.boot", err))
	}
	if err := expectState(ctx, c, chclient.StateRunning); err != nil && !poweredOffAfterBoot(err, p) {
		return undo(fail("vm.boot", err))
	}
	testStopAt(HookBooted) // crash tests (recover_hook.go): booted, not recorded
	if _, err := e.update(id, func(r *record.Record) {
		r.Runtime.CH, r.PID = rt, rt.Pid
		if qsd != nil {
			r.Runtime.QSD = qsd
		}
		r.State = record.StateRunning
		r.DisplayState = record.DisplayBooting
		r.FailureReason = nil
		r.ShuttingDown = false
	}); err != nil {
		return undo(err)
	}
	testStopAt(HookRunning) // crash tests: booted and recorded
	e.mu.Lock()
	q := e.live[id]
	delete(e.live, id) // the monitor owns both processes from here
	e.mu.Unlock()
	e.watch(id, p, q)
	e.o.Logger.Info("VM booted", "id", id, "ch_pid", p.Pid)
	timeout := time.Duration(e.o.Config.BootTimeoutSecs) * time.Second
	time.AfterFunc(timeout, func() { e.bootDeadline(id, p, timeout) })
	return nil
}

// stopHeldQSD stops the storage daemon the engine holds for id, if any,
// and forgets its identity.
func (e *Engine) stopHeldQSD(id string) {
	e.mu.Lock()
	q := e.live[id]
	delete(e.live, id)
	e.mu.Unlock()
	if q != nil {
		e.stopProcesses(id, nil, q)
	}
	e.killJail(e.recs.Get(id))
}

// readyHost makes sure of what a VM's CH needs before it starts, for a
// boot and a restore alike: its storage daemon, its jail (recorded with
// the daemon: rec is returned as it is now), its taps, and no stale event
// stream (it would replay the previous run's activations).
func (e *Engine) readyHost(ctx context.Context, rec *record.Record) (*record.Record, *record.QSDRuntime, *jail.VM, error) {
	qsd, err := e.ensureQSD(ctx, rec, nil)
	if err != nil {
		return nil, nil, nil, err
	}
	rec = e.current(rec)
	jv := e.vmJail(rec)
	if err := e.ensureTaps(ctx, rec, jv); err != nil {
		return nil, nil, nil, err
	}
	if err := os.Remove(e.layout().Events(rec.ID)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return nil, nil, nil, &record.HostError{Kind: record.HostHypervisor, Op: "removing old event stream of VM " + rec.ID, Err: err}
	}
	return rec, qsd, jv, nil
}

// chLaunch is the runtime paths of VM id's CH and the launch that uses them.
func (e *Engine) chLaunch(id string) (*record.CHRuntime, chclient.LaunchConfig) {
	l := e.layout()
	rt := &record.CHRuntime{APISocket: l.APISocket(id), EventsPath: l.Events(id), SerialSocket: l.ConsoleSocket(id),
		VsockSocket: l.VsockSocket(id), LogFile: l.CHLog(id)}
	return rt, chclient.LaunchConfig{
		Binary: e.o.CH.Binary, PreArgs: e.o.CH.PreArgs, Env: e.o.CH.Env,
		APISocket: rt.APISocket, EventMonitor: rt.EventsPath, LogFile: rt.LogFile,
		VsockSocket: rt.VsockSocket, SerialSocket: rt.SerialSocket,
	}
}

// ensureTaps recreates the taps the record says were made but that are
// gone: a host reboot removes every tap while the records keep them, and a
// VM started afterwards needs them back on their bridges, with their
// isolation, VLAN and anti-spoof rules. With jail jv, the taps that exist
// are given to the VM's uid (those made before it was confined had none).
func (e *Engine) ensureTaps(ctx context.Context, rec *record.Record, jv *jail.VM) error {
	if e.o.Taps == nil || len(rec.NICs) == 0 {
		return nil
	}
	owned, err := e.o.Taps.ListOwned(ctx)
	if err != nil {
		return &record.HostError{Kind: record.HostNetwork, Op: "listing taps of VM " + rec.ID, Err: err}
	}
	have := make(map[string]bool, len(owned))
	for _, o := range owned {
		have[o.Name] = true
	}
	for i, nic := range rec.NICs {
		if !rec.Runtime.Done(record.StepTap(i)) {
			continue
		}
		if !have[nic.Tap] {
			e.o.Logger.Info("recreating a missing tap before boot", "id", rec.ID, "tap", nic.Tap)
			if err := e.createTap(ctx, rec, i); err != nil {
				return err
			}
			continue
		}
		if jv != nil {
			// A tap made before the VM was confined has no owner yet.
			if err := e.o.Taps.SetOwner(ctx, nic.Tap, int(jv.UID)); err != nil {
				return &record.HostError{Kind: record.HostNetwork, Op: "giving tap " + nic.Tap + " to VM " + rec.ID, Err: err}
			}
		}
	}
	return nil
}

// lifeSign names what counts as a guest's first sign of life (docs/design.md §5).
func lifeSign(m record.Mode) string {
	if m == record.ModeAppVM {
		return "guest agent heartbeat"
	}
	return "virtio device activation"
}

// bootDeadline runs at the boot timeout of CH process p: if the VM still
// shows no sign of life, the VMM is shut down and the VM fails with
// boot_timeout. A VM that came alive, stopped, or booted again meanwhile
// is left alone.
func (e *Engine) bootDeadline(id string, p *chclient.Process, timeout time.Duration) {
	unlock := e.recs.Lock(id)
	defer unlock()
	r := e.recs.Get(id)
	if r == nil || r.State != record.StateRunning || r.DisplayState != record.DisplayBooting ||
		r.Runtime == nil || r.Runtime.CH == nil || r.Runtime.CH.Pid != p.Pid || r.Runtime.CH.StartTime != p.StartTime {
		return
	}
	ch, qsd := e.unwatch(id)
	if ch == nil {
		return // the monitor concluded first
	}
	secs := int(timeout / time.Second)
	e.o.Logger.Error("VM showed no sign of life; shutting the VMM down", "id", id, "boot_timeout_secs", secs)
	summary := fmt.Sprintf("the guest showed no sign of life (%s) within the boot timeout of %d s; the VMM was shut down", lifeSign(r.Mode), secs)
	if tail := e.consoleTail(id); tail != "" {
		summary += "; last console lines: " + tail
	}
	if _, err := e.recs.Update(id, func(r *record.Record) {
		r.State = record.StateFailed
		r.DisplayState = string(record.StateFailed)
		r.ShuttingDown = false
		r.PID = 0
		r.FailureReason = &record.FailureReason{
			DetectedAt: e.o.Now().UTC(),
			Summary:    summary,
			Detail:     record.FailureDetail{Kind: record.KindBootTimeout, Seconds: &secs},
			Cause:      record.CauseBootTimeout,
		}
	}); err != nil {
		e.o.Logger.Error("recording boot timeout", "id", id, "err", err)
	}
	e.shutdownVMM(ch)
	e.stopProcesses(id, ch, qsd)
	e.killJail(e.recs.Get(id))
}

// shutdownVMM asks CH to exit cleanly (vmm.shutdown) and waits up to the
// stop grace; stopProcesses signals what is left.
func (e *Engine) shutdownVMM(ch *chclient.Process) {
	ctx, cancel := context.WithTimeout(context.Background(), e.o.StopGrace)
	defer cancel()
	if err := ch.Client().ShutdownVMM(ctx); err != nil {
		return
	}
	select {
	case <-ch.Done():
	case <-ctx.Done():
	}
}

// expectState checks CH's VM state after a boot step (kata's bootVM does
// the same): a call that answered 204 but left the VM elsewhere is a
// failure too.
// poweredOffAfterBoot reports whether the state check after a vm.boot that
// answered 204 failed because the guest powered off at once (a workload
// that exits immediately): the VM is gone from the VMM, or the VMM itself
// exited, as CH does on a guest poweroff. The boot happened; the monitor,
// which takes the process next, records the guest's shutdown.
func poweredOffAfterBoot(err error, p *chclient.Process) bool {
	if errors.Is(err, chclient.ErrNotFound) {
		return true
	}
	select {
	case <-p.Done():
		return true
	case <-time.After(time.Second):
		return false
	}
}

func expectState(ctx context.Context, c *chclient.Client, want string) error {
	info, err := c.VMInfo(ctx)
	if err != nil {
		return err
	}
	if info.State != want {
		return fmt.Errorf("VM state is %s, want %s", info.State, want)
	}
	return nil
}

// killRecorded SIGKILLs a recorded process that the engine does not hold,
// if pid and start time still identify it, and waits up to 5 s for it to
// go.
func killRecorded(pid int, start uint64) error {
	a, err := proc.Adopt(pid, start)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) || errors.Is(err, proc.ErrIdentityMismatch) {
			return nil // gone, or the pid is someone else's now
		}
		return err
	}
	defer a.Close()
	if err := a.Signal(syscall.SIGKILL); err != nil && !errors.Is(err, os.ErrProcessDone) {
		return err
	}
	select {
	case <-a.Done():
		return nil
	case <-time.After(5 * time.Second):
		return fmt.Errorf("pid %d still alive 5s after SIGKILL", pid)
	}
}
