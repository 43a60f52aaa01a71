package record

import (
	"encoding/json"
	"fmt"
	"log/slog"
	"slices"
)

// Spec is the body of POST /api/vms (docs/api.md, POST /api/vms), and the stored,
// validated request of every VM record. An AppVM record carries a Spec too,
// synthesized from the AppVM request, so one engine boots both families.
//
// Tags: json names the field (for decoding and for the record file);
// `decode:"required"` marks what the decoder refuses when missing or null
// (422). Pointers mark optional fields whose absence differs from zero.
type Spec struct {
	VMID          string         `json:"vm_id,omitempty"`
	Vcpus         uint32         `json:"vcpus" decode:"required"`
	MemoryMB      uint64         `json:"memory_mb" decode:"required"`
	KernelPath    *string        `json:"kernel_path,omitempty"`
	FirmwarePath  *string        `json:"firmware_path,omitempty"`
	Disk          *DiskSpec      `json:"disk,omitempty"`
	Image         *ImageSpec     `json:"image,omitempty"`
	Volumes       []VolumeSpec   `json:"volumes,omitempty"`
	Cmdline       *string        `json:"cmdline,omitempty"`
	Nets          []NetSpec      `json:"nets,omitempty"`
	Platform      *Platform      `json:"platform,omitempty"`
	CloudInit     *CloudInitSpec `json:"cloud_init,omitempty"`
	Nested        *bool          `json:"nested,omitempty"`
	CPUAffinity   *string        `json:"cpu_affinity,omitempty"`
	CPUTopology   *CPUTopology   `json:"cpu_topology,omitempty"`
	PCIDevices    []string       `json:"pci_devices,omitempty"`
	DiskBpsTotal  uint64         `json:"disk_bps_total,omitempty"`
	DiskIopsTotal uint64         `json:"disk_iops_total,omitempty"`
	AutoBoot      bool           `json:"auto_boot,omitempty"`
	// FromSnapshot names the snapshot whose disks the VM gets copies of,
	// in the place of Disk and Image (docs/api.md, Snapshots).
	FromSnapshot string `json:"from_snapshot,omitempty"`
	// Labels are the caller's tags of the VM (package labels); a labels
	// edit (PATCH .../labels) changes them after the create.
	Labels map[string]string `json:"labels,omitempty"`
}

// DiskSpec is the root disk of a classic create.
type DiskSpec struct {
	Mode     string  `json:"mode,omitempty"`
	BasePath string  `json:"base_path,omitempty"`
	SizeGiB  *uint32 `json:"size_gib,omitempty"`
}

// ImageSpec names a registry image the agent downloads and verifies.
type ImageSpec struct {
	ImageID       string `json:"image_id" decode:"required"`
	ContentSHA256 string `json:"content_sha256" decode:"required"`
	FetchURL      string `json:"fetch_url" decode:"required"`
	Distro        string `json:"distro,omitempty"`
	Version       string `json:"version,omitempty"`
}

// VolumeSpec is one data volume of the VM, in disk order: a blank one
// asked for at create, or one attached later (docs/api.md, Attach and detach). The
// fields after SizeGiB are the agent's, never a request's (decode:"stored"
// refuses them in a create body).
type VolumeSpec struct {
	SizeGiB uint32 `json:"size_gib" decode:"required"`
	// ID is the stable per-VM id ("data0", "data1", ...): the owned file's
	// and the export's name. Records written before volumes could be
	// attached have none; Normalize gives them "data<i>".
	ID string `json:"id,omitempty" decode:"stored"`
	// VolumeID names the first-class volume attached here; empty for a
	// VM-owned volume.
	VolumeID string `json:"volume_id,omitempty" decode:"stored"`
	Readonly bool   `json:"readonly,omitempty" decode:"stored"`
	// Mountpoint is where the guest mounts the volume: an AppVM's (set at
	// create and attach), empty on a classic VM. See Mounted.
	Mountpoint string `json:"mountpoint,omitempty" decode:"stored"`
	// Pending is a hot attach or detach in progress ("attach", "detach"):
	// recorded before the host changes anything, so that recovery finishes
	// or rolls back the step.
	Pending string `json:"pending,omitempty" decode:"stored"`
}

// Pending volume operations (VolumeSpec.Pending).
const (
	PendingAttach = "attach"
	PendingDetach = "detach"
)

// Mounted reports whether the guest mounts v (at v.Mountpoint: an AppVM's
// volume), which therefore holds an ext4 file system, not a blank disk.
func (v VolumeSpec) Mounted() bool { return v.Mountpoint != "" }

// NormalizeVolumes gives every volume its per-VM id ("data<i>" for records
// from before attach existed, where the position was the id).
func (sp *Spec) NormalizeVolumes() {
	for i := range sp.Volumes {
		if sp.Volumes[i].ID == "" {
			sp.Volumes[i].ID = VolumeID(i)
		}
	}
}

// FreeVolumeID is the lowest "data<n>" no volume of sp uses.
func (sp *Spec) FreeVolumeID() string {
	for n := 0; ; n++ {
		id := VolumeID(n)
		if !slices.ContainsFunc(sp.Volumes, func(v VolumeSpec) bool { return v.ID == id }) {
			return id
		}
	}
}

// VolumeIndex is the position of the volume whose per-VM id is key, else
// of the one whose first-class volume id is key, or -1.
func (sp *Spec) VolumeIndex(key string) int {
	if i := slices.IndexFunc(sp.Volumes, func(v VolumeSpec) bool { return v.ID == key }); i >= 0 {
		return i
	}
	return slices.IndexFunc(sp.Volumes, func(v VolumeSpec) bool { return v.VolumeID != "" && v.VolumeID == key })
}

// NetSpec is one requested interface.
type NetSpec struct {
	Mode          string     `json:"mode,omitempty"`
	Bridge        string     `json:"bridge,omitempty"`
	MAC           string     `json:"mac,omitempty"`
	NetworkID     string     `json:"network_id,omitempty"`
	VLANTag       *uint32    `json:"vlan_tag,omitempty"`
	IPv4          *NetIPSpec `json:"ipv4,omitempty"`
	IPv6          *NetIPSpec `json:"ipv6,omitempty"`
	MTU           *uint32    `json:"mtu,omitempty"`
	Isolated      *bool      `json:"isolated,omitempty"`
	SpoofGuard    *bool      `json:"spoof_guard,omitempty"`
	RateLimitMbps *uint32    `json:"rate_limit_mbps,omitempty"`
	AllowedIPs    []string   `json:"allowed_ips,omitempty"`
}

// NetIPSpec is the address metadata of one interface and family.
type NetIPSpec struct {
	Address    string   `json:"address" decode:"required"`
	Gateway    string   `json:"gateway,omitempty"`
	DNSServers []string `json:"dns_servers,omitempty"`
}

// Platform holds SMBIOS values.
type Platform struct {
	SerialNumber string `json:"serial_number,omitempty"`
}

// CPUTopology is the guest-visible CPU topology.
type CPUTopology struct {
	Sockets uint32 `json:"sockets" decode:"required"`
	Cores   uint32 `json:"cores" decode:"required"`
	Threads uint32 `json:"threads" decode:"required"`
}

// CloudInitSpec configures the NoCloud seed. Password is a Secret: the
// create path moves it into Record.Secrets, so it is never part of a stored
// Spec nor of any view.
type CloudInitSpec struct {
	Hostname          *string         `json:"hostname,omitempty"`
	User              *string         `json:"user,omitempty"`
	SSHAuthorizedKeys []string        `json:"ssh_authorized_keys,omitempty"`
	Password          Secret          `json:"password,omitempty"`
	Network           *CloudInitNet   `json:"network,omitempty"`
	ConsoleAutologin  bool            `json:"console_autologin,omitempty"`
	Sudo              bool            `json:"sudo,omitempty"`
	InstanceID        *string         `json:"instance_id,omitempty"`
	RawUserData       json.RawMessage `json:"raw_user_data,omitempty"`
	RawNetworkConfig  json.RawMessage `json:"raw_network_config,omitempty"`
}

// CloudInitNet is the static network input of the first interface.
type CloudInitNet struct {
	IPv4 *CloudInitIP `json:"ipv4" decode:"required"`
	IPv6 *CloudInitIP `json:"ipv6,omitempty"`
}

// CloudInitIP is one family of CloudInitNet; the DNS field is named dns.
type CloudInitIP struct {
	Address string   `json:"address" decode:"required"`
	Gateway string   `json:"gateway,omitempty"`
	DNS     []string `json:"dns,omitempty"`
}

const redacted = "[redacted]"

// Secret is a secret string (a password, a secret env value, a secret file's
// contents). It formats, logs and JSON-encodes as "[redacted]"; only Reveal
// gives the value. Records store secrets through Secrets, whose file
// encoding reveals them; views never carry a Secret at all.
type Secret string

// Reveal returns the secret value, for the record file and the guest only.
func (s Secret) Reveal() string { return string(s) }

// String returns "[redacted]".
func (s Secret) String() string { return redacted }

// GoString returns "[redacted]", so %#v does not leak either.
func (s Secret) GoString() string { return redacted }

// Format renders the secret as "[redacted]" for every verb.
func (s Secret) Format(f fmt.State, verb rune) { fmt.Fprint(f, redacted) }

// LogValue renders the secret as "[redacted]" in slog output.
func (s Secret) LogValue() slog.Value { return slog.StringValue(redacted) }

// MarshalJSON encodes the secret as "[redacted]": a secret that strays into
// a JSON document never leaks its value.
func (s Secret) MarshalJSON() ([]byte, error) { return []byte(`"` + redacted + `"`), nil }
