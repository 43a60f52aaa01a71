package engine

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"sync"
	"time"

	"vmhost/config"
	"vmhost/disk"
	"vmhost/jail"
	"vmhost/qcow2"
	"vmhost/qmp"
	"vmhost/seed"
	"vmhost/tap"
	"vmhost/vm/record"
	"vmhost/vm/records"
)

// Program is an external program the engine runs: a binary and the
// arguments that come before its own flags (["sim-ch"] when Binary is the
// vmhost executable running a simulator).
type Program struct {
	Binary  string
	PreArgs []string
	// Env is the program's environment; nil means the agent's.
	Env []string
	// Jail is what the program needs in a VM's jail beyond what the
	// engine gives every VM's process of its kind (its binds and
	// devices; the program's own files are found by jail.ExecFiles): a
	// simulator's guest side, say.
	Jail jail.Exec
	// ExecRunDir mounts the VM's run directory executable in the
	// program's jail (noexec otherwise): the simulator in dev mode runs
	// the workload from the image tree the engine unpacks there.
	ExecRunDir bool
}

// Options configure an Engine. Config, Records, StateDir and RunDir are
// required.
type Options struct {
	Config *config.Config
	// Records owns the VM records the engine works on and records its
	// results in (package vm/records).
	Records *records.Registry
	// Guest is the host end of the AppVMs' guest agents (appvm.Guests);
	// nil on a host of classic VMs only.
	Guest Guest
	// StateDir and RunDir are the agent's state and run directories (the
	// record.Layout of every VM).
	StateDir, RunDir string
	// CH and QSD are Cloud Hypervisor and qemu-storage-daemon; an empty
	// Binary means Config.Binaries.
	CH, QSD Program
	// Taps creates taps, bridge ports and anti-spoof rules. Nil means this
	// host cannot (an agent without CAP_NET_ADMIN): creating a VM with an
	// interface then fails with a HostNetwork error carrying NoTapsReason.
	Taps         *tap.Handle
	NoTapsReason string
	// Jail confines the VMs' processes (jail.go); nil, or a Jailer that
	// is not Enabled, runs them unconfined.
	Jail *jail.Jailer
	// AppVMsUnconfined, when set, says why AppVMs run unconfined while
	// classic VMs are confined: the CH simulator's process-mode guest runs
	// the workload on the host, which needs what a jail takes away.
	AppVMsUnconfined string
	// HostCPUs is the vCPU hot-add ceiling; 0 means Config.HostCPUs, or
	// runtime.NumCPU() when that is 0 too.
	HostCPUs int
	// SimGuestRoot, when set, is where the CH simulator runs an AppVM's
	// workload, given the VM's vsock socket (chsim.GuestRoot): before
	// each boot the engine unpacks the VM's root disk there (simroot.go),
	// so that the simulated guest runs the image's own tree. serve --dev
	// sets it; nil leaves the simulator's directory alone.
	SimGuestRoot func(vsockSocket string) string
	// StopGrace is how long a VMM gets to exit after vmm.shutdown (and
	// again after SIGTERM); 0 means 5 seconds.
	StopGrace time.Duration
	Logger    *slog.Logger
	// Now gives the time of failure reasons; default time.Now.
	Now func() time.Time
}

// Engine is the production vm.Host: it provisions VMs (image download,
// disk copy, data volumes, seed, taps, qemu-storage-daemon), boots them in
// Cloud Hypervisor, supervises them (monitor.go), carries out lifecycle
// actions and, at Recover, reconciles the host with the records
// (recover.go). A provision records its steps (Runtime.Steps) with its
// result, or with its failure, so Rollback removes exactly what was made.
//
// New makes it; Recover must run before any other call. Its methods are
// safe for concurrent use; the caller holds the VM's action lock
// (records.Registry.Lock) for each action.
type Engine struct {
	o     Options
	lay   record.Layout
	log   *slog.Logger
	cache *disk.Cache
	recs  *records.Registry
	bg    sync.WaitGroup
	mon   watchers // the monitors of running VMs (monitor.go)
	// removals are the waiters for CH's device-removed events (volumes.go).
	removals removals
	// fw watches the running VMs' files (filewatch.go); nil means every
	// monitor polls.
	fw     *fileWatch
	starts sync.Once

	// consoleCtx ends the console keepers (console.go) at Close.
	consoleCtx  context.Context
	consoleStop context.CancelFunc
	cons        consoles

	// pmu guards provs: the provisions in progress, so that a forced
	// delete can cancel one (a stalled download, a long copy).
	pmu   sync.Mutex
	provs map[string]*provisionJob

	// cidMu guards cidsGiven: the vsock CIDs allocCID gave out that
	// their records may not hold yet, by VM id.
	cidMu     sync.Mutex
	cidsGiven map[string]uint32

	// jailMu guards jailGiven: the jail ids given to records that had
	// none whose writes are not stored yet (jail.go). It is taken under
	// the records' lock, never the other way round.
	jailMu    sync.Mutex
	jailGiven map[uint32]bool

	// mu guards live: the qemu-storage-daemon of each VM that is
	// provisioned but not running (a running VM's monitor owns its
	// processes).
	mu   sync.Mutex
	live map[string]*qmp.QSD
}

// New returns an engine over the directories of o; Start it before use.
func New(o Options) (*Engine, error) {
	if o.Config == nil || o.Records == nil || o.StateDir == "" || o.RunDir == "" {
		return nil, errors.New("engine.New: Config, Records, StateDir and RunDir are required")
	}
	if o.CH.Binary == "" {
		o.CH.Binary = o.Config.Binaries.CloudHypervisor
	}
	if o.QSD.Binary == "" {
		o.QSD.Binary = o.Config.Binaries.QemuStorageDaemon
	}
	if o.HostCPUs <= 0 {
		o.HostCPUs = o.Config.HostCPUs // what admission counts against
	}
	if o.HostCPUs <= 0 {
		o.HostCPUs = runtime.NumCPU()
	}
	if o.StopGrace <= 0 {
		o.StopGrace = 5 * time.Second
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	if o.NoTapsReason == "" {
		o.NoTapsReason = "this agent cannot create taps"
	}
	lay := record.Layout{StateDir: filepath.Clean(o.StateDir), RunDir: filepath.Clean(o.RunDir)}
	if err := lay.CheckRunDir(); err != nil {
		return nil, err
	}
	c, err := disk.NewCache(filepath.Join(lay.StateDir, "images"), disk.CacheOptions{
		MaxBytes:    o.Config.ImageMaxBytes,
		IdleTimeout: time.Duration(o.Config.DownloadIdleSecs) * time.Second,
		Deny:        o.Config.FetchDenyPrefixes(),

		MaxTotalBytes: o.Config.ImageCacheMaxBytes,
	})
	if err != nil {
		return nil, fmt.Errorf("opening image cache: %w", err)
	}
	e := &Engine{o: o, lay: lay, log: o.Logger, cache: c, recs: o.Records, live: map[string]*qmp.QSD{}, provs: map[string]*provisionJob{}, cidsGiven: map[string]uint32{}, jailGiven: map[uint32]bool{}}
	e.consoleCtx, e.consoleStop = context.WithCancel(context.Background())
	if e.fw, err = newFileWatch(); err != nil {
		e.log.Warn("inotify is unavailable; running VMs' files are polled", "err", err)
	}
	return e, nil
}

// ImageCache is the verified image cache classic creates download into.
func (e *Engine) ImageCache() *disk.Cache { return e.cache }

// Recover reconciles the host with the records (recover.go), once: running
// VMs are adopted and watched (a running AppVM's guest end too), dead ones
// ended, interrupted provisions resumed or rolled back, and orphan
// processes, taps and directories reaped; Recovery reports it. Call it
// after New and before anything else. Close releases the watched VMs
// without stopping them.
func (e *Engine) Recover() {
	e.starts.Do(func() {
		e.serveConsoleAttach()
		e.recoverHost()
	})
}

// Wait blocks until the provisions Start resumed have finished.
func (e *Engine) Wait() { e.bg.Wait() }

func (e *Engine) layout() record.Layout { return e.lay }

// current returns the newest version of the record of id (the Service
// hands the Host the version it had), or rec itself when id is not
// stored.
func (e *Engine) current(rec *record.Record) *record.Record {
	if r := e.recs.Get(rec.ID); r != nil {
		return r
	}
	return rec
}

// update stores f applied to the record of id.
func (e *Engine) update(id string, f func(*record.Record)) (*record.Record, error) {
	r, err := e.recs.Update(id, f)
	if err != nil {
		return nil, &record.HostError{Kind: record.HostStorage, Op: "recording VM " + id, Err: err}
	}
	return r, nil
}

// step records a completed provisioning step with f (the image step,
// whose display change the caller sees; the others are recorded together
// by provision).
func (e *Engine) step(id, name string, f func(*record.Record)) (*record.Record, error) {
	defer testStopAt(name) // crash tests (recover_hook.go): done and recorded
	return e.update(id, func(r *record.Record) {
		addSteps(r, name)
		f(r)
	})
}

// addSteps adds the provisioning steps names to r's, each once.
func addSteps(r *record.Record, names ...string) {
	if r.Runtime == nil {
		r.Runtime = &record.Runtime{}
	}
	for _, n := range names {
		if !slices.Contains(r.Runtime.Steps, n) {
			r.Runtime.Steps = append(r.Runtime.Steps, n)
		}
	}
}

// Provision carries out the provisioning steps not yet recorded as done:
// image download (display downloading), root disk copy (display creating),
// data volumes, seed, run directory, taps, then launches
// qemu-storage-daemon, which grows the root disk to disk.size_gib before
// exporting it. On error the steps done so far stay recorded for Rollback.
// A forced delete cancels it (Delete): the error then wraps
// record.ErrDeleted.
func (e *Engine) Provision(ctx context.Context, rec *record.Record) error {
	ctx, job, err := e.beginProvision(ctx, rec.ID)
	if err != nil {
		return err
	}
	return e.endProvision(rec.ID, job, e.provision(ctx, rec))
}

// provisionJob is a provision in progress.
type provisionJob struct {
	cancel    context.CancelFunc
	done      chan struct{} // closed when the provision returned
	cancelled bool          // by a delete
}

// beginProvision registers the provision of id, unless a delete of id is
// recorded: a delete that comes later cancels it.
func (e *Engine) beginProvision(ctx context.Context, id string) (context.Context, *provisionJob, error) {
	e.pmu.Lock()
	defer e.pmu.Unlock()
	if r := e.recs.Get(id); r != nil && r.Deleting {
		return nil, nil, fmt.Errorf("provisioning VM %s: %w", id, record.ErrDeleted)
	}
	ctx, cancel := context.WithCancel(ctx)
	j := &provisionJob{cancel: cancel, done: make(chan struct{})}
	e.provs[id] = j
	return ctx, j, nil
}

// endProvision ends the provision job of id; a provision a delete
// cancelled fails with record.ErrDeleted.
func (e *Engine) endProvision(id string, j *provisionJob, err error) error {
	e.pmu.Lock()
	if e.provs[id] == j {
		delete(e.provs, id)
	}
	cancelled := j.cancelled
	e.pmu.Unlock()
	j.cancel()
	close(j.done)
	if cancelled && err != nil {
		return fmt.Errorf("provisioning VM %s: %w (%w)", id, record.ErrDeleted, err)
	}
	return err
}

// cancelProvision cancels the provision of id in progress, if any, and
// waits until it returned (the download or copy stopped and removed its
// temp file). It reports whether there was one.
func (e *Engine) cancelProvision(id string) bool {
	e.pmu.Lock()
	j := e.provs[id]
	if j != nil {
		j.cancelled = true
		j.cancel()
	}
	e.pmu.Unlock()
	if j == nil {
		return false
	}
	<-j.done
	return true
}

// provision writes the record twice at most: the create's record, stored
// before any host work, is the intent; the steps done, the vsock CID, the
// storage daemon's identity and display created are its result, recorded
// together at the end (the image step alone is recorded when done, for
// its display change). The result of a create with auto_boot is staged
// instead, and stored with the boot's write. A failed provision records
// the steps it did, for Rollback. An agent that dies in between needs no record of each step:
// recovery rolls a synchronous create back by name (rollBackInterrupted),
// redoes a background one's unrecorded steps (removeUnrecordedFiles; taps
// are created idempotently), and reaps the unrecorded processes.
func (e *Engine) provision(ctx context.Context, rec *record.Record) (err error) {
	id := rec.ID
	l := e.layout()
	// A VM created while VMs ran unconfined gets its jail first: the
	// intent, before any host work (taps are made for its uid).
	rec, err = e.recordJail(e.current(rec))
	if err != nil {
		return err
	}
	cgroupMade := e.startCgroup(rec)
	if cgroupMade != nil {
		defer cgroupMade()
	}
	sp := &rec.Spec
	var done []string // steps done here and not recorded yet
	did := func(step string) {
		done = append(done, step)
		testStopAt(step) // crash tests (recover_hook.go): done, not recorded
	}
	defer func() {
		if err != nil && len(done) > 0 {
			if _, uerr := e.update(id, func(r *record.Record) { addSteps(r, done...) }); uerr != nil {
				e.log.Error("recording what a failed provision made; the agent's next start reaps it", "id", id, "steps", done, "err", uerr)
			}
		}
	}()

	if sp.Image != nil && !rec.Runtime.Done(record.StepRootDisk) {
		// The cached image must stay until the root disk is copied from
		// it: neither a DELETE of the cache entry nor eviction takes it.
		release := e.cache.Use(sp.Image.ContentSHA256)
		defer release()
	}
	if sp.Image != nil && !rec.Runtime.Done(record.StepImage) {
		path, err := e.cache.Fetch(ctx, sp.Image.FetchURL, sp.Image.ContentSHA256, nil)
		if err != nil {
			return &record.HostError{Kind: record.HostStorage, Op: "downloading image " + sp.Image.ImageID, Err: err}
		}
		h, err := qcow2.ReadHeaderFile(path)
		if err != nil {
			return &record.HostError{Kind: record.HostStorage, Op: "reading downloaded image " + sp.Image.ImageID, Err: err}
		}
		if rec, err = e.step(id, record.StepImage, func(r *record.Record) {
			r.Base = &record.BaseImage{Path: path, VirtualSizeBytes: h.Size}
			r.DisplayState = record.DisplayCreating
		}); err != nil {
			return err
		}
	}
	if rec.Base == nil {
		return &record.HostError{Kind: record.HostInternal, Op: "provisioning VM " + id, Err: errors.New("no base image recorded")}
	}

	if !rec.Runtime.Done(record.StepRootDisk) {
		if err := os.MkdirAll(l.VMDir(id), 0o700); err != nil {
			return &record.HostError{Kind: record.HostStorage, Op: "creating VM directory", Err: err}
		}
		var err error
		if sid := sp.FromSnapshot; sid != "" {
			// A snapshot's copy of a VM's disk, as it was: an overlay's
			// copy backs onto the build (rec.RootBacking, rec.Base).
			err = copySnapshotDisk(ctx, l.SnapshotDisk(sid, record.RootDiskID), l.RootDisk(id))
		} else {
			err = e.makeRootDisk(ctx, rec, rec.Base.Path, l.RootDisk(id))
		}
		if err != nil {
			return err
		}
		did(record.StepRootDisk)
	}
	for i := range sp.Volumes {
		if rec.Runtime.Done(record.StepData(i)) {
			continue
		}
		if err := e.makeDataVolume(ctx, rec, i); err != nil {
			return err
		}
		did(record.StepData(i))
	}
	if sp.CloudInit != nil && !rec.Runtime.Done(record.StepSeed) {
		files, err := seed.Render(e.seedConfig(rec))
		if err != nil {
			return &record.HostError{Kind: record.HostStorage, Op: "rendering cloud-init seed", Err: err}
		}
		if _, err := seed.WriteFile(l.Seed(id), files); err != nil {
			return &record.HostError{Kind: record.HostStorage, Op: "writing cloud-init seed", Err: err}
		}
		did(record.StepSeed)
	}
	if !rec.Runtime.Done(record.StepRunDir) {
		if err := os.MkdirAll(l.RunVMDir(id), 0o700); err != nil {
			return &record.HostError{Kind: record.HostInternal, Op: "creating run directory", Err: err}
		}
		did(record.StepRunDir)
	}
	for i := range rec.NICs {
		if rec.Runtime.Done(record.StepTap(i)) {
			continue
		}
		if err := e.createTap(ctx, rec, i); err != nil {
			return err
		}
		did(record.StepTap(i))
	}
	qsd, err := e.ensureQSD(ctx, rec, cgroupMade)
	if err != nil {
		return err
	}
	testStopAt(HookQSD) // crash tests (recover_hook.go): running, not recorded
	result := func(r *record.Record) {
		addSteps(r, done...)
		e.ensureCID(r)
		if qsd != nil {
			r.Runtime.QSD = qsd
		}
		r.DisplayState = string(record.StateCreated)
	}
	if rec.Spec.AutoBoot {
		// The boot that follows stores the result with its own write (or,
		// failing, alone: Boot saves it); an agent that dies in between
		// finds the create interrupted, as before the result.
		_, err = e.recs.Stage(id, result)
		if err != nil {
			err = &record.HostError{Kind: record.HostStorage, Op: "recording VM " + id, Err: err}
		}
	} else {
		_, err = e.update(id, result)
	}
	if err != nil {
		return err
	}
	done = nil
	testStopAt(HookProvisioned) // crash tests: the result recorded, or staged (auto_boot)
	return nil
}

// makeDataVolume creates data volume i of rec: a blank qcow2 image, or
// for a volume its guest mounts (an AppVM's) an ext4 file system made by
// mkfs.ext4 on a sparse raw file and converted to qcow2 (only written
// clusters are allocated; e2fsprogs must be installed; it replaces a
// leftover at its name); for a VM made from a snapshot, a copy of the
// snapshot's.
func (e *Engine) makeDataVolume(ctx context.Context, rec *record.Record, i int) error {
	v := rec.Spec.Volumes[i]
	path := e.lay.DataVolume(rec.ID, v.ID)
	size := uint64(v.SizeGiB) << 30
	if sid := rec.Spec.FromSnapshot; sid != "" {
		// A VM made from a snapshot gets copies of its volumes.
		if err := disk.CopyImage(ctx, e.lay.SnapshotDisk(sid, v.ID), path); err != nil {
			return &record.HostError{Kind: record.HostStorage, Op: "copying volume " + v.ID + " of snapshot " + sid, Err: err}
		}
		return nil
	}
	if v.Mounted() {
		if err := qcow2.CreateExt4(ctx, path, size, v.ID); err != nil {
			return &record.HostError{Kind: record.HostStorage, Op: fmt.Sprintf("formatting data volume %d of AppVM %s", i, rec.ID), Err: err}
		}
		return nil
	}
	if err := qcow2.Create(path, size); err != nil {
		return &record.HostError{Kind: record.HostStorage, Op: "creating data volume " + record.VolumeID(i), Err: err}
	}
	return nil
}

// ensureCID gives r a vsock CID unless it has one.
func (e *Engine) ensureCID(r *record.Record) {
	if r.Runtime == nil {
		r.Runtime = &record.Runtime{}
	}
	if r.Runtime.VsockCID == 0 {
		r.Runtime.VsockCID = e.allocCID(r.ID)
	}
}

// allocCID returns the smallest vsock CID ≥ 3 that no other record holds
// and no other allocation gave out. It runs inside a record update, and
// the updates of different VMs run side by side, so a CID given out is
// remembered until its record is stored with it (or is gone).
func (e *Engine) allocCID(id string) uint32 {
	e.cidMu.Lock()
	defer e.cidMu.Unlock()
	used := map[uint32]bool{}
	for _, r := range e.recs.All() {
		if r.ID != id && r.Runtime != nil {
			used[r.Runtime.VsockCID] = true
		}
	}
	for other, cid := range e.cidsGiven {
		if r := e.recs.Get(other); other == id || r == nil || (r.Runtime != nil && r.Runtime.VsockCID != 0) {
			delete(e.cidsGiven, other) // the records say it now
			continue
		}
		used[cid] = true
	}
	cid := uint32(3)
	for used[cid] {
		cid++
	}
	e.cidsGiven[id] = cid
	return cid
}

// seedConfig is the seed of a cloud-init VM: interface 0 takes
// cloud_init.network, the others their own static addresses.
func (e *Engine) seedConfig(rec *record.Record) seed.Config {
	ci := rec.Spec.CloudInit
	id := ci.Identity(rec.ID)
	c := seed.Config{
		InstanceID:        id.InstanceID,
		Hostname:          id.Hostname,
		User:              id.User,
		SSHAuthorizedKeys: ci.SSHAuthorizedKeys,
		Password:          rec.Secrets.Password.Reveal(),
		ConsoleAutologin:  ci.ConsoleAutologin,
		Sudo:              ci.Sudo,
	}
	for i, nic := range rec.NICs {
		itf := seed.Interface{MAC: nic.MAC}
		if i == 0 && ci.Network != nil {
			itf.IPv4 = seedAddr(ci.Network.IPv4.Address, ci.Network.IPv4.Gateway, ci.Network.IPv4.DNS)
			if v6 := ci.Network.IPv6; v6 != nil {
				itf.IPv6 = seedAddr(v6.Address, v6.Gateway, v6.DNS)
			}
		} else if i < len(rec.Spec.Nets) {
			n := rec.Spec.Nets[i]
			if n.IPv4 != nil {
				itf.IPv4 = seedAddr(n.IPv4.Address, n.IPv4.Gateway, n.IPv4.DNSServers)
			}
			if n.IPv6 != nil {
				itf.IPv6 = seedAddr(n.IPv6.Address, n.IPv6.Gateway, n.IPv6.DNSServers)
			}
		}
		c.Interfaces = append(c.Interfaces, itf)
	}
	return c
}

func seedAddr(addr, gw string, dns []string) *seed.Address {
	return &seed.Address{Address: addr, Gateway: gw, DNS: dns}
}

// createTap creates interface i's tap, puts it on its bridge with the
// network's policy (request overrides first) and guards it when spoof
// guarding applies. A failure after the tap exists deletes it again.
func (e *Engine) createTap(ctx context.Context, rec *record.Record, i int) error {
	nic := rec.NICs[i]
	var np *record.NetSpec
	if i < len(rec.Spec.Nets) {
		np = &rec.Spec.Nets[i]
	}
	cfg := e.o.Config
	nv := record.ResolveNet(cfg, np, nic)
	policy, _ := cfg.Network(nv.NetworkID)
	isolated, guard := policy.Isolated, policy.SpoofGuard
	if nv.Isolated != nil {
		isolated = *nv.Isolated
	}
	if nv.SpoofGuard != nil {
		guard = *nv.SpoofGuard
	}
	fail := func(op string, err error) error {
		return &record.HostError{Kind: record.HostNetwork, Op: op, Err: err}
	}
	if e.o.Taps == nil {
		return fail("creating tap "+nic.Tap, errors.New(e.o.NoTapsReason))
	}
	tc := tap.TapConfig{Name: nic.Tap, MTU: int(nv.MTU), VMID: rec.ID, Index: i}
	if rec.Jail != nil && e.jailer() != nil {
		tc.Owner = int(rec.Jail.UID) // a confined CH attaches as the owner
	}
	if err := e.o.Taps.Create(ctx, tc); err != nil {
		return fail("creating tap "+nic.Tap, err)
	}
	undo := func(err error) error {
		if derr := e.o.Taps.Delete(context.Background(), nic.Tap); derr != nil {
			e.o.Logger.Error("deleting tap after failed setup", "tap", nic.Tap, "err", derr)
		}
		return err
	}
	var vlan uint16
	if nv.VLANTag != nil {
		vlan = uint16(*nv.VLANTag)
	}
	if err := e.o.Taps.Attach(ctx, nic.Tap, nv.Bridge, tap.PortOptions{Isolated: isolated, VLAN: vlan}); err != nil {
		return undo(fail("connecting VM "+rec.ID, err)) // err names the tap, the bridge and what failed
	}
	if guard {
		r, err := guardRule(nic, nv, i, rec.Spec.CloudInit)
		if err != nil {
			return undo(fail("guarding tap "+nic.Tap, err))
		}
		if err := e.o.Taps.Guard(ctx, r); err != nil {
			return undo(fail("guarding tap "+nic.Tap, err))
		}
	}
	return nil
}

// guardRule is the anti-spoof rule of an interface: its MAC, its static
// addresses (interface 0 of a cloud-init VM may take them from
// cloud_init.network) and allowed_ips.
func guardRule(nic record.NIC, nv record.NetView, i int, ci *record.CloudInitSpec) (tap.GuardRule, error) {
	mac, err := net.ParseMAC(nic.MAC)
	if err != nil {
		return tap.GuardRule{}, err
	}
	r := tap.GuardRule{Tap: nic.Tap, MAC: mac}
	v4, v6 := nv.IPv4, nv.IPv6
	if i == 0 && ci != nil && ci.Network != nil {
		if v4 == nil && ci.Network.IPv4 != nil {
			v4 = &record.NetIPSpec{Address: ci.Network.IPv4.Address}
		}
		if v6 == nil && ci.Network.IPv6 != nil {
			v6 = &record.NetIPSpec{Address: ci.Network.IPv6.Address}
		}
	}
	if v4 != nil {
		p, err := netip.ParsePrefix(v4.Address)
		if err != nil {
			return r, err
		}
		r.IPv4 = p.Addr()
	}
	if v6 != nil {
		p, err := netip.ParsePrefix(v6.Address)
		if err != nil {
			return r, err
		}
		r.IPv6 = p.Addr()
	}
	for _, a := range nv.AllowedIPs {
		p, err := netip.ParsePrefix(a)
		if err != nil {
			addr, aerr := netip.ParseAddr(a)
			if aerr != nil {
				return r, err
			}
			p = netip.PrefixFrom(addr, addr.BitLen())
		}
		r.AllowedIPs = append(r.AllowedIPs, p)
	}
	return r, nil
}

// qsdConfig is how the VM's qemu-storage-daemon runs: the root disk (with
// its build as the backing node when it is an overlay) grown to
// disk.size_gib (never below the base) with the root-disk limits, and
// every data volume.
func (e *Engine) qsdConfig(rec *record.Record) qmp.QSDConfig {
	l, id, sp := e.layout(), rec.ID, &rec.Spec
	var size uint64
	if sp.Disk != nil && sp.Disk.SizeGiB != nil {
		size = rootDiskSize(rec, 0)
	}
	c := qmp.QSDConfig{
		Binary:  e.o.QSD.Binary,
		PreArgs: e.o.QSD.PreArgs,
		Env:     e.o.QSD.Env,
		Root: qmp.RootDisk{Path: l.RootDisk(id), Backing: rec.RootBacking(), Socket: l.RootSocket(id), Size: size,
			Limits: qmp.ThrottleLimits{BpsTotal: sp.DiskBpsTotal, IopsTotal: sp.DiskIopsTotal}},
		QMPSocket: l.QMPSocket(id),
		PidFile:   l.QSDPidFile(id),
		LogFile:   l.QSDLog(id),
	}
	for _, v := range sp.Volumes {
		c.Data = append(c.Data, qmp.DataDisk{ID: v.ID, Path: e.volumePath(rec, v), Socket: l.DataSocket(id, v.ID), Readonly: v.Readonly})
	}
	return c
}

// ensureQSD launches the VM's qemu-storage-daemon unless the engine holds
// a running one. A new one's identity is returned for the caller to
// record with its result (nil when none was launched); until then the
// engine holds it, and an agent that dies first leaves a process that the
// next start reaps. cgroupMade is prepareJail's.
func (e *Engine) ensureQSD(ctx context.Context, rec *record.Record, cgroupMade func() error) (*record.QSDRuntime, error) {
	rec, jv, err := e.prepareJail(rec, cgroupMade)
	if err != nil {
		return nil, err
	}
	e.mu.Lock()
	q := e.live[rec.ID]
	e.mu.Unlock()
	if q != nil && jv != nil {
		if in, _ := jv.Cgroup().Contains(q.Pid); !in {
			// Started unconfined (by an older vmhost, or before the VM had
			// a jail): a confined CH could not use its sockets.
			e.log.Info("restarting the storage daemon of a VM confined from this boot on", "id", rec.ID, "pid", q.Pid)
			e.stopHeldQSD(rec.ID)
			q = nil
		}
	}
	if q != nil {
		select {
		case <-q.Done():
			q.Close()
		default:
			err := e.syncExports(ctx, q, rec)
			if err == nil {
				return nil, nil
			}
			// A daemon whose monitor does not answer (an adopted one
			// another client holds) serves a VM that runs nothing:
			// replace it.
			e.log.Warn("replacing the storage daemon of a VM that is not running", "id", rec.ID, "err", err)
			e.mu.Lock()
			if e.live[rec.ID] == q {
				delete(e.live, rec.ID)
			}
			e.mu.Unlock()
			q.Close()
		}
	}
	if rt := rec.Runtime; rt != nil && rt.QSD != nil {
		// Recorded but not held (an agent restart that did not adopt it):
		// its sockets and pid file would clash with a new one.
		if err := killRecorded(rt.QSD.Pid, rt.QSD.StartTime); err != nil {
			return nil, &record.HostError{Kind: record.HostStorage, Op: "stopping stale qemu-storage-daemon of VM " + rec.ID, Err: err}
		}
	}
	if err := e.checkBacking(rec); err != nil {
		return nil, err
	}
	cfg := e.qsdConfig(rec)
	if jv != nil {
		cfg.Confine = e.confineQSD(rec, jv, cfg.Root.Backing)
	}
	q, err = qmp.LaunchQSD(ctx, cfg)
	if err != nil {
		return nil, &record.HostError{Kind: record.HostStorage, Op: "starting qemu-storage-daemon of VM " + rec.ID, Err: err}
	}
	e.mu.Lock()
	e.live[rec.ID] = q
	e.mu.Unlock()
	rt := &record.QSDRuntime{Pid: q.Pid, StartTime: q.StartTime, QMPSocket: cfg.QMPSocket, RootSocket: cfg.Root.Socket,
		PidFile: cfg.PidFile, LogFile: cfg.LogFile}
	for _, d := range cfg.Data {
		rt.DataSockets = append(rt.DataSockets, d.Socket)
	}
	return rt, nil
}

// Rollback removes what the record says provisioning made: it stops the
// processes, deletes the recorded taps, the recorded files and the VM's run
// directory. The image cache and the base image are never touched. Every
// step runs; the errors are joined.
func (e *Engine) Rollback(ctx context.Context, rec *record.Record) error {
	rec = e.current(rec)
	e.endGuest(rec)
	return e.teardown(ctx, rec, false)
}

// teardown stops the VM's processes and removes what it owns. all (delete)
// also removes the whole VM directory, whatever is in it; otherwise only
// the recorded files are removed, and the directory if then empty.
func (e *Engine) teardown(ctx context.Context, rec *record.Record, all bool) error {
	id, l := rec.ID, e.layout()
	var errs []error
	if err := e.stopAll(ctx, rec); err != nil {
		errs = append(errs, err)
	}
	// Whatever else runs in the VM's cgroup dies with it, and its
	// first-class volumes go back to root.
	if err := e.destroyJail(ctx, e.current(rec)); err != nil {
		errs = append(errs, err)
	}
	if err := e.disownVolumes(e.current(rec)); err != nil {
		errs = append(errs, err)
	}
	for i, nic := range rec.NICs {
		if !rec.Runtime.Done(record.StepTap(i)) || e.o.Taps == nil {
			continue
		}
		if err := e.o.Taps.Delete(ctx, nic.Tap); err != nil && !errors.Is(err, fs.ErrNotExist) {
			errs = append(errs, fmt.Errorf("deleting tap %s: %w", nic.Tap, err))
		}
	}
	remove := func(path string) {
		if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	if err := removeTree(l.RunVMDir(id)); err != nil {
		errs = append(errs, err)
	}
	if all {
		if err := os.RemoveAll(l.VMDir(id)); err != nil {
			errs = append(errs, err)
		}
	} else {
		if rec.Runtime.Done(record.StepRootDisk) {
			remove(l.RootDisk(id))
		}
		for i, v := range rec.Spec.Volumes {
			if v.VolumeID == "" && rec.Runtime.Done(record.StepData(i)) {
				remove(l.DataVolume(id, v.ID))
			}
		}
		if rec.Runtime.Done(record.StepSeed) {
			remove(l.Seed(id))
		}
		if err := os.RemoveAll(e.volumeLinks(id)); err != nil {
			errs = append(errs, err)
		}
		if err := os.Remove(l.VMDir(id)); err != nil && !errors.Is(err, fs.ErrNotExist) {
			e.o.Logger.Warn("VM directory not empty after rollback; left in place", "id", id, "err", err)
		}
	}
	return errors.Join(errs...)
}

// stopAll ends every process of the VM: those its monitor holds (a
// running VM: vmm.shutdown first, then signals), the qemu-storage-daemon
// the engine holds (a VM that is not running), and any only recorded (not
// adopted after an agent restart), which are killed if pid and start time
// still match. The record's process identities are cleared.
func (e *Engine) stopAll(ctx context.Context, rec *record.Record) error {
	id := rec.ID
	ch, qsd := e.unwatch(id)
	if ch != nil {
		e.shutdownVMM(ch)
	}
	e.mu.Lock()
	if q := e.live[id]; q != nil {
		if qsd == nil {
			qsd = q
		} else {
			q.Close()
		}
		delete(e.live, id)
	}
	e.mu.Unlock()
	e.stopProcesses(id, ch, qsd)
	var errs []error
	rec = e.current(rec)
	if rt := rec.Runtime; rt != nil {
		if rt.CH != nil {
			if err := killRecorded(rt.CH.Pid, rt.CH.StartTime); err != nil {
				errs = append(errs, fmt.Errorf("stopping cloud hypervisor: %w", err))
			}
		}
		if rt.QSD != nil {
			if err := killRecorded(rt.QSD.Pid, rt.QSD.StartTime); err != nil {
				errs = append(errs, fmt.Errorf("stopping qemu-storage-daemon: %w", err))
			}
		}
		if rt.CH != nil || rt.QSD != nil {
			if _, err := e.recs.Update(id, func(r *record.Record) {
				r.Runtime.CH, r.Runtime.QSD, r.PID = nil, nil, 0
			}); err != nil && !errors.Is(err, fs.ErrNotExist) {
				errs = append(errs, err)
			}
		}
	}
	return errors.Join(errs...)
}
