package engine

import (
	"context"
	"errors"
	"os"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"vmhost/chclient"
	"vmhost/qcow2"
	"vmhost/qmp"
	"vmhost/vm/record"
)

// hostVolumes is what the running VM's CH presents (its data disks' ids,
// in order) and what its storage daemon exports (data exports' ids).
func hostVolumes(t *testing.T, s *testService, id string) (ch, qsd []string) {
	t.Helper()
	ctx := context.Background()
	rec := s.recs.Get(id)
	c, err := s.client(rec)
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
	q, err := s.heldQSD(rec)
	if err != nil {
		t.Fatal(err)
	}
	exports, err := q.DataExports(ctx)
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

// firstClass makes the image of first-class volume id, as package volume
// does.
func firstClass(t *testing.T, s *testService, id string) {
	t.Helper()
	if err := os.MkdirAll(s.lay.VolumesDir(), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := qcow2.Create(s.lay.Volume(id), 1<<30); err != nil {
		t.Fatal(err)
	}
}

// TestEngineHotPlugVolumes: on a running VM an attach exports the image
// from the storage daemon and adds the disk to CH under the volume's
// per-VM id, a detach removes both once CH reports the guest released it,
// and the record agrees with CH and the daemon after each step; a VM's
// delete leaves the first-class volume it had attached.
func TestEngineHotPlugVolumes(t *testing.T) {
	s := simService(t, nil)
	ctx := context.Background()
	sp := baseSpec(t, s.root, "hot") // with VM-owned data0
	sp.AutoBoot = true
	s.mustCreate(t, sp)
	firstClass(t, s, "shared")
	check := func(step string, want []string) {
		t.Helper()
		ch, qsd := hostVolumes(t, s, "hot")
		sorted := slices.Sorted(slices.Values(want))
		if got := volumeIDs(s.recs.Get("hot")); !slices.Equal(got, want) || !slices.Equal(ch, want) || !slices.Equal(qsd, sorted) {
			t.Fatalf("%s: record %v, CH %v, QSD exports %v; want %v", step, got, ch, qsd, want)
		}
	}
	check("booted", []string{"data0"})

	rec, err := s.hotAttach(ctx, "hot", record.VolumeSpec{ID: "data1", VolumeID: "shared", SizeGiB: 1, Readonly: true})
	if err != nil {
		t.Fatal(err)
	}
	if v := rec.Spec.Volumes[1]; v.VolumeID != "shared" || !v.Readonly || record.VolumeDevice(rec, 1) != "/dev/vdc" {
		t.Fatalf("attached volume %+v as %s", v, record.VolumeDevice(rec, 1))
	}
	if err := qcow2.Create(s.lay.DataVolume("hot", "data2"), 2<<30); err != nil {
		t.Fatal(err)
	}
	if _, err := s.hotAttach(ctx, "hot", record.VolumeSpec{ID: "data2", SizeGiB: 2}); err != nil {
		t.Fatal(err)
	}
	check("two attached", []string{"data0", "data1", "data2"})

	// Detach the first-class volume by its volume id: the later one moves
	// up a letter.
	rec, err = s.hotDetach(ctx, "hot", "shared")
	if err != nil {
		t.Fatal(err)
	}
	check("shared detached", []string{"data0", "data2"})
	if d := record.VolumeDevice(rec, 1); d != "/dev/vdc" {
		t.Errorf("data2 is %s after detaching the volume before it, want /dev/vdc", d)
	}
	if _, err := s.hotDetach(ctx, "hot", "data0"); err != nil {
		t.Fatal(err)
	}
	check("data0 detached", []string{"data2"})

	// Deleting the VM keeps the first-class volume it had attached.
	if _, err := s.hotAttach(ctx, "hot", record.VolumeSpec{ID: "data0", VolumeID: "shared", SizeGiB: 1}); err != nil {
		t.Fatal(err)
	}
	if err := s.remove(ctx, "hot"); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(s.lay.Volume("shared")); err != nil {
		t.Errorf("the deleted VM's first-class volume is gone: %v", err)
	}
}

// TestEngineHotPlugFailureRollsBack: a failure half way leaves the VM as
// it was. The storage daemon cannot open a missing image (STORAGE_ERROR,
// nothing exported); CH refuses a disk whose id it already has (CH_ERROR,
// the export is removed again).
func TestEngineHotPlugFailureRollsBack(t *testing.T) {
	s := simService(t, nil)
	ctx := context.Background()
	sp := baseSpec(t, s.root, "rb")
	sp.AutoBoot = true
	s.mustCreate(t, sp)
	firstClass(t, s, "ok")
	_, err := s.hotAttach(ctx, "rb", record.VolumeSpec{ID: "data1", VolumeID: "gone", SizeGiB: 1})
	var he *record.HostError
	if !errors.As(err, &he) || he.Kind != record.HostStorage {
		t.Fatalf("attach of a missing image = %v, want a storage error", err)
	}
	ch, qsd := hostVolumes(t, s, "rb")
	if rec := s.recs.Get("rb"); !slices.Equal(volumeIDs(rec), []string{"data0"}) || !slices.Equal(ch, []string{"data0"}) || !slices.Equal(qsd, []string{"data0"}) {
		t.Fatalf("after a failed export: record %v, CH %v, QSD %v", volumeIDs(rec), ch, qsd)
	}

	// CH already has a device data1 (added behind the agent's back).
	c, err := s.client(s.recs.Get("rb"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.AddDisk(ctx, &chclient.DiskConfig{ID: "data1", Path: s.root + "/base.qcow2", Readonly: true}); err != nil {
		t.Fatal(err)
	}
	_, err = s.hotAttach(ctx, "rb", record.VolumeSpec{ID: "data1", VolumeID: "ok", SizeGiB: 1})
	if !errors.As(err, &he) || he.Kind != record.HostHypervisor {
		t.Fatalf("attach CH refuses = %v, want a hypervisor error", err)
	}
	_, qsd = hostVolumes(t, s, "rb")
	if rec := s.recs.Get("rb"); !slices.Equal(volumeIDs(rec), []string{"data0"}) || !slices.Equal(qsd, []string{"data0"}) {
		t.Fatalf("after CH refused: record %v, QSD %v", volumeIDs(rec), qsd)
	}
}

// TestEngineColdAttachBoots: on a stopped VM an attach and a detach change
// only the record; the next boot's CH config and storage daemon present
// exactly the recorded volumes, in order.
func TestEngineColdAttachBoots(t *testing.T) {
	s := simService(t, nil)
	ctx := context.Background()
	s.mustCreate(t, baseSpec(t, s.root, "cold"))
	firstClass(t, s, "v1")
	if err := s.coldChange("cold", func(vs *[]record.VolumeSpec) {
		*vs = append((*vs)[1:], record.VolumeSpec{ID: "data1", VolumeID: "v1", SizeGiB: 1}) // data0 detached, v1 attached
	}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.act(ctx, "cold", "start"); err != nil {
		t.Fatal(err)
	}
	ch, qsd := hostVolumes(t, s, "cold")
	if !slices.Equal(ch, []string{"data1"}) || !slices.Equal(qsd, []string{"data1"}) {
		t.Fatalf("booted after a cold attach and detach: CH %v, QSD %v, want [data1]", ch, qsd)
	}
}

// TestEngineHotDetachRefused: a guest that ignores the eject (chsim's
// /sim/v1/eject refusal) makes HotDetach wait DetachTimeout and answer a
// *record.StateError saying so, leaving the VM as it was: the disk in CH's
// config, the export in the storage daemon, the volume in the record with
// its socket. A caller's detach rolls its pending mark back the same way.
// Once the guest ejects again, a retry detaches.
func TestEngineHotDetachRefused(t *testing.T) {
	old := DetachTimeout
	DetachTimeout = 300 * time.Millisecond
	t.Cleanup(func() { DetachTimeout = old })
	s := simService(t, nil)
	ctx := context.Background()
	sp := baseSpec(t, s.root, "stuck") // with VM-owned data0
	sp.AutoBoot = true
	s.mustCreate(t, sp)
	before := s.recs.Get("stuck")
	unchanged := func(step string) {
		t.Helper()
		ch, qsd := hostVolumes(t, s, "stuck")
		if !slices.Equal(ch, []string{"data0"}) || !slices.Equal(qsd, []string{"data0"}) {
			t.Errorf("%s: CH %v, QSD exports %v; want [data0] in both", step, ch, qsd)
		}
		rec := s.recs.Get("stuck")
		if !reflect.DeepEqual(rec.Spec.Volumes, before.Spec.Volumes) || !reflect.DeepEqual(rec.Runtime.QSD.DataSockets, before.Runtime.QSD.DataSockets) {
			t.Errorf("%s: record volumes %+v sockets %v; want %+v sockets %v", step,
				rec.Spec.Volumes, rec.Runtime.QSD.DataSockets, before.Spec.Volumes, before.Runtime.QSD.DataSockets)
		}
	}
	if len(before.Runtime.QSD.DataSockets) != 1 {
		t.Fatalf("the record lists data sockets %v, want data0's", before.Runtime.QSD.DataSockets)
	}

	simAction(t, s.lay.APISocket("stuck"), "eject", `{"refuse":true}`)
	start := time.Now()
	err := s.HotDetach(ctx, before, "data0")
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

	// Through a caller: its pending mark is rolled back.
	if _, err := s.hotDetach(ctx, "stuck", "data0"); !errors.As(err, &se) || se.Error() != want {
		t.Fatalf("detach with a guest that refuses the eject = %v, want %q", err, want)
	}
	unchanged("after the detach")

	simAction(t, s.lay.APISocket("stuck"), "eject", `{"refuse":false}`)
	rec, err := s.hotDetach(ctx, "stuck", "data0")
	if err != nil {
		t.Fatalf("retried detach: %v", err)
	}
	ch, qsd := hostVolumes(t, s, "stuck")
	if len(rec.Spec.Volumes) != 0 || len(ch) != 0 || len(qsd) != 0 || len(rec.Runtime.QSD.DataSockets) != 0 {
		t.Fatalf("after the retried detach: record %v sockets %v, CH %v, QSD %v; want none",
			volumeIDs(rec), rec.Runtime.QSD.DataSockets, ch, qsd)
	}
}

// TestEngineHotPlugResumes: HotAttach and HotDetach run again over what a
// run cut short left, as recovery runs them: an attach over a storage
// daemon holding the volume's file node alone (the first blockdev-add
// done, which made every later attach fail with "Duplicate nodes"), an
// attach over one already complete, a detach over one already complete;
// each ends with CH and the daemon agreeing, and no node of the volume
// left after the detach.
func TestEngineHotPlugResumes(t *testing.T) {
	s := simService(t, nil)
	ctx := context.Background()
	sp := baseSpec(t, s.root, "rs")
	sp.AutoBoot = true
	s.mustCreate(t, sp)
	firstClass(t, s, "v")
	rec := s.recs.Get("rs")
	q, err := s.heldQSD(rec)
	if err != nil {
		t.Fatal(err)
	}
	c, err := q.Client(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.BlockdevAdd(ctx, qmp.FileNode("data1-file", s.lay.Volume("v"))); err != nil {
		t.Fatal(err)
	}
	rec, err = s.recs.Update("rs", func(r *record.Record) {
		r.Spec.Volumes = append(r.Spec.Volumes, record.VolumeSpec{ID: "data1", VolumeID: "v", SizeGiB: 1, Pending: record.PendingAttach})
	})
	if err != nil {
		t.Fatal(err)
	}
	for i := range 2 {
		if err := s.HotAttach(ctx, rec, "data1"); err != nil {
			t.Fatalf("HotAttach #%d: %v", i+1, err)
		}
		if ch, qsd := hostVolumes(t, s, "rs"); !slices.Equal(ch, []string{"data0", "data1"}) || !slices.Equal(qsd, []string{"data0", "data1"}) {
			t.Fatalf("after HotAttach #%d: CH %v, QSD %v", i+1, ch, qsd)
		}
	}
	for i := range 2 {
		if err := s.HotDetach(ctx, rec, "data1"); err != nil {
			t.Fatalf("HotDetach #%d: %v", i+1, err)
		}
		if ch, qsd := hostVolumes(t, s, "rs"); !slices.Equal(ch, []string{"data0"}) || !slices.Equal(qsd, []string{"data0"}) {
			t.Fatalf("after HotDetach #%d: CH %v, QSD %v", i+1, ch, qsd)
		}
	}
	nodes, err := c.QueryNamedBlockNodes(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range nodes {
		if strings.HasPrefix(n.NodeName, "data1") {
			t.Errorf("node %s left after the detach", n.NodeName)
		}
	}
}

// TestDeviceBDF reads a device's PCI address where CH's vm.info puts it:
// on the "_virtio-pci-<id>" parent of a virtio device's node, or on the
// node itself.
func TestDeviceBDF(t *testing.T) {
	info := &chclient.VmInfo{DeviceTree: map[string]chclient.DeviceNode{
		"data1":              {ID: "data1", Parent: "_virtio-pci-data1"},
		"_virtio-pci-data1":  {ID: "_virtio-pci-data1", Children: []string{"data1"}, PciBdf: "0000:00:07.0"},
		"__pvpanic":          {ID: "__pvpanic", PciBdf: "0000:00:03.0"},
		"_virtio-pci-orphan": {ID: "_virtio-pci-orphan"},
	}}
	for id, want := range map[string]string{"data1": "0000:00:07.0", "__pvpanic": "0000:00:03.0", "gone": ""} {
		if got := deviceBDF(info, id); got != want {
			t.Errorf("deviceBDF(%s) = %q, want %q", id, got, want)
		}
	}
}
