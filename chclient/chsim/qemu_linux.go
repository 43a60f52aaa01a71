package chsim

import (
	"fmt"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"
)

// kvmBootsStockKernels reports whether qemu should use KVM for --sim-accel auto. It checks
// modules rather than booting a probe: /dev/kvm must open read-write and be backed by
// kvm_intel or kvm_amd. A PVM host (kvm_pvm) is refused: there `-cpu host` aborts ("failed
// to set MSR 0x10a") and the default CPU model hangs after "Probing EDD", so a stock kernel
// never boots.
func kvmBootsStockKernels() (bool, string) { return kvmBootsStockKernelsAt("/") }

// kvmBootsStockKernelsAt is kvmBootsStockKernels on the tree under root (for tests).
func kvmBootsStockKernelsAt(root string) (bool, string) {
	f, err := os.OpenFile(filepath.Join(root, "dev/kvm"), os.O_RDWR, 0)
	if err != nil {
		return false, "no usable /dev/kvm (" + err.Error() + "): TCG"
	}
	f.Close()
	if _, err := os.Stat(filepath.Join(root, "sys/module/kvm_pvm")); err == nil {
		return false, "/dev/kvm is PVM (kvm_pvm), which boots no stock kernel: TCG"
	}
	for _, m := range []string{"kvm_intel", "kvm_amd"} {
		if _, err := os.Stat(filepath.Join(root, "sys/module", m)); err == nil {
			return true, "/dev/kvm is " + m
		}
	}
	return false, "/dev/kvm is neither kvm_intel nor kvm_amd: TCG"
}

// socketpair makes a close-on-exec unix stream pair: the backend keeps parent, qemu
// inherits child.
func socketpair(name string) (parent, child *os.File, err error) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, nil, fmt.Errorf("creating the %s socketpair: %w", name, err)
	}
	return os.NewFile(uintptr(fds[0]), name), os.NewFile(uintptr(fds[1]), name+"-qemu"), nil
}
