package chsim

import (
	"os"
	"path/filepath"
	"syscall"
)

// childProcAttr makes a child (qemu, vhost-device-vsock) die with the backend, even when
// the backend is killed without a chance to stop it.
func childProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}

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
