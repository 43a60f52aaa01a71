package chsim

import (
	"bytes"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
)

// The types below decode a vm.create body the way CH's serde derive does: absent fields take
// CH's defaults, required fields must be present, enums must name a variant, unknown keys are
// ignored (except in RateLimiterConfig). Re-encoding gives the config vm.info echoes:
// defaulted fields always present, unset optional fields omitted (v53).

// deserializeError is a serde decode failure; the API answers 400 with
// ["Failed to deserialize JSON", msg].
type deserializeError struct{ msg string }

func (e *deserializeError) Error() string { return e.msg }

func serdeErr(format string, args ...any) error {
	return &deserializeError{msg: fmt.Sprintf(format, args...)}
}

// decodeStrict decodes data into a struct with defaults already set, then checks that each
// required key is present and not null.
func decodeStrict(data []byte, into any, required ...string) error {
	if len(required) > 0 {
		var keys map[string]json.RawMessage
		if err := json.Unmarshal(data, &keys); err != nil {
			return serdeMessage(err)
		}
		for _, k := range required {
			v, ok := keys[k]
			if !ok {
				return serdeErr("missing field `%s`", k)
			}
			if string(bytes.TrimSpace(v)) == "null" {
				return serdeErr("invalid type: null, expected field `%s`", k)
			}
		}
	}
	if err := json.Unmarshal(data, into); err != nil {
		return serdeMessage(err)
	}
	return nil
}

// serdeMessage turns an encoding/json error into a serde-like message.
func serdeMessage(err error) error {
	var de *deserializeError
	if errors.As(err, &de) {
		return de
	}
	var te *json.UnmarshalTypeError
	if errors.As(err, &te) {
		return serdeErr("invalid type: %s, expected %s for field `%s` at offset %d", te.Value, te.Type, te.Field, te.Offset)
	}
	var se *json.SyntaxError
	if errors.As(err, &se) {
		return serdeErr("%s at offset %d", strings.TrimPrefix(se.Error(), "json: "), se.Offset)
	}
	return serdeErr("%s", strings.TrimPrefix(err.Error(), "json: "))
}

func checkEnum(field, v string, variants ...string) error {
	if slices.Contains(variants, v) {
		return nil
	}
	return serdeErr("unknown variant `%s`, expected one of `%s` for field `%s`", v, strings.Join(variants, "`, `"), field)
}

func boolp(b bool) *bool { return &b }

type vmConfig struct {
	Cpus            cpusConfig        `json:"cpus"`
	Memory          memoryConfig      `json:"memory"`
	Payload         *payloadConfig    `json:"payload,omitempty"`
	RateLimitGroups []json.RawMessage `json:"rate_limit_groups,omitempty"`
	Disks           []diskConfig      `json:"disks,omitempty"`
	Net             []netConfig       `json:"net,omitempty"`
	Rng             rngConfig         `json:"rng"`
	Balloon         *balloonConfig    `json:"balloon,omitempty"`
	Serial          consoleConfig     `json:"serial"`
	Console         consoleConfig     `json:"console"`
	Devices         []deviceConfig    `json:"devices,omitempty"`
	Vsock           *vsockConfig      `json:"vsock,omitempty"`
	Iommu           bool              `json:"iommu"`
	Watchdog        bool              `json:"watchdog"`
	Pvpanic         bool              `json:"pvpanic"`
	Platform        *platformConfig   `json:"platform,omitempty"`
	LandlockEnable  bool              `json:"landlock_enable"`
	LandlockRules   []json.RawMessage `json:"landlock_rules,omitempty"`

	// other holds fields CH knows but the simulator does not model (fs, pmem, numa, …);
	// they are echoed unchanged.
	other map[string]json.RawMessage
}

var passthroughKeys = []string{"fs", "pmem", "vdpa", "user_devices", "generic_vhost_user", "numa",
	"pci_segments", "tpm", "rtc", "debug_console", "sgx_epc", "preserved_fds"}

func (c *vmConfig) UnmarshalJSON(data []byte) error {
	type plain vmConfig
	p := plain{
		Cpus:    defaultCpus(),
		Memory:  memoryConfig{Size: 512 << 20, HotplugMethod: "Acpi", Thp: true},
		Rng:     rngConfig{Src: "/dev/urandom"},
		Serial:  consoleConfig{Mode: "Null"},
		Console: consoleConfig{Mode: "Tty"},
	}
	if err := decodeStrict(data, &p); err != nil {
		return err
	}
	var keys map[string]json.RawMessage
	if err := json.Unmarshal(data, &keys); err != nil {
		return serdeMessage(err)
	}
	*c = vmConfig(p)
	for _, k := range passthroughKeys {
		if v, ok := keys[k]; ok && string(v) != "null" {
			if c.other == nil {
				c.other = map[string]json.RawMessage{}
			}
			c.other[k] = v
		}
	}
	return nil
}

func (c vmConfig) MarshalJSON() ([]byte, error) {
	type plain vmConfig
	data, err := json.Marshal(plain(c))
	if err != nil || len(c.other) == 0 {
		return data, err
	}
	var m map[string]json.RawMessage
	if err := json.Unmarshal(data, &m); err != nil {
		return nil, err
	}
	for k, v := range c.other {
		m[k] = v
	}
	return json.Marshal(m)
}

type cpusConfig struct {
	BootVcpus      uint32          `json:"boot_vcpus"`
	MaxVcpus       uint32          `json:"max_vcpus"`
	Topology       *cpuTopology    `json:"topology,omitempty"`
	KvmHyperv      bool            `json:"kvm_hyperv"`
	MaxPhysBits    uint8           `json:"max_phys_bits"`
	Affinity       []cpuAffinity   `json:"affinity,omitempty"`
	Features       map[string]bool `json:"features"`
	Nested         *bool           `json:"nested"`
	CoreScheduling string          `json:"core_scheduling"`
	Profile        string          `json:"profile"`
}

func defaultCpus() cpusConfig {
	return cpusConfig{BootVcpus: 1, MaxVcpus: 1, MaxPhysBits: 46, Features: map[string]bool{"amx": false},
		Nested: boolp(true), CoreScheduling: "Vm", Profile: "Host"}
}

func (c *cpusConfig) UnmarshalJSON(data []byte) error {
	type plain cpusConfig
	p := plain(defaultCpus())
	p.Features = map[string]bool{"amx": false}
	if err := decodeStrict(data, &p, "boot_vcpus", "max_vcpus"); err != nil {
		return err
	}
	if p.Nested == nil {
		p.Nested = boolp(true)
	}
	if err := checkEnum("core_scheduling", p.CoreScheduling, "Vm", "Vcpu", "Off"); err != nil {
		return err
	}
	*c = cpusConfig(p)
	return nil
}

type cpuTopology struct {
	ThreadsPerCore uint16 `json:"threads_per_core"`
	CoresPerDie    uint16 `json:"cores_per_die"`
	DiesPerPackage uint16 `json:"dies_per_package"`
	Packages       uint16 `json:"packages"`
}

func (t *cpuTopology) UnmarshalJSON(data []byte) error {
	type plain cpuTopology
	var p plain
	if err := decodeStrict(data, &p, "threads_per_core", "cores_per_die", "dies_per_package", "packages"); err != nil {
		return err
	}
	*t = cpuTopology(p)
	return nil
}

type cpuAffinity struct {
	Vcpu     uint32 `json:"vcpu"`
	HostCpus []uint `json:"host_cpus"`
}

func (a *cpuAffinity) UnmarshalJSON(data []byte) error {
	type plain cpuAffinity
	var p plain
	if err := decodeStrict(data, &p, "vcpu", "host_cpus"); err != nil {
		return err
	}
	*a = cpuAffinity(p)
	return nil
}

type memoryConfig struct {
	Size           uint64            `json:"size"`
	Mergeable      bool              `json:"mergeable"`
	HotplugMethod  string            `json:"hotplug_method"`
	HotplugSize    *uint64           `json:"hotplug_size,omitempty"`
	HotpluggedSize *uint64           `json:"hotplugged_size,omitempty"`
	Shared         bool              `json:"shared"`
	Hugepages      bool              `json:"hugepages"`
	HugepageSize   *uint64           `json:"hugepage_size,omitempty"`
	Prefault       bool              `json:"prefault"`
	Zones          []json.RawMessage `json:"zones,omitempty"`
	Thp            bool              `json:"thp"`
	Reserve        bool              `json:"reserve"`
}

func (m *memoryConfig) UnmarshalJSON(data []byte) error {
	type plain memoryConfig
	p := plain{HotplugMethod: "Acpi", Thp: true}
	if err := decodeStrict(data, &p, "size"); err != nil {
		return err
	}
	if err := checkEnum("hotplug_method", p.HotplugMethod, "Acpi", "VirtioMem"); err != nil {
		return err
	}
	*m = memoryConfig(p)
	return nil
}

type payloadConfig struct {
	Firmware  *string `json:"firmware,omitempty"`
	Kernel    *string `json:"kernel,omitempty"`
	Cmdline   *string `json:"cmdline,omitempty"`
	Initramfs *string `json:"initramfs,omitempty"`
}

type tokenBucket struct {
	Size         uint64  `json:"size"`
	OneTimeBurst *uint64 `json:"one_time_burst,omitempty"`
	RefillTime   uint64  `json:"refill_time"`
}

func (t *tokenBucket) UnmarshalJSON(data []byte) error {
	type plain tokenBucket
	var p plain
	if err := decodeStrict(data, &p, "size", "refill_time"); err != nil {
		return err
	}
	*t = tokenBucket(p)
	return nil
}

type rateLimiterConfig struct {
	Bandwidth *tokenBucket `json:"bandwidth,omitempty"`
	Ops       *tokenBucket `json:"ops,omitempty"`
}

// UnmarshalJSON rejects unknown keys: RateLimiterConfig is CH's one deny_unknown_fields type.
func (r *rateLimiterConfig) UnmarshalJSON(data []byte) error {
	type plain rateLimiterConfig
	var p plain
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&p); err != nil {
		msg := strings.TrimPrefix(err.Error(), "json: ")
		if f, ok := strings.CutPrefix(msg, "unknown field "); ok {
			return serdeErr("unknown field `%s`, expected `bandwidth` or `ops`", strings.Trim(f, `"`))
		}
		return serdeMessage(err)
	}
	*r = rateLimiterConfig(p)
	return nil
}

type diskConfig struct {
	Path              *string            `json:"path,omitempty"`
	Readonly          bool               `json:"readonly"`
	Direct            bool               `json:"direct"`
	Iommu             bool               `json:"iommu"`
	NumQueues         int                `json:"num_queues"`
	QueueSize         uint16             `json:"queue_size"`
	VhostUser         bool               `json:"vhost_user"`
	VhostSocket       *string            `json:"vhost_socket,omitempty"`
	RateLimitGroup    *string            `json:"rate_limit_group,omitempty"`
	RateLimiterConfig *rateLimiterConfig `json:"rate_limiter_config,omitempty"`
	ID                *string            `json:"id,omitempty"`
	DisableIoUring    bool               `json:"disable_io_uring"`
	DisableAio        bool               `json:"disable_aio"`
	PciSegment        uint16             `json:"pci_segment"`
	Serial            *string            `json:"serial,omitempty"`
	QueueAffinity     []json.RawMessage  `json:"queue_affinity,omitempty"`
	BackingFiles      bool               `json:"backing_files"`
	Sparse            bool               `json:"sparse"`
	ImageType         string             `json:"image_type"`
	LockGranularity   string             `json:"lock_granularity"`
	PciDeviceID       *uint8             `json:"pci_device_id,omitempty"`
}

func (d *diskConfig) UnmarshalJSON(data []byte) error {
	type plain diskConfig
	p := plain{NumQueues: 1, QueueSize: 128, Sparse: true, ImageType: "Unknown", LockGranularity: "ByteRange"}
	if err := decodeStrict(data, &p); err != nil {
		return err
	}
	if err := checkEnum("image_type", p.ImageType, "FixedVhd", "Qcow2", "Raw", "Vhdx", "Unknown"); err != nil {
		return err
	}
	if err := checkEnum("lock_granularity", p.LockGranularity, "ByteRange", "Full"); err != nil {
		return err
	}
	*d = diskConfig(p)
	return nil
}

type netConfig struct {
	Tap               *string            `json:"tap,omitempty"`
	IP                *string            `json:"ip,omitempty"`
	Mask              *string            `json:"mask,omitempty"`
	Mac               string             `json:"mac"`
	HostMac           *string            `json:"host_mac,omitempty"`
	Mtu               *uint16            `json:"mtu,omitempty"`
	Iommu             bool               `json:"iommu"`
	NumQueues         int                `json:"num_queues"`
	QueueSize         uint16             `json:"queue_size"`
	VhostUser         bool               `json:"vhost_user"`
	VhostSocket       *string            `json:"vhost_socket,omitempty"`
	VhostMode         string             `json:"vhost_mode"`
	ID                *string            `json:"id,omitempty"`
	RateLimiterConfig *rateLimiterConfig `json:"rate_limiter_config,omitempty"`
	PciSegment        uint16             `json:"pci_segment"`
	OffloadTso        bool               `json:"offload_tso"`
	OffloadUfo        bool               `json:"offload_ufo"`
	OffloadCsum       bool               `json:"offload_csum"`
	PciDeviceID       *uint8             `json:"pci_device_id,omitempty"`
}

func (n *netConfig) UnmarshalJSON(data []byte) error {
	type plain netConfig
	p := plain{NumQueues: 2, QueueSize: 256, VhostMode: "Client", OffloadTso: true, OffloadUfo: true, OffloadCsum: true}
	if err := decodeStrict(data, &p); err != nil {
		return err
	}
	if err := checkEnum("vhost_mode", p.VhostMode, "Client", "Server"); err != nil {
		return err
	}
	if p.Mac == "" {
		// v53 picks a random locally administered MAC when none is given.
		var b [6]byte
		rand.Read(b[:])
		b[0] = b[0]&0xfe | 0x02
		p.Mac = fmt.Sprintf("%02x:%02x:%02x:%02x:%02x:%02x", b[0], b[1], b[2], b[3], b[4], b[5])
	}
	*n = netConfig(p)
	return nil
}

type rngConfig struct {
	Src   string `json:"src"`
	Iommu bool   `json:"iommu"`
}

func (r *rngConfig) UnmarshalJSON(data []byte) error {
	type plain rngConfig
	var p plain
	if err := decodeStrict(data, &p, "src"); err != nil {
		return err
	}
	*r = rngConfig(p)
	return nil
}

type consoleConfig struct {
	File   *string `json:"file,omitempty"`
	Mode   string  `json:"mode"`
	Iommu  bool    `json:"iommu"`
	Socket *string `json:"socket,omitempty"`
}

func (c *consoleConfig) UnmarshalJSON(data []byte) error {
	type plain consoleConfig
	var p plain
	if err := decodeStrict(data, &p, "mode"); err != nil {
		return err
	}
	if err := checkEnum("mode", p.Mode, "Off", "Pty", "Tty", "File", "Socket", "Null"); err != nil {
		return err
	}
	*c = consoleConfig(p)
	return nil
}

type vsockConfig struct {
	Cid         uint32  `json:"cid"`
	Socket      string  `json:"socket"`
	Iommu       bool    `json:"iommu"`
	ID          *string `json:"id,omitempty"`
	PciSegment  uint16  `json:"pci_segment"`
	PciDeviceID *uint8  `json:"pci_device_id,omitempty"`
}

func (v *vsockConfig) UnmarshalJSON(data []byte) error {
	type plain vsockConfig
	var p plain
	if err := decodeStrict(data, &p, "cid", "socket"); err != nil {
		return err
	}
	*v = vsockConfig(p)
	return nil
}

type balloonConfig struct {
	ID                *string `json:"id,omitempty"`
	Size              uint64  `json:"size"`
	DeflateOnOom      bool    `json:"deflate_on_oom"`
	FreePageReporting bool    `json:"free_page_reporting"`
	PciSegment        uint16  `json:"pci_segment"`
}

func (b *balloonConfig) UnmarshalJSON(data []byte) error {
	type plain balloonConfig
	var p plain
	if err := decodeStrict(data, &p, "size"); err != nil {
		return err
	}
	*b = balloonConfig(p)
	return nil
}

type platformConfig struct {
	NumPciSegments        uint16   `json:"num_pci_segments"`
	IommuSegments         []uint16 `json:"iommu_segments,omitempty"`
	IommuAddressWidthBits uint8    `json:"iommu_address_width_bits"`
	SystemSerialNumber    *string  `json:"system_serial_number,omitempty"`
	SystemUUID            *string  `json:"system_uuid,omitempty"`
	SystemManufacturer    *string  `json:"system_manufacturer,omitempty"`
	SystemProductName     *string  `json:"system_product_name,omitempty"`
	SystemVersion         *string  `json:"system_version,omitempty"`
	SystemFamily          *string  `json:"system_family,omitempty"`
	SystemSkuNumber       *string  `json:"system_sku_number,omitempty"`
	ChassisAssetTag       *string  `json:"chassis_asset_tag,omitempty"`
	OemStrings            []string `json:"oem_strings,omitempty"`
	Iommufd               bool     `json:"iommufd"`
	VfioP2pDma            bool     `json:"vfio_p2p_dma"`
}

// UnmarshalJSON accepts the pre-v53 names serial_number and uuid as aliases.
func (p *platformConfig) UnmarshalJSON(data []byte) error {
	type plain platformConfig
	q := plain{NumPciSegments: 1, IommuAddressWidthBits: 64, VfioP2pDma: true}
	if err := decodeStrict(data, &q); err != nil {
		return err
	}
	var alias struct {
		SerialNumber *string `json:"serial_number"`
		UUID         *string `json:"uuid"`
	}
	if err := json.Unmarshal(data, &alias); err != nil {
		return serdeMessage(err)
	}
	if q.SystemSerialNumber == nil {
		q.SystemSerialNumber = alias.SerialNumber
	}
	if q.SystemUUID == nil {
		q.SystemUUID = alias.UUID
	}
	*p = platformConfig(q)
	return nil
}

type deviceConfig struct {
	Path        *string `json:"path,omitempty"`
	Iommu       bool    `json:"iommu"`
	ID          *string `json:"id,omitempty"`
	PciSegment  uint16  `json:"pci_segment"`
	PciDeviceID *uint8  `json:"pci_device_id,omitempty"`
}

// resizeRequest is the body of vm.resize.
type resizeRequest struct {
	DesiredVcpus   *uint32 `json:"desired_vcpus"`
	DesiredRAM     *uint64 `json:"desired_ram"`
	DesiredBalloon *uint64 `json:"desired_balloon"`
}

// removeRequest is the body of vm.remove-device.
type removeRequest struct {
	ID string `json:"id"`
}

func (r *removeRequest) UnmarshalJSON(data []byte) error {
	type plain removeRequest
	var p plain
	if err := decodeStrict(data, &p, "id"); err != nil {
		return err
	}
	*r = removeRequest(p)
	return nil
}

func strp(s string) *string { return &s }

func deref(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}
