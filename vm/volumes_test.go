package vm_test

import (
	"context"
	"errors"
	"os"
	"testing"

	"vmhost/vm"
	"vmhost/vm/vmtest"
)

func coldVM(t *testing.T, env *vmtest.Env, s *vm.Service, id string) {
	t.Helper()
	size := uint32(2)
	sp := &vm.Spec{VMID: id, Vcpus: 1, MemoryMB: 128, KernelPath: &env.Kernel,
		Disk: &vm.DiskSpec{BasePath: env.Base, SizeGiB: &size}, Volumes: []vm.VolumeSpec{{SizeGiB: 1}}}
	if _, _, err := s.CreateVM(context.Background(), sp); err != nil {
		t.Fatal(err)
	}
}

// TestRecoverVolumesNotRunning: a hot attach or detach cut short on a VM
// that no longer runs completes from the record at the next start: the
// attach is kept (the next boot presents it), the detach finishes (a
// VM-owned volume kept as a first-class one).
func TestRecoverVolumesNotRunning(t *testing.T) {
	env := vmtest.NewEnv(t)
	s := env.Service(t)
	ctx := context.Background()
	coldVM(t, env, s, "r")
	if _, err := s.CreateVolume(ctx, vm.VolumeRequest{VolumeID: "fc", SizeGiB: 1}); err != nil {
		t.Fatal(err)
	}
	// What an agent killed in the middle of both leaves in the record.
	if _, err := env.Records.Update("r", func(r *vm.Record) {
		r.Spec.Volumes[0].Pending = vm.PendingDetach
		r.Spec.Volumes = append(r.Spec.Volumes, vm.VolumeSpec{ID: "data1", VolumeID: "fc", SizeGiB: 1, Pending: vm.PendingAttach})
	}); err != nil {
		t.Fatal(err)
	}
	if info, _ := s.GetVolume("fc"); info == nil || info.AttachedTo == nil {
		t.Fatalf("a pending attach does not reserve the volume: %+v", info)
	}
	s2 := env.Service(t)
	s2.RecoverVolumes(ctx)
	rec, err := s2.Get(vm.ModeVM, "r")
	if err != nil {
		t.Fatal(err)
	}
	if len(rec.Spec.Volumes) != 1 || rec.Spec.Volumes[0].ID != "data1" || rec.Spec.Volumes[0].Pending != "" {
		t.Fatalf("volumes after recovery: %+v, want data1 (fc) attached", rec.Spec.Volumes)
	}
	kept, err := s2.GetVolume("r-data0")
	if err != nil || kept.AttachedTo != nil {
		t.Fatalf("the detached owned volume: %+v %v", kept, err)
	}
	if _, err := os.Stat(s2.Layout().DataVolume("r", "data0")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("data0's old file is still there: %v", err)
	}
	if info, _ := s2.GetVolume("fc"); info == nil || info.AttachedTo == nil || info.AttachedTo.Device != "/dev/vdb" {
		t.Fatalf("fc after recovery: %+v, want attached as /dev/vdb", info)
	}
}

// TestVolumeAdmission: a volume the state directory's free space cannot
// hold is refused before anything is written (create and attach alike).
func TestVolumeAdmission(t *testing.T) {
	env := vmtest.NewEnv(t)
	s := env.Service(t)
	ctx := context.Background()
	coldVM(t, env, s, "a")
	env.DiskFree = 3 << 30
	var ce *vm.CapacityError
	if _, err := s.CreateVolume(ctx, vm.VolumeRequest{VolumeID: "big", SizeGiB: 4}); !errors.As(err, &ce) || ce.Resource != "disk" {
		t.Fatalf("CreateVolume(4 GiB) with 3 GiB free = %v, want a disk capacity error", err)
	}
	size := uint32(4)
	if _, err := s.AttachVolume(ctx, vm.ModeVM, "a", vm.AttachRequest{SizeGiB: &size}); !errors.As(err, &ce) {
		t.Fatalf("attach of a new 4 GiB volume with 3 GiB free = %v, want a capacity error", err)
	}
	if vols, _ := s.ListVolumes(); len(vols) != 0 {
		t.Errorf("volumes after refusals: %+v", vols)
	}
	if _, err := os.Stat(s.Layout().DataVolume("a", "data1")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("a refused attach left a file: %v", err)
	}
	if _, err := s.CreateVolume(ctx, vm.VolumeRequest{VolumeID: "fits", SizeGiB: 3}); err != nil {
		t.Fatalf("CreateVolume(3 GiB) with 3 GiB free: %v", err)
	}
}
