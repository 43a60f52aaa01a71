package disk

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"vmhost/qcow2"
)

// sealHelperEnv makes the test binary run sealHelper (in a mount namespace
// of its own) instead of the tests; its value is the file system to mount.
const sealHelperEnv = "VMHOST_TEST_SEAL_FS"

func init() {
	if fsType := os.Getenv(sealHelperEnv); fsType != "" {
		os.Exit(sealHelper(fsType))
	}
}

func isImmutable(t *testing.T, path string) bool {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	flags, err := getFlags(f)
	if err != nil {
		t.Fatalf("reading the flags of %s: %v", path, err)
	}
	return flags&fsImmutableFL != 0
}

func mode(t *testing.T, path string) os.FileMode {
	t.Helper()
	st, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	return st.Mode().Perm()
}

// flagFileSystems are those known to support FS_IMMUTABLE_FL (tmpfs since
// Linux 6.0).
var flagFileSystems = map[string]bool{"ext4": true, "xfs": true, "btrfs": true, "tmpfs": true}

// hasImmutableCap reports whether the calling thread's effective set holds
// CAP_LINUX_IMMUTABLE (root in a container may lack it).
func hasImmutableCap(t *testing.T) bool {
	t.Helper()
	hdr := unix.CapUserHeader{Version: 0x20080522} // _LINUX_CAPABILITY_VERSION_3
	var data [2]unix.CapUserData
	if err := unix.Capget(&hdr, &data[0]); err != nil {
		t.Fatalf("capget: %v", err)
	}
	return data[0].Effective&(1<<unix.CAP_LINUX_IMMUTABLE) != 0
}

// fsName names the file system holding dir, for the log.
func fsName(dir string) string {
	var st unix.Statfs_t
	if unix.Statfs(dir, &st) != nil {
		return "unknown"
	}
	switch st.Type {
	case unix.EXT4_SUPER_MAGIC:
		return "ext4"
	case unix.TMPFS_MAGIC:
		return "tmpfs"
	case unix.XFS_SUPER_MAGIC:
		return "xfs"
	case unix.BTRFS_SUPER_MAGIC:
		return "btrfs"
	case unix.RAMFS_MAGIC:
		return "ramfs"
	}
	return fmt.Sprintf("%#x", st.Type)
}

// TestSealBuild seals a real build on the test's temp directory (ext4 on
// this machine), checks what the flag forbids even to root, that a build
// is still read (its header, an overlay on it), that sealing again is a
// no-op and fixes a wrong mode, and that UnsealBuild lets it be deleted.
func TestSealBuild(t *testing.T) {
	dir := t.TempDir()
	build := filepath.Join(dir, "rootfs-sha256-1.qcow2")
	if err := qcow2.Create(build, 1<<30); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { UnsealBuild(build) }) // or TempDir's cleanup cannot remove it
	s, err := SealBuild(build)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("on %s as uid %d: immutable %v (%v)", fsName(dir), os.Geteuid(), s.Immutable, s.NotImmutable)
	if m := mode(t, build); m != 0o444 {
		t.Errorf("mode after SealBuild = %v, want 0444", m)
	}
	switch fs := fsName(dir); {
	case hasImmutableCap(t) && flagFileSystems[fs] && !s.Immutable:
		t.Fatalf("SealBuild with CAP_LINUX_IMMUTABLE on %s did not set the immutable flag: %v", fs, s.NotImmutable)
	case !hasImmutableCap(t) && !errors.Is(s.NotImmutable, ErrNoImmutableCapability) && !errors.Is(s.NotImmutable, ErrImmutableUnsupported):
		t.Fatalf("SealBuild without CAP_LINUX_IMMUTABLE = %+v, want the flag refused", s)
	}
	if s.Immutable != isImmutable(t, build) {
		t.Errorf("Seal.Immutable = %v, but the inode says %v", s.Immutable, !s.Immutable)
	}
	if !s.Immutable && !errors.Is(s.NotImmutable, ErrImmutableUnsupported) && !errors.Is(s.NotImmutable, ErrNoImmutableCapability) {
		t.Errorf("NotImmutable = %v, want one of the two sentinels", s.NotImmutable)
	}
	if s.Immutable {
		// Root bypasses the mode, not the flag.
		if _, err := os.OpenFile(build, os.O_WRONLY, 0); !errors.Is(err, syscall.EPERM) {
			t.Errorf("opening a sealed build for writing = %v, want EPERM", err)
		}
		if err := os.Remove(build); !errors.Is(err, syscall.EPERM) {
			t.Errorf("removing a sealed build = %v, want EPERM", err)
		}
		if err := os.Rename(build, build+".moved"); !errors.Is(err, syscall.EPERM) {
			t.Errorf("renaming a sealed build = %v, want EPERM", err)
		}
		if err := os.Link(build, build+".link"); !errors.Is(err, syscall.EPERM) {
			t.Errorf("hard-linking a sealed build = %v, want EPERM", err)
		}
		if err := os.Chmod(build, 0o600); !errors.Is(err, syscall.EPERM) {
			t.Errorf("chmod of a sealed build = %v, want EPERM", err)
		}
	}
	// Still a usable build.
	if h, err := qcow2.ReadHeaderFile(build); err != nil || h.CheckBase() != nil {
		t.Errorf("reading the sealed build's header: %v", err)
	}
	if err := qcow2.CreateOverlay(filepath.Join(dir, "root.qcow2"), build, 2<<30); err != nil {
		t.Errorf("an overlay on the sealed build: %v", err)
	}
	// Again: nothing to do.
	if s2, err := SealBuild(build); err != nil || s2.Immutable != s.Immutable {
		t.Errorf("SealBuild again = %+v, %v; want %+v", s2, err, s)
	}
	if s.Immutable {
		// An immutable build with another mode (sealed by hand, say) gets
		// its mode fixed.
		f, _ := os.Open(build)
		flags, _ := getFlags(f)
		if err := setFlags(f, flags&^fsImmutableFL); err != nil {
			t.Fatal(err)
		}
		os.Chmod(build, 0o644)
		if err := setFlags(f, flags); err != nil {
			t.Fatal(err)
		}
		f.Close()
		if s2, err := SealBuild(build); err != nil || !s2.Immutable || mode(t, build) != 0o444 || !isImmutable(t, build) {
			t.Errorf("SealBuild of an immutable 0644 build = %+v, %v; mode %v", s2, err, mode(t, build))
		}
	}

	if err := UnsealBuild(build); err != nil {
		t.Fatal(err)
	}
	if isImmutable(t, build) || mode(t, build) != 0o600 {
		t.Errorf("after UnsealBuild: immutable %v, mode %v; want neither flag nor 0444", isImmutable(t, build), mode(t, build))
	}
	if err := UnsealBuild(build); err != nil {
		t.Errorf("UnsealBuild again = %v", err)
	}
	if err := os.Remove(build); err != nil {
		t.Errorf("removing an unsealed build: %v", err)
	}
	if err := UnsealBuild(build); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("UnsealBuild of a missing build = %v, want fs.ErrNotExist", err)
	}
	if _, err := SealBuild(build); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("SealBuild of a missing build = %v, want fs.ErrNotExist", err)
	}
	// Not a regular file: refused, the target untouched.
	link := filepath.Join(dir, "link.qcow2")
	target := filepath.Join(dir, "root.qcow2")
	os.Symlink(target, link)
	if _, err := SealBuild(link); err == nil {
		t.Error("SealBuild followed a symlink")
	}
	if _, err := SealBuild(dir); err == nil || !strings.Contains(err.Error(), "not a regular file") {
		t.Errorf("SealBuild of a directory = %v", err)
	}
	if m := mode(t, target); m != 0o600 {
		t.Errorf("the symlink's target changed mode to %v", m)
	}
}

// TestRemoveAllSealed: RemoveAll removes a tree holding sealed builds
// (immutable where this host allows), which os.RemoveAll cannot, and
// leaves a symlink's target alone.
func TestRemoveAllSealed(t *testing.T) {
	dir := t.TempDir()
	tree := filepath.Join(dir, "images", ".deleted-app-1", "app")
	if err := os.MkdirAll(tree, 0o700); err != nil {
		t.Fatal(err)
	}
	outside := filepath.Join(dir, "outside.qcow2")
	for _, p := range []string{filepath.Join(tree, "rootfs-sha256-1.qcow2"), filepath.Join(tree, "rootfs-sha256-2.qcow2"), outside} {
		if err := qcow2.Create(p, 1<<20); err != nil {
			t.Fatal(err)
		}
		if _, err := SealBuild(p); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() { UnsealBuild(outside) })
	if err := os.Symlink(outside, filepath.Join(tree, "link.qcow2")); err != nil {
		t.Fatal(err)
	}
	if hasImmutableCap(t) && flagFileSystems[fsName(dir)] {
		if err := os.RemoveAll(filepath.Join(dir, "images")); err == nil {
			t.Fatal("os.RemoveAll removed immutable builds: the test shows nothing")
		}
	}
	if err := RemoveAll(filepath.Join(dir, "images")); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir, "images")); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("the tree is still there: %v", err)
	}
	if m := mode(t, outside); m != 0o444 {
		t.Errorf("the symlink's target was unsealed: mode %v", m)
	}
	if err := RemoveAll(filepath.Join(dir, "nothing")); err != nil {
		t.Errorf("RemoveAll of a missing path = %v, want nil", err)
	}
}

// TestSealBuildWithoutCapability drops CAP_LINUX_IMMUTABLE from the
// effective set of one OS thread (capabilities are per thread) and seals
// from it: the mode is set, the flag is not, and NotImmutable says why;
// unsealing a build made immutable elsewhere fails the same way.
func TestSealBuildWithoutCapability(t *testing.T) {
	if !hasImmutableCap(t) {
		t.Skip("no CAP_LINUX_IMMUTABLE: TestSealBuild already runs without it")
	}
	dir := t.TempDir()
	plain, sealed := filepath.Join(dir, "plain.qcow2"), filepath.Join(dir, "sealed.qcow2")
	for _, p := range []string{plain, sealed} {
		if err := qcow2.Create(p, 1<<30); err != nil {
			t.Fatal(err)
		}
	}
	s, err := SealBuild(sealed)
	if err != nil || !s.Immutable {
		t.Skipf("cannot set the immutable flag on %s here: %+v %v", fsName(dir), s, err)
	}
	t.Cleanup(func() { UnsealBuild(sealed) })

	type result struct {
		seal      Seal
		sealErr   error
		unsealErr error
	}
	done := make(chan result)
	go func() {
		// The thread is never unlocked: it dies with the goroutine, so
		// its reduced capabilities are never reused.
		runtime.LockOSThread()
		var r result
		if err := dropEffectiveCap(unix.CAP_LINUX_IMMUTABLE); err != nil {
			r.sealErr = err
			done <- r
			return
		}
		r.seal, r.sealErr = SealBuild(plain)
		r.unsealErr = UnsealBuild(sealed)
		done <- r
	}()
	r := <-done
	if r.sealErr != nil {
		t.Fatal(r.sealErr)
	}
	if r.seal.Immutable || !errors.Is(r.seal.NotImmutable, ErrNoImmutableCapability) {
		t.Errorf("SealBuild without the capability = %+v, want not immutable for want of CAP_LINUX_IMMUTABLE", r.seal)
	}
	if mode(t, plain) != 0o444 || isImmutable(t, plain) {
		t.Errorf("build sealed without the capability: mode %v, immutable %v; want 0444, no flag", mode(t, plain), isImmutable(t, plain))
	}
	if !errors.Is(r.unsealErr, ErrNoImmutableCapability) {
		t.Errorf("UnsealBuild of an immutable build without the capability = %v, want ErrNoImmutableCapability", r.unsealErr)
	}
	if !isImmutable(t, sealed) {
		t.Error("the failed UnsealBuild cleared the flag")
	}
}

// dropEffectiveCap removes capability c from the calling thread's
// effective set (the permitted set keeps it).
func dropEffectiveCap(c int) error {
	hdr := unix.CapUserHeader{Version: 0x20080522} // _LINUX_CAPABILITY_VERSION_3
	var data [2]unix.CapUserData
	if err := unix.Capget(&hdr, &data[0]); err != nil {
		return fmt.Errorf("capget: %w", err)
	}
	data[c/32].Effective &^= 1 << (c % 32)
	if err := unix.Capset(&hdr, &data[0]); err != nil {
		return fmt.Errorf("capset: %w", err)
	}
	return nil
}

// sealReport is what sealHelper found on one file system.
type sealReport struct {
	FS           string `json:"fs"`
	Immutable    bool   `json:"immutable"`
	Unsupported  bool   `json:"unsupported"`
	NoCapability bool   `json:"no_capability"`
	Why          string `json:"why"`
	Mode         uint32 `json:"mode"`
	WriteErr     string `json:"write_err"`
	UnlinkErr    string `json:"unlink_err"`
	UnsealErr    string `json:"unseal_err"`
	RemoveErr    string `json:"remove_err"`
}

// TestSealBuildFileSystems mounts ext4 (a loop-mounted image made by
// mkfs.ext4), tmpfs and ramfs in a mount namespace of a child process and
// seals a build on each: ext4 must take the flag (given
// CAP_LINUX_IMMUTABLE), ramfs has none (mode only), tmpfs has it since
// Linux 6.0. Needs root.
func TestSealBuildFileSystems(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("mounting file systems needs root")
	}
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	for _, fsType := range []string{"ext4", "tmpfs", "ramfs"} {
		t.Run(fsType, func(t *testing.T) {
			dir := t.TempDir()
			if fsType == "ext4" {
				if _, err := exec.LookPath("mkfs.ext4"); err != nil {
					t.Skip("mkfs.ext4 not installed (apt-get install e2fsprogs)")
				}
				img := filepath.Join(dir, "ext4.img")
				f, err := os.Create(img)
				if err != nil {
					t.Fatal(err)
				}
				f.Truncate(32 << 20)
				f.Close()
				if out, err := exec.Command("mkfs.ext4", "-q", "-F", img).CombinedOutput(); err != nil {
					t.Fatalf("mkfs.ext4: %v\n%s", err, out)
				}
			}
			cmd := exec.Command(self, "-test.run=^$")
			// atexit_sleep_ms: a race-enabled child would sleep a second on exit.
			cmd.Env = append(os.Environ(), sealHelperEnv+"="+fsType, "VMHOST_TEST_SEAL_DIR="+dir, "GORACE=atexit_sleep_ms=0")
			cmd.SysProcAttr = &syscall.SysProcAttr{Unshareflags: syscall.CLONE_NEWNS}
			out, err := cmd.Output()
			if err != nil {
				if ee, ok := err.(*exec.ExitError); ok && ee.ExitCode() == 3 {
					t.Skipf("cannot mount %s here: %s", fsType, ee.Stderr)
				}
				t.Fatalf("helper: %v\n%s", err, exitStderr(err))
			}
			var r sealReport
			if err := json.Unmarshal(out, &r); err != nil {
				t.Fatalf("helper output %q: %v", out, err)
			}
			t.Logf("%s: %+v", fsType, r)
			if r.FS != fsType {
				t.Fatalf("the helper sealed a file on %s, not %s", r.FS, fsType)
			}
			if r.Mode != 0o444 {
				t.Errorf("mode = %#o, want 0444", r.Mode)
			}
			switch {
			case !hasImmutableCap(t):
				if r.Immutable || !r.NoCapability && !r.Unsupported {
					t.Errorf("without CAP_LINUX_IMMUTABLE: %+v, want the flag refused", r)
				}
			case fsType == "ext4" && !r.Immutable:
				t.Errorf("ext4 did not take the immutable flag: %s", r.Why)
			case fsType == "ramfs" && (r.Immutable || !r.Unsupported):
				t.Errorf("ramfs: immutable %v, unsupported %v (%s); want the flag refused as unsupported", r.Immutable, r.Unsupported, r.Why)
			case fsType == "tmpfs" && !r.Immutable && !r.Unsupported:
				t.Errorf("tmpfs: %s", r.Why)
			}
			if r.Immutable && (!strings.Contains(r.WriteErr, "operation not permitted") || !strings.Contains(r.UnlinkErr, "operation not permitted")) {
				t.Errorf("immutable build: write %q, unlink %q; want both refused with EPERM", r.WriteErr, r.UnlinkErr)
			}
			if r.UnsealErr != "" || r.RemoveErr != "" {
				t.Errorf("unseal %q, remove %q; want both to succeed", r.UnsealErr, r.RemoveErr)
			}
		})
	}
}

func exitStderr(err error) string {
	if ee, ok := err.(*exec.ExitError); ok {
		return string(ee.Stderr)
	}
	return ""
}

// sealHelper runs in the child of TestSealBuildFileSystems, in its own
// mount namespace: it mounts fsType at $VMHOST_TEST_SEAL_DIR/mnt (exit 3
// when it cannot), seals a build there, tries to write and unlink it,
// unseals and removes it, and prints a sealReport.
func sealHelper(fsType string) int {
	dir := os.Getenv("VMHOST_TEST_SEAL_DIR")
	mnt := filepath.Join(dir, "mnt")
	if err := os.Mkdir(mnt, 0o700); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	var out []byte
	var err error
	if fsType == "ext4" {
		out, err = exec.Command("mount", "-o", "loop", filepath.Join(dir, "ext4.img"), mnt).CombinedOutput()
	} else {
		err = unix.Mount("none", mnt, fsType, 0, "")
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "mount %s: %v %s\n", fsType, err, out)
		return 3
	}
	defer func() {
		if err := unix.Unmount(mnt, 0); err != nil {
			fmt.Fprintln(os.Stderr, "umount:", err)
		}
	}()
	build := filepath.Join(mnt, "rootfs.qcow2")
	if err := qcow2.Create(build, 1<<30); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	s, err := SealBuild(build)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	r := sealReport{FS: fsName(mnt), Immutable: s.Immutable,
		Unsupported:  errors.Is(s.NotImmutable, ErrImmutableUnsupported),
		NoCapability: errors.Is(s.NotImmutable, ErrNoImmutableCapability)}
	if s.NotImmutable != nil {
		r.Why = s.NotImmutable.Error()
	}
	if st, err := os.Stat(build); err == nil {
		r.Mode = uint32(st.Mode().Perm())
	}
	errText := func(err error) string {
		if err == nil {
			return ""
		}
		return err.Error()
	}
	f, err := os.OpenFile(build, os.O_WRONLY, 0)
	if err == nil {
		f.Close()
	}
	r.WriteErr = errText(err)
	// Unlinking is tried only where the flag must refuse it.
	if s.Immutable {
		r.UnlinkErr = errText(os.Remove(build))
	}
	r.UnsealErr = errText(UnsealBuild(build))
	r.RemoveErr = errText(os.Remove(build))
	b, _ := json.Marshal(r)
	fmt.Println(string(b))
	return 0
}
