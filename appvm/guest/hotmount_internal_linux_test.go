package guest

import (
	"errors"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestPCIBlockDeviceWaitsUntilItOpens: a disk whose node is there but
// cannot be opened yet (ENXIO, as a hot-plugged virtio disk the kernel has
// not finished adding) is not handed to the mount; once the node opens,
// it is. Run on a thread of its own in a private mount namespace, with a
// tmpfs over /dev.
func TestPCIBlockDeviceWaitsUntilItOpens(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: a mount namespace and device nodes")
	}
	const bdf = "0000:01:00.0"
	sysfs := filepath.Join(t.TempDir(), "sys")
	if err := os.MkdirAll(filepath.Join(sysfs, "bus/pci/devices", bdf, "virtio3/block/vdz"), 0o755); err != nil {
		t.Fatal(err)
	}
	type result struct {
		notReady, ready error
		dev             string
	}
	done := make(chan result, 1)
	go func() {
		// The thread is never unlocked: it ends with the goroutine, and
		// its mount namespace with it.
		runtime.LockOSThread()
		var r result
		defer func() { done <- r }()
		if err := unix.Unshare(unix.CLONE_NEWNS); err != nil {
			r.notReady = err
			return
		}
		if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
			r.notReady = err
			return
		}
		if err := unix.Mount("test-dev", "/dev", "tmpfs", 0, "mode=0755"); err != nil {
			r.notReady = err
			return
		}
		// Block major 240 is for local use: nothing registers it here,
		// so the node opens with ENXIO.
		if err := unix.Mknod("/dev/vdz", unix.S_IFBLK|0o600, int(unix.Mkdev(240, 0))); err != nil {
			r.notReady = err
			return
		}
		_, r.notReady = pciBlockDevice(sysfs, bdf, 200*time.Millisecond)
		// An unattached loop device opens.
		os.Remove("/dev/vdz")
		if err := unix.Mknod("/dev/vdz", unix.S_IFBLK|0o600, int(unix.Mkdev(7, 0))); err != nil {
			r.ready = err
			return
		}
		r.dev, r.ready = pciBlockDevice(sysfs, bdf, 200*time.Millisecond)
	}()
	r := <-done
	if r.notReady == nil || !errors.Is(r.notReady, unix.ENXIO) || !strings.Contains(r.notReady.Error(), "not ready") {
		t.Errorf("a node that opens with ENXIO: %v, want not ready (ENXIO)", r.notReady)
	}
	if r.ready != nil || r.dev != "/dev/vdz" {
		t.Errorf("a node that opens: %q, %v; want /dev/vdz", r.dev, r.ready)
	}
}
