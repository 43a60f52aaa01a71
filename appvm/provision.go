package appvm

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"time"

	"vmhost/chclient"
	"vmhost/initramfs"
	"vmhost/internal/atomicfile"
	"vmhost/kmod"
	"vmhost/qcow2"
	"vmhost/vm"
	"vmhost/vm/engine"
)

// StepFormat is the provisioning step (vm.Runtime.Steps) of formatting
// AppVM data volume n as ext4; until it is recorded the volume is new, and
// a blank volume the engine created in its place is replaced.
func StepFormat(n int) string { return fmt.Sprintf("ext4_data%d", n) }

// hooks implements engine.AppVMHooks.
type hooks struct{ s *Service }

var _ engine.AppVMHooks = hooks{}

// Provision formats the AppVM's data volumes: ext4 made by mkfs.ext4 on a
// sparse raw file of the volume's size, converted to qcow2 (only written
// clusters are allocated). mkfs.ext4 (e2fsprogs) must be installed.
func (h hooks) Provision(ctx context.Context, rec *vm.Record) error {
	l := h.s.vms.Layout()
	for i, v := range rec.Spec.Volumes {
		if rec.Runtime.Done(StepFormat(i)) {
			continue
		}
		if err := os.MkdirAll(l.VMDir(rec.ID), 0o700); err != nil {
			return &vm.HostError{Kind: vm.HostStorage, Op: "creating VM directory", Err: err}
		}
		if err := qcow2.CreateExt4(ctx, l.DataVolume(rec.ID, v.ID), uint64(v.SizeGiB)<<30, v.ID); err != nil {
			return &vm.HostError{Kind: vm.HostStorage, Op: fmt.Sprintf("formatting data volume %d of AppVM %s", i, rec.ID), Err: err}
		}
		var err error
		rec, err = h.s.vms.Records().Update(rec.ID, func(r *vm.Record) {
			if r.Runtime == nil {
				r.Runtime = &vm.Runtime{}
			}
			for _, st := range []string{vm.StepData(i), StepFormat(i)} {
				if !slices.Contains(r.Runtime.Steps, st) {
					r.Runtime.Steps = append(r.Runtime.Steps, st)
				}
			}
		})
		if err != nil {
			return &vm.HostError{Kind: vm.HostStorage, Op: "recording data volume of AppVM " + rec.ID, Err: err}
		}
	}
	return nil
}

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
	if _, err := os.Stat(dst); err == nil {
		return dst, nil
	}
	if err := os.MkdirAll(filepath.Dir(dst), 0o700); err != nil {
		return "", err
	}
	err = atomicfile.Write(dst, 0o600, func(w io.Writer) error { return initramfs.ForGuestAgent(w, bin, mods) })
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

// ErrNoAppVMKernel is returned when an AppVM is booted on a host whose
// configuration names no AppVM kernel (appvm_kernel).
var ErrNoAppVMKernel = errors.New("the host configuration sets no appvm_kernel: AppVMs cannot boot on this host")

// PrepareBoot completes the vm.create body of an AppVM (the kernel from
// the host configuration, the guest-agent initramfs) and starts listening
// for its guest agent on <vsock.sock>_1024. The initramfs holds the vmhost
// binary itself as /init, so in production that binary must be static
// (CGO_ENABLED=0).
func (h hooks) PrepareBoot(ctx context.Context, rec *vm.Record, cfg *chclient.VmConfig) error {
	if cfg.Payload == nil {
		cfg.Payload = &chclient.PayloadConfig{}
	}
	if cfg.Payload.Kernel == "" && cfg.Payload.Firmware == "" {
		cfg.Payload.Kernel = h.s.vms.Config().AppVMKernel
	}
	if cfg.Payload.Kernel == "" && cfg.Payload.Firmware == "" {
		return &vm.HostError{Kind: vm.HostInternal, Op: "booting AppVM " + rec.ID, Err: ErrNoAppVMKernel}
	}
	if cfg.Payload.Initramfs == "" {
		bin, err := h.s.binary()
		if err != nil {
			return &vm.HostError{Kind: vm.HostInternal, Op: "booting AppVM " + rec.ID, Err: fmt.Errorf("finding the vmhost binary for the initramfs: %w", err)}
		}
		p, err := h.s.initrd.get(h.s.vms.Layout().RunDir, bin, cfg.Payload.Kernel, h.s.vms.Config().AppVMModules)
		if err != nil {
			return &vm.HostError{Kind: vm.HostInternal, Op: "booting AppVM " + rec.ID, Err: err}
		}
		cfg.Payload.Initramfs = p
	}
	if _, err := h.s.guests.listen(rec.ID); err != nil {
		return &vm.HostError{Kind: vm.HostHypervisor, Op: "booting AppVM " + rec.ID, Err: err}
	}
	// A new boot: the live facts of the previous one, and its workload's
	// end, no longer hold.
	_, err := h.s.vms.Records().Update(rec.ID, func(r *vm.Record) {
		if g := r.AppVM.Guest; g != nil {
			g.BootID, g.LastHeartbeatAt, g.Lease, g.Health, g.HealthStreak, g.LogStreamDetached = "", nil, nil, "", 0, false
			g.ExitCode, g.ExitSignal, g.Fatal = nil, 0, ""
		}
	})
	if err != nil {
		h.s.guests.forget(rec.ID)
		return &vm.HostError{Kind: vm.HostStorage, Op: "booting AppVM " + rec.ID, Err: err}
	}
	return nil
}

// Shutdown asks the guest agent to stop the workload and power off.
func (h hooks) Shutdown(_ context.Context, rec *vm.Record) error { return h.s.guests.stop(rec.ID) }

// Adopt listens again for the guest agent of a running AppVM found at
// agent start; the view shows log_stream_detached until it reconnects.
func (h hooks) Adopt(ctx context.Context, rec *vm.Record) error { return h.s.guests.adopt(ctx, rec) }

// Forget closes the AppVM's session (VM deleted).
func (h hooks) Forget(rec *vm.Record) { h.s.guests.forget(rec.ID) }

// Settle waits (at most a second) for the guest agent's connection to end.
func (h hooks) Settle(rec *vm.Record) { h.s.guests.settle(rec.ID, time.Second) }

// Rollback closes the session and removes the workload logs; the engine
// removes the disks.
func (h hooks) Rollback(_ context.Context, rec *vm.Record) error {
	h.s.guests.forget(rec.ID)
	p := WorkloadLog(h.s.vms.Layout(), rec.ID)
	for _, f := range []string{p, p + ".1"} {
		if err := os.Remove(f); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return err
		}
	}
	return nil
}
