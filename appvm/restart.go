package appvm

import (
	"context"
	"time"

	"vmhost/vm"
	"vmhost/vm/records"
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
	s.restartMu.Lock()
	s.restart.StablePeriod = d
	s.restartMu.Unlock()
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

// followRecords follows the records' changes (records.Registry.Watch):
// an AppVM's workload that ended (its guest agent's exit or fatal setup
// error, just recorded) goes to the restart policy. It runs under the
// record's write lock: the restart waits in a goroutine of its own.
func (s *Service) followRecords(c records.Change) {
	if !records.WorkloadExited(c) {
		return
	}
	g := c.New.AppVM.Guest
	s.workloadEnded(c.New, g.ExitCode == nil || *g.ExitCode != 0)
}

// workloadEnded answers the end of rec's workload; the guest then powers
// off (without keepalive). When the policy asks for it, the VM is booted
// again once it is recorded stopped by a guest poweroff, after the
// backoff; not when the operator asked the workload to stop.
func (s *Service) workloadEnded(rec *vm.Record, failed bool) {
	if !wantsRestart(rec.AppVM, failed) {
		return
	}
	ss := s.guests.get(rec.ID)
	if ss == nil {
		return
	}
	ss.mu.Lock()
	up := ss.upSince
	stopped := ss.stopRequested
	ss.mu.Unlock()
	if stopped {
		return
	}
	go s.restartWhenStopped(ss, up)
}

// restartWhenStopped waits for the boot of session ss to be recorded
// ended, stopped, then for the backoff, and boots the VM again. The
// workload may have ended before its boot was even recorded (a guest
// quicker than the engine's write of state running): the wait is for the
// end of that boot (session.bootEnd), whatever the record showed at the
// exit. An operator's stop, a VM that failed instead, a delete or a start
// in the meantime (which closes ss) cancel the restart.
func (s *Service) restartWhenStopped(ss *session, upSince time.Time) {
	s.restartMu.Lock()
	o := s.restart
	s.restartMu.Unlock()
	log := s.guests.log.With("id", ss.id)
	wait := time.NewTimer(o.StopWait)
	defer wait.Stop()
	select {
	case <-ss.bootEnd:
	case <-ss.done:
		return
	case <-wait.C:
		log.Warn("not restarting: the AppVM was not recorded stopped after its workload ended", "waited", o.StopWait)
		return
	}
	rec := ss.bootEnded()
	if rec.State != vm.StateStopped {
		log.Info("not restarting: the AppVM did not stop by a guest poweroff", "state", rec.State)
		return
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
	next := ss.now().Add(delay).Truncate(time.Millisecond)
	if _, err := ss.update(func(r *vm.Record, gst *vm.AppVMGuest) { gst.NextRestartAt = &next }); err != nil {
		return
	}
	log.Info("restarting AppVM after its workload ended", "restart", count+1, "backoff", delay, "at", next)
	select {
	case <-ss.done:
		s.clearNextRestart(ss.id, next)
		return
	case <-time.After(delay):
	}
	ss.mu.Lock()
	stopped := ss.stopRequested
	ss.mu.Unlock()
	if stopped {
		s.clearNextRestart(ss.id, next)
		return
	}
	s.bootAgain(ss.id, next, count+1)
}

// bootAgain boots AppVM id again for the restart policy, as restart
// number count, unless it is no longer stopped waiting for the restart
// due at next (an operator's start or stop, a delete came first).
func (s *Service) bootAgain(id string, next time.Time, count uint32) {
	log := s.guests.log.With("id", id)
	still := false
	if _, err := s.recs.Update(id, func(r *vm.Record) {
		g := r.AppVM.Guest
		if r.State != vm.StateStopped || g == nil || g.NextRestartAt == nil || !g.NextRestartAt.Equal(next) {
			return
		}
		still = true
		at := s.vms.Now().UTC()
		g.RestartCount, g.LastRestartAt, g.NextRestartAt = count, &at, nil
	}); err != nil || !still {
		s.clearNextRestart(id, next)
		return
	}
	// The lifecycle start serializes with the operator's actions on the VM.
	if _, err := s.vms.Act(context.Background(), vm.ModeAppVM, id, vm.ActionStart); err != nil {
		log.Error("automatic restart failed", "err", err)
	}
}

// clearNextRestart drops a restart due at next that will not happen.
func (s *Service) clearNextRestart(id string, next time.Time) {
	s.recs.Update(id, func(r *vm.Record) {
		if r.AppVM != nil && r.AppVM.Guest != nil && r.AppVM.Guest.NextRestartAt != nil && r.AppVM.Guest.NextRestartAt.Equal(next) {
			r.AppVM.Guest.NextRestartAt = nil
		}
	})
}

// RecoverRestarts resumes the restarts an agent stop cut short: an AppVM
// still stopped with a recorded next_restart_at is booted at that time
// (at once when it has passed), as the restart it was waiting for.
func (s *Service) RecoverRestarts() {
	for _, rec := range s.List() {
		g := rec.AppVM.Guest
		if rec.State != vm.StateStopped || g == nil || g.NextRestartAt == nil {
			continue
		}
		id, next, count := rec.ID, *g.NextRestartAt, g.RestartCount+1
		s.guests.log.Info("resuming an AppVM restart the agent's stop interrupted", "id", id, "at", next)
		go func() {
			time.Sleep(time.Until(next))
			s.bootAgain(id, next, count)
		}()
	}
}
