package vm

import (
	"context"
	"sync"
	"time"

	"vmhost/chclient"
)

// AppVMHooks is what the engine calls for the AppVM specifics it cannot
// know about (package vm cannot import package appvm): the guest agent's
// files and session, and the workload's stop. appvm.New registers its
// implementation on the Service; a Service without one (classic-only
// tests) gets nil from AppVMHooks.
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
	Provision(ctx context.Context, rec *Record) error
	PrepareBoot(ctx context.Context, rec *Record, cfg *chclient.VmConfig) error
	Shutdown(ctx context.Context, rec *Record) error
	Adopt(ctx context.Context, rec *Record) error
	Forget(rec *Record)
	Rollback(ctx context.Context, rec *Record) error
}

// appVMHooks holds the hooks of each Service. A map beside the Service
// rather than a field keeps the hooks in this file.
var appVMHooks sync.Map // *Service → AppVMHooks

// SetAppVMHooks registers h as the AppVM hooks of s.
func (s *Service) SetAppVMHooks(h AppVMHooks) { appVMHooks.Store(s, h) }

// AppVMHooks returns the registered AppVM hooks, or nil.
func (s *Service) AppVMHooks() AppVMHooks {
	h, _ := appVMHooks.Load(s)
	hooks, _ := h.(AppVMHooks)
	return hooks
}

// AppVMGuest is what the host learned from an AppVM's guest agent and did
// about its workload, kept in the record (AppVMSpec.Guest) so it survives
// an agent restart. Contract §2.3 names the view fields.
type AppVMGuest struct {
	// BootID is the guest agent's boot id of the current boot.
	BootID string `json:"boot_id,omitempty"`
	// HeartbeatSecs is the heartbeat interval sent in the Spec.
	HeartbeatSecs int `json:"heartbeat_secs,omitempty"`
	// LastHeartbeatAt is persisted at the first heartbeat of a boot and
	// then at most every HeartbeatPersistEvery; the live value is kept in
	// memory by package appvm.
	LastHeartbeatAt *time.Time  `json:"last_heartbeat_at,omitempty"`
	Lease           *GuestLease `json:"lease,omitempty"`
	ExitCode        *int        `json:"workload_exit_code,omitempty"`
	ExitSignal      int         `json:"workload_exit_signal,omitempty"`
	Fatal           string      `json:"workload_fatal,omitempty"`
	Health          string      `json:"health,omitempty"`
	HealthStreak    uint32      `json:"health_failing_streak,omitempty"`
	// LogStreamDetached is set when the agent restarted while the AppVM ran
	// and cleared when the guest agent reconnects (Hello with resume).
	LogStreamDetached bool `json:"log_stream_detached,omitempty"`
	// RestartCount counts consecutive automatic restarts.
	RestartCount  uint32     `json:"restart_count,omitempty"`
	LastRestartAt *time.Time `json:"last_restart_at,omitempty"`
}

// GuestLease is the DHCP lease a guest agent reported.
type GuestLease struct {
	IP         string    `json:"ip"`
	Prefix     int       `json:"prefix"`
	Gateway    string    `json:"gateway,omitempty"`
	DNS        []string  `json:"dns,omitempty"`
	Search     []string  `json:"search,omitempty"`
	LeaseSecs  uint32    `json:"lease_secs,omitempty"`
	Hostname   string    `json:"hostname,omitempty"`
	ReportedAt time.Time `json:"reported_at"`
}

// The helpers below are the engine's one-line calls into the hooks; each
// does nothing for a classic VM or a Service without hooks.

// appVMProvision runs the AppVM provisioning hook (ext4 data volumes)
// before qemu-storage-daemon opens the volumes, and returns the current
// record.
func (s *Service) appVMProvision(ctx context.Context, rec *Record) (*Record, error) {
	h := s.AppVMHooks()
	if rec.Mode != ModeAppVM || h == nil {
		return rec, nil
	}
	if err := h.Provision(ctx, rec); err != nil {
		return rec, err
	}
	if r := s.reg.get(rec.ID); r != nil {
		return r, nil
	}
	return rec, nil
}

// appVMPrepareBoot completes cfg (kernel, initramfs) and starts listening
// for the guest agent, before vm.create.
func (s *Service) appVMPrepareBoot(ctx context.Context, rec *Record, cfg *chclient.VmConfig) error {
	h := s.AppVMHooks()
	if rec.Mode != ModeAppVM || h == nil {
		return nil
	}
	return h.PrepareBoot(ctx, rec, cfg)
}

// appVMShutdown asks an AppVM's guest agent to stop the workload and power
// off; handled is false for a classic VM (use the ACPI power button).
func (s *Service) appVMShutdown(ctx context.Context, rec *Record) (handled bool, err error) {
	h := s.AppVMHooks()
	if rec.Mode != ModeAppVM || h == nil {
		return false, nil
	}
	return true, h.Shutdown(ctx, rec)
}

// appVMForget closes an AppVM's guest session (stop, delete).
func (s *Service) appVMForget(rec *Record) {
	if h := s.AppVMHooks(); rec.Mode == ModeAppVM && h != nil {
		h.Forget(rec)
	}
}

// appVMRollback undoes the AppVM hooks' work with a failed create.
func (s *Service) appVMRollback(ctx context.Context, rec *Record) error {
	if h := s.AppVMHooks(); rec.Mode == ModeAppVM && h != nil {
		return h.Rollback(ctx, rec)
	}
	return nil
}
