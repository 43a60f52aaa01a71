package jail

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// ensure copies the links on the way and makes directories and the mount
// point, never through a link, and resolves the path as the kernel would.
// It needs no privilege: host and root are temporary directories.
func TestEnsurePath(t *testing.T) {
	host, root := t.TempDir(), t.TempDir()
	defer unix.Umask(unix.Umask(0o022)) // as the helper runs
	rb := newRootBuilder(root)
	ensurePath := func(_, p string, dir bool) (string, error) { return rb.ensure(p, dir) }
	// host/usr/lib/x/libc.so.6 (file), host/lib -> usr/lib (relative link),
	// host/usr/lib/x/libc.so -> libc.so.6, host/abs -> host/usr (absolute).
	must(t, os.MkdirAll(host+"/usr/lib/x", 0o755))
	must(t, os.WriteFile(host+"/usr/lib/x/libc.so.6", nil, 0o644))
	must(t, os.Symlink("usr/lib", host+"/lib"))
	must(t, os.Symlink("libc.so.6", host+"/usr/lib/x/libc.so"))
	must(t, os.Symlink(host+"/usr", host+"/abs"))
	must(t, os.Symlink("loop", host+"/loop"))

	real, err := ensurePath(root, host+"/lib/x/libc.so", false)
	if err != nil {
		t.Fatal(err)
	}
	if real != host+"/usr/lib/x/libc.so.6" {
		t.Errorf("resolved to %s", real)
	}
	// Inside root: the links as on the host, the mount point a file.
	if l, err := os.Readlink(root + host + "/lib"); err != nil || l != "usr/lib" {
		t.Errorf("link lib: %q, %v", l, err)
	}
	if l, err := os.Readlink(root + host + "/usr/lib/x/libc.so"); err != nil || l != "libc.so.6" {
		t.Errorf("link libc.so: %q, %v", l, err)
	}
	if fi, err := os.Lstat(root + real); err != nil || !fi.Mode().IsRegular() || fi.Size() != 0 {
		t.Errorf("mount point %s: %v, %v", root+real, fi, err)
	}
	if fi, err := os.Lstat(root + host + "/usr/lib/x"); err != nil || !fi.IsDir() || fi.Mode().Perm() != 0o755 {
		t.Errorf("directory: %v, %v", fi, err)
	}

	// An absolute link is copied as is; what it names is made at the
	// resolved path inside root, not through the link (which, followed
	// now, would reach the host's own file system).
	real, err = ensurePath(root, host+"/abs/lib/x", true)
	if err != nil || real != host+"/usr/lib/x" {
		t.Errorf("through an absolute link: %s, %v", real, err)
	}
	if l, err := os.Readlink(root + host + "/abs"); err != nil || l != host+"/usr" {
		t.Errorf("absolute link: %q, %v", l, err)
	}

	// A second call finds everything in place (also a second builder, which
	// looks again); a clash is an error.
	if _, err := ensurePath(root, host+"/lib/x/libc.so", false); err != nil {
		t.Errorf("again: %v", err)
	}
	if _, err := newRootBuilder(root).ensure(host+"/lib/x/libc.so", false); err != nil {
		t.Errorf("again, with another builder: %v", err)
	}
	if _, err := newRootBuilder(root).ensure(host+"/usr/lib/x/libc.so.6", true); err == nil {
		t.Error("a file made again as a directory by another builder: no error")
	}
	if _, err := ensurePath(root, host+"/usr/lib/x/libc.so.6", true); err == nil {
		t.Error("a file made again as a directory: no error")
	}
	if _, err := ensurePath(root, host+"/loop", false); err == nil || !strings.Contains(err.Error(), "too many symbolic links") {
		t.Errorf("a link loop: %v", err)
	}
	if _, err := ensurePath(root, host+"/missing", false); !os.IsNotExist(err) {
		t.Errorf("a missing path: %v", err)
	}
	// Nothing was created on the host side.
	var hostFiles []string
	filepath.Walk(host, func(p string, _ os.FileInfo, _ error) error {
		hostFiles = append(hostFiles, strings.TrimPrefix(p, host))
		return nil
	})
	want := []string{"", "/abs", "/lib", "/loop", "/usr", "/usr/lib", "/usr/lib/x", "/usr/lib/x/libc.so", "/usr/lib/x/libc.so.6"}
	if !slices.Equal(hostFiles, want) {
		t.Errorf("the host tree changed: %v", hostFiles)
	}
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// ExecFiles of a dynamic program (/bin/true links libc): the program, the
// loader its PT_INTERP names, libc and libgcc_s, every file there.
func TestExecFilesDynamic(t *testing.T) {
	prog, err := filepath.EvalSymlinks("/bin/true")
	if err != nil {
		t.Skip("no /bin/true")
	}
	files, err := ExecFiles(prog)
	if err != nil {
		t.Fatal(err)
	}
	if files[0] != prog {
		t.Errorf("first file %s, want the program", files[0])
	}
	o, err := readELF(prog)
	if err != nil {
		t.Fatal(err)
	}
	if o.interp == "" {
		t.Skipf("%s is static here", prog)
	}
	if !slices.Contains(files, o.interp) {
		t.Errorf("%v lacks the interpreter %s", files, o.interp)
	}
	var libc, gcc bool
	for _, f := range files {
		if _, err := os.Stat(f); err != nil {
			t.Errorf("%s: %v", f, err)
		}
		libc = libc || filepath.Base(f) == "libc.so.6"
		gcc = gcc || filepath.Base(f) == "libgcc_s.so.1"
	}
	if !libc {
		t.Errorf("%v lacks libc.so.6", files)
	}
	if _, err := os.Stat("/usr/lib/x86_64-linux-gnu/libgcc_s.so.1"); err == nil && !gcc {
		t.Errorf("%v lacks libgcc_s.so.1", files)
	}
	again, err := ExecFiles(prog)
	if err != nil || !slices.Equal(again, files) {
		t.Errorf("a second call: %v, %v", again, err)
	}
}

// ExecFiles gives its files again while they are what they were, and
// looks again once one of them is another file (an upgrade replaced a
// library, whose own dependencies may be others now).
func TestExecFilesNoticesAReplacedFile(t *testing.T) {
	prog, err := filepath.EvalSymlinks("/bin/true")
	if err != nil {
		t.Skip("no /bin/true")
	}
	files, err := ExecFiles(prog)
	if err != nil {
		t.Fatal(err)
	}
	if len(files) < 3 {
		t.Skipf("%s needs too few files here: %v", prog, files)
	}
	fi, err := os.Stat(prog)
	if err != nil {
		t.Fatal(err)
	}
	key := execKey{prog, fi.Size(), fi.ModTime()}
	execCache.Lock()
	e := execCache.m[key]
	execCache.Unlock()
	// What the cache holds now names one file too few: it is given again
	// as long as each file it names is the file it was.
	short := execEntry{files: e.files[:len(e.files)-1], infos: e.infos[:len(e.infos)-1]}
	execCache.Lock()
	execCache.m[key] = short
	execCache.Unlock()
	if got, _ := ExecFiles(prog); !slices.Equal(got, short.files) {
		t.Fatalf("unchanged files: %v, want what was kept, %v", got, short.files)
	}
	// One of them is another file now (here: the program's own stat in
	// its place): found again, whole.
	short.infos = slices.Clone(short.infos)
	short.infos[1] = fi
	execCache.Lock()
	execCache.m[key] = short
	execCache.Unlock()
	if got, _ := ExecFiles(prog); !slices.Equal(got, files) {
		t.Errorf("after a file was replaced: %v, want %v", got, files)
	}
}

// ExecFiles of a static program is the program alone; a file that is not
// ELF is refused.
func TestExecFilesStatic(t *testing.T) {
	dir := t.TempDir()
	script := filepath.Join(dir, "script")
	must(t, os.WriteFile(script, []byte("#!/bin/sh\n"), 0o755))
	if _, err := ExecFiles(script); err == nil || !strings.Contains(err.Error(), "not an ELF program") {
		t.Errorf("a script: %v", err)
	}
	// A tiny static ELF: the header of this test binary is not static
	// everywhere, so look for one on the host.
	for _, p := range []string{"/usr/bin/busybox", "/bin/busybox", "/sbin/ldconfig"} {
		o, err := readELF(p)
		if err != nil || o.interp != "" || o.dynamic {
			continue
		}
		files, err := ExecFiles(p)
		if err != nil || !slices.Equal(files, []string{p}) {
			t.Errorf("static %s: %v, %v", p, files, err)
		}
		return
	}
	t.Log("no static program found on this host to check")
}

// A check report of a process that is not confined names every fault.
func TestCheckReport(t *testing.T) {
	l := Layout{Unified: "/sys/fs/cgroup", UnifiedLimits: true}
	v := &VM{ID: "x", UID: 1000005, GID: 1000005, cgroup: l.Cgroup("vmhost/a/vm-x")}
	good := checkReport{
		Status: "Name:\tx\nUid:\t1000005\t1000005\t1000005\t1000005\nGid:\t1000005\t1000005\t1000005\t1000005\n" +
			"CapInh:\t0000000000000000\nCapPrm:\t0000000000000000\nCapEff:\t0000000000000000\n" +
			"CapBnd:\t0000000000000000\nCapAmb:\t0000000000000000\nNoNewPrivs:\t1\n",
		Cgroup:  "0::/vmhost/a/vm-x\n",
		MountNS: "mnt:[1]",
	}
	prog := filepath.Join(t.TempDir(), "vmhost")
	must(t, os.WriteFile(prog, nil, 0o755))
	files := []string{prog}
	top, _, _ := strings.Cut(strings.TrimPrefix(prog, "/"), "/")
	good.Root = []string{"proc", top}
	if err := v.checkReport(good, files); err != nil {
		t.Fatalf("a confined report: %v", err)
	}
	bad := good
	bad.Status = strings.NewReplacer("Uid:\t1000005", "Uid:\t0", "CapBnd:\t0000000000000000", "CapBnd:\t000001ffffffffff",
		"NoNewPrivs:\t1", "NoNewPrivs:\t0").Replace(good.Status)
	bad.Cgroup = "0::/\n"
	bad.Root = append(good.Root, "etc")
	err := v.checkReport(bad, files)
	for _, want := range []string{"Uid is", "CapBnd is", "NoNewPrivs is", "not in cgroup vmhost/a/vm-x", "its root holds [etc proc " + top + "]"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%v: want %q", err, want)
		}
	}
}

// A bind inside a bound directory is left out when the directory gives it
// what it needs (a program's library under a bound /usr), refused when it
// needs more (a writable file under a read-only directory); binds beside
// each other stay, sorted.
func TestDropContained(t *testing.T) {
	p := func(path string, w, x bool) mountPlan {
		return mountPlan{real: path, Bind: Bind{Path: path, Writable: w, Exec: x}}
	}
	got, err := dropContained([]mountPlan{
		p("/usr/lib/x/libc.so.6", false, true), p("/usr-local", false, false), p("/usr", false, true),
		p("/usr/bin/qemu", false, true), p("/usr/share/f", false, false), p("/run/vm", true, false),
	})
	if err != nil {
		t.Fatal(err)
	}
	var paths []string
	for _, g := range got {
		paths = append(paths, g.real)
	}
	if want := []string{"/run/vm", "/usr", "/usr-local"}; !slices.Equal(paths, want) {
		t.Errorf("kept %v, want %v", paths, want)
	}
	for _, inner := range []mountPlan{p("/usr/share/f", true, false), p("/usr/share/x", false, true)} {
		if _, err := dropContained([]mountPlan{p("/usr", false, false), inner}); err == nil || !strings.Contains(err.Error(), "fewer permissions") {
			t.Errorf("%+v inside a read-only, noexec /usr: %v, want a refusal", inner.Bind, err)
		}
	}
}
