package engine

import (
	"context"

	"vmhost/chclient"
	"vmhost/vm/record"
)

// AppVMHooks is what the engine calls for the AppVM specifics it cannot
// know about (the engine does not import package appvm): the guest
// agent's files and session, and the workload's stop. Package appvm
// implements it (appvm.Service.Hooks), and Start takes it; an engine
// without it (classic-only tests) skips the AppVM specifics.
//
// The engine calls, for a record of mode appvm:
//   - Provision after its own provisioning steps (root disk copy, taps),
//     Rollback with its own rollback;
//   - PrepareBoot after building the vm.create body and before vm.create:
//     it adds the initramfs and starts listening for the guest agent;
//   - Shutdown instead of the ACPI power button (the guest agent does not
//     watch it): the workload gets SIGTERM, then SIGKILL after its grace,
//     and the guest powers off;
//   - Adopt for a running AppVM found at agent start (recovery), so the
//     guest agent's reconnection is accepted;
//   - Forget when the VM is deleted.
type AppVMHooks interface {
	Provision(ctx context.Context, rec *record.Record) error
	PrepareBoot(ctx context.Context, rec *record.Record, cfg *chclient.VmConfig) error
	Shutdown(ctx context.Context, rec *record.Record) error
	Adopt(ctx context.Context, rec *record.Record) error
	Forget(rec *record.Record)
	// Settle waits, bounded, until the guest agent's connection has ended,
	// so what the guest sent before it powered off (the workload's exit)
	// is recorded before the VM's end.
	Settle(rec *record.Record)
	Rollback(ctx context.Context, rec *record.Record) error
	// MountVolume has a running AppVM's guest agent mount its hot-plugged
	// volume key (at PCI address bdf) at the volume's mountpoint;
	// UnmountVolume has it unmount it before a hot detach (a busy mount is
	// *record.StateError naming the mountpoint).
	MountVolume(ctx context.Context, rec *record.Record, key, bdf string) error
	UnmountVolume(ctx context.Context, rec *record.Record, key string) error
}

// The helpers below are the engine's one-line calls into the hooks; each
// does nothing for a classic VM or an engine without hooks.

// appVMProvision runs the AppVM provisioning hook (ext4 data volumes)
// before qemu-storage-daemon opens the volumes, and returns the current
// record.
func (e *Engine) appVMProvision(ctx context.Context, rec *record.Record) (*record.Record, error) {
	h := e.hooks
	if rec.Mode != record.ModeAppVM || h == nil {
		return rec, nil
	}
	if err := h.Provision(ctx, rec); err != nil {
		return rec, err
	}
	if r := e.recs.Get(rec.ID); r != nil {
		return r, nil
	}
	return rec, nil
}

// appVMPrepareBoot completes cfg (kernel, initramfs) and starts listening
// for the guest agent, before vm.create.
func (e *Engine) appVMPrepareBoot(ctx context.Context, rec *record.Record, cfg *chclient.VmConfig) error {
	h := e.hooks
	if rec.Mode != record.ModeAppVM || h == nil {
		return nil
	}
	return h.PrepareBoot(ctx, rec, cfg)
}

// appVMShutdown asks an AppVM's guest agent to stop the workload and power
// off; handled is false for a classic VM (use the ACPI power button).
func (e *Engine) appVMShutdown(ctx context.Context, rec *record.Record) (handled bool, err error) {
	h := e.hooks
	if rec.Mode != record.ModeAppVM || h == nil {
		return false, nil
	}
	return true, h.Shutdown(ctx, rec)
}

// appVMForget closes an AppVM's guest session (stop, delete).
func (e *Engine) appVMForget(rec *record.Record) {
	if h := e.hooks; rec.Mode == record.ModeAppVM && h != nil {
		h.Forget(rec)
	}
}

// appVMSettle lets an AppVM's guest session read what the guest sent
// before it ended (monitor.go, before the end is recorded).
func (e *Engine) appVMSettle(id string) {
	if h := e.hooks; h != nil {
		if rec := e.recs.Get(id); rec != nil && rec.Mode == record.ModeAppVM {
			h.Settle(rec)
		}
	}
}

// appVMRollback undoes the AppVM hooks' work with a failed create.
func (e *Engine) appVMRollback(ctx context.Context, rec *record.Record) error {
	if h := e.hooks; rec.Mode == record.ModeAppVM && h != nil {
		return h.Rollback(ctx, rec)
	}
	return nil
}
