package vm

import (
	"context"
	"errors"

	"vmhost/snapshot"
	"vmhost/vm/record"
)

// Host is the work a VM needs done on the host: disk copies, data volumes,
// taps, the seed, qemu-storage-daemon and Cloud Hypervisor, and the
// lifecycle actions. The Service calls it only after validation and
// admission passed, and checks the state and holds the VM's action lock
// before each action, so an implementation sees one action per VM at a
// time. Implementations report failures as *HostError so the API can pick
// the error code.
//
// engine.Engine is the production implementation; vmtest.Host is an
// in-memory fake that records calls.
type Host interface {
	// Preflight reports whether the host can carry out creating rec at
	// all, before admission and before anything is stored: a host
	// precondition it lacks is a *FieldError naming it. It changes
	// nothing.
	Preflight(ctx context.Context, rec *Record) error
	// Claim gives rec, a create being admitted, what the host hands out
	// one per VM and records with it (a confined VM's uid and gid),
	// chosen against others: every other stored record and create in
	// flight. It runs under the records' lock, so two creates never get
	// the same, and the create's first record write holds it. An error
	// refuses the create with nothing made.
	Claim(rec *Record, others []*Record) error
	// Provision creates the VM's disks, taps and seed (downloading the
	// image first when rec.Spec.Image is set). On error it leaves nothing
	// behind that Rollback cannot remove.
	Provision(ctx context.Context, rec *Record) error
	// Boot starts the VM's processes and boots it. A host that staged its
	// provision's result (records.Registry.Stage, for a create with auto_boot)
	// stores it with the boot's record write, or alone when the boot
	// fails.
	Boot(ctx context.Context, rec *Record) error
	// Rollback removes everything Provision created for rec. It is
	// idempotent.
	Rollback(ctx context.Context, rec *Record) error

	// The lifecycle actions of a running or paused VM (docs/design.md §5); start
	// is Boot.
	Shutdown(ctx context.Context, rec *Record) error
	Stop(ctx context.Context, rec *Record) error
	Pause(ctx context.Context, rec *Record) error
	Resume(ctx context.Context, rec *Record) error
	Reboot(ctx context.Context, rec *Record) error
	// Balloon sets the balloon of a running or paused VM to mb MiB.
	Balloon(ctx context.Context, rec *Record, mb uint64) error
	// Counters reads the device counters of a running or paused VM
	// (Cloud Hypervisor's vm.counters: device id → counter → value).
	Counters(ctx context.Context, rec *Record) (map[string]map[string]uint64, error)
	// Usage reads what a confined VM's processes use now (its cgroup's
	// counters); nil, with no error, for a VM that runs unconfined.
	Usage(rec *Record) (*record.Usage, error)
	// HotAttach plugs volume key of rec, a running or paused VM (recorded
	// with Pending attach), into it: the storage daemon exports the image,
	// CH adds the disk, and a running AppVM's guest mounts it. On failure
	// whatever it did is undone. It can run again over what a run cut
	// short left (recovery finishes an interrupted attach with it).
	HotAttach(ctx context.Context, rec *Record, key string) error
	// HotDetach unplugs volume key from rec, a running VM: a running
	// AppVM's guest unmounts it (busy: *StateError), CH removes the disk
	// and the guest releases it within DetachTimeout (else *StateError,
	// the disk stays), then the export goes. It can run again over what a
	// run cut short left.
	HotDetach(ctx context.Context, rec *Record, key string) error
	// Delete removes everything the VM owns on the host (processes, taps,
	// run directory, its own files) and nothing else; the Service then
	// removes the record.
	Delete(ctx context.Context, rec *Record) error

	// Suspend saves the memory and device state of rec, a running or
	// paused VM, and stops its processes; the host records it stopped
	// with Suspended. Boot of a VM with Suspended resumes from the saved
	// state (failing, it keeps it); DiscardSaved drops it (a start cold).
	Suspend(ctx context.Context, rec *Record) error
	DiscardSaved(ctx context.Context, rec *Record) error
	// Snapshot writes snapshot sid of rec into dir (the snapshot store's
	// staging directory): copies of the disks rec owns, and its saved
	// state when memory is asked for and rec runs, is paused or is
	// suspended. It returns the copies and whether the state was saved.
	Snapshot(ctx context.Context, rec *Record, sid, dir string, memory bool) ([]snapshot.Disk, bool, error)
	// RestoreSnapshot makes the disks rec owns (rec does not run) copies
	// of sn's and its saved state sn's, or none; apply's changes to the
	// record are recorded with the restore's commit.
	RestoreSnapshot(ctx context.Context, rec *Record, sn *snapshot.Snapshot, apply func(*Record)) error
}

// ErrNoHost is wrapped by the errors of NoHost.
var ErrNoHost = errors.New("this service does no host work")

// NoHost is a Host that refuses all host work: every create fails in
// Preflight (before anything is stored) with a HostInternal error, and Boot
// and the actions fail likewise; Delete has nothing to remove. Tests use
// it where no disk, tap or process may be made.
type NoHost struct{}

// Preflight refuses the create.
func (NoHost) Preflight(_ context.Context, rec *Record) error {
	return &HostError{Kind: HostInternal, Op: "creating VM " + rec.ID, Err: ErrNoHost}
}

// Provision refuses like Preflight.
func (h NoHost) Provision(ctx context.Context, rec *Record) error { return h.Preflight(ctx, rec) }

// Boot refuses.
func (NoHost) Boot(_ context.Context, rec *Record) error {
	return &HostError{Kind: HostInternal, Op: "booting VM " + rec.ID, Err: ErrNoHost}
}

// Claim gives nothing: VMs run nowhere.
func (NoHost) Claim(*Record, []*Record) error { return nil }

// Rollback has nothing to undo.
func (NoHost) Rollback(context.Context, *Record) error { return nil }

// Balloon refuses: no VM runs here.
func (NoHost) Balloon(_ context.Context, rec *Record, _ uint64) error {
	return RunsNoVMs("balloon", rec)
}

// Usage has nothing to read: no VM runs here.
func (NoHost) Usage(*Record) (*record.Usage, error) { return nil, nil }

// Counters refuses: no VM runs here.
func (NoHost) Counters(_ context.Context, rec *Record) (map[string]map[string]uint64, error) {
	return nil, RunsNoVMs("counters of", rec)
}

// Shutdown refuses: no VM runs here.
func (NoHost) Shutdown(_ context.Context, rec *Record) error { return RunsNoVMs("shutdown", rec) }

// Stop refuses: no VM runs here.
func (NoHost) Stop(_ context.Context, rec *Record) error { return RunsNoVMs("stop", rec) }

// Pause refuses: no VM runs here.
func (NoHost) Pause(_ context.Context, rec *Record) error { return RunsNoVMs("pause", rec) }

// Resume refuses: no VM runs here.
func (NoHost) Resume(_ context.Context, rec *Record) error { return RunsNoVMs("resume", rec) }

// Reboot refuses: no VM runs here.
func (NoHost) Reboot(_ context.Context, rec *Record) error { return RunsNoVMs("reboot", rec) }

// Delete has nothing to remove.
func (NoHost) Delete(context.Context, *Record) error { return nil }

// HotAttach refuses: no VM runs here.
func (NoHost) HotAttach(_ context.Context, rec *Record, _ string) error {
	return RunsNoVMs("hot-plug a volume into", rec)
}

// HotDetach refuses: no VM runs here.
func (NoHost) HotDetach(_ context.Context, rec *Record, _ string) error {
	return RunsNoVMs("hot-unplug a volume from", rec)
}

// RunsNoVMs is the error of a lifecycle action on a host that runs no VMs
// (a test host).
func RunsNoVMs(action string, rec *Record) error {
	return &HostError{Kind: HostInternal, Op: action + " VM " + rec.ID, Err: errors.New("this host runs no VMs")}
}

// Suspend refuses: no VM runs here.
func (NoHost) Suspend(_ context.Context, rec *Record) error { return RunsNoVMs("suspend", rec) }

// DiscardSaved has nothing to drop.
func (NoHost) DiscardSaved(context.Context, *Record) error { return nil }

// Snapshot refuses: no VM has disks here.
func (NoHost) Snapshot(_ context.Context, rec *Record, _, _ string, _ bool) ([]snapshot.Disk, bool, error) {
	return nil, false, RunsNoVMs("snapshot", rec)
}

// RestoreSnapshot refuses: no VM has disks here.
func (NoHost) RestoreSnapshot(_ context.Context, rec *Record, _ *snapshot.Snapshot, _ func(*Record)) error {
	return RunsNoVMs("restore a snapshot onto", rec)
}
