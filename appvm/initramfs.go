package appvm

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sync"

	"vmhost/initramfs"
	"vmhost/internal/atomicfile"
	"vmhost/kmod"
	"vmhost/vm"
)

// AgentModules are the kernel modules the guest agent needs when the AppVM
// kernel builds them as modules (Debian's and Ubuntu's do): the virtio PCI
// transport, the root and data disks, the NIC, ext4, and vsock with its
// virtio transport. Built-in ones are skipped.
var AgentModules = []string{"virtio_pci", "virtio_blk", "virtio_net", "ext4", "vsock", "vmw_vsock_virtio_transport"}

// agentOptionalModules are added when the module tree has them:
// crc32c_generic, which ext4 asks for through the crypto API for its
// metadata checksums and which a guest without modprobe cannot autoload;
// button and evdev, through which the agent sees the ACPI power button.
var agentOptionalModules = []string{"crc32c_generic", "button", "evdev"}

// initramfsBuild builds the guest-agent initramfs. The archive is named by
// a digest of what it holds (the vmhost binary and the module set), so a
// rebuilt binary or a changed module tree reaches the next boot, and an
// unchanged one reuses the file.
type initramfsBuild struct {
	mu sync.Mutex
	// binStat and binSum memoize the binary's digest: it is only hashed
	// again when its path, size or mtime change.
	binStat string
	binSum  [sha256.Size]byte
}

// initramfsFormat changes whenever the archive layout does, so that an
// archive written by an older vmhost is never reused.
const initramfsFormat = "vmhost-appvm-initramfs/2"

// InitramfsPath is where the AppVM initramfs with digest key is written:
// in the run directory (it holds no secret).
func InitramfsPath(l vm.Layout, key string) string { return initramfsPath(l.RunDir, key) }

func initramfsPath(runDir, key string) string {
	return filepath.Join(runDir, "appvm-initramfs-"+key+".cpio")
}

// initramfsMode is the AppVM initramfs's mode.
const initramfsMode = 0o644

// get returns the initramfs for the vmhost binary at bin and, when
// modulesDir is set, the agent's modules from that tree, which must be
// built for kernel's release.
func (b *initramfsBuild) get(runDir, bin, kernel, modulesDir string) (string, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	var mods []initramfs.Module
	if modulesDir != "" {
		var err error
		if mods, err = agentModules(kernel, modulesDir); err != nil {
			return "", err
		}
	}
	binSum, err := b.binaryDigest(bin)
	if err != nil {
		return "", err
	}
	h := sha256.New()
	fmt.Fprintf(h, "%s\nbinary %x\n", initramfsFormat, binSum)
	for _, m := range mods {
		fmt.Fprintf(h, "module %s %x\n", m.Name, sha256.Sum256(m.Data))
	}
	dst := initramfsPath(runDir, hex.EncodeToString(h.Sum(nil))[:32])
	// Readable by all: a confined VM's Cloud Hypervisor reads it as the
	// VM's uid. It holds the agent's binary and modules, no secret.
	if fi, err := os.Stat(dst); err == nil {
		if fi.Mode().Perm() != initramfsMode {
			if err := os.Chmod(dst, initramfsMode); err != nil {
				return "", fmt.Errorf("making the AppVM initramfs readable: %w", err)
			}
		}
		return dst, nil
	}
	if err := os.MkdirAll(filepath.Dir(dst), 0o700); err != nil {
		return "", err
	}
	err = atomicfile.Write(dst, initramfsMode, func(w io.Writer) error { return initramfs.ForGuestAgent(w, bin, mods) })
	if err != nil {
		return "", fmt.Errorf("writing the AppVM initramfs: %w", err)
	}
	return dst, nil
}

func (b *initramfsBuild) binaryDigest(bin string) ([sha256.Size]byte, error) {
	st, err := os.Stat(bin)
	if err != nil {
		return [sha256.Size]byte{}, fmt.Errorf("reading the vmhost binary for the initramfs: %w", err)
	}
	key := fmt.Sprintf("%s %d %d", bin, st.Size(), st.ModTime().UnixNano())
	if key == b.binStat {
		return b.binSum, nil
	}
	f, err := os.Open(bin)
	if err != nil {
		return [sha256.Size]byte{}, fmt.Errorf("reading the vmhost binary for the initramfs: %w", err)
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return [sha256.Size]byte{}, fmt.Errorf("reading the vmhost binary for the initramfs: %w", err)
	}
	copy(b.binSum[:], h.Sum(nil))
	b.binStat = key
	return b.binSum, nil
}

// agentModules resolves AgentModules in the tree dir, in load order, and
// checks that they were built for the release of kernel.
func agentModules(kernel, dir string) ([]initramfs.Module, error) {
	if kernel == "" {
		return nil, errors.New("appvm_modules is set but the AppVM boots no kernel (firmware only): the modules would not match")
	}
	tree, err := kmod.Open(dir)
	if err != nil {
		return nil, fmt.Errorf("appvm_modules: %w", err)
	}
	resolved, err := tree.Resolve(AgentModules, agentOptionalModules)
	if err != nil {
		return nil, fmt.Errorf("appvm_modules: %w", err)
	}
	release, err := kmod.KernelRelease(kernel)
	if err != nil {
		return nil, fmt.Errorf("checking appvm_modules against the kernel: %w", err)
	}
	if err := kmod.CheckVermagic(resolved, release); err != nil {
		return nil, fmt.Errorf("appvm_modules %s does not fit the kernel %s: %w", tree.Dir, kernel, err)
	}
	out := make([]initramfs.Module, len(resolved))
	for i, m := range resolved {
		out[i] = initramfs.Module{Name: m.Name, Data: m.Data}
	}
	return out, nil
}
