package doctor

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"vmhost/config"
)

func requireRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root for namespaces and mounts of the test's own: run go test as root")
	}
}

// inNS returns a function that runs steps on a thread of its own that left
// the host's mount namespace (and, with flags, others): mounts and
// interfaces made there, and by processes started there, never reach the
// host. The thread ends with the test.
func inNS(t *testing.T, flags int, setup func() error) func(func() error) error {
	t.Helper()
	steps, errc := make(chan func() error), make(chan error)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread dies in its namespaces
		err := unix.Unshare(unix.CLONE_NEWNS | flags)
		if err == nil {
			err = unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, "")
		}
		if err == nil && setup != nil {
			err = setup()
		}
		errc <- err
		if err != nil {
			return
		}
		for f := range steps {
			errc <- f()
		}
	}()
	if err := <-errc; err != nil {
		t.Skipf("cannot make namespaces of the test's own: %v", err)
	}
	t.Cleanup(func() { close(steps) })
	return func(f func() error) error {
		steps <- f
		return <-errc
	}
}

func inMountNS(t *testing.T) func(func() error) error { return inNS(t, 0, nil) }

// inNetAndMountNS adds a network namespace, and mounts a sysfs of it at
// sysfs: sysfs shows the network devices of the namespace that mounted it.
func inNetAndMountNS(t *testing.T, sysfs string) func(func() error) error {
	return inNS(t, unix.CLONE_NEWNET, func() error {
		if err := unix.Mount("sysfs", sysfs, "sysfs", 0, ""); err != nil {
			return fmt.Errorf("mounting sysfs: %w", err)
		}
		return nil
	})
}

// TestKVM: a device that is missing, and one that is not KVM (/dev/null
// answers ENOTTY to KVM_GET_API_VERSION), fail; the host's /dev/kvm, when
// it opens, answers API version 12.
func TestKVM(t *testing.T) {
	wantCheck(t, checkKVM(filepath.Join(t.TempDir(), "kvm")), Fail, "does not exist")
	wantCheck(t, checkKVM("/dev/null"), Fail, "is not a KVM device")
	if f, err := os.OpenFile("/dev/kvm", os.O_RDWR, 0); err == nil {
		f.Close()
		wantCheck(t, checkKVM("/dev/kvm"), OK, "KVM API version 12")
	} else {
		t.Logf("the host's /dev/kvm does not open (%v); its check is %+v", err, checkKVM("/dev/kvm"))
	}
}

// TestBridge: in a network namespace of its own, with sysfs mounted from
// it: a missing bridge fails (the fix creates it), a bridge that is down
// warns, an up bridge passes, and an interface that is not a bridge fails.
func TestBridge(t *testing.T) {
	ipTool := tool(t, "ip", "iproute2")
	requireRoot(t)
	sysfs := t.TempDir()
	run := inNetAndMountNS(t, sysfs)
	ip := func(args ...string) error {
		if out, err := exec.Command(ipTool, args...).CombinedOutput(); err != nil {
			t.Errorf("ip %q: %v: %s", args, err, out)
		}
		return nil
	}
	var checks []Check
	err := run(func() error {
		n := config.Network{ID: "lan", Bridge: "br-doctor"}
		checks = append(checks, checkBridge(sysfs, n))
		ip("link", "add", "br-doctor", "type", "bridge")
		checks = append(checks, checkBridge(sysfs, n))
		ip("link", "set", "br-doctor", "up")
		checks = append(checks, checkBridge(sysfs, n))
		ip("link", "add", "veth-doctor", "type", "veth", "peer", "name", "veth-doctor1")
		checks = append(checks, checkBridge(sysfs, config.Network{ID: "dmz", Bridge: "veth-doctor"}))
		checks = append(checks, Check{Name: "nft", Status: OK, Detail: errString(nftablesUsable())})
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	wantCheck(t, checks[0], Fail, "bridge br-doctor does not exist")
	if !strings.Contains(checks[0].Fix, "ip link add br-doctor type bridge && ip link set br-doctor up") {
		t.Errorf("fix %q does not create the bridge", checks[0].Fix)
	}
	wantCheck(t, checks[1], Warn, "bridge br-doctor is down")
	wantCheck(t, checks[2], OK, "bridge br-doctor is up")
	if checks[2].Name != "network lan" {
		t.Errorf("check name %q, want network lan", checks[2].Name)
	}
	wantCheck(t, checks[3], Fail, "veth-doctor exists but is not a bridge")
	if checks[4].Detail != "" {
		t.Errorf("nf_tables in a fresh namespace, as root: %s", checks[4].Detail)
	}
	// The host's own view never saw the namespace's bridge.
	if _, err := os.Stat("/sys/class/net/br-doctor"); err == nil {
		t.Error("br-doctor appeared in the host's namespace")
	}
}

func errString(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

// TestStateDirTmpfs: a state directory on tmpfs loses its VMs at reboot:
// a warning, with the copy mode found by a real FICLONE (tmpfs has none);
// a directory not made yet is judged by its nearest existing parent.
func TestStateDirTmpfs(t *testing.T) {
	requireRoot(t)
	dir := t.TempDir()
	var c Check
	var left []os.DirEntry
	err := inMountNS(t)(func() error {
		// A tmpfs's size is a bound, not an allocation.
		if out, err := exec.Command("mount", "-t", "tmpfs", "-o", "size=20g", "tmpfs", dir).CombinedOutput(); err != nil {
			return fmt.Errorf("mount tmpfs: %v: %s", err, out)
		}
		c = checkStateDir(filepath.Join(dir, "state"))
		left, _ = os.ReadDir(dir)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	wantCheck(t, c, Warn, filepath.Join(dir, "state")+" (not made yet; "+dir+") on tmpfs: copy (each root disk is a full copy", "20.0 GiB free", "tmpfs loses every VM")
	if len(left) != 0 {
		t.Errorf("the probe left %v behind", left)
	}
}

// TestStateDirReflink: on a btrfs made in a sparse file and mounted in a
// mount namespace of the test, root disk copies are reflinks; the probe's
// files are gone afterwards.
func TestStateDirReflink(t *testing.T) {
	mkfs := tool(t, "mkfs.btrfs", "btrfs-progs")
	requireRoot(t)
	img := filepath.Join(t.TempDir(), "btrfs.img")
	if err := os.WriteFile(img, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(img, 12<<30); err != nil { // sparse: mkfs writes a few MiB
		t.Fatal(err)
	}
	if out, err := exec.Command(mkfs, "-q", img).CombinedOutput(); err != nil {
		t.Fatalf("mkfs.btrfs: %v: %s", err, out)
	}
	mnt := t.TempDir()
	var c Check
	var left []os.DirEntry
	var mountErr error
	err := inMountNS(t)(func() error {
		if out, err := exec.Command("mount", "-o", "loop", img, mnt).CombinedOutput(); err != nil {
			mountErr = fmt.Errorf("%v: %s", err, out)
			return nil
		}
		defer exec.Command("umount", mnt).Run()
		c = checkStateDir(mnt)
		left, _ = os.ReadDir(mnt)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if mountErr != nil {
		t.Skipf("cannot mount a loop device here: %v", mountErr)
	}
	wantCheck(t, c, OK, mnt+" on btrfs: reflink (root disks share their image's blocks")
	if len(left) != 0 {
		t.Errorf("the probe left %v behind", left)
	}
}
