package engine

import (
	"context"
	"errors"
	"os"
	"reflect"
	"slices"
	"testing"
	"time"

	"vmhost/chclient"
	"vmhost/vm"
	"vmhost/vm/record"
)

// hostVolumes is what the running VM's CH presents (its data disks' ids,
// in order) and what its storage daemon exports (data exports' ids).
func hostVolumes(t *testing.T, e *Engine, s *vm.Service, id string) (ch, qsd []string) {
	t.Helper()
	ctx := context.Background()
	rec := s.Records().Get(id)
	c, err := e.client(rec)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	info, err := c.VMInfo(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range info.Config.Disks {
		if d.ID != "" && d.ID[0] != '_' {
			ch = append(ch, d.ID)
		}
	}
	q, err := e.heldQSD(rec)
	if err != nil {
		t.Fatal(err)
	}
	exports, err := q.Client().QueryBlockExports(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, x := range exports {
		if x.ID != "root" && x.ID != "root-export" {
			qsd = append(qsd, x.ID)
		}
	}
	slices.Sort(qsd)
	return ch, qsd
}

func volumeIDs(rec *record.Record) (ids []string) {
	for _, v := range rec.Spec.Volumes {
		if v.Pending != "" {
			ids = append(ids, v.ID+"("+v.Pending+")")
			continue
		}
		ids = append(ids, v.ID)
	}
	return ids
}

// TestEngineHotPlugVolumes: on a running VM an attach exports the image
// from the storage daemon and adds the disk to CH under the volume's
// per-VM id, a detach removes both once CH reports the guest released it,
// the record agrees with CH and the daemon after each step, and detaching
// a VM-owned volume keeps its data as a first-class volume.
func TestEngineHotPlugVolumes(t *testing.T) {
	s, e, root := engineService(t, nil)
	ctx := context.Background()
	sp := baseSpec(t, root, "hot") // with VM-owned data0
	sp.AutoBoot = true
	if _, _, err := s.CreateVM(ctx, sp); err != nil {
		t.Fatal(err)
	}
	if _, err := s.CreateVolume(ctx, vm.VolumeRequest{VolumeID: "shared", SizeGiB: 1}); err != nil {
		t.Fatal(err)
	}
	check := func(step string, want []string) {
		t.Helper()
		rec, _ := s.Get(record.ModeVM, "hot")
		ch, qsd := hostVolumes(t, e, s, "hot")
		sorted := slices.Sorted(slices.Values(want))
		if got := volumeIDs(rec); !slices.Equal(got, want) || !slices.Equal(ch, want) || !slices.Equal(qsd, sorted) {
			t.Fatalf("%s: record %v, CH %v, QSD exports %v; want %v", step, got, ch, qsd, want)
		}
	}
	check("booted", []string{"data0"})

	rec, err := s.AttachVolume(ctx, record.ModeVM, "hot", vm.AttachRequest{VolumeID: "shared", Readonly: true})
	if err != nil {
		t.Fatal(err)
	}
	if v := rec.Spec.Volumes[1]; v.VolumeID != "shared" || !v.Readonly || vm.VolumeDevice(rec, 1) != "/dev/vdc" {
		t.Fatalf("attached volume %+v as %s", v, vm.VolumeDevice(rec, 1))
	}
	size := uint32(2)
	if _, err := s.AttachVolume(ctx, record.ModeVM, "hot", vm.AttachRequest{SizeGiB: &size}); err != nil {
		t.Fatal(err)
	}
	check("two attached", []string{"data0", "data1", "data2"})
	if info, err := s.GetVolume("shared"); err != nil || info.AttachedTo == nil || info.AttachedTo.VMID != "hot" || info.AttachedTo.Device != "/dev/vdc" {
		t.Fatalf("GetVolume(shared) = %+v %v", info, err)
	}

	// Detach the first-class volume by its volume id: the later one moves
	// up a letter.
	rec, err = s.DetachVolume(ctx, record.ModeVM, "hot", "shared")
	if err != nil {
		t.Fatal(err)
	}
	check("shared detached", []string{"data0", "data2"})
	if d := vm.VolumeDevice(rec, 1); d != "/dev/vdc" {
		t.Errorf("data2 is %s after detaching the volume before it, want /dev/vdc", d)
	}
	if info, err := s.GetVolume("shared"); err != nil || info.AttachedTo != nil {
		t.Fatalf("GetVolume(shared) after detach = %+v %v", info, err)
	}

	// Detach the VM-owned data0: kept as first-class volume hot-data0,
	// the same file (no copy), the old name gone.
	old, err := os.Stat(s.Layout().DataVolume("hot", "data0"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.DetachVolume(ctx, record.ModeVM, "hot", "data0"); err != nil {
		t.Fatal(err)
	}
	check("data0 detached", []string{"data2"})
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

	// Deleting the VM keeps the first-class volume it had attached.
	if _, err := s.AttachVolume(ctx, record.ModeVM, "hot", vm.AttachRequest{VolumeID: "shared"}); err != nil {
		t.Fatal(err)
	}
	if err := s.Delete(ctx, record.ModeVM, "hot", true); err != nil {
		t.Fatal(err)
	}
	if info, err := s.GetVolume("shared"); err != nil || info.AttachedTo != nil {
		t.Fatalf("GetVolume(shared) after the VM's delete = %+v %v", info, err)
	}
	if _, err := os.Stat(s.Volumes().Path("shared")); err != nil {
		t.Errorf("the deleted VM's first-class volume is gone: %v", err)
	}
}

// TestEngineHotPlugFailureRollsBack: a failure half way leaves the VM as
// it was. The storage daemon cannot open a missing image (STORAGE_ERROR,
// nothing exported, nothing recorded); CH refuses a disk whose id it
// already has (CH_ERROR, the export is removed again).
func TestEngineHotPlugFailureRollsBack(t *testing.T) {
	s, e, root := engineService(t, nil)
	ctx := context.Background()
	sp := baseSpec(t, root, "rb")
	sp.AutoBoot = true
	if _, _, err := s.CreateVM(ctx, sp); err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"gone", "ok"} {
		if _, err := s.CreateVolume(ctx, vm.VolumeRequest{VolumeID: id, SizeGiB: 1}); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Remove(s.Volumes().Path("gone")); err != nil {
		t.Fatal(err)
	}
	_, err := s.AttachVolume(ctx, record.ModeVM, "rb", vm.AttachRequest{VolumeID: "gone"})
	var he *record.HostError
	if !errors.As(err, &he) || he.Kind != record.HostStorage {
		t.Fatalf("attach of a missing image = %v, want a storage error", err)
	}
	ch, qsd := hostVolumes(t, e, s, "rb")
	if rec, _ := s.Get(record.ModeVM, "rb"); !slices.Equal(volumeIDs(rec), []string{"data0"}) || !slices.Equal(ch, []string{"data0"}) || !slices.Equal(qsd, []string{"data0"}) {
		t.Fatalf("after a failed export: record %v, CH %v, QSD %v", volumeIDs(rec), ch, qsd)
	}

	// CH already has a device data1 (added behind the agent's back).
	c, err := e.client(s.Records().Get("rb"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.AddDisk(ctx, &chclient.DiskConfig{ID: "data1", Path: root + "/base.qcow2", Readonly: true}); err != nil {
		t.Fatal(err)
	}
	_, err = s.AttachVolume(ctx, record.ModeVM, "rb", vm.AttachRequest{VolumeID: "ok"})
	if !errors.As(err, &he) || he.Kind != record.HostHypervisor {
		t.Fatalf("attach CH refuses = %v, want a hypervisor error", err)
	}
	_, qsd = hostVolumes(t, e, s, "rb")
	if rec, _ := s.Get(record.ModeVM, "rb"); !slices.Equal(volumeIDs(rec), []string{"data0"}) || !slices.Equal(qsd, []string{"data0"}) {
		t.Fatalf("after CH refused: record %v, QSD %v", volumeIDs(rec), qsd)
	}
	if info, _ := s.GetVolume("ok"); info == nil || info.AttachedTo != nil {
		t.Fatalf("volume ok after a failed attach: %+v", info)
	}
}

// TestEngineColdAttachBoots: on a stopped VM an attach and a detach change
// only the record; the next boot's CH config and storage daemon present
// exactly the recorded volumes, in order.
func TestEngineColdAttachBoots(t *testing.T) {
	s, e, root := engineService(t, nil)
	ctx := context.Background()
	sp := baseSpec(t, root, "cold")
	if _, _, err := s.CreateVM(ctx, sp); err != nil {
		t.Fatal(err)
	}
	if _, err := s.CreateVolume(ctx, vm.VolumeRequest{VolumeID: "v1", SizeGiB: 1}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.AttachVolume(ctx, record.ModeVM, "cold", vm.AttachRequest{VolumeID: "v1"}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.DetachVolume(ctx, record.ModeVM, "cold", "data0"); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Act(ctx, record.ModeVM, "cold", vm.ActionStart); err != nil {
		t.Fatal(err)
	}
	ch, qsd := hostVolumes(t, e, s, "cold")
	if !slices.Equal(ch, []string{"data1"}) || !slices.Equal(qsd, []string{"data1"}) {
		t.Fatalf("booted after a cold attach and detach: CH %v, QSD %v, want [data1]", ch, qsd)
	}
	if _, err := s.GetVolume("cold-data0"); err != nil {
		t.Fatalf("the detached owned volume was not kept: %v", err)
	}
}

// TestEngineHotDetachRefused: a guest that ignores the eject (chsim's
// /sim/v1/eject refusal) makes HotDetach wait DetachTimeout and answer a
// *record.StateError saying so, leaving the VM as it was: the disk in CH's
// config, the export in the storage daemon, the volume in the record with
// its socket. The service's detach rolls its pending mark back the same
// way. Once the guest ejects again, a retry detaches.
func TestEngineHotDetachRefused(t *testing.T) {
	old := DetachTimeout
	DetachTimeout = 300 * time.Millisecond
	t.Cleanup(func() { DetachTimeout = old })
	s, e, root := engineService(t, nil)
	ctx := context.Background()
	sp := baseSpec(t, root, "stuck") // with VM-owned data0
	sp.AutoBoot = true
	if _, _, err := s.CreateVM(ctx, sp); err != nil {
		t.Fatal(err)
	}
	before := s.Records().Get("stuck")
	unchanged := func(step string) {
		t.Helper()
		ch, qsd := hostVolumes(t, e, s, "stuck")
		if !slices.Equal(ch, []string{"data0"}) || !slices.Equal(qsd, []string{"data0"}) {
			t.Errorf("%s: CH %v, QSD exports %v; want [data0] in both", step, ch, qsd)
		}
		rec := s.Records().Get("stuck")
		if !reflect.DeepEqual(rec.Spec.Volumes, before.Spec.Volumes) || !reflect.DeepEqual(rec.Runtime.QSD.DataSockets, before.Runtime.QSD.DataSockets) {
			t.Errorf("%s: record volumes %+v sockets %v; want %+v sockets %v", step,
				rec.Spec.Volumes, rec.Runtime.QSD.DataSockets, before.Spec.Volumes, before.Runtime.QSD.DataSockets)
		}
	}
	if len(before.Runtime.QSD.DataSockets) != 1 {
		t.Fatalf("the record lists data sockets %v, want data0's", before.Runtime.QSD.DataSockets)
	}

	simAction(t, s.Layout().APISocket("stuck"), "eject", `{"refuse":true}`)
	start := time.Now()
	err := e.HotDetach(ctx, before, "data0")
	took := time.Since(start)
	var se *record.StateError
	want := `the guest of VM "stuck" did not release volume data0 within 300ms; it stays attached (retry the detach, or stop the VM and detach it then)`
	if !errors.As(err, &se) || se.Error() != want {
		t.Fatalf("HotDetach with a guest that refuses the eject = %v\nwant *record.StateError %q", err, want)
	}
	if took < DetachTimeout {
		t.Errorf("HotDetach gave up after %v, before DetachTimeout %v", took, DetachTimeout)
	}
	unchanged("after HotDetach")

	// Through the service: its pending mark is rolled back.
	if _, err := s.DetachVolume(ctx, record.ModeVM, "stuck", "data0"); !errors.As(err, &se) || se.Error() != want {
		t.Fatalf("DetachVolume with a guest that refuses the eject = %v, want %q", err, want)
	}
	unchanged("after DetachVolume")

	simAction(t, s.Layout().APISocket("stuck"), "eject", `{"refuse":false}`)
	rec, err := s.DetachVolume(ctx, record.ModeVM, "stuck", "data0")
	if err != nil {
		t.Fatalf("retried detach: %v", err)
	}
	ch, qsd := hostVolumes(t, e, s, "stuck")
	if len(rec.Spec.Volumes) != 0 || len(ch) != 0 || len(qsd) != 0 || len(rec.Runtime.QSD.DataSockets) != 0 {
		t.Fatalf("after the retried detach: record %v sockets %v, CH %v, QSD %v; want none",
			volumeIDs(rec), rec.Runtime.QSD.DataSockets, ch, qsd)
	}
	if _, err := s.GetVolume("stuck-data0"); err != nil {
		t.Errorf("the detached volume was not kept: %v", err)
	}
}
