package engine

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"vmhost/internal/atomicfile"
	"vmhost/internal/sbin"
	"vmhost/qcow2"
	"vmhost/vm/record"
)

// ext4Image writes the tree files (path → content; a path ending in / is
// a directory of mode 0555) as an ext4 file system in the qcow2 image dst,
// as an AppVM image's build is made.
func ext4Image(t *testing.T, dst string, files map[string]string) {
	t.Helper()
	mkfs := sbin.Path("mkfs.ext4")
	if !filepath.IsAbs(mkfs) {
		t.Skip("mkfs.ext4 (e2fsprogs) not installed")
	}
	tree := t.TempDir()
	for p, content := range files {
		full := filepath.Join(tree, p)
		if p[len(p)-1] == '/' {
			if err := os.MkdirAll(full, 0o755); err != nil {
				t.Fatal(err)
			}
			continue
		}
		if err := os.MkdirAll(filepath.Dir(full), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(full, []byte(content), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	for p := range files {
		if p[len(p)-1] == '/' {
			os.Chmod(filepath.Join(tree, p), 0o555)
		}
	}
	raw := filepath.Join(t.TempDir(), "fs.raw")
	if out, err := exec.Command(mkfs, "-q", "-F", "-t", "ext4", "-d", tree, "-E", "root_owner=0:0", raw, "32M").CombinedOutput(); err != nil {
		t.Fatalf("mkfs.ext4: %v: %s", err, out)
	}
	f, err := os.Open(raw)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	os.Remove(dst)
	if err := qcow2.ConvertRaw(dst, f); err != nil {
		t.Fatal(err)
	}
}

// TestEngineSimGuestRoot: with SimGuestRoot (serve --dev), an AppVM's boot
// unpacks its root disk where the simulator runs the workload; the tree is
// kept across boots, with what was written in it, until the root disk is
// another file (a redeploy's), whose tree replaces it; what an interrupted
// unpack left is replaced at the next boot; a delete removes it all.
func TestEngineSimGuestRoot(t *testing.T) {
	for _, tool := range []string{"qemu-img", "debugfs"} {
		if !filepath.IsAbs(sbin.Path(tool)) {
			t.Skipf("%s not installed", tool)
		}
	}
	g := &recordingGuest{}
	s := newTestServiceWith(t, testOpts{sims: true, guest: g, edit: func(o *Options) {
		o.CH.PreArgs = []string{"--sim-no-guest-agent"}
		o.SimGuestRoot = func(vsock string) string { return vsock + ".root" }
	}})
	g.initrd = filepath.Join(s.root, "agent.cpio")
	if err := os.WriteFile(g.initrd, []byte("cpio"), 0o600); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	sp := baseSpec(t, s.root, "app")
	sp.Volumes = nil
	ext4Image(t, sp.Disk.BasePath, map[string]string{"hello": "v1", "etc/os-release": "ID=test\n", "ro/": ""})
	rec := newRecord(sp)
	rec.Mode = record.ModeAppVM
	rec.AppVM = &record.AppVMSpec{ImageID: "img", NetworkMode: "none", RestartPolicy: "no"}
	if err := s.recs.Create(rec); err != nil {
		t.Fatal(err)
	}
	if err := s.Provision(ctx, rec); err != nil {
		t.Fatal(err)
	}
	root := s.lay.VsockSocket("app") + ".root"
	read := func(p string) string {
		b, err := os.ReadFile(filepath.Join(root, p))
		if err != nil {
			return "error: " + err.Error()
		}
		return string(b)
	}
	cycle := func() {
		t.Helper()
		if _, err := s.act(ctx, "app", "start"); err != nil {
			t.Fatal(err)
		}
		if _, err := s.act(ctx, "app", "stop"); err != nil {
			t.Fatal(err)
		}
	}
	cycle()
	if read("hello") != "v1" || read("etc/os-release") != "ID=test\n" {
		t.Fatalf("unpacked tree: hello %q, os-release %q", read("hello"), read("etc/os-release"))
	}
	if fi, err := os.Stat(filepath.Join(root, "ro")); err != nil || !fi.IsDir() {
		t.Errorf("ro: %v", err)
	} else if os.Geteuid() == 0 && fi.Mode().Perm() != 0o555 {
		t.Errorf("ro has mode %v, want the image's 0555 (root keeps modes)", fi.Mode().Perm())
	}
	if err := os.WriteFile(filepath.Join(root, "written"), []byte("w"), 0o644); err != nil {
		t.Fatal(err)
	}
	cycle()
	if read("written") != "w" {
		t.Errorf("what the workload wrote is gone after a reboot: %q", read("written"))
	}
	// An agent killed while it unpacked: a half-made tree and raw file
	// left (temp names, which the startup sweep knows too), the stamp not
	// written yet. The next boot unpacks afresh and leaves neither.
	dir, base := filepath.Split(root)
	tempTree, tempRaw := dir+"."+base+".tmp-new", dir+"."+base+".tmp-raw"
	if !atomicfile.IsTemp(filepath.Base(tempTree)) || !atomicfile.IsTemp(filepath.Base(tempRaw)) {
		t.Fatalf("%s, %s: not names the startup sweep knows", tempTree, tempRaw)
	}
	if err := os.MkdirAll(tempTree+"/half", 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(tempRaw, []byte("partial"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(root + ".disk"); err != nil {
		t.Fatal(err)
	}
	cycle()
	if read("hello") != "v1" || read("written") == "w" {
		t.Errorf("after an interrupted unpack: hello %q, written %q; want a fresh tree", read("hello"), read("written"))
	}
	for _, p := range []string{tempTree, tempRaw} {
		if _, err := os.Lstat(p); err == nil {
			t.Errorf("%s left after an interrupted unpack", p)
		}
	}
	if err := os.WriteFile(filepath.Join(root, "written"), []byte("w"), 0o644); err != nil {
		t.Fatal(err)
	}
	// A redeploy's root disk: another file under the same name.
	next := s.lay.RootDisk("app") + ".test-next"
	ext4Image(t, next, map[string]string{"hello": "v2"})
	if err := os.Rename(next, s.lay.RootDisk("app")); err != nil {
		t.Fatal(err)
	}
	cycle()
	if read("hello") != "v2" || read("written") == "w" || read("etc/os-release") == "ID=test\n" {
		t.Errorf("after the disk changed: hello %q, written %q, os-release %q; want only the new disk's tree", read("hello"), read("written"), read("etc/os-release"))
	}
	for _, p := range []string{tempTree, tempRaw} {
		if _, err := os.Lstat(p); err == nil {
			t.Errorf("%s left behind", p)
		}
	}
	if err := s.remove(ctx, "app"); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(root); err == nil {
		t.Error("the tree outlived the delete")
	}
}

// TestRemoveTree: ownerWritable gives directories (only) their owner's
// rwx; a tree with a directory its owner may not write (as a workload
// leaves it) is removed all the same.
func TestRemoveTree(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "tree")
	if err := os.MkdirAll(filepath.Join(dir, "a/b"), 0o755); err != nil {
		t.Fatal(err)
	}
	os.WriteFile(filepath.Join(dir, "a/b/f"), []byte("x"), 0o444)
	os.Chmod(filepath.Join(dir, "a/b"), 0o555)
	os.Chmod(filepath.Join(dir, "a"), 0o500)
	if err := ownerWritable(dir); err != nil {
		t.Fatal(err)
	}
	for p, want := range map[string]os.FileMode{"a": 0o700, "a/b": 0o755, "a/b/f": 0o444} {
		if fi, err := os.Stat(filepath.Join(dir, p)); err != nil || fi.Mode().Perm() != want {
			t.Errorf("%s after ownerWritable: %v, %v; want mode %v", p, fi.Mode().Perm(), err, want)
		}
	}
	os.Chmod(filepath.Join(dir, "a/b"), 0o555)
	os.Chmod(filepath.Join(dir, "a"), 0o500)
	if err := removeTree(dir); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(dir); err == nil {
		t.Error("tree still there")
	}
	if err := removeTree(dir); err != nil {
		t.Errorf("removing what is gone = %v", err)
	}
}
