// Package config holds the host settings of a vmhost agent: its networks and
// the default one, kernel command lines, the nested-virtualization override,
// overcommit ratios, host totals, the boot timeout, binary paths and the
// image download cap. They come from one JSON file (`vmhost serve --config`).
//
// Load starts from Default, so a file names only what it changes; a key it
// does not know is an error (a misspelt key must not silently fall back to a
// default). Networks, when given, replace the default list as a whole.
// Validate reports every problem at once, each naming its key.
//
// The package imports none of vmhost's packages.
package config

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/netip"
	"net/url"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"strings"

	"vmhost/jail"
)

// Defaults that Default fills in.
const (
	DefaultNetworkID     = "default"
	DefaultBridge        = "vmhost0"
	DefaultKernelCmdline = "console=ttyS0 root=/dev/vda1 rw"
	DefaultAppVMCmdline  = "console=ttyS0 quiet panic=-1"
	DefaultCPURatio      = 4.0
	DefaultMemoryRatio   = 1.0
	DefaultBootTimeout   = 120
	DefaultPingInterval  = 1
	DefaultPingTimeout   = 10
	DefaultSysfsRoot     = "/sys"
	DefaultCHBinary      = "cloud-hypervisor"
	DefaultQSDBinary     = "qemu-storage-daemon"
	DefaultImageMaxBytes = 64 << 30
	// The AppVM image import limits (ociimage's defaults).
	DefaultImageImportMaxBytes   = 16 << 30
	DefaultImageImportMaxEntries = 1_000_000
	// DefaultGuestFileMaxBytes caps an archive copied into an AppVM.
	DefaultGuestFileMaxBytes = 1 << 30
)

// Defaults of the image download knobs.
const (
	DefaultDownloadIdleSecs = 60
	// MaxDownloadIdleSecs bounds download_idle_secs (a day), far below
	// where a time.Duration would overflow.
	MaxDownloadIdleSecs = 86400
)

// Defaults of the observability knobs.
const (
	DefaultAuditLogMaxBytes = 64 << 20
	DefaultEventsKeep       = 10_000
	// DefaultWorkloadLogMaxBytes caps each AppVM's workload log.
	DefaultWorkloadLogMaxBytes = 64 << 20
)

// The values of appvm_root_disk.
const (
	AppVMRootOverlay = "overlay"
	AppVMRootCopy    = "copy"
)

// DefaultRegistryRefreshSecs is how often registry indexes are read again.
const DefaultRegistryRefreshSecs = 3600

// DefaultHostPathRoots are the directories a classic create's
// kernel_path, firmware_path and disk.base_path may lie under: where
// distributions put kernels, firmware and images.
var DefaultHostPathRoots = []string{"/var/lib/vmhost", "/usr/lib/vmhost", "/usr/share/cloud-hypervisor", "/usr/share/qemu", "/usr/share/OVMF", "/boot"}

// DefaultFetchDeny are the networks image downloads may not reach: the
// cloud metadata address range and IPv6 link-local.
var DefaultFetchDeny = []string{"169.254.0.0/16", "fe80::/10"}

// Config is the host configuration. The zero value is not useful; start from
// Default or Load.
type Config struct {
	// Networks are the host networks VMs can join (at least one).
	Networks []Network `json:"networks"`
	// DefaultNetwork is the id of the Networks entry used when a create
	// names neither network_id nor bridge.
	DefaultNetwork string `json:"default_network"`
	// DefaultCmdline is the kernel command line of classic VMs whose create
	// gives none.
	DefaultCmdline string `json:"default_cmdline"`
	// AppVMCmdline is the kernel command line AppVMs boot with.
	AppVMCmdline string `json:"appvm_cmdline"`
	// AppVMKernel is the absolute path of the host kernel AppVMs boot;
	// empty means AppVMs cannot be booted on this host.
	AppVMKernel string `json:"appvm_kernel"`
	// AppVMModules is the absolute path of the AppVM kernel's module tree:
	// its lib/modules/<release> directory, or the root of an extracted
	// kernel package holding exactly one. The AppVM initramfs then carries
	// the modules the guest agent needs (virtio, ext4, vsock) that the
	// kernel does not build in. Empty: the kernel must build them in.
	AppVMModules string `json:"appvm_modules,omitempty"`
	// AppVMRootDisk is how a new AppVM's root disk is made from its
	// image's build: AppVMRootOverlay (a qcow2 overlay whose backing file
	// is the build: made in constant time, sharing the build's blocks) or
	// AppVMRootCopy (a full copy, independent of the build). AppVMs keep
	// the kind they were made with.
	AppVMRootDisk string `json:"appvm_root_disk"`
	// Nested, when set, overrides what
	// /sys/module/kvm_{intel,amd}/parameters/nested says about nested
	// virtualization support.
	Nested *bool `json:"nested,omitempty"`
	// Overcommit are the admission ratios against host totals.
	Overcommit Overcommit `json:"overcommit"`
	// HostCPUs is the CPU total admission counts against; 0 means the online
	// CPUs read from sysfs.
	HostCPUs int `json:"host_cpus,omitempty"`
	// HostMemoryMB is the memory total (MiB) admission counts against; 0
	// means MemTotal from /proc/meminfo.
	HostMemoryMB int `json:"host_memory_mb,omitempty"`
	// BootTimeoutSecs is how long a booting VM may take to show life.
	BootTimeoutSecs int `json:"boot_timeout_secs"`
	// PingIntervalSecs is how often the monitor of a running VM pings its
	// Cloud Hypervisor (vmm.ping over a fresh connection, which also
	// notices a socket that refuses connections).
	PingIntervalSecs int `json:"ping_interval_secs"`
	// PingTimeoutSecs is how long a ping may go unanswered while the
	// process lives before the VM is failed as hung (ping_timeout).
	PingTimeoutSecs int `json:"ping_timeout_secs"`
	// SysfsRoot is where sysfs is read from; tests point it at a fake tree.
	SysfsRoot string `json:"sysfs_root"`
	// Binaries are the external programs vmhost runs.
	Binaries Binaries `json:"binaries"`
	// ImageMaxBytes caps the size of an image download.
	ImageMaxBytes int64 `json:"image_max_bytes"`
	// ImageImportMaxBytes caps the unpacked content of an AppVM image
	// import (its uncompressed layers together).
	ImageImportMaxBytes int64 `json:"image_import_max_bytes"`
	// ImageImportMaxEntries caps the entries (files, directories, links)
	// of an AppVM image import's layers together.
	ImageImportMaxEntries int64 `json:"image_import_max_entries"`
	// GuestFileMaxBytes caps an archive copied into an AppVM (PUT
	// /api/appvm/vms/{id}/files): its bytes, and its files' contents.
	GuestFileMaxBytes int64 `json:"guest_file_max_bytes"`
	// DefaultMTU is the MTU of an interface whose network and request give
	// none; 0 means the bridge's MTU.
	DefaultMTU int `json:"default_mtu,omitempty"`

	// HostPathRoots are the directories the host files a classic create
	// names (kernel_path, firmware_path, disk.base_path) must resolve
	// under, symlinks followed; the agent's state and run directories are
	// refused whatever the roots. [] lets any other path through (serve
	// --dev's default).
	HostPathRoots []string `json:"host_path_roots"`

	// DownloadIdleSecs fails an image download that receives nothing for
	// this many seconds.
	DownloadIdleSecs int `json:"download_idle_secs"`
	// FetchDeny are CIDRs an image fetch_url, and each of its redirects,
	// may not connect to; checked on the resolved address. A list given
	// replaces the default one; [] denies nothing.
	FetchDeny []string `json:"fetch_deny"`

	// TLS, when Cert and Key are set, makes serve answer HTTPS only.
	TLS TLS `json:"tls,omitempty"`
	// AuditLogMaxBytes is the size at which <state>/audit.log is rotated
	// (to audit.log.1, replacing the previous one).
	AuditLogMaxBytes int64 `json:"audit_log_max_bytes"`
	// EventsKeep is how many events the durable event log keeps at least,
	// across restarts, for clients that resume with Last-Event-ID.
	EventsKeep int `json:"events_keep"`
	// WorkloadLogMaxBytes caps each AppVM's workload log (its two
	// generations together): the oldest chunks go first.
	WorkloadLogMaxBytes int64 `json:"workload_log_max_bytes"`

	// Registry names the image indexes whose images a classic create can
	// name in image.
	Registry Registry `json:"registry"`
	// ImageCacheMaxBytes bounds the verified image cache: after each
	// download, the least recently used images no provision is using are
	// removed until the cache fits. 0 means no bound.
	ImageCacheMaxBytes int64 `json:"image_cache_max_bytes"`

	// Jail confines each VM's Cloud Hypervisor and qemu-storage-daemon
	// (docs/operating.md, Confinement): a uid and gid of their own, no
	// capabilities, a private root, one cgroup per VM. It takes effect
	// only when the agent runs as root.
	Jail jail.Config `json:"jail"`
}

// Registry is where registry images come from.
type Registry struct {
	// Indexes are http(s) URLs or absolute file paths of SimpleStreams
	// products:1.0 documents or flat vmhost indexes.
	Indexes []string `json:"indexes"`
	// RefreshSecs is how often every index is read again.
	RefreshSecs int `json:"refresh_secs"`
}

// TLS names the PEM files of the API's certificate and key and, for mutual
// TLS, of the CA that must have signed every client's certificate. They are
// read again on SIGHUP.
type TLS struct {
	Cert     string `json:"cert,omitempty"`
	Key      string `json:"key,omitempty"`
	ClientCA string `json:"client_ca,omitempty"`
}

// Network is one host network: a bridge VM taps are attached to, and the
// policies that apply to its ports unless a create overrides them.
type Network struct {
	// ID is what creates name in network_id.
	ID string `json:"id"`
	// Bridge is the host bridge interface.
	Bridge string `json:"bridge"`
	// MTU of the taps; 0 means Config.DefaultMTU.
	MTU int `json:"mtu,omitempty"`
	// Isolated sets the bridge-port isolation flag on the taps.
	Isolated bool `json:"isolated"`
	// SpoofGuard installs anti-spoof rules on the taps.
	SpoofGuard bool `json:"spoof_guard"`
}

// Overcommit are the ratios by which admission multiplies host totals.
type Overcommit struct {
	// CPU: vCPUs of VMs that are not stopped may reach host CPUs × CPU.
	CPU float64 `json:"cpu"`
	// Memory: memory of VMs that are not stopped may reach host memory ×
	// Memory.
	Memory float64 `json:"memory"`
}

// Binaries are the paths of the external programs. A bare name is looked up
// in PATH when the program is started.
type Binaries struct {
	CloudHypervisor   string `json:"cloud_hypervisor"`
	QemuStorageDaemon string `json:"qemu_storage_daemon"`
}

// Default returns a configuration with every default filled in and one
// network, {"default", bridge "vmhost0"}, which is the default network.
func Default() *Config {
	return &Config{
		Networks:         []Network{{ID: DefaultNetworkID, Bridge: DefaultBridge}},
		DefaultNetwork:   DefaultNetworkID,
		DefaultCmdline:   DefaultKernelCmdline,
		AppVMCmdline:     DefaultAppVMCmdline,
		AppVMRootDisk:    AppVMRootOverlay,
		Overcommit:       Overcommit{CPU: DefaultCPURatio, Memory: DefaultMemoryRatio},
		BootTimeoutSecs:  DefaultBootTimeout,
		PingIntervalSecs: DefaultPingInterval,
		PingTimeoutSecs:  DefaultPingTimeout,
		SysfsRoot:        DefaultSysfsRoot,
		Binaries:         Binaries{CloudHypervisor: DefaultCHBinary, QemuStorageDaemon: DefaultQSDBinary},
		ImageMaxBytes:    DefaultImageMaxBytes,

		ImageImportMaxBytes:   DefaultImageImportMaxBytes,
		ImageImportMaxEntries: DefaultImageImportMaxEntries,
		GuestFileMaxBytes:     DefaultGuestFileMaxBytes,
		HostPathRoots:         slices.Clone(DefaultHostPathRoots),
		DownloadIdleSecs:      DefaultDownloadIdleSecs,
		FetchDeny:             slices.Clone(DefaultFetchDeny),
		AuditLogMaxBytes:      DefaultAuditLogMaxBytes,
		EventsKeep:            DefaultEventsKeep,
		WorkloadLogMaxBytes:   DefaultWorkloadLogMaxBytes,
		Registry:              Registry{Indexes: []string{}, RefreshSecs: DefaultRegistryRefreshSecs},
		Jail:                  jail.DefaultConfig(),
	}
}

// DevDefault is Default for serve --dev: no host_path_roots, so kernels
// and images anywhere outside the state and run directories will do.
func DevDefault() *Config {
	c := Default()
	c.HostPathRoots = []string{}
	return c
}

// Load reads the JSON configuration at path over Default and validates it.
// Unknown keys and trailing data are errors. A missing file gives an error
// that satisfies errors.Is(err, fs.ErrNotExist); an invalid one is an
// *Error naming the file, and the line and column of each problem.
func Load(path string) (*Config, error) { return LoadOver(path, Default()) }

// LoadOver is Load over the defaults def (DevDefault for serve --dev)
// instead of Default; def is used up.
func LoadOver(path string, def *Config) (*Config, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("reading config: %w", err)
	}
	c, err := ParseOver(data, def)
	if e, ok := err.(*Error); ok {
		e.File = path
	}
	return c, err
}

// Parse decodes a JSON configuration over Default and validates it, as Load
// does for a file.
func Parse(data []byte) (*Config, error) { return ParseOver(data, Default()) }

// ParseOver is Parse over the defaults def instead of Default; def is
// used up. Its error is an *Error.
func ParseOver(data []byte, def *Config) (*Config, error) {
	fail := func(p ...Problem) (*Config, error) { return nil, &Error{Problems: p} }
	// A syntax error or trailing data first: the walk below needs one
	// well-formed document.
	first := json.NewDecoder(bytes.NewReader(data))
	if err := first.Decode(new(json.RawMessage)); err != nil {
		return fail(decodeProblem(data, err, nil))
	}
	end := int(first.InputOffset())
	if _, err := first.Token(); !errors.Is(err, io.EOF) {
		p := Problem{Msg: "decoding: unexpected data after the JSON object"}
		p.Line, p.Column = (&locator{data: data}).position(skipSpace(data, end))
		return fail(p)
	}
	loc, unknown, err := locate(data, reflect.TypeFor[Config]())
	if err != nil {
		return fail(Problem{Msg: "decoding: " + err.Error()})
	}
	if len(unknown) > 0 {
		return fail(unknown...)
	}
	c := def
	defaultNetworks := c.Networks
	// encoding/json decodes array elements into the slice's existing
	// elements without zeroing them, so a given network would inherit the
	// default one's fields; decode into an empty list and restore the
	// default only if the file has no "networks" key.
	c.Networks = nil
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(c); err != nil {
		return fail(decodeProblem(data, err, loc))
	}
	if _, given := loc.starts["networks"]; !given {
		c.Networks = defaultNetworks
	}
	if probs := c.problems(); len(probs) > 0 {
		for i := range probs {
			probs[i] = loc.at(probs[i])
		}
		return fail(probs...)
	}
	return c, nil
}

var (
	networkIDPattern = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$`)
	// Linux accepts any bytes but '/', ':', whitespace and NUL in interface
	// names, up to IFNAMSIZ-1 bytes; keep to what ip(8) users type.
	ifnamePattern = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.@-]{0,14}$`)
)

// Validate reports every problem in c, one per line, each naming its key.
// The error is an *Error.
func (c *Config) Validate() error {
	if probs := c.problems(); len(probs) > 0 {
		return &Error{Problems: probs}
	}
	return nil
}

// problems lists what is wrong with c, each problem naming its key.
func (c *Config) problems() []Problem {
	var probs []Problem
	// Every message starts with the key it is about ("networks[0].mtu: …").
	bad := func(format string, args ...any) {
		key, msg, _ := strings.Cut(fmt.Sprintf(format, args...), ": ")
		probs = append(probs, Problem{Key: key, Msg: msg})
	}

	if len(c.Networks) == 0 {
		bad("networks: at least one network is required")
	}
	ids := map[string]int{}
	bridges := map[string]int{}
	for i, n := range c.Networks {
		key := fmt.Sprintf("networks[%d]", i)
		if !networkIDPattern.MatchString(n.ID) {
			bad("%s.id: %q must match %s", key, n.ID, networkIDPattern)
		} else if j, dup := ids[n.ID]; dup {
			bad("%s.id: %q is also the id of networks[%d]", key, n.ID, j)
		} else {
			ids[n.ID] = i
		}
		if !ifnamePattern.MatchString(n.Bridge) {
			bad("%s.bridge: %q is not an interface name (1-15 of letters, digits, _ . @ -)", key, n.Bridge)
		} else if j, dup := bridges[n.Bridge]; dup {
			bad("%s.bridge: %q is also the bridge of networks[%d]", key, n.Bridge, j)
		} else {
			bridges[n.Bridge] = i
		}
		if !validMTU(n.MTU) {
			bad("%s.mtu: %d is outside %d..%d, the range a tap takes with Cloud Hypervisor (0 = default_mtu)", key, n.MTU, minMTU, maxMTU)
		}
	}
	if _, ok := ids[c.DefaultNetwork]; !ok && len(c.Networks) > 0 {
		bad("default_network: %q is not the id of any entry in networks", c.DefaultNetwork)
	}
	if strings.ContainsAny(c.DefaultCmdline, "\x00\n") {
		bad("default_cmdline: must not contain NUL or newline")
	}
	if strings.ContainsAny(c.AppVMCmdline, "\x00\n") {
		bad("appvm_cmdline: must not contain NUL or newline")
	}
	if c.AppVMKernel != "" && !filepath.IsAbs(c.AppVMKernel) {
		bad("appvm_kernel: %q must be an absolute path (or empty)", c.AppVMKernel)
	}
	if c.AppVMModules != "" && !filepath.IsAbs(c.AppVMModules) {
		bad("appvm_modules: %q must be an absolute path (or empty)", c.AppVMModules)
	}
	if c.AppVMModules != "" && c.AppVMKernel == "" {
		bad("appvm_modules: set without appvm_kernel, the kernel the modules are for")
	}
	if c.AppVMRootDisk != AppVMRootOverlay && c.AppVMRootDisk != AppVMRootCopy {
		bad("appvm_root_disk: %q must be %q or %q", c.AppVMRootDisk, AppVMRootOverlay, AppVMRootCopy)
	}
	if !(c.Overcommit.CPU > 0) || math.IsInf(c.Overcommit.CPU, 0) {
		bad("overcommit.cpu: %v must be a positive number", c.Overcommit.CPU)
	}
	if !(c.Overcommit.Memory > 0) || math.IsInf(c.Overcommit.Memory, 0) {
		bad("overcommit.memory: %v must be a positive number", c.Overcommit.Memory)
	}
	if c.HostCPUs < 0 {
		bad("host_cpus: %d must be 0 (read from sysfs) or positive", c.HostCPUs)
	}
	if c.HostMemoryMB < 0 {
		bad("host_memory_mb: %d must be 0 (read from /proc/meminfo) or positive", c.HostMemoryMB)
	}
	if c.BootTimeoutSecs < 1 {
		bad("boot_timeout_secs: %d must be at least 1", c.BootTimeoutSecs)
	}
	if c.PingIntervalSecs < 1 {
		bad("ping_interval_secs: %d must be at least 1", c.PingIntervalSecs)
	}
	if c.PingTimeoutSecs < 1 {
		bad("ping_timeout_secs: %d must be at least 1", c.PingTimeoutSecs)
	}
	if !filepath.IsAbs(c.SysfsRoot) {
		bad("sysfs_root: %q must be an absolute path", c.SysfsRoot)
	}
	for _, b := range []struct{ key, path string }{
		{"binaries.cloud_hypervisor", c.Binaries.CloudHypervisor},
		{"binaries.qemu_storage_daemon", c.Binaries.QemuStorageDaemon},
	} {
		key, p := b.key, b.path
		if p == "" || strings.ContainsRune(p, 0) || (!filepath.IsAbs(p) && strings.ContainsRune(p, '/')) {
			bad("%s: %q must be an absolute path or a bare program name", key, p)
		}
	}
	if c.ImageMaxBytes < 1 {
		bad("image_max_bytes: %d must be positive", c.ImageMaxBytes)
	}
	if c.ImageImportMaxBytes < 1 {
		bad("image_import_max_bytes: %d must be positive", c.ImageImportMaxBytes)
	}
	if c.ImageImportMaxEntries < 1 {
		bad("image_import_max_entries: %d must be positive", c.ImageImportMaxEntries)
	}
	if c.GuestFileMaxBytes < 1 {
		bad("guest_file_max_bytes: %d must be positive", c.GuestFileMaxBytes)
	}
	if !validMTU(c.DefaultMTU) {
		bad("default_mtu: %d is outside %d..%d, the range a tap takes with Cloud Hypervisor (0 = the bridge's MTU)", c.DefaultMTU, minMTU, maxMTU)
	}

	for i, root := range c.HostPathRoots {
		if !filepath.IsAbs(root) || strings.ContainsRune(root, 0) {
			bad("host_path_roots[%d]: %q must be an absolute path", i, root)
		}
	}
	if c.DownloadIdleSecs < 1 || c.DownloadIdleSecs > MaxDownloadIdleSecs {
		bad("download_idle_secs: %d is outside 1..%d", c.DownloadIdleSecs, MaxDownloadIdleSecs)
	}
	for i, cidr := range c.FetchDeny {
		p, err := netip.ParsePrefix(cidr)
		switch {
		case err != nil:
			bad("fetch_deny[%d]: %q is not a CIDR such as 169.254.0.0/16 or fe80::/10", i, cidr)
		case p != p.Masked():
			bad("fetch_deny[%d]: %q has bits set past the prefix length (%s?)", i, cidr, p.Masked())
		}
	}
	for _, f := range []struct{ key, path string }{
		{"tls.cert", c.TLS.Cert}, {"tls.key", c.TLS.Key}, {"tls.client_ca", c.TLS.ClientCA},
	} {
		if f.path != "" && (!filepath.IsAbs(f.path) || strings.ContainsRune(f.path, 0)) {
			bad("%s: %q must be an absolute path", f.key, f.path)
		}
	}
	if (c.TLS.Cert == "") != (c.TLS.Key == "") {
		bad("tls: cert and key go together (one of them is empty)")
	}
	if c.TLS.ClientCA != "" && c.TLS.Cert == "" {
		bad("tls.client_ca: set without tls.cert and tls.key (mutual TLS needs TLS)")
	}
	if c.AuditLogMaxBytes < 4096 {
		bad("audit_log_max_bytes: %d must be at least 4096", c.AuditLogMaxBytes)
	}
	if c.WorkloadLogMaxBytes < 64<<10 {
		bad("workload_log_max_bytes: %d must be at least 65536", c.WorkloadLogMaxBytes)
	}
	if c.EventsKeep < 10_000 {
		bad("events_keep: %d must be at least 10000", c.EventsKeep)
	}
	for i, ix := range c.Registry.Indexes {
		if err := checkIndexLocation(ix); err != nil {
			bad("registry.indexes[%d]: %v", i, err)
		}
	}
	if c.Registry.RefreshSecs < 10 || c.Registry.RefreshSecs > MaxDownloadIdleSecs*7 {
		bad("registry.refresh_secs: %d is outside 10..%d", c.Registry.RefreshSecs, MaxDownloadIdleSecs*7)
	}
	if c.ImageCacheMaxBytes < 0 {
		bad("image_cache_max_bytes: %d must be 0 (no bound) or positive", c.ImageCacheMaxBytes)
	}
	if err := c.Jail.Validate(); err != nil {
		bad("%v", err) // jail's messages start with their key ("jail.id_range: ...")
	}

	return probs
}

// checkIndexLocation accepts an http or https URL with a host, or an
// absolute file path. Its messages never quote the URL, which may carry
// credentials.
func checkIndexLocation(ix string) error {
	if strings.HasPrefix(ix, "/") {
		if strings.ContainsRune(ix, 0) {
			return errors.New("the path contains NUL")
		}
		return nil
	}
	u, err := url.Parse(ix)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return errors.New("must be an http or https URL or an absolute file path")
	}
	return nil
}

// Tap MTU bounds: Cloud Hypervisor refuses less than 1280 at boot, and the
// kernel caps a tap at 65535 minus its 14-byte Ethernet header.
const (
	minMTU = 1280
	maxMTU = 65521
)

func validMTU(mtu int) bool { return mtu == 0 || (mtu >= minMTU && mtu <= maxMTU) }

// FetchDenyPrefixes returns FetchDeny parsed, skipping entries Validate
// refuses.
func (c *Config) FetchDenyPrefixes() []netip.Prefix {
	var ps []netip.Prefix
	for _, cidr := range c.FetchDeny {
		if p, err := netip.ParsePrefix(cidr); err == nil {
			ps = append(ps, p)
		}
	}
	return ps
}

// Network returns the network with the given id.
func (c *Config) Network(id string) (Network, bool) {
	for _, n := range c.Networks {
		if n.ID == id {
			return n, true
		}
	}
	return Network{}, false
}

// NetworkByBridge returns the network whose bridge is bridge.
func (c *Config) NetworkByBridge(bridge string) (Network, bool) {
	for _, n := range c.Networks {
		if n.Bridge == bridge {
			return n, true
		}
	}
	return Network{}, false
}

// Marshal returns c as indented JSON, the format Load reads. It fails only
// for a ratio that is NaN or infinite, which Validate rejects.
func (c *Config) Marshal() ([]byte, error) {
	b, err := json.MarshalIndent(c, "", "  ")
	if err != nil {
		return nil, fmt.Errorf("encoding config: %w", err)
	}
	return append(b, '\n'), nil
}
