package doctor

import (
	"errors"
	"fmt"
	"io/fs"
	"os"

	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"
)

// kvmGetAPIVersion is KVM_GET_API_VERSION, _IO(KVMIO 0xAE, 0x00); a usable
// KVM answers kvmAPIVersion, which has not changed since Linux 2.6.22.
const (
	kvmGetAPIVersion = 0xAE00
	kvmAPIVersion    = 12
)

// checkKVM opens the KVM device and asks its API version, as Cloud
// Hypervisor does first.
func checkKVM(dev string) Check {
	const name = "kvm"
	fd, err := unix.Open(dev, unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		c := Check{Name: name, Status: Fail, Detail: fmt.Sprintf("opening %s: %v", dev, err)}
		switch {
		case errors.Is(err, unix.ENOENT):
			c.Detail = dev + " does not exist: no hardware virtualization"
			c.Fix = "enable VT-x/AMD-V in the firmware and modprobe kvm_intel (or kvm_amd); in a VM, enable nested virtualization on its host"
		case errors.Is(err, unix.EACCES), errors.Is(err, unix.EPERM):
			c.Fix = "run as root (or in the kvm group)"
		default:
			c.Fix = "check that kvm_intel or kvm_amd is loaded (dmesg says why it refused)"
		}
		return c
	}
	defer unix.Close(fd)
	v, err := unix.IoctlRetInt(fd, kvmGetAPIVersion)
	switch {
	case errors.Is(err, unix.ENOTTY), errors.Is(err, unix.EINVAL):
		return Check{Name: name, Status: Fail, Detail: dev + " is not a KVM device (KVM_GET_API_VERSION: " + err.Error() + ")",
			Fix: "make " + dev + " the kvm character device (10:232), as udev does"}
	case err != nil:
		return Check{Name: name, Status: Fail, Detail: fmt.Sprintf("KVM_GET_API_VERSION on %s: %v", dev, err), Fix: "check dmesg for KVM's errors"}
	case v != kvmAPIVersion:
		return Check{Name: name, Status: Fail, Detail: fmt.Sprintf("%s answers KVM API version %d, not %d", dev, v, kvmAPIVersion), Fix: "use a Linux kernel with a standard KVM"}
	}
	return ok(name, "%s answers KVM API version %d", dev, v)
}

// checkTun opens the TUN/TAP clone device the agent makes taps with.
func checkTun(dev string) Check {
	const name = "tun"
	f, err := os.OpenFile(dev, os.O_RDWR, 0)
	if err != nil {
		c := Check{Name: name, Status: Fail, Detail: fmt.Sprintf("opening %s: %v: VMs with interfaces cannot be created", dev, err),
			Fix: "modprobe tun"}
		if errors.Is(err, fs.ErrPermission) {
			c.Fix = "run as root"
		}
		return c
	}
	f.Close()
	return ok(name, "%s opens (taps)", dev)
}

// nftablesUsable asks nf_tables for its ruleset generation over netlink: a
// read that answers when nf_tables is there and the caller may use it
// (CAP_NET_ADMIN), and changes nothing.
func nftablesUsable() error {
	c, err := netlink.Dial(unix.NETLINK_NETFILTER, nil)
	if err != nil {
		return fmt.Errorf("netlink: %w", err)
	}
	defer c.Close()
	msg := netlink.Message{
		Header: netlink.Header{
			Type:  netlink.HeaderType(unix.NFNL_SUBSYS_NFTABLES<<8 | unix.NFT_MSG_GETGEN),
			Flags: netlink.Request | netlink.Acknowledge,
		},
		Data: []byte{unix.AF_UNSPEC, unix.NFNETLINK_V0, 0, 0}, // struct nfgenmsg
	}
	if _, err := c.Execute(msg); err != nil {
		return fmt.Errorf("NFT_MSG_GETGEN: %w", err)
	}
	return nil
}

// fsNames are the statfs magic numbers of the file systems a state
// directory is likely to sit on.
var fsNames = map[int64]string{
	unix.EXT4_SUPER_MAGIC:      "ext4",
	unix.XFS_SUPER_MAGIC:       "xfs",
	unix.BTRFS_SUPER_MAGIC:     "btrfs",
	unix.TMPFS_MAGIC:           "tmpfs",
	unix.OVERLAYFS_SUPER_MAGIC: "overlayfs",
	unix.NFS_SUPER_MAGIC:       "nfs",
	unix.F2FS_SUPER_MAGIC:      "f2fs",
	0x2fc12fc1:                 "zfs",
	0xca451a4e:                 "bcachefs",
}

// statFS returns the file system type of dir and its free space for an
// unprivileged writer (root may use a little more).
func statFS(dir string) (string, uint64, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return "", 0, fmt.Errorf("statfs: %w", err)
	}
	name, ok := fsNames[int64(st.Type)]
	if !ok {
		name = fmt.Sprintf("file system 0x%x", st.Type)
	}
	return name, st.Bavail * uint64(st.Bsize), nil
}

// canReflink writes a small file in dir and asks the kernel to clone it
// (FICLONE), as a root disk copy does first; both files are removed.
func canReflink(dir string) (bool, error) {
	src, err := os.CreateTemp(dir, ".vmhost-doctor.tmp-*") // a name the startup sweep knows
	if err != nil {
		return false, err
	}
	defer os.Remove(src.Name())
	defer src.Close()
	if _, err := src.Write(make([]byte, 64<<10)); err != nil {
		return false, err
	}
	if err := src.Sync(); err != nil {
		return false, err
	}
	dst, err := os.CreateTemp(dir, ".vmhost-doctor.tmp-*")
	if err != nil {
		return false, err
	}
	defer os.Remove(dst.Name())
	defer dst.Close()
	err = unix.IoctlFileClone(int(dst.Fd()), int(src.Fd()))
	return err == nil, nil
}
