package appvm

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"net/netip"
	"path/filepath"
	"strings"
	"sync"

	"vmhost/appvm/guest/proto"
	"vmhost/config"
	"vmhost/store"
	"vmhost/vm"
	"vmhost/vm/record"
	"vmhost/vm/records"
)

// RestartPolicy is the restart_policy enum; any other value fails decoding.
type RestartPolicy string

// EnumValues lists the allowed restart policies.
func (RestartPolicy) EnumValues() []string { return []string{"no", "on-failure", "always"} }

// CreateRequest is the body of POST /api/appvm/vms (docs/api.md, POST /api/appvm/vms). Tags
// as in vm.Spec.
type CreateRequest struct {
	VMID          string              `json:"vm_id,omitempty"`
	ImageID       string              `json:"image_id,omitempty"`
	Vcpus         uint32              `json:"vcpus" decode:"required"`
	MemoryMB      uint64              `json:"memory_mb" decode:"required"`
	DiskGiB       uint32              `json:"disk_gib" decode:"required"`
	NetworkID     string              `json:"network_id,omitempty"`
	IP            *string             `json:"ip,omitempty"`
	Prefix        *uint32             `json:"prefix,omitempty"`
	Gateway       *string             `json:"gateway,omitempty"`
	DNS           []string            `json:"dns,omitempty"`
	Hostname      string              `json:"hostname,omitempty"`
	AutoBoot      *bool               `json:"auto_boot,omitempty"`
	Keepalive     bool                `json:"keepalive,omitempty"`
	Env           []string            `json:"env,omitempty"`
	SecretEnv     []vm.Secret         `json:"secret_env,omitempty"`
	RestartPolicy RestartPolicy       `json:"restart_policy,omitempty"`
	DataVolumes   []DataVolumeRequest `json:"data_volumes,omitempty"`
	DiskBpsTotal  uint64              `json:"disk_bps_total,omitempty"`
	DiskIopsTotal uint64              `json:"disk_iops_total,omitempty"`
	// The rest of the editable workload spec (workload.go).
	Command       []string            `json:"command,omitempty"`
	Workdir       string              `json:"workdir,omitempty"`
	User          string              `json:"user,omitempty"`
	NoHealthcheck bool                `json:"no_healthcheck,omitempty"`
	Healthcheck   *vm.Healthcheck     `json:"healthcheck,omitempty"`
	ExtraHosts    []vm.ExtraHost      `json:"extra_hosts,omitempty"`
	ConfigFiles   []vm.ConfigFile     `json:"config_files,omitempty"`
	SecretFiles   []SecretFileRequest `json:"secret_files,omitempty"`
	TmpfsMounts   []vm.TmpfsMount     `json:"tmpfs_mounts,omitempty"`
	StopGraceSecs *uint32             `json:"stop_grace_secs,omitempty"`
	Labels        map[string]string   `json:"labels,omitempty"`
	// FromSnapshot names a snapshot of an AppVM whose disks the new one
	// gets copies of, in the place of image_id (docs/api.md, Suspend and
	// snapshots).
	FromSnapshot string `json:"from_snapshot,omitempty"`
}

// Network modes of an AppVM (appvm.network_mode).
const (
	// NetworkDHCP: the guest asks a DHCP server of its network.
	NetworkDHCP = "dhcp"
	// NetworkStatic: the guest gets the create's ip, prefix and gateway.
	NetworkStatic = "static"
	// NetworkNone: the AppVM has no interface, only loopback (serve
	// --dev's default; see Config.NoDefaultNetwork).
	NetworkNone = "none"
)

// DataVolumeRequest is one requested data volume.
type DataVolumeRequest struct {
	SizeGiB    uint32 `json:"size_gib" decode:"required"`
	Mountpoint string `json:"mountpoint" decode:"required"`
}

// Limits of docs/api.md (POST /api/appvm/vms).
const (
	MaxEnvEntries    = 100
	MaxEnvEntryBytes = 8192
	MaxDataVolumes   = 8
	MaxMountpoint    = vm.MaxMountpoint
)

// ConflictError is a create that must wait for a related operation (409
// CONFLICT): the image is still importing.
type ConflictError struct{ Msg string }

// Error says which operation is in progress.
func (e *ConflictError) Error() string { return e.Msg }

// CreateResponse is the create-AppVM response (docs/api.md, POST /api/appvm/vms).
type CreateResponse struct {
	ID      string `json:"id"`
	Mode    string `json:"mode"`
	ImageID string `json:"image_id"`
	Booted  bool   `json:"booted"`
}

// RootDisks rebuilds the root disk of a VM that runs nothing, for a
// redeploy: the engine's StageRootDisk, SwapRootDisk and
// DropStagedRootDisk (see there).
type RootDisks interface {
	StageRootDisk(ctx context.Context, rec *vm.Record, base string) error
	SwapRootDisk(ctx context.Context, rec *vm.Record) error
	DropStagedRootDisk(rec *vm.Record) error
}

// Config wires a Service; every field but Dialer and Restart is required.
type Config struct {
	// VMs holds the rules of both families' records: create, actions,
	// volumes, views.
	VMs *vm.Service
	// Records owns the records; the AppVM parts are written through it.
	Records *records.Registry
	// Guests is the host end of the guest agents, the one the engine was
	// given.
	Guests *Guests
	// RootDisks rebuilds root disks for redeploys (the engine).
	RootDisks RootDisks
	// Dialer connects to the guest agents' operation port (the engine);
	// without it exec, files and signals fail with 500.
	Dialer GuestDialer
	// Restart tunes the restart policy.
	Restart RestartOptions
	// NoDefaultNetwork gives an AppVM whose create names no network (no
	// network_id, no static address) no interface at all (network_mode
	// none) instead of one on the default network: serve --dev, whose
	// bridge has no DHCP server, and which without root has no taps.
	NoDefaultNetwork bool
}

// Service creates, views, edits, redeploys and restarts AppVMs on top of a
// vm.Service.
type Service struct {
	vms     *vm.Service
	recs    *records.Registry
	guests  *Guests
	disks   RootDisks
	dialer  GuestDialer
	catalog Catalog
	// restartMu guards restart (SetRestartStablePeriod).
	restartMu sync.Mutex
	restart   RestartOptions
	// bg counts the background redeploys (Wait).
	bg sync.WaitGroup
	// noDefaultNetwork is Config.NoDefaultNetwork.
	noDefaultNetwork bool
	// builds keeps the builds AppVMs use (builds.go).
	builds buildKeeper
}

// New returns the AppVM service of c. The catalog is
// <StateDir>/appvm-images. It follows the records' changes: a workload's
// end that the restart policy answers boots the AppVM again.
func New(c Config) *Service {
	c.Restart.defaults()
	s := &Service{vms: c.VMs, recs: c.Records, guests: c.Guests, disks: c.RootDisks, dialer: c.Dialer, restart: c.Restart,
		catalog:          Catalog{Dir: filepath.Join(c.VMs.Layout().StateDir, "appvm-images")},
		noDefaultNetwork: c.NoDefaultNetwork}
	s.recs.Watch(s.followRecords)
	s.recs.Watch(s.followBuilds)
	c.VMs.OnSnapshotDeleted(s.followSnapshotDelete)
	return s
}

// Catalog returns the image catalog.
func (s *Service) Catalog() Catalog { return s.catalog }

// Create validates req (400 *vm.FieldError), checks the image is ready (409
// *ConflictError), admits and creates the AppVM through the vm machinery.
//
// The root disk is made from the image's current build as
// appvm_root_disk says: an overlay of it, or a copy. The build is pinned
// (builds.go) until the record, which names it, is stored.
func (s *Service) Create(ctx context.Context, req *CreateRequest) (*CreateResponse, error) {
	src, err := s.source(req)
	if err != nil {
		return nil, err
	}
	defer src.release()
	img, err := s.validate(req, src)
	if err != nil {
		return nil, err
	}
	if img.Status == StatusImporting {
		return nil, &ConflictError{Msg: fmt.Sprintf("AppVM image %q is still importing", img.ID)}
	}
	booted := req.AutoBoot == nil || *req.AutoBoot
	size := uint32(req.DiskGiB)
	mode := record.DiskCopy
	if s.vms.Config().AppVMRootDisk == config.AppVMRootOverlay {
		mode = record.DiskOverlay
	}
	spec := &vm.Spec{
		VMID:          req.VMID,
		Vcpus:         req.Vcpus,
		MemoryMB:      req.MemoryMB,
		Disk:          &vm.DiskSpec{Mode: src.mode(mode), BasePath: src.base.Path, SizeGiB: &size},
		FromSnapshot:  req.FromSnapshot,
		Volumes:       src.volumes,
		DiskBpsTotal:  req.DiskBpsTotal,
		DiskIopsTotal: req.DiskIopsTotal,
		AutoBoot:      booted,
		Labels:        req.Labels,
	}
	app := &vm.AppVMSpec{
		ImageID:       img.ID,
		Hostname:      strings.TrimSpace(req.Hostname),
		NetworkMode:   NetworkDHCP,
		Keepalive:     req.Keepalive,
		Env:           req.Env,
		RestartPolicy: string(req.RestartPolicy),
		Booted:        booted,
		Image:         img.Workload,
	}
	if app.RestartPolicy == "" {
		app.RestartPolicy = "no"
	}
	if s.noDefaultNetwork && req.NetworkID == "" && req.IP == nil {
		app.NetworkMode = NetworkNone
	} else {
		spec.Nets = []vm.NetSpec{{NetworkID: req.NetworkID}}
	}
	if req.IP != nil {
		app.NetworkMode = NetworkStatic
		app.IP, app.Prefix, app.Gateway, app.DNS = *req.IP, *req.Prefix, *req.Gateway, req.DNS
		spec.Nets[0].IPv4 = &vm.NetIPSpec{
			Address:    fmt.Sprintf("%s/%d", *req.IP, *req.Prefix),
			Gateway:    *req.Gateway,
			DNSServers: req.DNS,
		}
	}
	for _, d := range req.DataVolumes {
		spec.Volumes = append(spec.Volumes, vm.VolumeSpec{SizeGiB: d.SizeGiB, Mountpoint: d.Mountpoint})
	}
	rec, err := s.vms.NewRecord(vm.ModeAppVM, spec, len(spec.Nets))
	if err != nil {
		return nil, err
	}
	for _, e := range req.SecretEnv {
		k, v, _ := strings.Cut(e.Reveal(), "=")
		app.SecretEnvKeys = append(app.SecretEnvKeys, k)
		rec.Secrets.SecretEnv = append(rec.Secrets.SecretEnv, vm.SecretEnv{Key: k, Value: vm.Secret(v)})
	}
	req.workload().apply(app, &rec.Secrets)
	rec.AppVM = app
	rec.Base = &src.base
	rec, _, err = s.vms.Launch(ctx, rec)
	if err != nil && rec == nil {
		return nil, err
	}
	// A boot failure keeps the VM (rec != nil) and is still an error.
	return &CreateResponse{ID: rec.ID, Mode: string(vm.ModeAppVM), ImageID: img.ID, Booted: booted}, err
}

func bad(field, format string, args ...any) error {
	return &vm.FieldError{Field: field, Msg: fmt.Sprintf(format, args...)}
}

// createSource is where a new AppVM's disks come from: its image's build,
// or a snapshot's copies (pinned until release).
type createSource struct {
	img     *Image
	base    vm.BaseImage
	volumes []vm.VolumeSpec // a snapshot's own volumes, as they were
	release func()
	// fromSnapshot: the disks are a snapshot's copies; overlay: its root
	// disk is an overlay of the build base names.
	fromSnapshot, overlay bool
}

// source resolves the image_id or from_snapshot of r (exactly one of them;
// *vm.FieldError otherwise).
func (s *Service) source(r *CreateRequest) (*createSource, error) {
	if r.VMID != "" && !store.ValidID(r.VMID) {
		return nil, bad("vm_id", "must match ^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
	}
	switch {
	case r.FromSnapshot != "" && r.ImageID != "":
		return nil, bad("image_id", "not with from_snapshot: the AppVM's disks and workload are the snapshot's")
	case r.FromSnapshot != "" && len(r.DataVolumes) > 0:
		return nil, bad("data_volumes", "not with from_snapshot: the AppVM gets copies of the snapshot's volumes (attach more later)")
	case r.FromSnapshot != "":
		sn, vols, release, err := s.vms.FromSnapshot(r.FromSnapshot, vm.ModeAppVM)
		if err != nil {
			return nil, err
		}
		img := &Image{ID: sn.Source.ImageID, Status: StatusReady}
		if len(sn.Source.Workload) > 0 {
			if err := json.Unmarshal(sn.Source.Workload, &img.Workload); err != nil {
				release()
				return nil, &vm.HostError{Kind: vm.HostStorage, Op: "reading snapshot " + sn.ID, Err: err}
			}
		}
		// The root disk is a copy of the snapshot's. A copy of an overlay
		// backs onto the build, which is then the AppVM's base as for any
		// overlay (record.Record.RootBacking): the keeper keeps it
		// (builds.go) and the storage daemon opens the chain.
		root := sn.Disks[0]
		src := &createSource{img: img, base: vm.BaseImage{Path: root.Path, VirtualSizeBytes: root.VirtualSizeBytes},
			volumes: vols, release: release, fromSnapshot: true}
		if root.Backing != "" {
			src.base.Path, src.overlay = root.Backing, true
		}
		return src, nil
	case r.ImageID == "":
		return nil, bad("image_id", "required unless from_snapshot is given")
	}
	// The build is pinned (builds.go) until the record, which names it,
	// is stored.
	img, unpin, err := s.pinBuild(r.ImageID)
	if err != nil && unpin == nil {
		return nil, err // the build of a ready image is missing
	}
	switch {
	case errors.Is(err, fs.ErrNotExist):
		unpin()
		return nil, bad("image_id", "unknown AppVM image %q", r.ImageID)
	case err != nil:
		unpin()
		return nil, bad("image_id", "%v", err)
	case img.Status == StatusFailed:
		unpin()
		return nil, bad("image_id", "AppVM image %q failed to import", r.ImageID)
	}
	return &createSource{img: img, base: vm.BaseImage{Path: s.catalog.RootFS(img), VirtualSizeBytes: img.SizeBytes}, release: unpin}, nil
}

// mode is the root disk's kind: configured, for an image's build; for a
// snapshot, that of the snapshot's root disk, which the AppVM gets a copy
// of as it is (an overlay of a build, or a disk of its own).
func (c *createSource) mode(configured string) string {
	switch {
	case c.overlay:
		return record.DiskOverlay
	case c.fromSnapshot:
		return record.DiskCopy
	}
	return configured
}

// validate checks every rule of docs/api.md (POST /api/appvm/vms) that goes beyond types and
// returns the image. The image's import status is left to Create (409).
func (s *Service) validate(r *CreateRequest, src *createSource) (*Image, error) {
	img := src.img
	if err := vm.CheckLabels(r.Labels); err != nil {
		return nil, err
	}
	if r.Vcpus < 1 || r.Vcpus > vm.MaxVcpus {
		return nil, bad("vcpus", "must be 1..%d, got %d", vm.MaxVcpus, r.Vcpus)
	}
	if err := vm.CheckMemory(r.MemoryMB); err != nil {
		return nil, err
	}
	if r.DiskGiB < 1 || r.DiskGiB > vm.MaxSizeGiB {
		return nil, bad("disk_gib", "must be 1..%d, got %d", vm.MaxSizeGiB, r.DiskGiB)
	}
	if uint64(r.DiskGiB)<<30 < src.base.VirtualSizeBytes {
		what := "the image's size"
		if r.FromSnapshot != "" {
			what = "the size of the snapshot's root disk"
		}
		return nil, bad("disk_gib", "%d GiB is below %s of %d bytes", r.DiskGiB, what, src.base.VirtualSizeBytes)
	}
	if r.NetworkID != "" {
		if _, ok := s.vms.Config().Network(r.NetworkID); !ok {
			return nil, bad("network_id", "unknown network %q", r.NetworkID)
		}
	}
	if err := checkNetworkMode(r); err != nil {
		return nil, err
	}
	if h := strings.TrimSpace(r.Hostname); h != "" && !vm.ValidHostname(h) {
		return nil, bad("hostname", "at most %d bytes of letters, digits and -, not starting or ending with -", vm.MaxHostnameBytes)
	}
	keys := map[string]string{}
	plain := make([]string, len(r.Env))
	copy(plain, r.Env)
	if err := checkEnv("env", plain, keys); err != nil {
		return nil, err
	}
	secret := make([]string, len(r.SecretEnv))
	for i, e := range r.SecretEnv {
		secret[i] = e.Reveal()
	}
	if err := checkEnv("secret_env", secret, keys); err != nil {
		return nil, err
	}
	if len(r.DataVolumes) > MaxDataVolumes {
		return nil, bad("data_volumes", "at most %d volumes, got %d", MaxDataVolumes, len(r.DataVolumes))
	}
	seen := map[string]int{}
	for i, d := range r.DataVolumes {
		f := func(n string) string { return fmt.Sprintf("data_volumes[%d].%s", i, n) }
		if d.SizeGiB < 1 || d.SizeGiB > vm.MaxSizeGiB {
			return nil, bad(f("size_gib"), "must be 1..%d, got %d", vm.MaxSizeGiB, d.SizeGiB)
		}
		if err := vm.CheckMountpoint(d.Mountpoint); err != nil {
			return nil, bad(f("mountpoint"), "%s", err)
		}
		if j, dup := seen[d.Mountpoint]; dup {
			return nil, bad(f("mountpoint"), "%s is also the mountpoint of data_volumes[%d]", d.Mountpoint, j)
		}
		seen[d.Mountpoint] = i
	}
	if err := vm.CheckIOLimits(r.DiskBpsTotal, r.DiskIopsTotal); err != nil {
		return nil, err
	}
	if err := r.workload().validate(); err != nil {
		return nil, err
	}
	return img, nil
}

// checkNetworkMode applies the network mode rules 1-4.
func checkNetworkMode(r *CreateRequest) error {
	given := 0
	for _, p := range []bool{r.IP != nil, r.Prefix != nil, r.Gateway != nil} {
		if p {
			given++
		}
	}
	switch given {
	case 0:
		if len(r.DNS) > 0 {
			return bad("dns", "must be empty in DHCP mode (ip, prefix and gateway omitted)")
		}
		return nil
	case 3:
	default:
		for _, m := range []struct {
			name    string
			missing bool
		}{{"ip", r.IP == nil}, {"prefix", r.Prefix == nil}, {"gateway", r.Gateway == nil}} {
			if m.missing {
				return bad(m.name, "static mode needs ip, prefix and gateway together; %s is missing", m.name)
			}
		}
	}
	ip, err := netip.ParseAddr(*r.IP)
	if err != nil || !ip.Is4() {
		return bad("ip", "must be an IPv4 address without a prefix length")
	}
	if *r.Prefix < 1 || *r.Prefix > 32 {
		return bad("prefix", "must be 1..32, got %d", *r.Prefix)
	}
	gw, err := netip.ParseAddr(*r.Gateway)
	if err != nil || !gw.Is4() {
		return bad("gateway", "must be an IPv4 address")
	}
	for i, d := range r.DNS {
		if _, err := netip.ParseAddr(d); err != nil {
			return bad(fmt.Sprintf("dns[%d]", i), "not an IP address: %q", d)
		}
	}
	return nil
}

// checkEnv applies the env item rules to one list; keys collects keys
// across env and secret_env, which may not repeat. Values never appear in
// messages (they may be secret).
func checkEnv(field string, entries []string, keys map[string]string) error {
	if len(entries) > MaxEnvEntries {
		return bad(field, "at most %d entries, got %d", MaxEnvEntries, len(entries))
	}
	for i, e := range entries {
		f := fmt.Sprintf("%s[%d]", field, i)
		if len(e) > MaxEnvEntryBytes {
			return bad(f, "entry longer than %d bytes", MaxEnvEntryBytes)
		}
		k, v, ok := strings.Cut(e, "=")
		if !ok {
			return bad(f, "must be KEY=VALUE")
		}
		if !proto.ValidEnvKey(k) {
			return bad(f, "key must match [A-Za-z_][A-Za-z0-9_]*")
		}
		if strings.ContainsAny(v, "\x00\n\r") {
			return bad(f, "value of %s contains NUL, newline or carriage return", k)
		}
		if prev, dup := keys[k]; dup {
			return bad(f, "key %s is already set by %s", k, prev)
		}
		keys[k] = f
	}
	return nil
}
