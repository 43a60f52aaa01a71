package vm_test

import (
	"context"
	"errors"
	"os"
	"syscall"
	"testing"

	"vmhost/vm"
	"vmhost/vm/vmtest"
)

// TestVolumeOnFullDisk: admission passes (the free space reported is
// stale), the write runs out of space: a storage error, nothing left.
func TestVolumeOnFullDisk(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("mounting a small tmpfs needs root")
	}
	env := vmtest.NewEnv(t)
	dir := env.StateDir + "/volumes"
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Mount("tmpfs", dir, "tmpfs", 0, "size=256k"); err != nil {
		t.Skipf("mounting tmpfs: %v", err)
	}
	t.Cleanup(func() { syscall.Unmount(dir, syscall.MNT_DETACH) })
	s := env.Service(t)
	_, err := s.CreateVolume(context.Background(), vm.VolumeRequest{VolumeID: "big", SizeGiB: 64, Format: "ext4"})
	var he *vm.HostError
	if !errors.As(err, &he) || he.Kind != vm.HostStorage {
		t.Fatalf("CreateVolume on a full disk = %v, want a storage error", err)
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 0 {
		t.Errorf("files left: %v", ents)
	}
}
