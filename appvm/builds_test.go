package appvm_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"vmhost/appvm"
	"vmhost/config"
	"vmhost/vm"
)

// buildFiles lists the build files of image id.
func buildFiles(t *testing.T, cat appvm.Catalog, id string) []string {
	t.Helper()
	var out []string
	for _, n := range dirNames(t, filepath.Join(cat.Dir, id)) {
		if strings.HasPrefix(n, "rootfs") {
			out = append(out, n)
		}
	}
	return out
}

// TestBuildsKeptWhileUsed follows the builds of one image through
// re-imports, creates, a redeploy and deletes: an AppVM's root disk is an
// overlay of the build it was made from, which stays (sealed) while any
// AppVM uses it, beside the current build; a build nothing uses goes
// after the next import's commit or the change that dropped its last
// user; an image whose AppVMs exist cannot be deleted (409 naming them).
func TestBuildsKeptWhileUsed(t *testing.T) {
	e, vms, apps := newEnv(t)
	ctx := context.Background()
	cat := apps.Catalog()
	im, err := apps.NewImporter(importOptions(t))
	if err != nil {
		t.Fatal(err)
	}
	defer im.Close()
	apps.WaitSweeps()
	b1 := cat.RootFS(must(cat.Get("web")))
	if st, err := os.Stat(b1); err != nil || st.Mode().Perm() != 0o444 {
		t.Fatalf("a build imported before builds were sealed, after the agent's start: %v %v, want 0444", st.Mode(), err)
	}
	create := func(id string) *vm.Record {
		t.Helper()
		req := baseReq()
		req.VMID, req.AutoBoot = id, ptr(false)
		if _, err := apps.Create(ctx, &req); err != nil {
			t.Fatal(err)
		}
		return must(vms.Get(vm.ModeAppVM, id))
	}
	a1 := create("a1")
	if a1.RootBacking() != b1 || a1.Spec.Disk.Mode != "overlay" || a1.Base.Path != b1 {
		t.Fatalf("a1's root disk: mode %q, backing %q; want an overlay of %s", a1.Spec.Disk.Mode, a1.RootBacking(), b1)
	}
	reimport := func(version string) string {
		t.Helper()
		src := filepath.Join(t.TempDir(), version)
		testImage(t, version).WriteDir(t, src)
		img, err := im.Import(ctx, &appvm.ImportRequest{ID: "web", Path: src})
		if err != nil {
			t.Fatal(err)
		}
		apps.WaitSweeps()
		return cat.RootFS(img)
	}
	b2 := reimport("v2")
	if got, want := buildFiles(t, cat, "web"), sortedBase(b1, b2); !slices.Equal(got, want) {
		t.Errorf("after a re-import: builds %q, want %q (a1 uses the first)", got, want)
	}
	b3 := reimport("v3")
	if got, want := buildFiles(t, cat, "web"), sortedBase(b1, b3); !slices.Equal(got, want) {
		t.Errorf("after a second re-import: builds %q, want %q (the second unused)", got, want)
	}
	a2 := create("a2")
	if a2.RootBacking() != b3 {
		t.Errorf("a2's root disk is an overlay of %q, want the current build %s", a2.RootBacking(), b3)
	}

	// A redeploy moves a1 to the current build; the first is then unused.
	if _, err := apps.Redeploy(ctx, "a1"); err != nil {
		t.Fatal(err)
	}
	apps.Wait()
	apps.WaitSweeps()
	a1 = must(vms.Get(vm.ModeAppVM, "a1"))
	if a1.RootBacking() != b3 || a1.Spec.Disk.BasePath != b3 || a1.AppVM.Image.BuildDigest != must(cat.Get("web")).BuildDigest || a1.AppVM.RedeployError != "" {
		t.Errorf("a1 after its redeploy: backing %q, disk.base_path %q, error %q; want the current build %s",
			a1.RootBacking(), a1.Spec.Disk.BasePath, a1.AppVM.RedeployError, b3)
	}
	if !strings.Contains(e.Host.Transcript(), "stage-root a1\nswap-root a1") {
		t.Errorf("host calls of the redeploy:\n%s", e.Host.Transcript())
	}
	if got, want := buildFiles(t, cat, "web"), sortedBase(b3); !slices.Equal(got, want) {
		t.Errorf("after the redeploy: builds %q, want %q", got, want)
	}

	var ce *appvm.ConflictError
	if err := apps.DeleteImage(im, "web"); !errors.As(err, &ce) || !strings.Contains(err.Error(), "a1, a2") {
		t.Errorf("deleting an image AppVMs use = %v, want a conflict naming a1, a2", err)
	}
	for _, id := range []string{"a1", "a2"} {
		if err := vms.Delete(ctx, vm.ModeAppVM, id, true); err != nil {
			t.Fatal(err)
		}
	}
	apps.WaitSweeps()
	if got, want := buildFiles(t, cat, "web"), sortedBase(b3); !slices.Equal(got, want) {
		t.Errorf("with no AppVM left: builds %q, want the current one %q", got, want)
	}
	if err := apps.DeleteImage(im, "web"); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(cat.Dir, "web")); !os.IsNotExist(err) {
		t.Errorf("the image directory (a sealed build in it) is still there: %v", err)
	}
}

func sortedBase(paths ...string) []string {
	var out []string
	for _, p := range paths {
		out = append(out, filepath.Base(p))
	}
	slices.Sort(out)
	return out
}

// TestCopyRootDisks: with appvm_root_disk "copy" an AppVM's root disk is a
// copy of the build (disk.mode copy, no backing file); the build it was
// made from is not kept for it once the copy is made.
func TestCopyRootDisks(t *testing.T) {
	e, vms, apps := newEnv(t)
	e.Config.AppVMRootDisk = config.AppVMRootCopy
	req := baseReq()
	req.VMID = "c1"
	if _, err := apps.Create(context.Background(), &req); err != nil {
		t.Fatal(err)
	}
	rec := must(vms.Get(vm.ModeAppVM, "c1"))
	if rec.Spec.Disk.Mode != "copy" || rec.RootBacking() != "" {
		t.Errorf("root disk with appvm_root_disk copy: mode %q, backing %q", rec.Spec.Disk.Mode, rec.RootBacking())
	}
	if v := vms.View(rec, vm.ViewOptions{}); v.Disk == nil || v.Disk.Mode != "copy" {
		t.Errorf("view's disk: %+v; want mode copy", v.Disk)
	}
}

// TestBuildsKeptBySnapshots: a snapshot of an overlay AppVM holds a copy
// of its root disk that backs onto the build, so the build stays while the
// snapshot does, after its AppVM's delete and a re-import; the image
// cannot be deleted meanwhile (409 naming the snapshot). An AppVM made
// from the snapshot is an overlay of that build (disk mode overlay,
// RootBacking the build) and keeps it after the snapshot's delete; with
// neither left the build goes, and the image can be deleted.
func TestBuildsKeptBySnapshots(t *testing.T) {
	_, vms, apps := newEnv(t)
	ctx := context.Background()
	cat := apps.Catalog()
	im, err := apps.NewImporter(importOptions(t))
	if err != nil {
		t.Fatal(err)
	}
	defer im.Close()
	apps.WaitSweeps()
	b1 := cat.RootFS(must(cat.Get("web")))
	req := baseReq()
	req.VMID, req.AutoBoot = "a1", ptr(false)
	if _, err := apps.Create(ctx, &req); err != nil {
		t.Fatal(err)
	}
	if _, err := vms.CreateSnapshot(ctx, vm.ModeAppVM, "a1", vm.SnapshotRequest{SnapshotID: "s1"}); err != nil {
		t.Fatal(err)
	}
	if sn := must(vms.Snapshots().Get("s1")); sn.Disks[0].Backing != b1 {
		t.Fatalf("the snapshot's root disk backs onto %q, want %s", sn.Disks[0].Backing, b1)
	}
	src := filepath.Join(t.TempDir(), "v2")
	testImage(t, "v2").WriteDir(t, src)
	img, err := im.Import(ctx, &appvm.ImportRequest{ID: "web", Path: src})
	if err != nil {
		t.Fatal(err)
	}
	b2 := cat.RootFS(img)
	if err := vms.Delete(ctx, vm.ModeAppVM, "a1", true); err != nil {
		t.Fatal(err)
	}
	apps.WaitSweeps()
	if got, want := buildFiles(t, cat, "web"), sortedBase(b1, b2); !slices.Equal(got, want) {
		t.Errorf("with a1 deleted and its snapshot kept: builds %q, want %q", got, want)
	}
	var ce *appvm.ConflictError
	if err := apps.DeleteImage(im, "web"); !errors.As(err, &ce) || !strings.Contains(err.Error(), "used by snapshots s1;") {
		t.Errorf("deleting an image a snapshot uses = %v, want a conflict naming snapshot s1", err)
	}

	// An AppVM from the snapshot is an overlay of its build.
	req = appvm.CreateRequest{VMID: "a2", FromSnapshot: "s1", Vcpus: 1, MemoryMB: 256, DiskGiB: 2, AutoBoot: ptr(false)}
	if _, err := apps.Create(ctx, &req); err != nil {
		t.Fatal(err)
	}
	a2 := must(vms.Get(vm.ModeAppVM, "a2"))
	if a2.Spec.Disk.Mode != "overlay" || a2.RootBacking() != b1 || a2.Base.Path != b1 || a2.Spec.FromSnapshot != "s1" {
		t.Fatalf("a2 from the snapshot: mode %q, backing %q, base %+v; want an overlay of %s", a2.Spec.Disk.Mode, a2.RootBacking(), a2.Base, b1)
	}
	if v := vms.View(a2, vm.ViewOptions{}); v.Disk == nil || v.Disk.Mode != "overlay" || v.Disk.BasePath != b1 {
		t.Errorf("a2's view's disk: %+v; want an overlay of %s", v.Disk, b1)
	}
	if err := apps.DeleteImage(im, "web"); !errors.As(err, &ce) || !strings.Contains(err.Error(), "used by AppVMs a2 and snapshots s1;") {
		t.Errorf("deleting an image an AppVM and a snapshot use = %v, want a conflict naming both", err)
	}
	if err := vms.DeleteSnapshot("s1"); err != nil {
		t.Fatal(err)
	}
	apps.WaitSweeps()
	if got, want := buildFiles(t, cat, "web"), sortedBase(b1, b2); !slices.Equal(got, want) {
		t.Errorf("with the snapshot deleted and a2 from it kept: builds %q, want %q", got, want)
	}
	if err := vms.Delete(ctx, vm.ModeAppVM, "a2", true); err != nil {
		t.Fatal(err)
	}
	apps.WaitSweeps()
	if got, want := buildFiles(t, cat, "web"), sortedBase(b2); !slices.Equal(got, want) {
		t.Errorf("with neither left: builds %q, want %q", got, want)
	}
	if err := apps.DeleteImage(im, "web"); err != nil {
		t.Fatalf("deleting the image nothing uses: %v", err)
	}
}

// TestSnapshotDeleteSweepsItsBuild: the delete of the last user of an
// old build being a snapshot's, the build goes with it (no other change
// of a record asks for the sweep).
func TestSnapshotDeleteSweepsItsBuild(t *testing.T) {
	_, vms, apps := newEnv(t)
	ctx := context.Background()
	cat := apps.Catalog()
	im, err := apps.NewImporter(importOptions(t))
	if err != nil {
		t.Fatal(err)
	}
	defer im.Close()
	apps.WaitSweeps()
	b1 := cat.RootFS(must(cat.Get("web")))
	req := baseReq()
	req.VMID, req.AutoBoot = "a1", ptr(false)
	if _, err := apps.Create(ctx, &req); err != nil {
		t.Fatal(err)
	}
	if _, err := vms.CreateSnapshot(ctx, vm.ModeAppVM, "a1", vm.SnapshotRequest{SnapshotID: "s1"}); err != nil {
		t.Fatal(err)
	}
	if err := vms.Delete(ctx, vm.ModeAppVM, "a1", true); err != nil {
		t.Fatal(err)
	}
	apps.WaitSweeps() // a sweep holds the image's lock: an import would be 409
	src := filepath.Join(t.TempDir(), "v2")
	testImage(t, "v2").WriteDir(t, src)
	img, err := im.Import(ctx, &appvm.ImportRequest{ID: "web", Path: src})
	if err != nil {
		t.Fatal(err)
	}
	apps.WaitSweeps()
	if got, want := buildFiles(t, cat, "web"), sortedBase(b1, cat.RootFS(img)); !slices.Equal(got, want) {
		t.Fatalf("after a re-import, the snapshot kept: builds %q, want %q", got, want)
	}
	if err := vms.DeleteSnapshot("s1"); err != nil {
		t.Fatal(err)
	}
	apps.WaitSweeps()
	if got, want := buildFiles(t, cat, "web"), sortedBase(cat.RootFS(img)); !slices.Equal(got, want) {
		t.Errorf("after the snapshot's delete: builds %q, want %q", got, want)
	}
}
