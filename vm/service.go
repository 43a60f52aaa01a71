package vm

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/google/uuid"

	"vmhost/config"
	"vmhost/events"
	"vmhost/follow"
	"vmhost/snapshot"
	"vmhost/vm/record"
	"vmhost/vm/records"
	"vmhost/volume"
)

var errNotFound = records.ErrNotFound

// Options configure a Service. StateDir, RunDir, Config, Records and Host
// are required; the rest have defaults.
type Options struct {
	// StateDir is the agent's state directory.
	StateDir string
	// RunDir holds sockets and logs.
	RunDir string
	Config *config.Config
	// Records owns the records of both families (package vm/records):
	// the Service changes them only through it.
	Records *records.Registry
	// Host carries out host work, and records its results through
	// Records: the Engine in production.
	Host   Host
	Logger *slog.Logger
	// Now gives the time; default time.Now. Tests fix it.
	Now func() time.Time
	// Rand is the source of generated ids and MACs; default crypto/rand.
	Rand io.Reader
	// DiskFree reports the bytes available for disk copies in StateDir;
	// default statfs. Tests replace it.
	DiskFree func() (uint64, error)
	// Meminfo is the path of /proc/meminfo; tests point it elsewhere.
	Meminfo string
	// Events gets the snapshot events (the others come from the
	// records); nil publishes none.
	Events events.Publisher
	// AgentID is this agent's id (package agentid): the tap names of new
	// VMs derive from it, so that two agents in one network namespace
	// never pick the same name for a VM id both use (record.AgentTapName).
	AgentID string
}

// Service holds the rules of the records of both VM families: one id
// namespace, one create path, the lifecycle actions' states, volumes and
// views. It is safe for concurrent use.
type Service struct {
	o      Options
	log    *slog.Logger
	facts  HostFacts
	layout Layout
	recs   *records.Registry
	bg     sync.WaitGroup

	randMu sync.Mutex
	usage  diskUsage

	views viewMemo
	// changes tells the requests waiting on a VM of its changes (wait.go).
	changes changeHub
	// logs follows the logs the API serves (OpenLog); made at first use.
	logsOnce sync.Once
	logs     *follow.Watcher

	vols  *volume.Store
	volMu sync.Mutex // see volumes.go

	snaps *snapshot.Store // see snapshots.go
	// snapDeleted are told of each snapshot deleted (OnSnapshotDeleted).
	snapDeleted []func(*snapshot.Snapshot)
}

// New returns the service over the records of o.Records. Reconciling the
// host with the records is the host's job (engine.Engine.Recover).
func New(o Options) (*Service, error) {
	if o.Config == nil || o.Records == nil || o.Host == nil || o.StateDir == "" || o.RunDir == "" {
		return nil, errors.New("vm.New: StateDir, RunDir, Config, Records and Host are required")
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	if o.Rand == nil {
		o.Rand = rand.Reader
	}
	if o.DiskFree == nil {
		dir := o.StateDir
		o.DiskFree = func() (uint64, error) { return diskFree(dir) }
	}
	sysfs := o.Config.SysfsRoot
	if sysfs == "" {
		sysfs = "/sys"
	}
	s := &Service{
		o:      o,
		log:    o.Logger,
		facts:  HostFacts{Sysfs: sysfs, Nested: o.Config.Nested, Meminfo: o.Meminfo},
		layout: Layout{StateDir: filepath.Clean(o.StateDir), RunDir: filepath.Clean(o.RunDir)},
		recs:   o.Records,
	}
	vols, err := volume.Open(s.layout.VolumesDir(), o.Logger.With("component", "volumes"))
	if err != nil {
		return nil, err
	}
	s.vols = vols
	if s.snaps, err = snapshot.Open(s.layout.SnapshotsDir(), o.Logger.With("component", "snapshots")); err != nil {
		return nil, err
	}
	// The memo of a view goes with its VM.
	s.recs.Watch(func(c records.Change) {
		if c.New == nil {
			s.forgetView(c.Old.ID)
		}
	})
	s.recs.Watch(s.changes.tell)
	return s, nil
}

// Layout returns the service's path layout.
func (s *Service) Layout() Layout { return s.layout }

// Facts returns what the service reads about the host.
func (s *Service) Facts() HostFacts { return s.facts }

// Config returns the host configuration.
func (s *Service) Config() *config.Config { return s.o.Config }

// Now returns the service clock's time.
func (s *Service) Now() time.Time { return s.o.Now() }

// Get returns the record of id if it belongs to family mode. Otherwise the
// error satisfies errors.Is(err, fs.ErrNotExist): an AppVM id read as a
// classic VM is not found, and the reverse.
func (s *Service) Get(mode Mode, id string) (*Record, error) {
	r := s.recs.Get(id)
	if r == nil || r.Mode != mode {
		return nil, fmt.Errorf("VM %q: %w", id, errNotFound)
	}
	return r, nil
}

// List returns the records of family mode, sorted by id.
func (s *Service) List(mode Mode) []*Record { return s.recs.List(mode) }

// Wait blocks until background provisioning started so far has finished.
func (s *Service) Wait() { s.bg.Wait() }

// CreateVM validates spec (400 as *FieldError) and creates a classic VM
// through Launch. async reports that provisioning continues in the
// background (202).
func (s *Service) CreateVM(ctx context.Context, spec *Spec) (rec *Record, async bool, err error) {
	checked, err := validateSpec(spec, s.o.Config, s.facts, s.layout)
	if err != nil {
		return nil, false, err
	}
	nics := len(spec.Nets)
	if nics == 0 && spec.CloudInit != nil {
		nics = 1 // the default interface of a cloud-init VM
	}
	if spec.FromSnapshot != "" {
		// The VM's disks are copies of the snapshot's: its root disk as
		// the base, its own volumes as they were.
		sn, vols, release, err := s.FromSnapshot(spec.FromSnapshot, ModeVM)
		if err != nil {
			return nil, false, err
		}
		defer release() // the copies are made before Launch returns: no image to download
		c := *spec
		c.Disk = &DiskSpec{Mode: "copy", BasePath: sn.Disks[0].Path}
		c.Volumes = vols
		spec = &c
		checked.base = &BaseImage{Path: sn.Disks[0].Path, VirtualSizeBytes: sn.Disks[0].VirtualSizeBytes}
	}
	rec, err = s.NewRecord(ModeVM, spec, nics)
	if err != nil {
		return nil, false, err
	}
	rec.Base = checked.base
	return s.Launch(ctx, rec)
}

// NewRecord builds the record of a create that passed validation: the
// explicit or a generated (UUID v4) id, the creation time, the identity
// (MAC, tap) of nics interfaces, and secrets moved out of the spec. spec is
// copied; nothing is stored.
func (s *Service) NewRecord(mode Mode, spec *Spec, nics int) (*Record, error) {
	rec := &Record{
		ID:           spec.VMID,
		Mode:         mode,
		State:        StateCreated,
		DisplayState: DisplayCreating,
		CreatedAt:    s.o.Now().UTC().Truncate(time.Second),
		Spec:         *spec,
	}
	if rec.ID == "" {
		s.randMu.Lock()
		u, err := uuid.NewRandomFromReader(s.o.Rand)
		s.randMu.Unlock()
		if err != nil {
			return nil, fmt.Errorf("generating VM id: %w", err)
		}
		rec.ID = u.String()
	}
	rec.Spec.VMID = rec.ID
	rec.Spec.Volumes = slices.Clone(spec.Volumes)
	rec.Spec.Labels = nil
	if len(spec.Labels) > 0 {
		rec.Spec.Labels = maps.Clone(spec.Labels)
	}
	rec.Spec.NormalizeVolumes()
	if spec.Image != nil {
		rec.DisplayState = DisplayDownloading
	}
	if ci := spec.CloudInit; ci != nil {
		c := *ci
		rec.Secrets.Password = c.Password
		c.Password = ""
		rec.Spec.CloudInit = &c
	}
	for i := range nics {
		mac := ""
		if i < len(spec.Nets) && spec.Nets[i].MAC != "" {
			hw, _ := net.ParseMAC(spec.Nets[i].MAC)
			mac = hw.String()
		} else {
			var err error
			if mac, err = s.generateMAC(); err != nil {
				return nil, err
			}
		}
		rec.NICs = append(rec.NICs, NIC{MAC: mac, Tap: record.AgentTapName(s.o.AgentID, rec.ID, i)})
	}
	return rec, nil
}

// generateMAC returns a locally administered unicast MAC (02:xx:xx:xx:xx:xx)
// that no stored VM uses.
func (s *Service) generateMAC() (string, error) {
	for range 16 {
		b := make([]byte, 6)
		s.randMu.Lock()
		_, err := io.ReadFull(s.o.Rand, b[1:])
		s.randMu.Unlock()
		if err != nil {
			return "", fmt.Errorf("generating MAC: %w", err)
		}
		b[0] = 0x02
		mac := net.HardwareAddr(b).String()
		if !s.macInUse(mac) {
			return mac, nil
		}
	}
	return "", errors.New("generating MAC: every candidate is in use")
}

// macInUse reports whether a stored VM or a create in flight has mac.
func (s *Service) macInUse(mac string) bool {
	used := false
	s.recs.Each(func(r *Record) {
		used = used || slices.ContainsFunc(r.NICs, func(n NIC) bool { return n.MAC == mac })
	})
	return used
}

// Launch has the host check its preconditions for rec (Preflight: 400
// *FieldError naming what the host lacks, with nothing made), admits it
// (409: *ExistsError, *CapacityError) and has the host claim its per-VM
// ids (Claim), then has the host create it: store the record, Provision (in the background when an image must be
// downloaded: async), and Boot when the spec asks for it. A synchronous
// failure before boot rolls back everything, record included, so a retry
// with the same id works; a boot failure keeps the VM.
func (s *Service) Launch(ctx context.Context, rec *Record) (out *Record, async bool, err error) {
	if err := s.o.Host.Preflight(ctx, rec); err != nil {
		return nil, false, err
	}
	admit := s.admission(rec)
	err = s.recs.Reserve(rec, func(others []*Record) error {
		if err := admit(others); err != nil {
			return err
		}
		return s.o.Host.Claim(rec, others)
	})
	if err != nil {
		return nil, false, err
	}
	if err := s.recs.Create(rec); err != nil {
		s.recs.Release(rec.ID)
		return nil, false, &HostError{Kind: HostStorage, Op: "creating VM " + rec.ID, Err: err}
	}
	s.log.Info("VM created", "id", rec.ID, "mode", rec.Mode)
	if rec.Spec.Image != nil {
		s.bg.Add(1)
		go func() {
			defer s.bg.Done()
			s.provisionInBackground(rec)
		}()
		return rec, true, nil
	}
	if err := s.o.Host.Provision(ctx, rec); err != nil {
		if errors.Is(err, record.ErrDeleted) { // a forced delete removes what it made
			return nil, false, &StateError{ID: rec.ID, Action: "create", State: "deleted"}
		}
		s.rollback(rec)
		return nil, false, err
	}
	// The host recorded the provision's result (display created).
	if out = s.recs.Get(rec.ID); out == nil {
		return nil, false, &StateError{ID: rec.ID, Action: "create", State: "deleted"}
	}
	if out.Spec.AutoBoot {
		return s.autoBoot(ctx, out)
	}
	return out, false, nil
}

// boot has the host boot rec, which records the boot (and may, by then,
// have recorded the guest's end: one that powered off at once), and
// returns the record after it.
func (s *Service) boot(ctx context.Context, rec *Record) (*Record, bool, error) {
	if err := s.o.Host.Boot(ctx, rec); err != nil {
		s.log.Error("booting new VM failed; VM kept", "id", rec.ID, "err", err)
		return rec, false, err
	}
	if cur := s.recs.Get(rec.ID); cur != nil {
		return cur, false, nil
	}
	return rec, false, nil
}

func (s *Service) rollback(rec *Record) {
	ctx := context.Background()
	if err := s.o.Host.Rollback(ctx, rec); err != nil {
		s.log.Error("rolling back failed create", "id", rec.ID, "err", err)
	}
	if err := s.recs.Remove(rec.ID); err != nil {
		s.log.Error("removing record of failed create", "id", rec.ID, "err", err)
	}
}

func (s *Service) provisionInBackground(rec *Record) {
	ctx := context.Background()
	if err := s.o.Host.Provision(ctx, rec); err != nil {
		if errors.Is(err, record.ErrDeleted) { // a forced delete removes what it made
			s.log.Info("provisioning cancelled by a delete", "id", rec.ID)
			return
		}
		s.log.Error("background provisioning failed", "id", rec.ID, "err", err)
		if rerr := s.o.Host.Rollback(ctx, rec); rerr != nil {
			s.log.Error("rolling back failed provision", "id", rec.ID, "err", rerr)
		}
		_, uerr := s.recs.Update(rec.ID, func(r *Record) {
			r.State = StateFailed
			r.DisplayState = DisplayProvisionFailed
			r.FailureReason = &FailureReason{
				DetectedAt: s.o.Now().UTC(),
				Summary:    oneLine(err.Error()),
				Detail:     FailureDetail{Kind: "provision_failed"},
				Cause:      "provision_failed",
			}
		})
		if uerr != nil {
			s.log.Error("recording provision failure", "id", rec.ID, "err", uerr)
		}
		return
	}
	if out := s.recs.Get(rec.ID); out != nil && out.Spec.AutoBoot {
		s.autoBoot(ctx, out)
	}
}

func oneLine(s string) string { return strings.Join(strings.Fields(s), " ") }

// ValidateSpec checks a classic spec against every field rule and host
// precondition without creating anything; the error is a *FieldError.
func (s *Service) ValidateSpec(spec *Spec) error {
	_, err := validateSpec(spec, s.o.Config, s.facts, s.layout)
	return err
}
