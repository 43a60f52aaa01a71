package appvm

import (
	"context"
	"time"

	"vmhost/vm"
)

// RestartOptions tune the restart policy. Zero fields take the defaults.
type RestartOptions struct {
	// BaseDelay is the wait before the first automatic restart; each
	// consecutive restart doubles it (default 1s).
	BaseDelay time.Duration
	// MaxDelay caps the backoff (default 60s).
	MaxDelay time.Duration
	// StablePeriod: a workload that ran (from the first heartbeat of its
	// boot) at least this long before it ended starts a new series, with
	// restart_count back to 0 (default 60s).
	StablePeriod time.Duration
	// StopWait bounds the wait for the VM to be recorded stopped after
	// the workload ended and the guest powered off (default 60s).
	StopWait time.Duration
}

func (o *RestartOptions) defaults() {
	if o.BaseDelay <= 0 {
		o.BaseDelay = time.Second
	}
	if o.MaxDelay <= 0 {
		o.MaxDelay = time.Minute
	}
	if o.StablePeriod <= 0 {
		o.StablePeriod = time.Minute
	}
	if o.StopWait <= 0 {
		o.StopWait = time.Minute
	}
}

// SetRestartStablePeriod changes RestartOptions.StablePeriod for restarts
// decided from now on (tests and operators tuning a running service).
func (s *Service) SetRestartStablePeriod(d time.Duration) {
	s.guests.mu.Lock()
	s.guests.o.Restart.StablePeriod = d
	s.guests.mu.Unlock()
}

// Backoff is the wait before automatic restart number count+1: BaseDelay
// × 2^count, at most MaxDelay.
func (o RestartOptions) Backoff(count uint32) time.Duration {
	d := o.BaseDelay
	for range count {
		d *= 2
		if d >= o.MaxDelay {
			return o.MaxDelay
		}
	}
	return min(d, o.MaxDelay)
}

// wantsRestart applies restart_policy to a workload end: "always"
// restarts, "on-failure" restarts after a non-zero exit code, a signal or
// a fatal setup error, "no" never does. A keepalive guest stays up after
// its workload, so there is nothing to restart.
func wantsRestart(a *vm.AppVMSpec, failed bool) bool {
	if a.Keepalive {
		return false
	}
	switch a.RestartPolicy {
	case "always":
		return true
	case "on-failure":
		return failed
	}
	return false
}

// workloadEnded is called when the guest reports the workload's end; the
// guest then powers off (without keepalive). When the policy asks for it,
// the VM is booted again once it is recorded stopped by a guest poweroff,
// after the backoff.
func (ss *session) workloadEnded(failed bool) {
	rec, err := ss.g.s.vms.Get(vm.ModeAppVM, ss.id)
	if err != nil || !wantsRestart(rec.AppVM, failed) {
		return
	}
	ss.mu.Lock()
	up := ss.upSince
	stopped := ss.stopRequested
	ss.mu.Unlock()
	if stopped {
		return
	}
	go ss.restartWhenStopped(up)
}

// restartWhenStopped waits for the VM to be recorded stopped, then for the
// backoff, and boots it again. An operator's stop, a VM that failed
// instead, a delete or a start in the meantime cancel the restart.
func (ss *session) restartWhenStopped(upSince time.Time) {
	ss.g.mu.Lock()
	o := ss.g.o.Restart
	ss.g.mu.Unlock()
	log := ss.g.log.With("id", ss.id)
	deadline := time.Now().Add(o.StopWait)
	var rec *vm.Record
	for {
		r, err := ss.g.s.vms.Get(vm.ModeAppVM, ss.id)
		if err != nil {
			return
		}
		if r.State == vm.StateStopped {
			rec = r
			break
		}
		if r.State != vm.StateRunning && r.State != vm.StatePaused {
			log.Info("not restarting: the AppVM did not stop by a guest poweroff", "state", r.State)
			return
		}
		if time.Now().After(deadline) {
			log.Warn("not restarting: the AppVM was not recorded stopped after its workload ended", "waited", o.StopWait)
			return
		}
		select {
		case <-ss.done:
			return
		case <-time.After(20 * time.Millisecond):
		}
	}
	if fr := rec.FailureReason; fr != nil && fr.Cause == "operator_shutdown" {
		return
	}
	var count uint32
	if gst := rec.AppVM.Guest; gst != nil {
		count = gst.RestartCount
	}
	if !upSince.IsZero() && time.Since(upSince) >= o.StablePeriod {
		count = 0
	}
	delay := o.Backoff(count)
	log.Info("restarting AppVM after its workload ended", "restart", count+1, "backoff", delay)
	select {
	case <-ss.done:
		return
	case <-time.After(delay):
	}
	ss.mu.Lock()
	stopped := ss.stopRequested
	ss.mu.Unlock()
	if stopped {
		return
	}
	if r, err := ss.g.s.vms.Get(vm.ModeAppVM, ss.id); err != nil || r.State != vm.StateStopped {
		return
	}
	at := ss.now()
	if _, err := ss.update(func(r *vm.Record, gst *vm.AppVMGuest) {
		gst.RestartCount = count + 1
		gst.LastRestartAt = &at
	}); err != nil {
		return
	}
	// The lifecycle start serializes with the operator's actions on the VM.
	if _, err := ss.g.s.vms.Act(context.Background(), vm.ModeAppVM, ss.id, vm.ActionStart); err != nil {
		log.Error("automatic restart failed", "err", err)
	}
}
