package vm_test

import (
	"context"
	"errors"
	"os"
	"strings"
	"testing"
	"time"

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
	s2.Wait() // recovery runs in the background
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

// TestHotVolumeChanges: on a running VM an attach is recorded pending, the
// host plugs the volume, and the mark goes; a detach of a VM-owned volume
// keeps its file as the first-class volume "<vm>-<data id>" (no copy, the
// old name gone). A host that fails leaves the record as it was: a failed
// attach drops the volume (and the new file it made), a failed detach
// clears its mark. A VM's delete frees the first-class volume it had.
func TestHotVolumeChanges(t *testing.T) {
	env := vmtest.NewEnv(t)
	s := env.Service(t)
	ctx := context.Background()
	size := uint32(2)
	sp := &vm.Spec{VMID: "hot", Vcpus: 1, MemoryMB: 128, KernelPath: &env.Kernel, AutoBoot: true,
		Disk: &vm.DiskSpec{BasePath: env.Base, SizeGiB: &size}, Volumes: []vm.VolumeSpec{{SizeGiB: 1}}}
	if rec, _, err := s.CreateVM(ctx, sp); err != nil || rec.State != vm.StateRunning {
		t.Fatalf("CreateVM = %+v, %v", rec, err)
	}
	if _, err := s.CreateVolume(ctx, vm.VolumeRequest{VolumeID: "shared", SizeGiB: 1}); err != nil {
		t.Fatal(err)
	}
	rec, err := s.AttachVolume(ctx, vm.ModeVM, "hot", vm.AttachRequest{VolumeID: "shared", Readonly: true})
	if err != nil {
		t.Fatal(err)
	}
	if v := rec.Spec.Volumes[1]; v.ID != "data1" || v.VolumeID != "shared" || !v.Readonly || v.Pending != "" {
		t.Fatalf("attached volume %+v", v)
	}
	if info, err := s.GetVolume("shared"); err != nil || info.AttachedTo == nil || info.AttachedTo.VMID != "hot" || info.AttachedTo.Device != "/dev/vdc" {
		t.Fatalf("GetVolume(shared) = %+v %v", info, err)
	}

	env.Host.FailHotAttach = errors.New("no slot")
	grow := uint32(1)
	if _, err := s.AttachVolume(ctx, vm.ModeVM, "hot", vm.AttachRequest{SizeGiB: &grow}); err == nil {
		t.Fatal("an attach the host failed succeeded")
	}
	if rec, _ := s.Get(vm.ModeVM, "hot"); len(rec.Spec.Volumes) != 2 {
		t.Errorf("volumes after a failed attach: %+v", rec.Spec.Volumes)
	}
	if _, err := os.Stat(s.Layout().DataVolume("hot", "data2")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("a failed attach left its new file: %v", err)
	}
	env.Host.FailHotAttach = nil

	env.Host.FailHotDetach = &vm.StateError{Msg: "busy"}
	if _, err := s.DetachVolume(ctx, vm.ModeVM, "hot", "data0"); err == nil {
		t.Fatal("a detach the host failed succeeded")
	}
	if rec, _ := s.Get(vm.ModeVM, "hot"); rec.Spec.Volumes[0].Pending != "" {
		t.Errorf("a failed detach left its mark: %+v", rec.Spec.Volumes[0])
	}
	env.Host.FailHotDetach = nil

	old, err := os.Stat(s.Layout().DataVolume("hot", "data0"))
	if err != nil {
		t.Fatal(err)
	}
	if rec, err = s.DetachVolume(ctx, vm.ModeVM, "hot", "data0"); err != nil {
		t.Fatal(err)
	}
	if len(rec.Spec.Volumes) != 1 || rec.Spec.Volumes[0].VolumeID != "shared" {
		t.Errorf("volumes after the detach: %+v", rec.Spec.Volumes)
	}
	kept, err := s.GetVolume("hot-data0")
	if err != nil || kept.Format != "raw" || kept.VirtualSizeBytes != 1<<30 {
		t.Fatalf("kept volume = %+v %v", kept, err)
	}
	if fi, err := os.Stat(kept.Path); err != nil || !os.SameFile(fi, old) {
		t.Errorf("kept volume is not the detached file: %v", err)
	}
	if _, err := os.Stat(s.Layout().DataVolume("hot", "data0")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the detached volume's old name is still there: %v", err)
	}
	want := "hot-attach hot data1\nhot-attach hot data2\nhot-detach hot data0\nhot-detach hot data0"
	var got []string
	for _, c := range env.Host.Calls() {
		if strings.HasPrefix(c, "hot-") {
			got = append(got, c)
		}
	}
	if strings.Join(got, "\n") != want {
		t.Errorf("host calls:\n%s\nwant\n%s", strings.Join(got, "\n"), want)
	}

	if err := s.Delete(ctx, vm.ModeVM, "hot", true); err != nil {
		t.Fatal(err)
	}
	if info, err := s.GetVolume("shared"); err != nil || info.AttachedTo != nil {
		t.Fatalf("GetVolume(shared) after the VM's delete = %+v %v", info, err)
	}
}

// TestDeleteWhileProvisioning: a VM still provisioning is deleted only
// with force, which has the host cancel the provision.
func TestDeleteWhileProvisioning(t *testing.T) {
	env := vmtest.NewEnv(t)
	env.Host.Gate = make(chan struct{})
	s := env.Service(t)
	size := uint32(2)
	sp := &vm.Spec{VMID: "slow", Vcpus: 1, MemoryMB: 128, KernelPath: &env.Kernel, Disk: &vm.DiskSpec{BasePath: env.Base, SizeGiB: &size}}
	created := make(chan error, 1)
	go func() {
		_, _, err := s.CreateVM(context.Background(), sp)
		created <- err
	}()
	defer func() { close(env.Host.Gate); <-created }()
	deadline := time.Now().Add(5 * time.Second)
	for {
		if rec, err := s.Get(vm.ModeVM, "slow"); err == nil && rec.Provisioning() {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the create never stored its record")
		}
		time.Sleep(5 * time.Millisecond)
	}
	var se *vm.StateError
	err := s.Delete(context.Background(), vm.ModeVM, "slow", false)
	if !errors.As(err, &se) || se.Hint != "delete with ?force=true to cancel the provision" {
		t.Fatalf("delete without force while provisioning = %v, want a StateError with the hint", err)
	}
}
