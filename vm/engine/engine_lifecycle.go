package engine

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"strings"
	"time"

	"vmhost/chclient"
	"vmhost/internal/atomicfile"
	"vmhost/vm/record"
)

// The Engine's lifecycle actions (vm.Host); start is Boot. The Service has
// checked the state and holds the VM's action lock.

// client is the API client of rec's recorded CH process. The caller holds
// the VM's lock, so rec, as it read or stored it, names the process.
func (e *Engine) client(rec *record.Record) (*chclient.Client, error) {
	if rec.Runtime == nil || rec.Runtime.CH == nil {
		return nil, &record.StateError{ID: rec.ID, Action: "reach the VMM of", State: "without a running VMM"}
	}
	return chclient.New(rec.Runtime.CH.APISocket), nil
}

// chAction runs one CH call and records f on success, unless the VM's
// monitor recorded its end meanwhile (then *StateError).
func (e *Engine) chAction(ctx context.Context, rec *record.Record, op string, call func(*chclient.Client, context.Context) error, f func(*record.Record)) error {
	c, err := e.client(rec)
	if err != nil {
		return err
	}
	defer c.Close()
	if err := call(c, ctx); err != nil {
		return &record.HostError{Kind: record.HostHypervisor, Op: op + " of VM " + rec.ID, Err: err}
	}
	return e.updateRunning(rec, strings.TrimPrefix(op, "vm."), f)
}

// updateRunning records f for an action on a running or paused VM, or
// answers *StateError when its monitor has recorded its end.
func (e *Engine) updateRunning(rec *record.Record, action string, f func(*record.Record)) error {
	ok, err := e.updateWatched(rec.ID, f)
	if err != nil {
		return &record.HostError{Kind: record.HostStorage, Op: "recording VM " + rec.ID, Err: err}
	}
	if !ok {
		return &record.StateError{ID: rec.ID, Action: action, State: e.current(rec).DisplayState}
	}
	return nil
}

// Shutdown presses the ACPI power button. The VM stays running with
// shutting_down set until the guest powers off, which its monitor records
// (stopped, operator_shutdown). shutting_down is recorded before the
// button is pressed, since a guest may power off before a record written
// afterwards is stored, and its monitor would then call the exit a guest
// shutdown; a press that fails puts the previous value back.
func (e *Engine) Shutdown(ctx context.Context, rec *record.Record) error {
	was := e.current(rec).ShuttingDown
	if err := e.updateRunning(rec, "shutdown", func(r *record.Record) { r.ShuttingDown = true }); err != nil {
		return err
	}
	err := e.pressPowerButton(ctx, rec)
	if err != nil {
		if _, uerr := e.update(rec.ID, func(r *record.Record) {
			r.ShuttingDown = was && r.State == record.StateRunning
		}); uerr != nil {
			e.o.Logger.Error("clearing shutting_down after a failed shutdown", "id", rec.ID, "err", uerr)
		}
	}
	return err
}

// pressPowerButton asks the guest to power off: an AppVM's guest agent
// is sent Stop over its connection; a classic VM, and an AppVM whose guest
// agent is not connected, get CH's power button (the guest agent watches
// it and stops the workload the same way).
func (e *Engine) pressPowerButton(ctx context.Context, rec *record.Record) error {
	if g := e.guest(rec); g != nil {
		err := g.Stop(ctx, rec)
		if err == nil {
			return nil
		}
		e.log.Info("AppVM guest agent not reachable; pressing the power button", "id", rec.ID, "err", err)
	}
	c, err := e.client(rec)
	if err != nil {
		return err
	}
	defer c.Close()
	if err := c.PowerButton(ctx); err != nil {
		return &record.HostError{Kind: record.HostHypervisor, Op: "vm.power-button of VM " + rec.ID, Err: err}
	}
	return nil
}

// Pause pauses the vCPUs: state paused.
func (e *Engine) Pause(ctx context.Context, rec *record.Record) error {
	return e.chAction(ctx, rec, "vm.pause", (*chclient.Client).PauseVM, func(r *record.Record) {
		r.State, r.DisplayState = record.StatePaused, string(record.StatePaused)
	})
}

// Resume continues a paused VM: state and display running.
func (e *Engine) Resume(ctx context.Context, rec *record.Record) error {
	return e.chAction(ctx, rec, "vm.resume", (*chclient.Client).ResumeVM, func(r *record.Record) {
		r.State, r.DisplayState = record.StateRunning, string(record.StateRunning)
	})
}

// Balloon resizes the balloon of a running or paused VM to mb MiB
// (vm.resize desired_balloon). The caller records the target.
func (e *Engine) Balloon(ctx context.Context, rec *record.Record, mb uint64) error {
	c, err := e.client(rec)
	if err != nil {
		return err
	}
	defer c.Close()
	size := mb << 20
	if err := c.Resize(ctx, &chclient.VmResize{DesiredBalloon: &size}); err != nil {
		return &record.HostError{Kind: record.HostHypervisor, Op: "vm.resize (balloon) of VM " + rec.ID, Err: err}
	}
	return nil
}

// StageRootDisk makes the VM's staged root disk (RootDiskNext, replacing
// a leftover) from base, of the kind its root disk is (an overlay of base,
// or a copy), for a rebuild of the root disk of a VM that runs nothing
// (appvm.RootDisks: an AppVM redeploy). A storage daemon kept from
// provisioning holds the old root disk open, so it stops first; the next
// boot starts one on the new disk.
func (e *Engine) StageRootDisk(ctx context.Context, rec *record.Record, base string) error {
	e.stopHeldQSD(rec.ID)
	next := e.layout().RootDiskNext(rec.ID)
	if err := e.DropStagedRootDisk(rec); err != nil {
		return err
	}
	if err := e.makeRootDisk(ctx, rec, base, next); err != nil {
		return &record.HostError{Kind: record.HostStorage, Op: "staging a new root disk for VM " + rec.ID, Err: err}
	}
	return nil
}

// SwapRootDisk renames the staged root disk over the root disk and syncs
// the directory, durably; without a staged disk it does nothing (the swap
// happened).
func (e *Engine) SwapRootDisk(_ context.Context, rec *record.Record) error {
	l := e.layout()
	err := atomicfile.Rename(l.RootDiskNext(rec.ID), l.RootDisk(rec.ID))
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return &record.HostError{Kind: record.HostStorage, Op: "installing the new root disk of VM " + rec.ID, Err: err}
	}
	return nil
}

// DropStagedRootDisk removes a staged root disk, if any.
func (e *Engine) DropStagedRootDisk(rec *record.Record) error {
	if err := os.Remove(e.layout().RootDiskNext(rec.ID)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return &record.HostError{Kind: record.HostStorage, Op: "removing the staged root disk of VM " + rec.ID, Err: err}
	}
	return nil
}

// Counters reads the VM's device counters from Cloud Hypervisor.
func (e *Engine) Counters(ctx context.Context, rec *record.Record) (map[string]map[string]uint64, error) {
	rec = e.current(rec)
	if rec.Runtime == nil || rec.Runtime.CH == nil {
		return nil, &record.StateError{ID: rec.ID, Action: "reach the VMM of", State: "without a running VMM"}
	}
	// A raw read: a scrape reads every VM's counters (chclient/pinger.go).
	out, err := chclient.ReadCounters(ctx, rec.Runtime.CH.APISocket)
	if err != nil {
		return nil, &record.HostError{Kind: record.HostHypervisor, Op: "vm.counters of VM " + rec.ID, Err: err}
	}
	return out, nil
}

// Reboot resets the guest: display booting until a device is activated
// again after CH's vm rebooting (the monitor follows the events).
func (e *Engine) Reboot(ctx context.Context, rec *record.Record) error {
	return e.chAction(ctx, rec, "vm.reboot", (*chclient.Client).RebootVM, func(r *record.Record) {
		r.DisplayState = record.DisplayBooting
		r.ShuttingDown = false
	})
}

// Stop ends the VMM at once (vm.shutdown, vmm.shutdown, then signals) and
// its qemu-storage-daemon: state stopped, cause operator_shutdown. If the
// VM ended by itself meanwhile, the monitor's verdict stands and Stop
// answers *StateError.
func (e *Engine) Stop(ctx context.Context, rec *record.Record) error {
	id := rec.ID
	ch, qsd := e.unwatch(id)
	if ch == nil {
		cur := e.current(rec)
		if cur.State != record.StateRunning && cur.State != record.StatePaused {
			return &record.StateError{ID: id, Action: "stop", State: cur.DisplayState}
		}
		// Running but not watched (a process recorded by an agent that
		// did not adopt it): stopAll kills it by its recorded identity.
		if err := e.stopAll(ctx, cur); err != nil {
			return &record.HostError{Kind: record.HostHypervisor, Op: "stopping VM " + id, Err: err}
		}
		e.killJail(cur)
		return e.recordStopped(id, nil)
	}
	sctx, cancel := context.WithTimeout(ctx, e.o.StopGrace)
	ch.Client().ShutdownVM(sctx) // best effort: CH releases its devices before exiting
	cancel()
	e.shutdownVMM(ch)
	e.stopProcesses(id, ch, qsd)
	e.mu.Lock()
	if q := e.live[id]; q != nil { // never both, but never leak one either
		q.Close()
		delete(e.live, id)
	}
	e.mu.Unlock()
	e.killJail(e.current(rec)) // what CH left (a child it forked) dies too
	e.endGuest(rec)
	return e.recordStopped(id, ch)
}

// recordStopped records an operator stop; ch, when known, gives the exit.
func (e *Engine) recordStopped(id string, ch *chclient.Process) error {
	d := record.FailureDetail{Kind: record.KindMissingPID}
	summary := "stopped by the operator"
	if ch != nil {
		if st, ok := ch.Exit(); ok {
			if st.Signaled() {
				sig := int(st.Signal)
				d = record.FailureDetail{Kind: record.KindProcessSignal, Signum: &sig}
				summary = fmt.Sprintf("stopped by the operator; cloud hypervisor did not exit in time and was killed by signal %d", sig)
			} else {
				code := st.Code
				d.Code = &code
			}
		}
	}
	_, err := e.update(id, func(r *record.Record) {
		r.State, r.DisplayState = record.StateStopped, string(record.StateStopped)
		r.PID = 0
		r.ShuttingDown = false
		r.FailureReason = &record.FailureReason{DetectedAt: e.o.Now().UTC(), Summary: summary, Detail: d, Cause: record.CauseOperatorShutdown}
	})
	return err
}

// Delete stops every process of the VM and removes its taps, run
// directory and VM directory (root disk, data volumes, seed). The image
// cache and base images are never touched. A provision in progress is
// cancelled first (a download or copy stops and removes its temp file);
// its taps are then deleted by name, since one may have been made without
// being recorded.
func (e *Engine) Delete(ctx context.Context, rec *record.Record) error {
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	cancelled := e.cancelProvision(rec.ID)
	rec = e.current(rec)
	e.endGuest(rec)
	err := e.teardown(ctx, rec, true)
	if cancelled && e.o.Taps != nil {
		for _, n := range rec.NICs {
			if derr := e.o.Taps.Delete(ctx, n.Tap); derr != nil && !errors.Is(derr, fs.ErrNotExist) {
				err = errors.Join(err, fmt.Errorf("deleting tap %s: %w", n.Tap, derr))
			}
		}
	}
	if err != nil {
		return errors.Join(fmt.Errorf("deleting VM %s", rec.ID), err)
	}
	return nil
}
