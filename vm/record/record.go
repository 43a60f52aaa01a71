package record

import (
	"encoding/json"
	"fmt"
	"path/filepath"
	"time"
)

// Mode is the family of a VM: classic ("vm") or AppVM ("appvm"). Both
// families share one record format, one registry and one id namespace.
type Mode string

// The two families.
const (
	ModeVM    Mode = "vm"
	ModeAppVM Mode = "appvm"
)

// State is a stored lifecycle state (docs/api.md, States and lifecycle actions).
type State string

// Stored lifecycle states.
const (
	StateCreated State = "created"
	StateRunning State = "running"
	StatePaused  State = "paused"
	StateStopped State = "stopped"
	StateFailed  State = "failed"
)

// Display states beyond the lifecycle states, reported while provisioning
// and booting.
const (
	DisplayBooting         = "booting"
	DisplayDownloading     = "downloading"
	DisplayCreating        = "creating"
	DisplayProvisionFailed = "provision_failed"
)

// Record is everything vmhost keeps about one VM, stored as
// <state>/vms/<id>.json (0600). Records are copy-on-write: a *Record handed
// out by the Service is never modified again; changes store a new one.
// Values derivable from the record (device letters, hostnames, paths, the
// effective command line) are computed by the views, not stored.
type Record struct {
	ID           string    `json:"id"`
	Mode         Mode      `json:"mode"`
	State        State     `json:"state"`
	DisplayState string    `json:"display_state"`
	CreatedAt    time.Time `json:"created_at"`
	// Spec is the validated request (for an AppVM: the VM-level spec
	// synthesized from it), secrets removed.
	Spec Spec `json:"spec"`
	// NICs holds the generated identity of every effective interface, in
	// order: Spec.Nets, or the one default interface of a cloud-init VM.
	NICs []NIC `json:"nics"`
	// Base is the canonical base image and its virtual size, as validated.
	Base *BaseImage `json:"base,omitempty"`
	// AppVM is the AppVM part; nil for a classic VM.
	AppVM         *AppVMSpec     `json:"appvm,omitempty"`
	FailureReason *FailureReason `json:"failure_reason,omitempty"`
	PID           int            `json:"pid,omitempty"`
	// Runtime is the identity of the VM's processes and provisioning
	// progress (engine_record.go); nil before any host work.
	Runtime *Runtime `json:"runtime,omitempty"`
	// Jail is the confinement the VM's processes run in, given to the VM
	// before any host work (its uid is never another record's); nil for a
	// VM whose processes run unconfined (an agent without root, or a VM
	// booted by an older vmhost, until its next boot).
	Jail *Confinement `json:"jail,omitempty"`
	// Deleting is stored before a delete tears anything down, so that an
	// agent killed during the delete finishes it at restart (recover.go)
	// instead of keeping a record whose disks and taps are gone.
	Deleting bool `json:"deleting,omitempty"`
	// ShuttingDown is set while an ACPI shutdown is pending.
	ShuttingDown bool `json:"shutting_down,omitempty"`
	// GuestPanickedAt is when CH reported a guest panic (pvpanic).
	GuestPanickedAt *time.Time `json:"guest_panicked_at,omitempty"`
	// BalloonMB is the balloon target (POST .../balloon): applied to a
	// running VM at once, and the balloon's size at every boot.
	BalloonMB uint64 `json:"balloon_mb,omitempty"`
	// Suspended is set while the memory and device state of a suspend (or
	// of a restored snapshot with memory) wait in the VM's suspend
	// directory: the next start resumes from them (saved.go).
	Suspended *Suspension `json:"suspended,omitempty"`
	// Saving is a suspend, snapshot, restore or resume in progress,
	// recorded before it changes the host, so that recovery finishes or
	// undoes it (saved.go).
	Saving *SaveOp `json:"saving,omitempty"`
	// Secrets never reaches a view; Encode writes it to the file.
	Secrets Secrets `json:"-"`
}

// Confinement is a VM's jail (docs/operating.md, Confinement): the uid and
// gid its Cloud Hypervisor and qemu-storage-daemon run as, and its cgroup,
// relative to each cgroup hierarchy's root.
type Confinement struct {
	UID    uint32 `json:"uid"`
	GID    uint32 `json:"gid"`
	Cgroup string `json:"cgroup"`
}

// Usage is what a confined VM's processes use now, read from its cgroup.
type Usage struct {
	CPUSeconds  float64 // CPU time of every process that has been in it
	MemoryBytes uint64  // memory charged to it
	Pids        uint64  // tasks (processes and threads) in it
}

// NIC is the generated, recorded identity of one interface.
type NIC struct {
	MAC string `json:"mac"`
	Tap string `json:"tap"`
	// DHCPSnoopedIPv4 is the address of the last DHCP ACK snooped on the
	// tap for MAC (facts.go); kept so the anti-spoof pin is restored after
	// an agent restart.
	DHCPSnoopedIPv4 string `json:"dhcp_snooped_ipv4,omitempty"`
	// LastObservedIPv4 is the last IPv4 the neighbour table showed for MAC;
	// kept after the entry expires.
	LastObservedIPv4 string `json:"last_observed_ipv4,omitempty"`
}

// BaseImage is the base qcow2 image of a root disk copy.
type BaseImage struct {
	Path             string `json:"path"`
	VirtualSizeBytes uint64 `json:"virtual_size_bytes"`
}

// Secrets is the secret material of a VM: it lives only in the 0600 record
// file and in what is sent to the guest. Formatting and logging it gives
// "[redacted]".
type Secrets struct {
	Password  Secret       `json:"-"`
	SecretEnv []SecretEnv  `json:"-"`
	Files     []SecretFile `json:"-"`
}

// SecretEnv is one secret environment variable of an AppVM.
type SecretEnv struct {
	Key   string
	Value Secret
}

// String returns "[redacted]".
func (Secrets) String() string { return redacted }

// FailureReason explains why a VM is not running (docs/api.md, The VM view).
type FailureReason struct {
	DetectedAt time.Time     `json:"detected_at"`
	Summary    string        `json:"summary"`
	Detail     FailureDetail `json:"detail"`
	Cause      string        `json:"cause"`
}

// FailureDetail is the tagged detail object of a FailureReason.
type FailureDetail struct {
	Kind    string `json:"kind"`
	Code    *int   `json:"code,omitempty"`
	Signum  *int   `json:"signum,omitempty"`
	Path    string `json:"path,omitempty"`
	ID      string `json:"id,omitempty"`
	Seconds *int   `json:"seconds,omitempty"`
}

// AppVMSpec is the AppVM part of a record: the request's workload settings
// and a snapshot of the image's workload defaults taken at create time.
type AppVMSpec struct {
	ImageID       string   `json:"image_id"`
	Hostname      string   `json:"hostname,omitempty"` // explicit; empty = derived from the MAC
	NetworkMode   string   `json:"network_mode"`       // static, dhcp or none (no interface)
	IP            string   `json:"ip,omitempty"`
	Prefix        uint32   `json:"prefix,omitempty"`
	Gateway       string   `json:"gateway,omitempty"`
	DNS           []string `json:"dns,omitempty"`
	Keepalive     bool     `json:"keepalive,omitempty"`
	Env           []string `json:"env,omitempty"`             // non-secret KEY=VALUE
	SecretEnvKeys []string `json:"secret_env_keys,omitempty"` // values in Record.Secrets
	RestartPolicy string   `json:"restart_policy"`
	Booted        bool     `json:"booted"` // the request asked to boot

	// The rest of the editable workload spec (docs/api.md, AppVMs); zero
	// values keep the image's defaults. Secret file contents are in
	// Record.Secrets.Files.
	Command       []string     `json:"command,omitempty"` // replaces entrypoint and cmd
	Workdir       string       `json:"workdir,omitempty"`
	User          string       `json:"user,omitempty"`
	NoHealthcheck bool         `json:"no_healthcheck,omitempty"`
	Healthcheck   *Healthcheck `json:"healthcheck,omitempty"` // replaces the image's
	ExtraHosts    []ExtraHost  `json:"extra_hosts,omitempty"`
	ConfigFiles   []ConfigFile `json:"config_files,omitempty"`
	TmpfsMounts   []TmpfsMount `json:"tmpfs_mounts,omitempty"`
	StopGraceSecs uint32       `json:"stop_grace_secs,omitempty"`
	// SpecPending is set when the spec changed while the AppVM ran and is
	// cleared once a boot's guest agent got the spec; SpecGen counts edits,
	// so an edit made while a spec was being sent stays pending.
	SpecPending bool   `json:"spec_pending,omitempty"`
	SpecGen     uint64 `json:"spec_gen,omitempty"`
	// Redeploy is a redeploy in progress (docs/api.md, AppVMs): the build it
	// installs and whether its root disk is staged (RootDiskNext complete),
	// so that recovery rolls it back or forward. RedeployError is the last
	// failure.
	Redeploy      *Redeploy `json:"redeploy,omitempty"`
	RedeployError string    `json:"redeploy_error,omitempty"`
	// Restart is an operation in progress whose outcome is this AppVM
	// running (a spec edit with restart, a redeploy of a running AppVM),
	// recorded before it stops anything, so that recovery finishes it if
	// the agent dies first (appvm.FinishRestarts).
	Restart *Restart    `json:"restart,omitempty"`
	Image   Workload    `json:"image"`
	Guest   *AppVMGuest `json:"guest,omitempty"` // what its guest agent reported (package appvm)

	// v1Mounts are the mountpoints a record written before volumes held
	// them kept in appvm.data_volumes, parallel to Spec.Volumes; Decode
	// moves them there (migrate on read) and the next write drops the
	// old list.
	v1Mounts []string
}

// UnmarshalJSON decodes an AppVM part, keeping the mountpoints of the
// data_volumes list of earlier versions for Decode to move.
func (a *AppVMSpec) UnmarshalJSON(b []byte) error {
	type spec AppVMSpec // the fields, without this method
	v := struct {
		*spec
		DataVolumes []struct {
			Mountpoint string `json:"mountpoint"`
		} `json:"data_volumes"`
	}{spec: (*spec)(a)}
	if err := json.Unmarshal(b, &v); err != nil {
		return err
	}
	for _, d := range v.DataVolumes {
		a.v1Mounts = append(a.v1Mounts, d.Mountpoint)
	}
	return nil
}

// Restart is an operation in progress that stops an AppVM to boot it
// again. Of is the start time (field 22 of /proc/PID/stat) of the Cloud
// Hypervisor of the boot it replaces: while that boot still runs, the
// operation has not stopped it yet.
type Restart struct {
	Of uint64 `json:"of,omitempty"`
}

// Redeploy is an AppVM redeploy in progress.
type Redeploy struct {
	To     Workload `json:"to"`
	Staged bool     `json:"staged,omitempty"`
}

// ExtraHost is one /etc/hosts entry the guest adds.
type ExtraHost struct {
	Hostname string `json:"hostname"`
	IP       string `json:"ip"`
}

// ConfigFile is a non-secret file written into the guest before the
// workload starts.
type ConfigFile struct {
	Path    string `json:"path"`
	Mode    uint32 `json:"mode"`
	Content string `json:"content"`
}

// TmpfsMount is a tmpfs the guest mounts before the workload starts; a
// zero size or mode takes the kernel's default.
type TmpfsMount struct {
	Path   string `json:"path"`
	SizeMB uint64 `json:"size_mb,omitempty"`
	Mode   uint32 `json:"mode,omitempty"`
}

// SecretFile is a secret file written into the guest: its content only in
// the record file and the guest, never in a view or a log.
type SecretFile struct {
	Path    string
	Mode    uint32
	Content Secret
}

// Workload is an AppVM image's workload defaults (the catalog's image.json
// fields), snapshotted into each AppVM record.
type Workload struct {
	BuildDigest string       `json:"build_digest,omitempty"`
	SizeBytes   uint64       `json:"size_bytes,omitempty"`
	Entrypoint  []string     `json:"entrypoint,omitempty"`
	Cmd         []string     `json:"cmd,omitempty"`
	Env         []string     `json:"env,omitempty"`
	Workdir     string       `json:"workdir,omitempty"`
	User        string       `json:"user,omitempty"`
	Healthcheck *Healthcheck `json:"healthcheck,omitempty"`
}

// Healthcheck is a workload health check, as an image defines it.
type Healthcheck struct {
	Test            []string `json:"test"`
	IntervalSecs    uint32   `json:"interval_secs,omitempty"`
	TimeoutSecs     uint32   `json:"timeout_secs,omitempty"`
	StartPeriodSecs uint32   `json:"start_period_secs,omitempty"`
	Retries         uint32   `json:"retries,omitempty"`
}

// recordFile is the on-disk form of a Record: the record plus its secrets
// revealed. Only Encode and Decode use it.
type recordFile struct {
	*Record
	Secrets *secretsFile `json:"secrets,omitempty"`
}

type secretsFile struct {
	Password  string           `json:"password,omitempty"`
	SecretEnv []secretEnvFile  `json:"secret_env,omitempty"`
	Files     []secretFileFile `json:"files,omitempty"`
}

type secretFileFile struct {
	Path    string `json:"path"`
	Mode    uint32 `json:"mode"`
	Content string `json:"content"`
}

type secretEnvFile struct {
	Key   string `json:"key"`
	Value string `json:"value"`
}

// Encode gives the record file contents, secrets included.
func Encode(r *Record) ([]byte, error) {
	f := recordFile{Record: r}
	if r.Secrets.Password != "" || len(r.Secrets.SecretEnv) > 0 || len(r.Secrets.Files) > 0 {
		s := &secretsFile{Password: r.Secrets.Password.Reveal()}
		for _, e := range r.Secrets.SecretEnv {
			s.SecretEnv = append(s.SecretEnv, secretEnvFile{Key: e.Key, Value: e.Value.Reveal()})
		}
		for _, f := range r.Secrets.Files {
			s.Files = append(s.Files, secretFileFile{Path: f.Path, Mode: f.Mode, Content: f.Content.Reveal()})
		}
		f.Secrets = s
	}
	b, err := json.MarshalIndent(f, "", "\t")
	if err != nil {
		return nil, fmt.Errorf("encoding record %q: %w", r.ID, err)
	}
	return append(b, '\n'), nil
}

// Decode parses a record file.
func Decode(data []byte) (*Record, error) {
	f := recordFile{Record: new(Record)}
	if err := json.Unmarshal(data, &f); err != nil {
		return nil, err
	}
	r := f.Record
	r.Spec.NormalizeVolumes()
	if a := r.AppVM; a != nil && a.v1Mounts != nil {
		for i, mp := range a.v1Mounts {
			if i < len(r.Spec.Volumes) && r.Spec.Volumes[i].Mountpoint == "" {
				r.Spec.Volumes[i].Mountpoint = mp
			}
		}
		a.v1Mounts = nil
	}
	if f.Secrets != nil {
		r.Secrets.Password = Secret(f.Secrets.Password)
		for _, e := range f.Secrets.SecretEnv {
			r.Secrets.SecretEnv = append(r.Secrets.SecretEnv, SecretEnv{Key: e.Key, Value: Secret(e.Value)})
		}
		for _, sf := range f.Secrets.Files {
			r.Secrets.Files = append(r.Secrets.Files, SecretFile{Path: sf.Path, Mode: sf.Mode, Content: Secret(sf.Content)})
		}
	}
	switch {
	case r.Mode != ModeVM && r.Mode != ModeAppVM:
		return nil, fmt.Errorf("unknown mode %q", r.Mode)
	case r.Mode == ModeAppVM && r.AppVM == nil:
		return nil, fmt.Errorf("appvm record without its appvm part")
	}
	return r, nil
}

// Clone returns a deep copy of r, for copy-on-write updates.
func (r *Record) Clone() *Record {
	b, err := Encode(r)
	if err != nil {
		panic(err) // every Record encodes
	}
	c, err := Decode(b)
	if err != nil {
		panic(err)
	}
	return c
}

// Provisioning reports whether a classic provision is still in progress,
// so the root disk and the console socket do not exist yet.
func (r *Record) Provisioning() bool {
	return r.State == StateCreated && (r.DisplayState == DisplayDownloading || r.DisplayState == DisplayCreating)
}

// Layout gives the host paths of a VM (docs/design.md §3). Paths are derived from
// the id and the state and run directories; records do not store them.
// StateDir and RunDir must be clean (New cleans them), and ids never hold
// a slash (they are valid ids or directory entry names), so the paths are
// built by concatenation: views build several per read.
type Layout struct {
	StateDir string
	RunDir   string
}

// VMDir is <state>/vms/<id>, the VM's own files.
func (l Layout) VMDir(id string) string { return l.StateDir + "/vms/" + id }

// RootDisk is the agent-owned copy of the base image.
func (l Layout) RootDisk(id string) string { return l.StateDir + "/vms/" + id + "/root.qcow2" }

// DataVolume is the file of the VM-owned data volume with per-VM id key.
func (l Layout) DataVolume(id, key string) string {
	return l.StateDir + "/vms/" + id + "/" + key + ".qcow2"
}

// VolumesDir holds the first-class volumes (package volume).
func (l Layout) VolumesDir() string { return l.StateDir + "/volumes" }

// SpoolDir is <state>/spool, where an AppVM files put spools the archive
// it checks before sending it (named as a temp file, and unlinked at once).
func (l Layout) SpoolDir() string { return l.StateDir + "/spool" }

// Volume is the file of first-class volume volID.
func (l Layout) Volume(volID string) string { return l.StateDir + "/volumes/" + volID + ".qcow2" }

// VolumeFile is the file of v, a volume of VM id: its first-class volume's,
// or the VM's own.
func (l Layout) VolumeFile(id string, v VolumeSpec) string {
	if v.VolumeID != "" {
		return l.Volume(v.VolumeID)
	}
	return l.DataVolume(id, v.ID)
}

// RootDiskNext is a root disk being rebuilt (an AppVM redeploy) before it
// replaces RootDisk.
func (l Layout) RootDiskNext(id string) string { return l.StateDir + "/vms/" + id + "/root.qcow2.next" }

// Seed is the NoCloud seed image.
func (l Layout) Seed(id string) string { return l.StateDir + "/vms/" + id + "/seed.img" }

// RunVMDir is <run>/vms/<id>, the VM's sockets and logs.
func (l Layout) RunVMDir(id string) string { return l.RunDir + "/vms/" + id }

// ConsoleSocket is the serial console socket.
func (l Layout) ConsoleSocket(id string) string { return l.RunDir + "/vms/" + id + "/console.sock" }

// ImageCache is the verified download of a registry image.
func (l Layout) ImageCache(sha256hex string) string {
	return filepath.Join(l.StateDir, "images", "sha256-"+sha256hex+".qcow2")
}

// AppVMGuest is what the host learned from an AppVM's guest agent and did
// about its workload, kept in the record (AppVMSpec.Guest) so it survives
// an agent restart. Contract §2.3 names the view fields.
type AppVMGuest struct {
	// BootID is the guest agent's boot id of the current boot.
	BootID string `json:"boot_id,omitempty"`
	// HeartbeatSecs is the heartbeat interval sent in the Spec.
	HeartbeatSecs int `json:"heartbeat_secs,omitempty"`
	// LastHeartbeatAt is persisted at the first heartbeat of a boot and
	// then at most every HeartbeatPersistEvery; the live value is kept in
	// memory by package appvm.
	LastHeartbeatAt *time.Time  `json:"last_heartbeat_at,omitempty"`
	Lease           *GuestLease `json:"lease,omitempty"`
	ExitCode        *int        `json:"workload_exit_code,omitempty"`
	ExitSignal      int         `json:"workload_exit_signal,omitempty"`
	Fatal           string      `json:"workload_fatal,omitempty"`
	Health          string      `json:"health,omitempty"`
	HealthStreak    uint32      `json:"health_failing_streak,omitempty"`
	// LogStreamDetached is set when the agent restarted while the AppVM ran
	// and cleared when the guest agent reconnects (Hello with resume).
	LogStreamDetached bool `json:"log_stream_detached,omitempty"`
	// RestartCount counts consecutive automatic restarts.
	RestartCount  uint32     `json:"restart_count,omitempty"`
	LastRestartAt *time.Time `json:"last_restart_at,omitempty"`
	// NextRestartAt is when the restart policy boots the stopped AppVM
	// again (set while its backoff waits): recorded, so that an agent
	// restarted meanwhile still does it.
	NextRestartAt *time.Time `json:"next_restart_at,omitempty"`
}

// GuestLease is the DHCP lease a guest agent reported.
type GuestLease struct {
	IP         string    `json:"ip"`
	Prefix     int       `json:"prefix"`
	Gateway    string    `json:"gateway,omitempty"`
	DNS        []string  `json:"dns,omitempty"`
	Search     []string  `json:"search,omitempty"`
	LeaseSecs  uint32    `json:"lease_secs,omitempty"`
	Hostname   string    `json:"hostname,omitempty"`
	ReportedAt time.Time `json:"reported_at"`
}
