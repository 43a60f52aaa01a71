package appvm

import (
	"context"
	"errors"
	"fmt"

	"vmhost/vm"
)

// Redeploy (docs/api.md, AppVMs): an AppVM gets a fresh root disk from its
// image's current build and boots on it; its data volumes stay. The steps,
// each recorded before the next so that an agent killed at any point
// recovers to one consistent root disk (RecoverRedeploys):
//
//  1. record the build to install (Redeploy.To), redeploying shows, and,
//     if the AppVM runs, that it is to run again (AppVMSpec.Restart);
//  2. stop the AppVM gracefully if it runs;
//  3. stage the new root disk beside the old one (RootDiskNext): an
//     overlay of the new build, or a copy of it, as the old one was;
//  4. record it staged;
//  5. rename it over the old one (the commit point);
//  6. record the new build as the AppVM's image and its root disk's
//     base, redeploy done (the old build is then unused, builds.go);
//  7. boot.
//
// A failure before 5 drops the staged disk and boots the old one if the
// AppVM ran; redeploy_error says why. An agent killed in between finishes
// it at its next start: RecoverRedeploys rolls the disk forward or back,
// then FinishRestarts boots an AppVM that ran.

// ErrRedeploying is a redeploy asked for while one runs (409 INVALID_STATE).
var errRedeploying = errors.New("a redeploy of this AppVM is in progress")

// Redeploy starts a redeploy of AppVM id in the background and returns the
// record showing it (202). Errors: fs.ErrNotExist (404), *ConflictError
// while the image imports or when it has no ready build (409 CONFLICT),
// *vm.StateError while a redeploy runs or the AppVM is being deleted or
// provisioned (409 INVALID_STATE).
func (s *Service) Redeploy(ctx context.Context, id string) (*vm.Record, error) {
	rec, out, err := s.startRedeploy(id)
	if err != nil {
		return nil, err
	}
	wasUp := rec.State == vm.StateRunning || rec.State == vm.StatePaused
	s.bg.Add(1)
	go func() {
		defer s.bg.Done()
		s.redeploy(context.Background(), out, wasUp)
		s.endRestart(id)
	}()
	return out, nil
}

// startRedeploy records the redeploy of AppVM id (step 1) under its
// action lock, and returns the record before and after.
func (s *Service) startRedeploy(id string) (before, after *vm.Record, err error) {
	unlock := s.recs.Lock(id)
	defer unlock()
	rec, err := s.Get(id)
	if err != nil {
		return nil, nil, err
	}
	state := func(why string) error {
		return &vm.StateError{ID: id, Action: "redeploy", State: why}
	}
	switch {
	case rec.AppVM.Redeploy != nil:
		return nil, nil, state("redeploying: " + errRedeploying.Error())
	case rec.Deleting:
		return nil, nil, state("being deleted")
	case rec.Provisioning():
		return nil, nil, state(rec.DisplayState)
	case rec.Suspended != nil:
		// Its saved state holds the old root disk's file system in memory.
		return nil, nil, state("suspended; start it (it resumes) and redeploy then, or start it with ?cold=true first")
	}
	img, unpin, err := s.pinBuild(rec.AppVM.ImageID) // until the record names it
	if unpin != nil {
		defer unpin()
	}
	switch {
	case err != nil:
		return nil, nil, &ConflictError{Msg: fmt.Sprintf("AppVM image %q cannot be read: %v", rec.AppVM.ImageID, err)}
	case img.Status == StatusImporting:
		return nil, nil, &ConflictError{Msg: fmt.Sprintf("AppVM image %q is still importing", img.ID)}
	case img.Status != StatusReady:
		return nil, nil, &ConflictError{Msg: fmt.Sprintf("AppVM image %q has no ready build", img.ID)}
	}
	out, err := s.recs.Update(id, func(r *vm.Record) {
		r.AppVM.Redeploy = &vm.Redeploy{To: img.Workload}
		r.AppVM.RedeployError = ""
		if r.State == vm.StateRunning || r.State == vm.StatePaused {
			r.AppVM.Restart = restartOf(r) // it ends running, on one disk or the other
		}
	})
	if err != nil {
		return nil, nil, &vm.HostError{Kind: vm.HostStorage, Op: "recording the redeploy of AppVM " + id, Err: err}
	}
	return rec, out, nil
}

// Wait waits for the background redeploys.
func (s *Service) Wait() { s.bg.Wait() }

func (s *Service) redeploy(ctx context.Context, rec *vm.Record, wasUp bool) {
	id := rec.ID
	log := s.guests.log.With("id", id)
	fail := func(step string, err error) {
		log.Error("AppVM redeploy failed; the old root disk is kept", "step", step, "err", err)
		if derr := s.disks.DropStagedRootDisk(rec); derr != nil {
			log.Error("removing the staged root disk", "err", derr)
		}
		if _, uerr := s.recs.Update(id, func(r *vm.Record) {
			r.AppVM.Redeploy = nil
			r.AppVM.RedeployError = step + ": " + err.Error()
		}); uerr != nil {
			log.Error("recording the redeploy failure", "err", uerr)
		}
		if cur, err := s.Get(id); wasUp && err == nil && (cur.State == vm.StateStopped || cur.State == vm.StateFailed) {
			if _, err := s.vms.Act(ctx, vm.ModeAppVM, id, vm.ActionStart); err != nil {
				log.Error("booting the AppVM again on its old root disk", "err", err)
			}
		}
	}
	if wasUp {
		if _, err := s.restartStop(ctx, rec); err != nil {
			fail("stopping the AppVM", err)
			return
		}
	}
	cur, step, err := s.installRootDisk(ctx, id)
	switch {
	case err != nil && step == "":
		log.Warn("AppVM gone during its redeploy", "err", err)
		return
	case err != nil:
		fail(step, err)
		return
	}
	log.Info("AppVM redeployed", "build_digest", cur.AppVM.Image.BuildDigest)
	if _, err := s.vms.Act(ctx, vm.ModeAppVM, id, vm.ActionStart); err != nil {
		log.Error("booting the redeployed AppVM", "err", err)
	}
}

// installRootDisk stages the new root disk of AppVM id, which runs
// nothing, records it staged, and installs it (steps 3 to 6), under the
// VM's action lock. It returns the record after, or the step that failed
// ("" when the AppVM is gone).
func (s *Service) installRootDisk(ctx context.Context, id string) (*vm.Record, string, error) {
	unlock := s.recs.Lock(id)
	defer unlock()
	cur, err := s.Get(id)
	if err != nil {
		return nil, "", err
	}
	if cur.State == vm.StateRunning || cur.State == vm.StatePaused {
		return nil, "stopping the AppVM", &vm.StateError{ID: id, Action: "redeploy", State: cur.DisplayState + " (it was started again meanwhile)"}
	}
	err = s.disks.StageRootDisk(ctx, cur, s.catalog.BuildFile(cur.AppVM.ImageID, cur.AppVM.Redeploy.To.BuildDigest))
	if err == nil {
		cur, err = s.recs.Update(id, func(r *vm.Record) { r.AppVM.Redeploy.Staged = true })
	}
	if err != nil {
		return nil, "staging the new root disk", err
	}
	testStopAt(HookRedeployStaged)
	if cur, err = s.finishRedeploy(ctx, cur); err != nil {
		return nil, "installing the new root disk", err
	}
	return cur, "", nil
}

// finishRedeploy swaps a staged root disk in and records the new build
// (steps 5 and 6); the VM's action lock is held.
func (s *Service) finishRedeploy(ctx context.Context, rec *vm.Record) (*vm.Record, error) {
	if err := s.disks.SwapRootDisk(ctx, rec); err != nil {
		return nil, err
	}
	testStopAt(HookRedeploySwapped)
	build := s.catalog.BuildFile(rec.AppVM.ImageID, rec.AppVM.Redeploy.To.BuildDigest)
	return s.recs.Update(rec.ID, func(r *vm.Record) {
		r.AppVM.Image = r.AppVM.Redeploy.To
		// The root disk is now made from (an overlay reads through to)
		// the new build; the old one is no longer this AppVM's.
		r.Base = &vm.BaseImage{Path: build, VirtualSizeBytes: r.AppVM.Image.SizeBytes}
		if r.Spec.Disk != nil {
			r.Spec.Disk.BasePath = build
		}
		r.AppVM.Redeploy = nil
		r.AppVM.RedeployError = ""
		r.AppVM.SpecPending = false
	})
}

// RecoverRedeploys finishes what an agent killed during a redeploy left
// (call it after the engine recovered the host): a redeploy whose root
// disk was staged is rolled forward (the AppVM stays stopped; boot it),
// one that was not is rolled back and its redeploy_error says so.
func (s *Service) RecoverRedeploys(ctx context.Context) {
	for _, rec := range s.List() {
		if rec.AppVM.Redeploy != nil {
			s.recoverRedeploy(ctx, rec)
		}
	}
}

func (s *Service) recoverRedeploy(ctx context.Context, rec *vm.Record) {
	unlock := s.recs.Lock(rec.ID)
	defer unlock()
	log := s.guests.log.With("id", rec.ID)
	if rec.AppVM.Redeploy.Staged {
		if _, err := s.finishRedeploy(ctx, rec); err != nil {
			log.Error("finishing an interrupted redeploy", "err", err)
			return
		}
		log.Warn("an interrupted redeploy was finished: the AppVM has its new root disk and stays stopped")
		return
	}
	if err := s.disks.DropStagedRootDisk(rec); err != nil {
		log.Error("removing the staged root disk of an interrupted redeploy", "err", err)
	}
	if _, err := s.recs.Update(rec.ID, func(r *vm.Record) {
		r.AppVM.Redeploy = nil
		r.AppVM.RedeployError = "interrupted by an agent restart before the new root disk was ready; the old one is kept"
	}); err != nil {
		log.Error("recording an interrupted redeploy", "err", err)
	}
	log.Warn("an interrupted redeploy was rolled back: the AppVM keeps its old root disk")
}
