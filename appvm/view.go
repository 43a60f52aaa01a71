package appvm

import (
	"fmt"
	"strings"
	"time"

	"vmhost/vm"
)

// KeepaliveArgs is the workload argument vector of an AppVM created with
// keepalive: a shell that stays up until it is told to stop.
var KeepaliveArgs = []string{"/bin/sh", "-c", "trap 'exit 0' TERM INT; while :; do sleep 3600 & wait $!; done"}

// View is the AppVM VmView: the VM view plus the appvm object.
type View struct {
	*vm.View
	AppVM AppvmView `json:"appvm"`
}

// AppvmView is the appvm object of docs/api.md (GET /api/appvm/vms), fields in its order.
// The guest-reported fields (lease, workload exit, health, heartbeat,
// restarts) come from the record's guest facts and the live session
// (session_view.go).
type AppvmView struct {
	ImageID             string          `json:"image_id"`
	Hostname            string          `json:"hostname,omitempty"`
	NetworkMode         string          `json:"network_mode"`
	IP                  string          `json:"ip,omitempty"`
	Prefix              uint32          `json:"prefix,omitempty"`
	Gateway             string          `json:"gateway,omitempty"`
	DNS                 []string        `json:"dns,omitempty"`
	Lease               *LeaseView      `json:"lease,omitempty"`
	WaitingFor          string          `json:"waiting_for,omitempty"`
	Args                []string        `json:"args,omitempty"`
	Cwd                 string          `json:"cwd,omitempty"`
	User                string          `json:"user,omitempty"`
	Env                 []EnvVar        `json:"env,omitempty"`
	WorkloadExitCode    *int            `json:"workload_exit_code,omitempty"`
	WorkloadExitSignal  int             `json:"workload_exit_signal,omitempty"`
	WorkloadFatal       string          `json:"workload_fatal,omitempty"`
	SpecPending         bool            `json:"spec_pending,omitempty"`
	Spec                SpecView        `json:"spec"`
	Health              string          `json:"health,omitempty"`
	HealthFailingStreak uint32          `json:"health_failing_streak,omitempty"`
	Healthcheck         *vm.Healthcheck `json:"healthcheck,omitempty"`
	ExtraHosts          []ExtraHost     `json:"extra_hosts,omitempty"`
	InjectedFiles       []InjectedFile  `json:"injected_files,omitempty"`
	TmpfsMounts         []TmpfsMount    `json:"tmpfs_mounts,omitempty"`
	LastHeartbeatAt     *time.Time      `json:"last_heartbeat_at,omitempty"`
	HeartbeatStale      bool            `json:"heartbeat_stale,omitempty"`
	LogStreamDetached   bool            `json:"log_stream_detached,omitempty"`
	RestartPolicy       string          `json:"restart_policy"`
	RestartCount        uint32          `json:"restart_count,omitempty"`
	LastRestartAt       *time.Time      `json:"last_restart_at,omitempty"`
	NextRestartAt       *time.Time      `json:"next_restart_at,omitempty"`
	DataMounts          []DataMount     `json:"data_mounts,omitempty"`
	BuildDigest         string          `json:"build_digest,omitempty"`
	UpdateAvailable     bool            `json:"update_available,omitempty"`
	Redeploying         bool            `json:"redeploying,omitempty"`
	RedeployError       string          `json:"redeploy_error,omitempty"`
}

// LeaseView is appvm.lease (AppvmLease): the latest DHCP lease the guest
// reported.
type LeaseView struct {
	IP         string    `json:"ip"`
	Prefix     int       `json:"prefix"`
	Gateway    string    `json:"gateway,omitempty"`
	DNS        []string  `json:"dns,omitempty"`
	Search     []string  `json:"search,omitempty"`
	LeaseSecs  uint32    `json:"lease_secs,omitempty"`
	Hostname   string    `json:"hostname,omitempty"`
	ReportedAt time.Time `json:"reported_at"`
}

// EnvVar is one effective environment variable; a secret one has no value.
type EnvVar struct {
	Key    string `json:"key"`
	Value  string `json:"value,omitempty"`
	Secret bool   `json:"secret,omitempty"`
}

// InjectedFile is a file written into the guest; contents never shown.
type InjectedFile struct {
	Path   string `json:"path"`
	Mode   uint32 `json:"mode"`
	Secret bool   `json:"secret"`
}

// ExtraHost is one extra /etc/hosts entry (its shape in docs/api.md, AppVMs).
type ExtraHost = vm.ExtraHost

// ConfigFile is a non-secret injected file with its contents.
type ConfigFile = vm.ConfigFile

// TmpfsMount is one tmpfs mount in the guest.
type TmpfsMount = vm.TmpfsMount

// DataMount maps a data volume's device to its mountpoint.
type DataMount struct {
	Device     string `json:"device"`
	Mountpoint string `json:"mountpoint"`
	ReadOnly   bool   `json:"read_only"`
}

// SpecView is the stored workload spec (AppvmSpecView): what the request
// set, not the image defaults.
type SpecView struct {
	Keepalive     bool            `json:"keepalive"`
	Command       []string        `json:"command"`
	Env           []string        `json:"env"`
	SecretEnvKeys []string        `json:"secret_env_keys"`
	Workdir       string          `json:"workdir,omitempty"`
	User          string          `json:"user,omitempty"`
	NoHealthcheck bool            `json:"no_healthcheck"`
	Healthcheck   *vm.Healthcheck `json:"healthcheck,omitempty"`
	ExtraHosts    []ExtraHost     `json:"extra_hosts"`
	ConfigFiles   []ConfigFile    `json:"config_files"`
	SecretFiles   []InjectedFile  `json:"secret_files"`
	TmpfsMounts   []TmpfsMount    `json:"tmpfs_mounts"`
	RestartPolicy string          `json:"restart_policy"`
	StopGraceSecs uint32          `json:"stop_grace_secs,omitempty"`
}

// Hostname is the AppVM's hostname: the configured one, or "appvm-" and
// the last three octets of its MAC in hex (02:00:00:a1:b2:c3 → appvm-a1b2c3);
// an AppVM without an interface is named after its id when that is a
// hostname, else "appvm".
func Hostname(rec *vm.Record) string {
	if rec.AppVM != nil && rec.AppVM.Hostname != "" {
		return rec.AppVM.Hostname
	}
	if len(rec.NICs) == 0 {
		if vm.ValidHostname(rec.ID) {
			return rec.ID
		}
		return "appvm"
	}
	m := strings.ReplaceAll(rec.NICs[0].MAC, ":", "")
	return "appvm-" + m[max(0, len(m)-6):]
}

// View builds the AppVM view of rec. Effective values (args, env, cwd,
// user, health check) are the image defaults recorded at create time
// overlaid with the request; secret env values are never included.
func (s *Service) View(rec *vm.Record, o vm.ViewOptions) *View {
	a := rec.AppVM
	v := &View{View: s.vms.View(rec, o)}
	av := AppvmView{
		ImageID:       a.ImageID,
		Hostname:      Hostname(rec),
		NetworkMode:   a.NetworkMode,
		IP:            a.IP,
		Prefix:        a.Prefix,
		Gateway:       a.Gateway,
		DNS:           a.DNS,
		User:          effectiveUser(a),
		Healthcheck:   effectiveHealthcheck(a),
		SpecPending:   a.SpecPending,
		Redeploying:   a.Redeploy != nil,
		RedeployError: a.RedeployError,
		RestartPolicy: a.RestartPolicy,
		BuildDigest:   a.Image.BuildDigest,
		Spec: SpecView{
			Keepalive:     a.Keepalive,
			Command:       nonNil(a.Command),
			Env:           nonNil(a.Env),
			SecretEnvKeys: nonNil(a.SecretEnvKeys),
			Workdir:       a.Workdir,
			User:          a.User,
			NoHealthcheck: a.NoHealthcheck,
			Healthcheck:   a.Healthcheck,
			ExtraHosts:    nonNil(a.ExtraHosts),
			ConfigFiles:   nonNil(a.ConfigFiles),
			SecretFiles:   []InjectedFile{},
			TmpfsMounts:   nonNil(a.TmpfsMounts),
			RestartPolicy: a.RestartPolicy,
			StopGraceSecs: a.StopGraceSecs,
		},
		ExtraHosts:  a.ExtraHosts,
		TmpfsMounts: a.TmpfsMounts,
	}
	for _, c := range a.ConfigFiles {
		av.InjectedFiles = append(av.InjectedFiles, InjectedFile{Path: c.Path, Mode: c.Mode})
	}
	for _, f := range rec.Secrets.Files { // path and mode only: never the content
		av.Spec.SecretFiles = append(av.Spec.SecretFiles, InjectedFile{Path: f.Path, Mode: f.Mode, Secret: true})
		av.InjectedFiles = append(av.InjectedFiles, InjectedFile{Path: f.Path, Mode: f.Mode, Secret: true})
	}
	entrypoint, cmd := effectiveArgs(a)
	av.Args = append(append([]string(nil), entrypoint...), cmd...)
	if wd := effectiveWorkdir(a); wd != "/" {
		av.Cwd = wd
	}
	av.Env = effectiveEnv(a)
	av.UpdateAvailable = s.updateAvailable(a)
	s.guestView(rec, &av)
	if g := a.Guest; g != nil && rec.State == vm.StateStopped {
		av.NextRestartAt = g.NextRestartAt // a boot since makes it stale
	}
	for _, m := range rec.Mounts() {
		av.DataMounts = append(av.DataMounts, DataMount{Device: m.Device, Mountpoint: m.Mountpoint, ReadOnly: m.ReadOnly})
	}
	v.AppVM = av
	return v
}

// updateAvailable reports whether the catalog's ready build of the AppVM's
// image differs from the build the AppVM was created from. It is derived at
// view time, never stored: a re-import (or its failure) shows at once.
func (s *Service) updateAvailable(a *vm.AppVMSpec) bool {
	img, err := s.catalog.Get(a.ImageID)
	return err == nil && img.Status == StatusReady && img.BuildDigest != "" && img.BuildDigest != a.Image.BuildDigest
}

// effectiveEnv overlays the request's env and secret keys on the image's
// env: an override keeps the image variable's position, new keys follow.
func effectiveEnv(a *vm.AppVMSpec) []EnvVar {
	var out []EnvVar
	index := map[string]int{}
	set := func(e EnvVar) {
		if i, ok := index[e.Key]; ok {
			out[i] = e
			return
		}
		index[e.Key] = len(out)
		out = append(out, e)
	}
	for _, lists := range [][]string{a.Image.Env, a.Env} {
		for _, kv := range lists {
			k, v, _ := strings.Cut(kv, "=")
			set(EnvVar{Key: k, Value: v})
		}
	}
	for _, k := range a.SecretEnvKeys {
		set(EnvVar{Key: k, Secret: true})
	}
	return out
}

func nonNil[T any](s []T) []T {
	if s == nil {
		return []T{}
	}
	return s
}

// Get returns the AppVM record of id; not found (also for a classic id)
// satisfies errors.Is(err, fs.ErrNotExist).
func (s *Service) Get(id string) (*vm.Record, error) {
	r, err := s.vms.Get(vm.ModeAppVM, id)
	if err != nil {
		return nil, fmt.Errorf("AppVM %q: %w", id, err)
	}
	return r, nil
}

// List returns every AppVM record, sorted by id.
func (s *Service) List() []*vm.Record { return s.vms.List(vm.ModeAppVM) }
