package guest

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"golang.org/x/sys/unix"

	"vmhost/appvm/guest/proto"
)

// pciBlockDevice returns the block device node ("/dev/vdc") of the
// virtio-blk device at PCI address bdf, waiting up to wait for the kernel
// to probe it: a hot-plugged disk appears a moment after the host's
// vm.add-disk answered, and its node a moment before the disk can be
// opened (ENXIO until the kernel has added it: a mount then fails so).
// sysfs is the sysfs mount ("/sys").
func pciBlockDevice(sysfs, bdf string, wait time.Duration) (string, error) {
	if !proto.ValidBDF(bdf) {
		return "", fmt.Errorf("%q is not a PCI address", bdf)
	}
	pattern := filepath.Join(sysfs, "bus/pci/devices", bdf, "virtio*/block/*")
	var dev string
	var last error
	found := waitFor(wait, func() bool {
		m, _ := filepath.Glob(pattern)
		if len(m) != 1 {
			return false
		}
		dev = "/dev/" + filepath.Base(m[0])
		f, err := os.OpenFile(dev, os.O_RDONLY, 0)
		if errors.Is(err, unix.ENOENT) || errors.Is(err, unix.ENXIO) {
			last = err
			return false
		}
		if err == nil {
			f.Close()
		}
		return true // another error is the mount's to report
	})
	if !found {
		if last != nil {
			return "", fmt.Errorf("the virtio block device at PCI address %s is not ready after %s: %w", bdf, wait, last)
		}
		return "", fmt.Errorf("no virtio block device at PCI address %s after %s", bdf, wait)
	}
	return dev, nil
}

// hotMount carries out the host's Mount and answers it.
func (a *agent) hotMount(m *proto.Mount) {
	res := &proto.MountResult{Seq: m.Seq}
	if err := a.mountVolume(m); err != nil {
		a.log.Error("hot mount failed", "mountpoint", m.Mountpoint, "bdf", m.BDF, "err", err)
		res.Error = err.Error()
	} else {
		a.log.Info("volume mounted", "mountpoint", m.Mountpoint, "bdf", m.BDF, "read_only", m.ReadOnly)
	}
	a.send(res)
}

func (a *agent) mountVolume(m *proto.Mount) error {
	a.mmu.Lock()
	defer a.mmu.Unlock()
	dev, err := a.sys.blockDevice(m.BDF)
	if err != nil {
		return fmt.Errorf("mounting %s: %w", m.Mountpoint, err)
	}
	if have, ok := a.mounts[m.Mountpoint]; ok {
		if have == dev {
			return nil // a retried Mount
		}
		return fmt.Errorf("mounting %s: it already holds %s", m.Mountpoint, have)
	}
	target, err := mkdirInRoot(a.opts.root, m.Mountpoint)
	if err != nil {
		return err
	}
	if err := a.sys.mountData(dev, target, m.ReadOnly); err != nil {
		return fmt.Errorf("mounting %s at %s: %w", dev, m.Mountpoint, err)
	}
	a.mounts[m.Mountpoint] = dev
	return nil
}

// hotUnmount carries out the host's Unmount and answers it: a file system
// in use stays mounted and the answer says busy.
func (a *agent) hotUnmount(m *proto.Unmount) {
	res := &proto.MountResult{Seq: m.Seq}
	if err := a.unmountVolume(m.Mountpoint); err != nil {
		a.log.Warn("hot unmount failed", "mountpoint", m.Mountpoint, "err", err)
		res.Error, res.Busy = err.Error(), errors.Is(err, unix.EBUSY)
	} else {
		a.log.Info("volume unmounted", "mountpoint", m.Mountpoint)
	}
	a.send(res)
}

func (a *agent) unmountVolume(mountpoint string) error {
	a.mmu.Lock()
	defer a.mmu.Unlock()
	if _, ok := a.mounts[mountpoint]; !ok {
		return nil // never mounted, or a retried Unmount
	}
	target, err := inRoot(a.opts.root, mountpoint)
	if err != nil {
		return err
	}
	if err := a.sys.unmountData(target); err != nil {
		return fmt.Errorf("unmounting %s: %w", mountpoint, err)
	}
	delete(a.mounts, mountpoint)
	return nil
}

// unmountData unmounts target without detaching a busy file system: the
// workload must let go of it first. target not being a mountpoint is
// success.
func unmountData(target string) error {
	unix.Sync()
	err := unix.Unmount(target, 0)
	if errors.Is(err, unix.EINVAL) {
		return nil
	}
	return err
}
