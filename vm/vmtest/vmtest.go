// Package vmtest holds test helpers for vm, appvm and api: a fake sysfs
// tree, a Host that writes a transcript of what it was asked to do and
// records its results through the records' owner (as the engine does),
// and a Service over a temp state dir, opened on a records.Registry, with
// a fixed clock and a deterministic random source. It exists only for
// tests.
package vmtest

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"vmhost/config"
	"vmhost/disk"
	"vmhost/events"
	"vmhost/qcow2"
	"vmhost/snapshot"
	"vmhost/store"
	"vmhost/vm"
	"vmhost/vm/record"
	"vmhost/vm/records"
)

// Sysfs describes a fake sysfs tree.
type Sysfs struct {
	Online  string              // devices/system/cpu/online, such as "0-7"
	Nested  bool                // module/kvm_intel/parameters/nested
	Bridges []string            // class/net/<br>/bridge
	Groups  map[string][]string // IOMMU group → PCI devices
	// Drivers overrides the driver a PCI device of Groups is bound to
	// (default vfio-pci; "" for none).
	Drivers map[string]string
}

// Write builds the tree under dir and returns dir.
func (s Sysfs) Write(t testing.TB, dir string) string {
	t.Helper()
	write := func(rel, content string) {
		p := filepath.Join(dir, rel)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("devices/system/cpu/online", s.Online+"\n")
	nested := "N"
	if s.Nested {
		nested = "Y"
	}
	write("module/kvm_intel/parameters/nested", nested+"\n")
	for _, b := range s.Bridges {
		if err := os.MkdirAll(filepath.Join(dir, "class/net", b, "bridge"), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	for g, devs := range s.Groups {
		gdir := filepath.Join(dir, "kernel/iommu_groups", g, "devices")
		if err := os.MkdirAll(gdir, 0o755); err != nil {
			t.Fatal(err)
		}
		for _, d := range devs {
			ddir := filepath.Join(dir, "bus/pci/devices", d)
			if err := os.MkdirAll(ddir, 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.Symlink("../../../kernel/iommu_groups/"+g, filepath.Join(ddir, "iommu_group")); err != nil {
				t.Fatal(err)
			}
			if err := os.Symlink("../../../../bus/pci/devices/"+d, filepath.Join(gdir, d)); err != nil {
				t.Fatal(err)
			}
			for name, v := range map[string]string{"vendor": "0x1af4", "device": "0x1041", "class": "0x020000"} {
				write(filepath.Join("bus/pci/devices", d, name), v+"\n")
			}
			drv, set := s.Drivers[d]
			if !set {
				drv = "vfio-pci"
			}
			if drv != "" {
				if err := os.MkdirAll(filepath.Join(dir, "bus/pci/drivers", drv), 0o755); err != nil {
					t.Fatal(err)
				}
				if err := os.Symlink("../../drivers/"+drv, filepath.Join(ddir, "driver")); err != nil {
					t.Fatal(err)
				}
			}
		}
	}
	return dir
}

// Host is a vm.Host (and an appvm.RootDisks) that records every call as a
// line ("provision vm1")
// and creates the files provisioning would (sparse), so views can stat
// them. Like the engine, it records its results through the records'
// owner: a provision display created, a boot state running, display
// booting. Setting a Fail* field makes that step fail with it.
type Host struct {
	vm.NoHost // the lifecycle actions: it runs no VMs
	Layout    vm.Layout
	// Records is where it records its results (Env.Service sets it).
	Records *records.Registry

	mu            sync.Mutex
	calls         []string
	FailPreflight error
	FailProvision error
	FailBoot      error
	FailStage     error
	FailHotAttach error
	FailHotDetach error
	// Gate, when set, makes Provision wait until it is closed.
	Gate chan struct{}
	// OnClaim, when set, is what Claim does (by default nothing).
	OnClaim func(rec *vm.Record, others []*vm.Record) error
}

func (h *Host) record(op string, rec *vm.Record) {
	h.mu.Lock()
	h.calls = append(h.calls, op+" "+rec.ID)
	h.mu.Unlock()
}

// Calls returns the transcript so far.
func (h *Host) Calls() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]string(nil), h.calls...)
}

// Transcript returns the calls as lines.
func (h *Host) Transcript() string { return strings.Join(h.Calls(), "\n") }

// Preflight records the call.
func (h *Host) Preflight(_ context.Context, rec *vm.Record) error {
	h.record("preflight", rec)
	return h.FailPreflight
}

// Claim does OnClaim, when set; it is not in the transcript.
func (h *Host) Claim(rec *vm.Record, others []*vm.Record) error {
	if h.OnClaim != nil {
		return h.OnClaim(rec, others)
	}
	return nil
}

// Provision records the call and creates sparse root and data volume files.
func (h *Host) Provision(_ context.Context, rec *vm.Record) error {
	if h.Gate != nil {
		<-h.Gate
	}
	h.record("provision", rec)
	if h.FailProvision != nil {
		return h.FailProvision
	}
	if err := os.MkdirAll(h.Layout.VMDir(rec.ID), 0o700); err != nil {
		return err
	}
	files := map[string]int64{h.Layout.RootDisk(rec.ID): 1 << 30}
	for _, v := range rec.Spec.Volumes {
		files[h.Layout.VolumeFile(rec.ID, v)] = int64(v.SizeGiB) << 30
	}
	for p, size := range files {
		f, err := os.Create(p)
		if err != nil {
			return err
		}
		err = f.Truncate(size)
		f.Close()
		if err != nil {
			return err
		}
	}
	_, err := h.Records.Update(rec.ID, func(r *vm.Record) { r.DisplayState = string(vm.StateCreated) })
	return err
}

// Balloon records the call ("balloon vm1 256").
func (h *Host) Balloon(_ context.Context, rec *vm.Record, mb uint64) error {
	h.record(fmt.Sprintf("balloon %d", mb), rec)
	return nil
}

// Usage reads nothing: the fake runs no process.
func (h *Host) Usage(*vm.Record) (*vm.Usage, error) { return nil, nil }

// Boot records the call, and the boot: state running, display booting;
// for a VM with a saved state, a resume ("resume vm1"): running, and the
// state consumed.
func (h *Host) Boot(_ context.Context, rec *vm.Record) error {
	if cur := h.Records.Get(rec.ID); cur != nil && cur.Suspended != nil {
		h.record("resume", rec)
		if h.FailBoot != nil {
			return h.FailBoot
		}
		_, err := h.Records.Update(rec.ID, func(r *vm.Record) {
			r.State, r.DisplayState = vm.StateRunning, string(vm.StateRunning)
			r.Suspended, r.FailureReason = nil, nil
		})
		return err
	}
	h.record("boot", rec)
	if h.FailBoot != nil {
		return h.FailBoot
	}
	_, err := h.Records.Update(rec.ID, func(r *vm.Record) {
		r.State = vm.StateRunning
		r.DisplayState = vm.DisplayBooting
		r.FailureReason = nil
	})
	return err
}

// HotAttach records the call ("hot-attach vm1 data1"): the fake's VMs
// take any volume.
func (h *Host) HotAttach(_ context.Context, rec *vm.Record, key string) error {
	h.record("hot-attach", &vm.Record{ID: rec.ID + " " + key})
	return h.FailHotAttach
}

// HotDetach records the call ("hot-detach vm1 data1"): the fake's guests
// release any volume.
func (h *Host) HotDetach(_ context.Context, rec *vm.Record, key string) error {
	h.record("hot-detach", &vm.Record{ID: rec.ID + " " + key})
	return h.FailHotDetach
}

// Rollback records the call and removes the VM's directory.
func (h *Host) Rollback(_ context.Context, rec *vm.Record) error {
	h.record("rollback", rec)
	return os.RemoveAll(h.Layout.VMDir(rec.ID))
}

// StageRootDisk records the call and copies base to the staged root disk
// (a plain copy: the fake's disks are only files).
func (h *Host) StageRootDisk(_ context.Context, rec *vm.Record, base string) error {
	h.record("stage-root", rec)
	if h.FailStage != nil {
		return h.FailStage
	}
	data, err := os.ReadFile(base)
	if err != nil {
		return err
	}
	return os.WriteFile(h.Layout.RootDiskNext(rec.ID), data, 0o600)
}

// SwapRootDisk records the call and renames the staged disk over the root.
func (h *Host) SwapRootDisk(_ context.Context, rec *vm.Record) error {
	h.record("swap-root", rec)
	err := os.Rename(h.Layout.RootDiskNext(rec.ID), h.Layout.RootDisk(rec.ID))
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	return err
}

// DropStagedRootDisk removes the staged disk.
func (h *Host) DropStagedRootDisk(rec *vm.Record) error {
	if err := os.Remove(h.Layout.RootDiskNext(rec.ID)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	return nil
}

// Suspend records the call and the suspend: stopped, with a saved state.
func (h *Host) Suspend(_ context.Context, rec *vm.Record) error {
	h.record("suspend", rec)
	_, err := h.Records.Update(rec.ID, func(r *vm.Record) {
		r.State, r.DisplayState = vm.StateStopped, string(vm.StateStopped)
		r.Suspended = &record.Suspension{At: time.Unix(1700000000, 0).UTC()}
	})
	return err
}

// DiscardSaved records the call ("discard vm1") and drops the saved state.
func (h *Host) DiscardSaved(_ context.Context, rec *vm.Record) error {
	h.record("discard", rec)
	_, err := h.Records.Update(rec.ID, func(r *vm.Record) { r.Suspended = nil })
	return err
}

// Snapshot records the call ("snapshot vm1 s1") and writes a small file
// per disk the VM owns into dir/disks, and dir/memory/config.json when
// memory is asked for and the VM runs, is paused or is suspended.
func (h *Host) Snapshot(_ context.Context, rec *vm.Record, sid, dir string, memory bool) ([]snapshot.Disk, bool, error) {
	h.record("snapshot", &vm.Record{ID: rec.ID + " " + sid})
	ids := []string{record.RootDiskID}
	for _, v := range rec.Spec.Volumes {
		if v.VolumeID == "" {
			ids = append(ids, v.ID)
		}
	}
	var disks []snapshot.Disk
	for _, id := range ids {
		if err := os.WriteFile(filepath.Join(dir, snapshot.DisksDir, id+".qcow2"), []byte("copy of "+id), 0o600); err != nil {
			return nil, false, err
		}
		d := snapshot.Disk{ID: id, Path: h.Layout.SnapshotDisk(sid, id), VirtualSizeBytes: 1 << 30}
		if id == record.RootDiskID {
			d.Backing = rec.RootBacking() // as the engine reads it in the copy's header
		}
		disks = append(disks, d)
	}
	saved := memory && (rec.State == vm.StateRunning || rec.State == vm.StatePaused || rec.Suspended != nil)
	if saved {
		if err := os.MkdirAll(filepath.Join(dir, snapshot.MemoryDir), 0o700); err != nil {
			return nil, false, err
		}
		if err := os.WriteFile(filepath.Join(dir, snapshot.MemoryDir, "config.json"), []byte("{}"), 0o600); err != nil {
			return nil, false, err
		}
	}
	return disks, saved, nil
}

// RestoreSnapshot records the call ("restore vm1 s1") and the restore:
// the saved state is sn's, or none, and apply's changes.
func (h *Host) RestoreSnapshot(_ context.Context, rec *vm.Record, sn *snapshot.Snapshot, apply func(*vm.Record)) error {
	h.record("restore", &vm.Record{ID: rec.ID + " " + sn.ID})
	_, err := h.Records.Update(rec.ID, func(r *vm.Record) {
		r.Suspended = nil
		if sn.Memory {
			r.Suspended = &record.Suspension{At: sn.CreatedAt, Snapshot: sn.ID}
		}
		apply(r)
	})
	return err
}

// Delete is Rollback: the fake runs nothing.
func (h *Host) Delete(ctx context.Context, rec *vm.Record) error { return h.Rollback(ctx, rec) }

// Env is a test environment: a state dir, a run dir, a fake sysfs, a
// config and a fake host.
type Env struct {
	StateDir, RunDir, SysfsDir string
	Config                     *config.Config
	Host                       *Host
	// Kernel and Base are an existing kernel file and a 1 GiB qcow2 base image.
	Kernel, Base string
	// Now is the fixed clock's time.
	Now time.Time
	// Seed seeds the deterministic random source of each Service.
	Seed uint64
	// DiskFree is what the services report as free space.
	DiskFree uint64
	// OnDiskFree, when set, runs each time a service asks for free space.
	OnDiskFree func()
	// Logger, when set, is the services' logger.
	Logger *slog.Logger
	// Events, when set, gets the services' events.
	Events events.Publisher
	// Records is the registry of the latest Service.
	Records *records.Registry
}

// NewEnv builds an Env: 8 online CPUs, nested supported, bridges br0 and
// br1, IOMMU group 7 with 0000:01:00.0 and 0000:01:00.1, group 8 with
// 0000:02:00.0; networks "default" (vmhost0) and "lab" (br1, MTU 9000);
// 16 CPUs and 65536 MiB of host capacity.
func NewEnv(t testing.TB) *Env {
	t.Helper()
	dir := t.TempDir()
	// AppVM image builds in the state dir are sealed (immutable, as
	// root): TempDir's own cleanup, which runs after this one, could not
	// remove them.
	t.Cleanup(func() { disk.RemoveAll(dir) })
	e := &Env{
		StateDir: filepath.Join(dir, "state"),
		RunDir:   filepath.Join(dir, "run"),
		SysfsDir: filepath.Join(dir, "sys"),
		Now:      time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC),
		Seed:     1,
		DiskFree: 1 << 40,
	}
	Sysfs{
		Online:  "0-7",
		Nested:  true,
		Bridges: []string{"br0", "br1"},
		Groups:  map[string][]string{"7": {"0000:01:00.0", "0000:01:00.1"}, "8": {"0000:02:00.0"}, "9": {"0000:04:00.0"}},
		Drivers: map[string]string{"0000:04:00.0": "e1000e"}, // still on its host driver
	}.Write(t, e.SysfsDir)
	cfg := config.Default()
	cfg.SysfsRoot = e.SysfsDir
	cfg.AppVMKernel = "/usr/lib/vmhost/appvm-vmlinux"
	cfg.Networks = append(cfg.Networks, config.Network{ID: "lab", Bridge: "br1", MTU: 9000})
	cfg.HostCPUs = 16
	cfg.HostMemoryMB = 65536
	// The kernel and base image below are the only host files creates
	// name; a test that names others adds their directory.
	cfg.HostPathRoots = []string{filepath.Join(dir, "boot")}
	e.Config = cfg
	e.Host = &Host{Layout: vm.Layout{StateDir: e.StateDir, RunDir: e.RunDir}}
	if err := os.MkdirAll(filepath.Join(dir, "boot"), 0o755); err != nil {
		t.Fatal(err)
	}
	e.Kernel = filepath.Join(dir, "boot", "vmlinux")
	if err := os.WriteFile(e.Kernel, []byte("kernel"), 0o644); err != nil {
		t.Fatal(err)
	}
	e.Base = filepath.Join(dir, "boot", "base.qcow2")
	if err := qcow2.Create(e.Base, 1<<30); err != nil {
		t.Fatal(err)
	}
	return e
}

// Service opens a vm.Service on the env's state dir (a new store and
// records each call, as a restarted agent would: Records, and the Host's,
// are the new ones; Events, when set, follows them).
func (e *Env) Service(t testing.TB) *vm.Service {
	t.Helper()
	st, err := store.Open(filepath.Join(e.StateDir, "vms"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	recs, err := records.Open(st, records.Options{Logger: e.Logger, Now: func() time.Time { return e.Now }})
	if err != nil {
		t.Fatal(err)
	}
	if e.Events != nil {
		recs.Watch(records.Publish(e.Events))
	}
	e.Records, e.Host.Records = recs, recs
	s, err := vm.New(vm.Options{
		StateDir: e.StateDir,
		RunDir:   e.RunDir,
		Config:   e.Config,
		Records:  recs,
		Host:     e.Host,
		Now:      func() time.Time { return e.Now },
		Rand:     &detReader{r: rand.New(rand.NewPCG(e.Seed, e.Seed))},
		DiskFree: func() (uint64, error) {
			if e.OnDiskFree != nil {
				e.OnDiskFree()
			}
			return e.DiskFree, nil
		},
		Logger: e.Logger,
	})
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// detReader adapts a math/rand/v2 source to io.Reader: deterministic
// bytes for generated ids and MACs.
type detReader struct {
	mu sync.Mutex
	r  *rand.Rand
}

var _ io.Reader = (*detReader)(nil)

func (c *detReader) Read(p []byte) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for i := range p {
		p[i] = byte(c.r.Uint32())
	}
	return len(p), nil
}
