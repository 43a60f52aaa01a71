package guest

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// moduleLoader loads one kernel module from an open file: finit_module(2)
// in the guest, a fake in tests.
type moduleLoader func(f *os.File) error

func finitModule(f *os.File) error { return unix.FinitModule(int(f.Fd()), "", 0) }

// loadModules loads the modules named in list (one name a line, in
// dependency order, as the host wrote it into the initramfs) from dir/<name>.ko.
// A module already loaded is fine. A module that fails does not stop the
// others (the disks may still come up and the host hear why); every failure
// is in the returned error. Without a list there is nothing to load.
func loadModules(list, dir string, load moduleLoader) (int, error) {
	b, err := os.ReadFile(list)
	if errors.Is(err, fs.ErrNotExist) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("reading the module list: %w", err)
	}
	var failed []string
	n := 0
	for _, name := range strings.Fields(string(b)) {
		if err := loadModule(filepath.Join(dir, name+".ko"), load); err != nil {
			failed = append(failed, fmt.Sprintf("loading kernel module %s: %v", name, err))
			continue
		}
		n++
	}
	if len(failed) > 0 {
		return n, errors.New(strings.Join(failed, "; "))
	}
	return n, nil
}

func loadModule(path string, load moduleLoader) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	switch err := load(f); {
	case err == nil, errors.Is(err, unix.EEXIST):
		return nil
	case errors.Is(err, unix.ENOEXEC):
		return fmt.Errorf("%w (not a module this kernel loads: built for another kernel release or architecture?)", err)
	case errors.Is(err, unix.ENOENT):
		return fmt.Errorf("%w (unknown symbol: a module it needs is not loaded, or it was built for another kernel)", err)
	case errors.Is(err, unix.EKEYREJECTED), errors.Is(err, unix.EPERM):
		return fmt.Errorf("%w (signature refused: the kernel enforces module signatures)", err)
	case errors.Is(err, unix.ENOSYS):
		return fmt.Errorf("%w (the kernel has no module support, CONFIG_MODULES)", err)
	default:
		return err
	}
}

// waitFor polls ready every 50 ms until it reports true or timeout passes.
func waitFor(timeout time.Duration, ready func() bool) bool {
	deadline := time.Now().Add(timeout)
	for {
		if ready() {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// waitForDisk waits for the block device node dev, which the kernel
// creates in devtmpfs once virtio_blk has probed the disk.
func waitForDisk(dev string, timeout time.Duration) error {
	ok := waitFor(timeout, func() bool {
		_, err := os.Stat(dev)
		return err == nil
	})
	if !ok {
		return fmt.Errorf("%s did not appear in %s (is virtio_blk built in or listed in appvm_modules?)", dev, timeout)
	}
	return nil
}
