package appvm

import (
	"context"
	"errors"

	"vmhost/vm"
)

// AttachVolume attaches a volume to AppVM id (extensions.md §1.2): the
// mountpoint follows the rules of data_volumes[].mountpoint, the volume
// must hold ext4 (a new one is made so), and a running AppVM's guest
// agent mounts it before the answer (vm.Service.AttachVolume does the
// rest).
func (s *Service) AttachVolume(ctx context.Context, id string, req vm.AttachRequest) (*vm.Record, error) {
	if _, err := s.Get(id); err != nil {
		return nil, err
	}
	if req.Mountpoint == "" {
		return nil, bad("mountpoint", "required on an AppVM")
	}
	if err := checkMountpoint(req.Mountpoint); err != nil {
		return nil, bad("mountpoint", "%s", err)
	}
	return s.vms.AttachVolume(ctx, vm.ModeAppVM, id, req)
}

// DetachVolume detaches volume key from AppVM id; a running AppVM's guest
// agent unmounts it first.
func (s *Service) DetachVolume(ctx context.Context, id, key string) (*vm.Record, error) {
	return s.vms.DetachVolume(ctx, vm.ModeAppVM, id, key)
}

// MountVolume has the guest agent mount hot-plugged volume key
// (engine.AppVMHooks).
func (h hooks) MountVolume(ctx context.Context, rec *vm.Record, key, bdf string) error {
	return errors.New("TODO guest mount")
}

// UnmountVolume has the guest agent unmount volume key before a hot
// detach (engine.AppVMHooks).
func (h hooks) UnmountVolume(ctx context.Context, rec *vm.Record, key string) error {
	return errors.New("TODO guest unmount")
}
