package vm

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"net"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/google/uuid"

	"vmhost/config"
	"vmhost/events"
	"vmhost/store"
	"vmhost/vm/record"
	"vmhost/volume"
)

var errNotFound = fmt.Errorf("no such VM: %w", fs.ErrNotExist)

// Options configure a Service. StateDir, RunDir, Config, Store and Host are
// required; the rest have defaults.
type Options struct {
	// StateDir is the agent's state directory; records live in the Store,
	// normally opened on <StateDir>/vms.
	StateDir string
	// RunDir holds sockets and logs.
	RunDir string
	Config *config.Config
	Store  *store.Store
	// Host carries out host work: the Engine in production.
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
	// Events gets an event for each change of a record (vm/events.go);
	// nil publishes none.
	Events events.Publisher
}

// Service owns the records of both VM families: one registry, one id
// namespace, one create path. It is safe for concurrent use.
type Service struct {
	o      Options
	log    *slog.Logger
	facts  HostFacts
	layout Layout
	reg    *registry
	bg     sync.WaitGroup

	randMu sync.Mutex
	usage  diskUsage

	report LoadReport
	views  viewMemo
	locks  vmLocks

	vols  *volume.Store
	volMu sync.Mutex // see volumes.go
}

// LoadReport says what New found in the store.
type LoadReport struct {
	Loaded       int
	Invalid      []string        // file names that are not valid ids: loaded as failed VMs
	Damaged      []store.Damaged // moved aside by the store
	Undecodable  []string        // JSON objects that are not records: left in place
	RemovedTemps []string
}

// New opens the service on the records in o.Store. Damaged records are moved
// aside and logged; a record whose file name is not a valid id loads as a
// failed VM (detail.kind invalid_vm_id, cause record_invalid). Reconciling
// the host with the records is the host's job (engine.Engine.Start, given
// HostRecords).
func New(o Options) (*Service, error) {
	if o.Config == nil || o.Store == nil || o.Host == nil || o.StateDir == "" || o.RunDir == "" {
		return nil, errors.New("vm.New: StateDir, RunDir, Config, Store and Host are required")
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
		reg:    newRegistry(o.Store, o.Events),
	}
	vols, err := volume.Open(s.layout.VolumesDir(), o.Logger.With("component", "volumes"))
	if err != nil {
		return nil, err
	}
	s.vols = vols
	if err := s.load(); err != nil {
		return nil, err
	}
	return s, nil
}

func (s *Service) load() error {
	l, err := s.o.Store.Load()
	if err != nil {
		return fmt.Errorf("loading VM records: %w", err)
	}
	s.report.RemovedTemps = l.RemovedTemps
	for _, t := range l.RemovedTemps {
		s.log.Warn("removed leftover temp file of an interrupted record write", "file", t)
	}
	s.report.Damaged = l.Damaged
	for _, d := range l.Damaged {
		s.log.Error("damaged VM record moved aside", "id", d.ID, "moved_to", d.MovedTo, "err", d.Err)
	}
	for _, r := range l.Records {
		rec, err := record.Decode(r.Data)
		if err == nil && rec.ID != r.ID {
			err = fmt.Errorf("record holds id %q", rec.ID)
		}
		if err != nil {
			s.report.Undecodable = append(s.report.Undecodable, r.ID)
			s.log.Error("VM record is not a valid record; left in place", "id", r.ID, "err", err)
			continue
		}
		s.reg.adopt(rec)
		s.report.Loaded++
	}
	for _, r := range l.Invalid {
		rec, err := record.Decode(r.Data)
		if err != nil {
			rec = &Record{Mode: ModeVM}
		}
		rec.ID = r.ID
		rec.State = StateFailed
		rec.DisplayState = string(StateFailed)
		rec.PID = 0
		rec.FailureReason = &FailureReason{
			DetectedAt: s.o.Now().UTC(),
			Summary:    fmt.Sprintf("record file name %q is not a valid VM id", r.ID),
			Detail:     FailureDetail{Kind: "invalid_vm_id", ID: r.ID},
			Cause:      "record_invalid",
		}
		s.reg.adopt(rec)
		s.report.Invalid = append(s.report.Invalid, r.ID)
		s.log.Error("VM record has an invalid id; loaded as failed", "id", r.ID)
	}
	return nil
}

// Report returns what New found in the store.
func (s *Service) Report() LoadReport { return s.report }

// Layout returns the service's path layout.
func (s *Service) Layout() Layout { return s.layout }

// Config returns the host configuration.
func (s *Service) Config() *config.Config { return s.o.Config }

// Now returns the service clock's time.
func (s *Service) Now() time.Time { return s.o.Now() }

// Get returns the record of id if it belongs to family mode. Otherwise the
// error satisfies errors.Is(err, fs.ErrNotExist): an AppVM id read as a
// classic VM is not found, and the reverse.
func (s *Service) Get(mode Mode, id string) (*Record, error) {
	r := s.reg.get(id)
	if r == nil || r.Mode != mode {
		return nil, fmt.Errorf("VM %q: %w", id, errNotFound)
	}
	return r, nil
}

// List returns the records of family mode, sorted by id.
func (s *Service) List(mode Mode) []*Record { return s.reg.list(mode) }

// Update stores a new version of the record of id: f is applied to a copy
// of the current record (records are copy-on-write), which is then
// persisted and returned. The error satisfies errors.Is(err,
// fs.ErrNotExist) when id has no record.
func (s *Service) Update(id string, f func(*Record)) (*Record, error) {
	return s.reg.update(id, f)
}

// Wait blocks until background provisioning started so far has finished.
func (s *Service) Wait() { s.bg.Wait() }

// CreateVM validates spec (400 as *FieldError) and creates a classic VM
// through Launch. async reports that provisioning continues in the
// background (202).
func (s *Service) CreateVM(ctx context.Context, spec *Spec) (rec *Record, async bool, err error) {
	c, err := validateSpec(spec, s.o.Config, s.facts, s.layout)
	if err != nil {
		return nil, false, err
	}
	nics := len(spec.Nets)
	if nics == 0 && spec.CloudInit != nil {
		nics = 1 // the default interface of a cloud-init VM
	}
	rec, err = s.NewRecord(ModeVM, spec, nics)
	if err != nil {
		return nil, false, err
	}
	rec.Base = c.base
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
		rec.NICs = append(rec.NICs, NIC{MAC: mac, Tap: record.TapName(rec.ID, i)})
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

func (s *Service) macInUse(mac string) bool {
	s.reg.mu.RLock()
	defer s.reg.mu.RUnlock()
	for _, m := range []map[string]*Record{s.reg.recs, s.reg.pending} {
		for _, r := range m {
			for _, n := range r.NICs {
				if n.MAC == mac {
					return true
				}
			}
		}
	}
	return false
}

// Launch admits rec (409: *ExistsError, *CapacityError), then has the host
// create it: Preflight, store the record, Provision (in the background when
// an image must be downloaded: async), and Boot when the spec asks for it.
// A synchronous failure before boot rolls back everything, record
// included, so a retry with the same id works; a boot failure keeps the VM.
func (s *Service) Launch(ctx context.Context, rec *Record) (out *Record, async bool, err error) {
	if err := s.reg.reserve(rec, s.admission(rec)); err != nil {
		return nil, false, err
	}
	if err := s.o.Host.Preflight(ctx, rec); err != nil {
		s.reg.release(rec.ID)
		return nil, false, err
	}
	if err := s.reg.put(rec); err != nil {
		s.reg.release(rec.ID)
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
	out, err = s.markCreated(rec.ID)
	if err != nil {
		s.rollback(rec)
		return nil, false, &HostError{Kind: HostStorage, Op: "creating VM " + rec.ID, Err: err}
	}
	if out.Spec.AutoBoot {
		return s.autoBoot(ctx, out)
	}
	return out, false, nil
}

// markCreated records display created after a successful provision,
// unless the host recorded it with its result (the Engine does).
func (s *Service) markCreated(id string) (*Record, error) {
	if cur := s.reg.get(id); cur != nil && cur.DisplayState == string(StateCreated) {
		return cur, nil
	}
	return s.reg.update(id, func(r *Record) { r.DisplayState = string(StateCreated) })
}

func (s *Service) boot(ctx context.Context, rec *Record) (*Record, bool, error) {
	if err := s.o.Host.Boot(ctx, rec); err != nil {
		s.log.Error("booting new VM failed; VM kept", "id", rec.ID, "err", err)
		return rec, false, err
	}
	// A host that records the boot itself (the Engine) hands the VM to its
	// monitor, which may already have recorded the guest's end (a guest
	// that powered off at once): that must stand. Only when the record is
	// still the one booted (a host that records nothing) is the boot
	// recorded here.
	if cur := s.reg.get(rec.ID); cur != rec {
		if cur == nil {
			return rec, false, nil
		}
		return cur, false, nil
	}
	out, err := s.reg.update(rec.ID, func(r *Record) {
		r.State = StateRunning
		r.DisplayState = DisplayBooting
		r.FailureReason = nil
	})
	if err != nil {
		return rec, false, &HostError{Kind: HostStorage, Op: "recording boot of VM " + rec.ID, Err: err}
	}
	return out, false, nil
}

func (s *Service) rollback(rec *Record) {
	ctx := context.Background()
	if err := s.o.Host.Rollback(ctx, rec); err != nil {
		s.log.Error("rolling back failed create", "id", rec.ID, "err", err)
	}
	if err := s.reg.remove(rec.ID); err != nil {
		s.log.Error("removing record of failed create", "id", rec.ID, "err", err)
	}
	s.forgetView(rec.ID)
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
		_, uerr := s.reg.update(rec.ID, func(r *Record) {
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
	out, err := s.markCreated(rec.ID)
	if err != nil {
		s.log.Error("recording provisioned VM", "id", rec.ID, "err", err)
		return
	}
	if out.Spec.AutoBoot {
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
