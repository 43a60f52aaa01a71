package appvm

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"

	"vmhost/chclient"
	"vmhost/initramfs"
	"vmhost/internal/atomicfile"
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
		if err := FormatDataVolume(ctx, l.DataVolume(rec.ID, i), uint64(v.SizeGiB)<<30, fmt.Sprintf("data%d", i)); err != nil {
			return &vm.HostError{Kind: vm.HostStorage, Op: fmt.Sprintf("formatting data volume %d of AppVM %s", i, rec.ID), Err: err}
		}
		var err error
		rec, err = h.s.vms.Update(rec.ID, func(r *vm.Record) {
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

// FormatDataVolume writes an ext4 file system of size bytes as the qcow2
// image dst, replacing dst: mkfs.ext4 on a sparse raw temp file beside it,
// then qcow2.ConvertRaw, then a rename.
func FormatDataVolume(ctx context.Context, dst string, size uint64, label string) error {
	dir := filepath.Dir(dst)
	raw, err := os.CreateTemp(dir, ".format-*.raw")
	if err != nil {
		return err
	}
	defer os.Remove(raw.Name())
	defer raw.Close()
	if err := raw.Truncate(int64(size)); err != nil {
		return fmt.Errorf("sizing raw volume: %w", err)
	}
	// lazy_itable_init keeps the image sparse; the guest kernel zeroes the
	// inode tables in the background on first mount.
	cmd := exec.CommandContext(ctx, "mkfs.ext4", "-q", "-F", "-L", label,
		"-E", "lazy_itable_init=1,lazy_journal_init=1", raw.Name())
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("mkfs.ext4: %w: %s", err, strings.TrimSpace(string(out)))
	}
	tmp := filepath.Join(dir, "."+filepath.Base(dst)+".new")
	os.Remove(tmp)
	if err := qcow2.ConvertRaw(tmp, raw); err != nil {
		return err
	}
	if err := os.Rename(tmp, dst); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("placing data volume: %w", err)
	}
	// The caller records the volume formatted next: the rename must be
	// durable first, or a crash could leave that record over a blank disk.
	if err := atomicfile.SyncDir(dir); err != nil {
		return fmt.Errorf("placing data volume: %w", err)
	}
	return nil
}

// initramfsBuild builds the guest-agent initramfs once per process.
type initramfsBuild struct {
	mu   sync.Mutex
	path string
}

// InitramfsPath is where the AppVM initramfs is written: one per host, in
// the run directory, rebuilt from the running vmhost binary by the first
// AppVM boot of each agent process (so an upgraded binary reaches new
// boots). It holds no secret.
func InitramfsPath(l vm.Layout) string { return l.RunDir + "/appvm-initramfs.cpio" }

func (b *initramfsBuild) get(l vm.Layout, binary func() (string, error)) (string, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.path != "" {
		return b.path, nil
	}
	bin, err := binary()
	if err != nil {
		return "", fmt.Errorf("finding the vmhost binary for the initramfs: %w", err)
	}
	dst := InitramfsPath(l)
	if err := os.MkdirAll(filepath.Dir(dst), 0o700); err != nil {
		return "", err
	}
	f, err := os.CreateTemp(filepath.Dir(dst), ".initramfs-*")
	if err != nil {
		return "", err
	}
	defer os.Remove(f.Name())
	if err := initramfs.ForGuestAgent(f, bin); err != nil {
		f.Close()
		return "", fmt.Errorf("writing the AppVM initramfs: %w", err)
	}
	if err := f.Close(); err != nil {
		return "", err
	}
	if err := os.Rename(f.Name(), dst); err != nil {
		return "", err
	}
	b.path = dst
	return dst, nil
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
		p, err := h.s.initrd.get(h.s.vms.Layout(), h.s.binary)
		if err != nil {
			return &vm.HostError{Kind: vm.HostInternal, Op: "booting AppVM " + rec.ID, Err: err}
		}
		cfg.Payload.Initramfs = p
	}
	if _, err := h.s.guests.listen(rec.ID); err != nil {
		return &vm.HostError{Kind: vm.HostHypervisor, Op: "booting AppVM " + rec.ID, Err: err}
	}
	// A new boot: the live facts of the previous one no longer hold.
	_, err := h.s.vms.Update(rec.ID, func(r *vm.Record) {
		if g := r.AppVM.Guest; g != nil {
			g.BootID, g.LastHeartbeatAt, g.Lease, g.Health, g.HealthStreak, g.LogStreamDetached = "", nil, nil, "", 0, false
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
