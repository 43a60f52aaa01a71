package appvm

import (
	"context"

	"vmhost/vm"
)

// Operations whose outcome is a running AppVM (a spec edit with
// ?restart=true, a redeploy of a running AppVM) stop it and boot it again.
// Each records that intent (AppVMSpec.Restart) in its first write, before
// it stops anything, and clears it when it returns, whatever the outcome:
// an agent killed in between finds the intent at its next start, and
// FinishRestarts boots the AppVM.

// restartOf is the intent to restart r, naming the boot it replaces.
func restartOf(r *vm.Record) *vm.Restart {
	var of uint64
	if rt := r.Runtime; rt != nil && rt.CH != nil {
		of = rt.CH.StartTime
	}
	return &vm.Restart{Of: of}
}

// endRestart clears AppVM id's recorded restart: the operation returned.
func (s *Service) endRestart(id string) {
	_, err := s.recs.Update(id, func(r *vm.Record) {
		if r.AppVM != nil {
			r.AppVM.Restart = nil
		}
	})
	if err != nil {
		s.guests.log.Error("clearing an AppVM's recorded restart", "id", id, "err", err)
	}
}

// FinishRestarts finishes the restarts an agent stop cut short (call it
// after RecoverRedeploys, which settles a redeploy's root disk first), in
// the background (Wait waits for them): an AppVM recorded as restarting
// is booted when it does not run; when the boot it was to replace still
// runs, shutting down (the agent died during the stop) or with an older
// spec than its record's (spec_pending: it died before the stop), it is
// stopped gracefully and booted; otherwise (it runs a boot that came
// after, or a redeploy rolled back before it stopped anything) the
// restart happened.
func (s *Service) FinishRestarts(ctx context.Context) {
	for _, rec := range s.List() {
		if rec.AppVM.Restart == nil {
			continue
		}
		s.bg.Add(1)
		go func() {
			defer s.bg.Done()
			s.finishRestart(ctx, rec.ID)
			s.endRestart(rec.ID)
		}()
	}
}

func (s *Service) finishRestart(ctx context.Context, id string) {
	log := s.guests.log.With("id", id)
	rec, err := s.Get(id)
	if err != nil || rec.AppVM.Restart == nil || rec.Deleting {
		return
	}
	switch rec.State {
	case vm.StateRunning, vm.StatePaused:
		sameBoot := rec.Runtime != nil && rec.Runtime.CH != nil && rec.Runtime.CH.StartTime == rec.AppVM.Restart.Of
		if !sameBoot || !rec.AppVM.SpecPending && !rec.ShuttingDown {
			return
		}
		log.Warn("finishing a restart an agent restart interrupted before the AppVM stopped: restarting it")
		_, err := s.restartNow(ctx, rec)
		if err == nil {
			return
		}
		log.Error("finishing an interrupted restart", "err", err)
		if cur, gerr := s.Get(id); gerr != nil || cur.State == vm.StateRunning || cur.State == vm.StatePaused {
			return
		}
		fallthrough // stopped all the same: boot it
	default:
		log.Warn("finishing a restart an agent restart interrupted: booting the AppVM")
		if _, err := s.vms.Act(ctx, vm.ModeAppVM, id, vm.ActionStart); err != nil {
			log.Error("booting an AppVM whose restart an agent restart interrupted", "err", err)
		}
	}
}
