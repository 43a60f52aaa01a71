package engine

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"vmhost/disk"
	"vmhost/qcow2"
	"vmhost/qmp"
	"vmhost/vm/record"
)

// sealedBuild makes a sealed build of size bytes at path, as an AppVM
// image import leaves one, and removes it at the end of the test.
func sealedBuild(t *testing.T, path string, size uint64) {
	t.Helper()
	if err := qcow2.Create(path, size); err != nil {
		t.Fatal(err)
	}
	if _, err := disk.SealBuild(path); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { disk.RemoveAll(path) })
}

// overlaySpec is baseSpec with a root disk that is an overlay of build.
func overlaySpec(t *testing.T, root, id, build string) *record.Spec {
	sp := baseSpec(t, root, id)
	sp.Disk.Mode, sp.Disk.BasePath = record.DiskOverlay, build
	return sp
}

// TestEngineOverlayRootDisk: a root disk of kind overlay is a qcow2 overlay
// of the build at disk.size_gib, whatever the build's size (nothing of the
// build is copied); the storage daemon opens the chain (the build as the
// read-only backing node of the root's qcow2 node, under the throttle
// node with the root's limits) and the VM boots on it. The build stays
// sealed.
func TestEngineOverlayRootDisk(t *testing.T) {
	s := simService(t, nil)
	build := filepath.Join(s.root, "rootfs-sha256-1.qcow2")
	sealedBuild(t, build, 1<<30)
	sp := overlaySpec(t, s.root, "ovl", build)
	sp.DiskBpsTotal = 50 << 20
	sp.AutoBoot = true
	rec := s.mustCreate(t, sp)
	defer s.remove(context.Background(), "ovl")
	if rec.State != record.StateRunning || rec.RootBacking() != build {
		t.Fatalf("record after the create: %s (backing %q)", describe(rec), rec.RootBacking())
	}
	root := s.lay.RootDisk("ovl")
	h, err := qcow2.ReadHeaderFile(root)
	if err != nil {
		t.Fatal(err)
	}
	if err := h.CheckOverlay(build); err != nil {
		t.Errorf("root disk: %v", err)
	}
	if h.Size != 2<<30 {
		t.Errorf("root disk's virtual size = %d, want disk.size_gib 2 GiB", h.Size)
	}
	if st, err := os.Stat(root); err != nil || st.Size() > 1<<20 {
		t.Errorf("root disk holds %d bytes: more than an empty overlay (%v)", st.Size(), err)
	}
	// The storage daemon's command line: the chain, in order.
	args := string(cmdline(t, rec.Runtime.QSD.Pid))
	for _, want := range []string{`"node-name":"root-base-file","read-only":true`, `"filename":"` + build + `"`,
		`"backing":"root-base"`, `"bps-total":52428800`} {
		if !strings.Contains(args, want) {
			t.Errorf("qemu-storage-daemon's command line lacks %s:\n%s", want, args)
		}
	}
	if st, err := os.Stat(build); err != nil || st.Mode().Perm() != 0o444 {
		t.Errorf("the build after the boot: %v %v, want it sealed (0444)", st.Mode(), err)
	}
}

// cmdline is the NUL-separated command line of pid, with spaces.
func cmdline(t *testing.T, pid int) []byte {
	t.Helper()
	b, err := os.ReadFile("/proc/" + itoa(pid) + "/cmdline")
	if err != nil {
		t.Fatal(err)
	}
	for i := range b {
		if b[i] == 0 {
			b[i] = ' '
		}
	}
	return b
}

func itoa(n int) string {
	var b [20]byte
	i := len(b)
	for {
		i--
		b[i] = byte('0' + n%10)
		if n /= 10; n == 0 {
			return string(b[i:])
		}
	}
}

// TestEngineOverlayBuildGone: an overlay whose build is gone cannot boot
// (the error names the build) and, found at an agent start, is failed
// like a VM whose root disk is gone (disk_missing, detail.path the
// build); a copy does not depend on its base.
func TestEngineOverlayBuildGone(t *testing.T) {
	s := simService(t, nil)
	ctx := context.Background()
	build := filepath.Join(s.root, "rootfs-sha256-2.qcow2")
	sealedBuild(t, build, 1<<30)
	s.mustCreate(t, overlaySpec(t, s.root, "ovl", build))
	copySpec := baseSpec(t, s.root, "cp")
	copyBase := filepath.Join(s.root, "copy-base.qcow2")
	if err := qcow2.Create(copyBase, 1<<30); err != nil {
		t.Fatal(err)
	}
	copySpec.Disk.BasePath = copyBase
	s.mustCreate(t, copySpec)
	if _, err := s.act(ctx, "ovl", "start"); err != nil {
		t.Fatal(err)
	}
	if _, err := s.act(ctx, "ovl", "stop"); err != nil {
		t.Fatal(err)
	}
	if err := disk.RemoveAll(build); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(copyBase); err != nil {
		t.Fatal(err)
	}
	_, err := s.act(ctx, "ovl", "start")
	var he *record.HostError
	if !errors.As(err, &he) || he.Kind != record.HostStorage || !errors.Is(err, errBuildGone) || !strings.Contains(err.Error(), build) {
		t.Errorf("booting an overlay whose build is gone = %v, want a storage error naming %s", err, build)
	}
	s = s.restart(t)
	r := s.recs.Get("ovl")
	if f := r.FailureReason; r.State != record.StateFailed || f == nil || f.Detail.Kind != record.KindDiskMissing ||
		f.Detail.Path != build || f.Cause != record.CauseDiskMissing || !strings.Contains(f.Summary, "overlay") {
		t.Errorf("overlay whose build is gone, after a restart: %s", describe(r))
	}
	if got := s.Recovery().NoDisk; len(got) != 1 || got[0] != "ovl" {
		t.Errorf("Recovery().NoDisk = %q, want [ovl]", got)
	}
	if r := s.recs.Get("cp"); r.State != record.StateCreated {
		t.Errorf("a copy whose base is gone: %s, want it untouched", describe(r))
	}
	if _, err := s.act(ctx, "cp", "start"); err != nil {
		t.Errorf("booting a copy whose base is gone: %v", err)
	}
	for _, id := range []string{"ovl", "cp"} {
		if err := s.remove(ctx, id); err != nil {
			t.Error(err)
		}
	}
}

// TestEngineStageRootDiskOverlay: a redeploy's staged root disk is of the
// kind the root disk is: an overlay of the new build, grown to the new
// build's size when that exceeds disk.size_gib; a copy stays a copy.
func TestEngineStageRootDiskOverlay(t *testing.T) {
	s := simService(t, nil)
	ctx := context.Background()
	old, next := filepath.Join(s.root, "rootfs-old.qcow2"), filepath.Join(s.root, "rootfs-new.qcow2")
	sealedBuild(t, old, 1<<30)
	sealedBuild(t, next, 3<<30) // above disk.size_gib
	rec := s.mustCreate(t, overlaySpec(t, s.root, "ovl", old))
	defer s.remove(ctx, "ovl")
	if err := s.StageRootDisk(ctx, rec, next); err != nil {
		t.Fatal(err)
	}
	h, err := qcow2.ReadHeaderFile(s.lay.RootDiskNext("ovl"))
	if err != nil {
		t.Fatal(err)
	}
	if err := h.CheckOverlay(next); err != nil || h.Size != 3<<30 {
		t.Errorf("staged root disk: %v, size %d; want an overlay of the new build of its 3 GiB", err, h.Size)
	}
	// Staged again (a redeploy retried): the leftover is replaced.
	if err := s.StageRootDisk(ctx, rec, next); err != nil {
		t.Fatal(err)
	}
	if err := s.SwapRootDisk(ctx, rec); err != nil {
		t.Fatal(err)
	}
	if h, err := qcow2.ReadHeaderFile(s.lay.RootDisk("ovl")); err != nil || h.CheckOverlay(next) != nil {
		t.Errorf("root disk after the swap: %v", err)
	}

	cp := s.mustCreate(t, baseSpec(t, s.root, "cp"))
	defer s.remove(ctx, "cp")
	if err := s.StageRootDisk(ctx, cp, next); err != nil {
		t.Fatal(err)
	}
	if h, err := qcow2.ReadHeaderFile(s.lay.RootDiskNext("cp")); err != nil || h.BackingFileOffset != 0 || h.Size != 3<<30 {
		t.Errorf("staged root disk of a copy: %+v, %v; want a copy of the new build", h, err)
	}
}

// TestQSDConfigOverlay: the storage daemon's root disk of an overlay names
// the build as its backing file and keeps the root's limits and size; a
// copy's names none.
func TestQSDConfigOverlay(t *testing.T) {
	s := newTestService(t)
	build := filepath.Join(s.root, "rootfs-sha256-3.qcow2")
	sp := overlaySpec(t, s.root, "ovl", build)
	sp.DiskIopsTotal = 100
	rec := newRecord(sp)
	got := s.qsdConfig(rec).Root
	want := qmp.RootDisk{Path: s.lay.RootDisk("ovl"), Backing: build, Socket: s.lay.RootSocket("ovl"), Size: 2 << 30,
		Limits: qmp.ThrottleLimits{IopsTotal: 100}}
	if got != want {
		t.Errorf("overlay root disk = %+v, want %+v", got, want)
	}
	rec = newRecord(baseSpec(t, s.root, "cp"))
	if got := s.qsdConfig(rec).Root; got.Backing != "" {
		t.Errorf("copy root disk has backing %q", got.Backing)
	}
}

// TestUnwatchedEvent: replaying CH's event stream decodes boots,
// activations, device removals and guest panics, in CH's pretty-printed
// form, and passes over the rest.
func TestUnwatchedEvent(t *testing.T) {
	ev := func(source, event, props string) []byte {
		return []byte("{\n  \"timestamp\": {\n    \"secs\": 0,\n    \"nanos\": 5\n  },\n  \"source\": \"" + source +
			"\",\n  \"event\": \"" + event + "\",\n  \"properties\": " + props + "\n}")
	}
	for _, tc := range []struct {
		raw  []byte
		skip bool
	}{
		{ev("virtio-device", "activated", "{\n    \"id\": \"_disk0\"\n  }"), false},
		{ev("virtio-device", "activated", "{\n    \"id\": \"_net1\"\n  }"), false},
		{ev("vm", "device-removed", "{\n    \"id\": \"data1\"\n  }"), false},
		{ev("guest", "panic", "{\n    \"event\": \"panic\"\n  }"), false},
		{ev("vm", "booting", "null"), false},
		{ev("vm", "rebooting", "null"), false},
		{ev("vm", "booted", "null"), true},
		{ev("vmm", "starting", "null"), true},
		{ev("vm", "shutdown", "null"), true},
	} {
		if got := unwatchedEvent(tc.raw); got != tc.skip {
			t.Errorf("unwatchedEvent(%s) = %v, want %v", tc.raw, got, tc.skip)
		}
	}
}

// qemuIO runs qemu-io's cmd on the qcow2 image at path (its backing chain
// read-only, as QEMU opens one) and returns what it printed; read-only
// (-r -U) when write is false.
func qemuIO(t *testing.T, path, cmd string, write bool) string {
	t.Helper()
	if _, err := exec.LookPath("qemu-io"); err != nil {
		t.Skip("qemu-io is not installed (apt-get install qemu-utils)")
	}
	args := []string{"-f", "qcow2", "-c", cmd, path}
	if !write {
		args = append([]string{"-r", "-U"}, args...)
	}
	out, err := exec.Command("qemu-io", args...).CombinedOutput()
	if err != nil || strings.Contains(string(out), "failed") {
		t.Fatalf("qemu-io %q %s: %v\n%s", cmd, path, err, out)
	}
	return string(out)
}

// TestEngineFromSnapshotOfOverlay: a VM made from a snapshot of a VM whose
// root disk is an overlay of a build (as appvm records an AppVM
// from_snapshot: disk mode overlay, the build its base) gets a copy of the
// snapshot's root disk that is an overlay of the same build, and the
// storage daemon serves it as that chain: the guest reads what the source
// wrote and, where it wrote nothing, the build (a copy opened with
// "backing": null would read zeros there).
func TestEngineFromSnapshotOfOverlay(t *testing.T) {
	s := simService(t, nil)
	ctx := context.Background()
	build := filepath.Join(s.root, "rootfs-sha256-1.qcow2")
	if err := qcow2.Create(build, 1<<30); err != nil {
		t.Fatal(err)
	}
	qemuIO(t, build, "write -P 0x5a 0 64k", true) // the build's own data
	if _, err := disk.SealBuild(build); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { disk.RemoveAll(build) })
	s.mustCreate(t, overlaySpec(t, s.root, "src", build))
	defer s.remove(ctx, "src")
	qemuIO(t, s.lay.RootDisk("src"), "write -P 0xa7 1M 64k", true) // what the source wrote
	sn := s.takeSnapshot(t, "src", "s1", false)
	if sn.Disks[0].ID != record.RootDiskID || sn.Disks[0].Backing != build {
		t.Fatalf("the snapshot's root disk: %+v; want a copy backing onto %s", sn.Disks[0], build)
	}

	sp := overlaySpec(t, s.root, "c", build)
	sp.FromSnapshot, sp.AutoBoot = "s1", true
	rec := s.mustCreate(t, sp)
	defer s.remove(ctx, "c")
	if rec.State != record.StateRunning || rec.RootBacking() != build {
		t.Fatalf("the VM from the snapshot: %s (backing %q)", describe(rec), rec.RootBacking())
	}
	root := s.lay.RootDisk("c")
	h, err := qcow2.ReadHeaderFile(root)
	if err == nil {
		err = h.CheckOverlay(build)
	}
	if err != nil {
		t.Errorf("its root disk: %v", err)
	}
	qemuIO(t, root, "read -P 0xa7 1M 64k", false)
	qemuIO(t, root, "read -P 0x5a 0 64k", false)
	args := string(cmdline(t, rec.Runtime.QSD.Pid))
	for _, want := range []string{`"filename":"` + build + `"`, `"backing":"root-base"`} {
		if !strings.Contains(args, want) {
			t.Errorf("qemu-storage-daemon's command line lacks %s:\n%s", want, args)
		}
	}
}
