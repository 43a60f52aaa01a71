package vm

import (
	"context"
	"fmt"
)

// Action is a lifecycle action of docs/design.md §5: POST /api/vms/{id}/{action}.
type Action string

// Lifecycle actions.
const (
	ActionStart    Action = "start"    // boot a created, stopped or failed VM
	ActionShutdown Action = "shutdown" // ACPI power button; shutting_down until the guest is off
	ActionStop     Action = "stop"     // end the VMM now: stopped, operator_shutdown
	ActionPause    Action = "pause"
	ActionResume   Action = "resume"
	ActionReboot   Action = "reboot"
)

// Actions lists every lifecycle action, for routes.
var Actions = []Action{ActionStart, ActionShutdown, ActionStop, ActionPause, ActionResume, ActionReboot}

// allowed reports whether action may run on rec (docs/design.md §5): start from
// created, stopped or failed (not while provisioning, nor after a failed
// provision or with an invalid record); shutdown, pause and reboot while
// running; stop while running or paused; resume while paused.
func allowed(a Action, rec *Record) bool {
	if rec.Deleting { // a delete that failed part-way: only a delete again
		return false
	}
	switch a {
	case ActionStart:
		if rec.Provisioning() || rec.DisplayState == DisplayProvisionFailed {
			return false
		}
		if fr := rec.FailureReason; rec.State == StateFailed && fr != nil && fr.Detail.Kind == "invalid_vm_id" {
			return false
		}
		return rec.State == StateCreated || rec.State == StateStopped || rec.State == StateFailed
	case ActionShutdown, ActionPause, ActionReboot:
		return rec.State == StateRunning
	case ActionStop:
		return rec.State == StateRunning || rec.State == StatePaused
	case ActionResume:
		return rec.State == StatePaused
	}
	return false
}

// lockVM takes the action lock of VM id (records.Registry.Lock) and
// returns its unlock.
func (s *Service) lockVM(id string) func() { return s.recs.Lock(id) }

// Act runs a lifecycle action on the VM id of family mode and returns the
// record after it. Not found satisfies errors.Is(err, fs.ErrNotExist); a
// state that does not allow the action gives *StateError; host failures
// are *HostError.
func (s *Service) Act(ctx context.Context, mode Mode, id string, a Action) (*Record, error) {
	unlock := s.lockVM(id)
	defer unlock()
	rec, err := s.Get(mode, id)
	if err != nil {
		return nil, err
	}
	if !allowed(a, rec) {
		return nil, &StateError{ID: id, Action: string(a), State: rec.DisplayState}
	}
	if a == ActionStart { // Host.Boot, as a create with auto_boot
		if _, _, err := s.boot(ctx, rec); err != nil {
			return nil, err
		}
		s.log.Info("VM lifecycle action", "id", id, "action", a)
		return s.recs.Get(id), nil
	}
	lc := s.o.Host
	switch a {
	case ActionShutdown:
		err = lc.Shutdown(ctx, rec)
	case ActionStop:
		err = lc.Stop(ctx, rec)
	case ActionPause:
		err = lc.Pause(ctx, rec)
	case ActionResume:
		err = lc.Resume(ctx, rec)
	case ActionReboot:
		err = lc.Reboot(ctx, rec)
	default:
		return nil, fmt.Errorf("unknown action %q", a)
	}
	if err != nil {
		return nil, err
	}
	s.log.Info("VM lifecycle action", "id", id, "action", a)
	return s.recs.Get(id), nil
}

// SetBalloon sets the balloon target of the VM id of family mode to mb
// MiB (docs/api.md, balloon): a running or paused VM's balloon changes at once
// (Host.Balloon) and the target is recorded; any other VM only records it
// for its next boot. mb must be below the VM's memory (*FieldError).
func (s *Service) SetBalloon(ctx context.Context, mode Mode, id string, mb uint64) (*Record, error) {
	unlock := s.lockVM(id)
	defer unlock()
	rec, err := s.Get(mode, id)
	if err != nil {
		return nil, err
	}
	if mb >= rec.Spec.MemoryMB {
		return nil, bad("balloon_mb", "%d must be below the VM's memory_mb (%d)", mb, rec.Spec.MemoryMB)
	}
	if rec.Deleting {
		return nil, &StateError{ID: id, Action: "balloon", State: rec.DisplayState}
	}
	if rec.State == StateRunning || rec.State == StatePaused {
		if err := s.o.Host.Balloon(ctx, rec, mb); err != nil {
			return nil, err
		}
	}
	rec, err = s.recs.Update(id, func(r *Record) { r.BalloonMB = mb })
	if err != nil {
		return nil, &HostError{Kind: HostStorage, Op: "recording the balloon of VM " + id, Err: err}
	}
	s.log.Info("VM balloon set", "id", id, "balloon_mb", mb)
	return rec, nil
}

// Counters reads the device counters of rec, a running or paused VM (a
// *StateError otherwise). It takes no lock: counters are a read, and a VM
// that ends meanwhile answers an error.
func (s *Service) Counters(ctx context.Context, rec *Record) (map[string]map[string]uint64, error) {
	if rec.State != StateRunning && rec.State != StatePaused {
		return nil, &StateError{ID: rec.ID, Action: "counters", State: rec.DisplayState}
	}
	return s.o.Host.Counters(ctx, rec)
}

// Usage reads what the processes of rec, a running or paused VM, use now
// (its cgroup's counters); nil for one that is not running or runs
// unconfined.
func (s *Service) Usage(rec *Record) (*Usage, error) {
	if rec.State != StateRunning && rec.State != StatePaused {
		return nil, nil
	}
	return s.o.Host.Usage(rec)
}

// Delete removes the VM id of family mode: everything it owns on the host,
// then its record. A running or paused VM is refused (*StateError) unless
// force is set, and so is one whose provisioning is still in progress:
// with force, the host cancels the provision (a download, a copy) first.
func (s *Service) Delete(ctx context.Context, mode Mode, id string, force bool) error {
	unlock := s.lockVM(id)
	defer unlock()
	rec, err := s.Get(mode, id)
	if err != nil {
		return err
	}
	if !force && rec.Provisioning() {
		return &StateError{ID: id, Action: "delete", State: rec.DisplayState, Hint: "delete with ?force=true to cancel the provision"}
	}
	if !force && (rec.State == StateRunning || rec.State == StatePaused) {
		return &StateError{ID: id, Action: "delete", State: rec.DisplayState, Hint: "stop it first, or delete with ?force=true"}
	}
	// The intent is stored first: an agent killed during the teardown
	// finishes the delete at restart rather than keep a VM that looks
	// healthy without its disks.
	if rec, err = s.recs.Update(id, func(r *Record) { r.Deleting = true }); err != nil {
		return &HostError{Kind: HostStorage, Op: "deleting VM " + id, Err: err}
	}
	if err := s.o.Host.Delete(ctx, rec); err != nil {
		return &HostError{Kind: HostInternal, Op: "deleting VM " + id, Err: err}
	}
	if err := s.recs.Remove(id); err != nil {
		return &HostError{Kind: HostStorage, Op: "deleting VM " + id, Err: err}
	}
	s.log.Info("VM deleted", "id", id)
	return nil
}

// autoBoot boots a just-provisioned VM under its action lock, unless an
// action (a start, a delete) got to it first.
func (s *Service) autoBoot(ctx context.Context, rec *Record) (*Record, bool, error) {
	unlock := s.lockVM(rec.ID)
	defer unlock()
	cur := s.recs.Get(rec.ID)
	if cur == nil {
		// A delete won the race: the create's outcome is a state that
		// changed under it (409 INVALID_STATE), not a missing id.
		return nil, false, &StateError{ID: rec.ID, Action: "boot", State: "deleted"}
	}
	if cur.State != StateCreated {
		return cur, false, nil
	}
	return s.boot(ctx, cur)
}
