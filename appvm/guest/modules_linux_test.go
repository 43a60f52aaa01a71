package guest

import (
	"errors"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestLoadModulesInListOrder: the modules are handed to the loader in the
// list's order; one already loaded is fine; one the kernel refuses is named
// with the likely cause, and the others still load.
func TestLoadModulesInListOrder(t *testing.T) {
	dir := t.TempDir()
	list := filepath.Join(dir, "modules")
	os.WriteFile(list, []byte("virtio_ring\nvirtio\nvirtio_pci\nvirtio_blk\n"), 0o644)
	for _, n := range []string{"virtio_ring", "virtio", "virtio_pci", "virtio_blk"} {
		os.WriteFile(filepath.Join(dir, n+".ko"), []byte(n), 0o644)
	}
	var order []string
	load := func(f *os.File) error {
		b := make([]byte, 64)
		n, _ := f.Read(b)
		order = append(order, string(b[:n]))
		switch string(b[:n]) {
		case "virtio_ring":
			return unix.EEXIST
		case "virtio_pci":
			return unix.ENOEXEC
		}
		return nil
	}
	n, err := loadModules(list, dir, load)
	if got := strings.Join(order, " "); got != "virtio_ring virtio virtio_pci virtio_blk" {
		t.Errorf("load order %s", got)
	}
	if n != 3 {
		t.Errorf("loaded %d, want 3 (EEXIST counts as loaded)", n)
	}
	if err == nil || !strings.Contains(err.Error(), "loading kernel module virtio_pci: exec format error (not a module this kernel loads: built for another kernel release") || strings.Contains(err.Error(), "virtio_blk") {
		t.Errorf("err = %v, want virtio_pci alone named", err)
	}

	// A listed module missing from the archive is named too.
	os.Remove(filepath.Join(dir, "virtio.ko"))
	if _, err := loadModules(list, dir, func(*os.File) error { return nil }); err == nil || !strings.Contains(err.Error(), "loading kernel module virtio:") {
		t.Errorf("missing file: %v", err)
	}
	// No list: nothing to load.
	if n, err := loadModules(filepath.Join(dir, "absent"), dir, load); n != 0 || err != nil {
		t.Errorf("no list: %d, %v", n, err)
	}
}

func TestWaitForDiskSaysTheCause(t *testing.T) {
	dev := filepath.Join(t.TempDir(), "vda")
	err := waitForDisk(dev, 100*time.Millisecond)
	if err == nil || err.Error() != dev+" did not appear in 100ms (is virtio_blk built in or listed in appvm_modules?)" {
		t.Errorf("waitForDisk = %v", err)
	}
	go func() {
		time.Sleep(100 * time.Millisecond)
		os.WriteFile(dev, nil, 0o600)
	}()
	if err := waitForDisk(dev, 10*time.Second); err != nil {
		t.Errorf("a disk that appears late: %v", err)
	}
}

func TestWaitForInterfaceSaysTheCause(t *testing.T) {
	err := waitForInterface("vmhostnone0", 100*time.Millisecond)
	if err == nil || err.Error() != "network interface vmhostnone0 did not appear in 100ms (is virtio_net built in or listed in appvm_modules?)" {
		t.Errorf("waitForInterface = %v", err)
	}
	if err := waitForInterface("lo", time.Second); err != nil {
		t.Errorf("lo: %v", err)
	}
}

// TestDialNoAFVsockIsNotRetried: EAFNOSUPPORT (no vsock in the kernel) ends
// the dial at once with the kernel options named; a refused connection
// (the host not listening yet) is retried until the dial timeout.
func TestDialNoAFVsockIsNotRetried(t *testing.T) {
	dialErr := func(errno unix.Errno) error {
		return &net.OpError{Op: "dial", Net: "vsock", Err: os.NewSyscallError("socket", errno)}
	}
	for _, tt := range []struct {
		errno     unix.Errno
		permanent bool
		want      string
	}{
		{unix.EAFNOSUPPORT, true, "the kernel has no AF_VSOCK (CONFIG_VSOCKETS, CONFIG_VIRTIO_VSOCKETS"},
		{unix.ENODEV, true, "no vsock transport"},
		{unix.ECONNREFUSED, false, "(no answer from the host in 300ms)"},
	} {
		var calls atomic.Int32
		a := &agent{
			opts: options{transport: "vsock", dialWait: 300 * time.Millisecond},
			sys:  &processSystem{},
			dialVsock: func(uint32) (net.Conn, error) {
				calls.Add(1)
				return nil, dialErr(tt.errno)
			},
		}
		_, err := a.dial()
		if err == nil || !strings.Contains(err.Error(), tt.want) || !errors.Is(err, tt.errno) {
			t.Errorf("%v: err = %v, want it to contain %q", tt.errno, err, tt.want)
		}
		if got := calls.Load(); tt.permanent != (got == 1) {
			t.Errorf("%v: %d dials (permanent %v)", tt.errno, got, tt.permanent)
		}
	}
}

func TestReportOnConsole(t *testing.T) {
	console := filepath.Join(t.TempDir(), "console")
	os.WriteFile(console, nil, 0o600)
	reportOnConsole(console, errors.New("/dev/vda did not appear in 10s"))
	b, _ := os.ReadFile(console)
	if string(b) != "vmhost guest agent failed: /dev/vda did not appear in 10s\n" {
		t.Errorf("console got %q", b)
	}
}
