package chclient

// The types below mirror CH's VmConfig (vmm/src/vm_config.rs, v53) for the fields vmhost
// uses. Names follow CH's OpenAPI schemas. Optional fields are omitted when zero, so the
// body carries only what the caller set and CH fills its own defaults. Fields whose CH
// default is true (cpus.nested) are pointers, so false can be sent.

// VmConfig is the body of vm.create and the config echoed by vm.info.
type VmConfig struct {
	Cpus     *CpusConfig     `json:"cpus,omitempty"`
	Memory   *MemoryConfig   `json:"memory,omitempty"`
	Payload  *PayloadConfig  `json:"payload,omitempty"`
	Disks    []DiskConfig    `json:"disks,omitempty"`
	Net      []NetConfig     `json:"net,omitempty"`
	Rng      *RngConfig      `json:"rng,omitempty"`
	Serial   *ConsoleConfig  `json:"serial,omitempty"`
	Console  *ConsoleConfig  `json:"console,omitempty"`
	Vsock    *VsockConfig    `json:"vsock,omitempty"`
	Pvpanic  bool            `json:"pvpanic,omitempty"`
	Watchdog bool            `json:"watchdog,omitempty"`
	Balloon  *BalloonConfig  `json:"balloon,omitempty"`
	Platform *PlatformConfig `json:"platform,omitempty"`
	Devices  []DeviceConfig  `json:"devices,omitempty"`
}

// CpusConfig sets the vCPUs. MaxVcpus must be ≥ BootVcpus; a topology's product must equal
// MaxVcpus.
type CpusConfig struct {
	BootVcpus int           `json:"boot_vcpus"`
	MaxVcpus  int           `json:"max_vcpus"`
	Topology  *CpuTopology  `json:"topology,omitempty"`
	Affinity  []CpuAffinity `json:"affinity,omitempty"`
	// Nested exposes VMX/SVM to the guest (CH default true, v50+).
	Nested *bool `json:"nested,omitempty"`
}

// CpuTopology is the guest CPU topology; no part may be zero.
type CpuTopology struct {
	ThreadsPerCore int `json:"threads_per_core"`
	CoresPerDie    int `json:"cores_per_die"`
	DiesPerPackage int `json:"dies_per_package"`
	Packages       int `json:"packages"`
}

// CpuAffinity pins one vCPU to host CPUs.
type CpuAffinity struct {
	Vcpu     int   `json:"vcpu"`
	HostCpus []int `json:"host_cpus"`
}

// MemoryConfig sets guest RAM; sizes are bytes. Shared is required for vhost-user devices.
type MemoryConfig struct {
	Size        uint64 `json:"size"`
	HotplugSize uint64 `json:"hotplug_size,omitempty"`
	Shared      bool   `json:"shared,omitempty"`
	Hugepages   bool   `json:"hugepages,omitempty"`
}

// PayloadConfig names what boots: exactly one of Kernel or Firmware.
type PayloadConfig struct {
	Kernel    string `json:"kernel,omitempty"`
	Firmware  string `json:"firmware,omitempty"`
	Cmdline   string `json:"cmdline,omitempty"`
	Initramfs string `json:"initramfs,omitempty"`
}

// Image types for DiskConfig.ImageType. Send ImageRaw for raw images: with the default
// Unknown, CH disables writes to sector 0 of an image it detects as raw.
const (
	ImageRaw     = "Raw"
	ImageQcow2   = "Qcow2"
	ImageUnknown = "Unknown"
)

// DiskConfig is one block device: either Path, or VhostUser with VhostSocket (the JSON key is
// vhost_socket, not socket).
type DiskConfig struct {
	ID                string             `json:"id,omitempty"`
	Path              string             `json:"path,omitempty"`
	Readonly          bool               `json:"readonly,omitempty"`
	Direct            bool               `json:"direct,omitempty"`
	VhostUser         bool               `json:"vhost_user,omitempty"`
	VhostSocket       string             `json:"vhost_socket,omitempty"`
	NumQueues         int                `json:"num_queues,omitempty"`
	QueueSize         int                `json:"queue_size,omitempty"`
	Serial            string             `json:"serial,omitempty"`
	ImageType         string             `json:"image_type,omitempty"`
	RateLimiterConfig *RateLimiterConfig `json:"rate_limiter_config,omitempty"`
	PciSegment        int                `json:"pci_segment,omitempty"`
}

// NetConfig is one virtio-net device on an existing tap. Mtu must be ≥ 1280 when set.
type NetConfig struct {
	ID                string             `json:"id,omitempty"`
	Tap               string             `json:"tap,omitempty"`
	Mac               string             `json:"mac,omitempty"`
	HostMac           string             `json:"host_mac,omitempty"`
	Mtu               int                `json:"mtu,omitempty"`
	NumQueues         int                `json:"num_queues,omitempty"`
	QueueSize         int                `json:"queue_size,omitempty"`
	RateLimiterConfig *RateLimiterConfig `json:"rate_limiter_config,omitempty"`
	PciSegment        int                `json:"pci_segment,omitempty"`
}

// RateLimiterConfig limits bytes/s (Bandwidth) and operations/s (Ops) with token buckets.
type RateLimiterConfig struct {
	Bandwidth *TokenBucket `json:"bandwidth,omitempty"`
	Ops       *TokenBucket `json:"ops,omitempty"`
}

// TokenBucket holds Size tokens refilled every RefillTime milliseconds.
type TokenBucket struct {
	Size         uint64 `json:"size"`
	OneTimeBurst uint64 `json:"one_time_burst,omitempty"`
	RefillTime   uint64 `json:"refill_time"`
}

// RngConfig is the entropy source.
type RngConfig struct {
	Src string `json:"src"`
}

// Console modes for ConsoleConfig.Mode. Socket works for the serial port only.
const (
	ConsoleOff    = "Off"
	ConsolePty    = "Pty"
	ConsoleTty    = "Tty"
	ConsoleFile   = "File"
	ConsoleSocket = "Socket"
	ConsoleNull   = "Null"
)

// ConsoleConfig configures the serial port or the virtio console. CH defaults the console
// to Tty (its own stdout); a daemon sends Off.
type ConsoleConfig struct {
	Mode   string `json:"mode"`
	File   string `json:"file,omitempty"`
	Socket string `json:"socket,omitempty"`
}

// VsockConfig is the hybrid vsock device: CID (3 … 2^32-2) and the host unix socket CH binds
// at boot.
type VsockConfig struct {
	ID     string `json:"id,omitempty"`
	Cid    uint32 `json:"cid"`
	Socket string `json:"socket"`
}

// BalloonConfig adds a virtio balloon of Size bytes (less than RAM).
type BalloonConfig struct {
	ID                string `json:"id,omitempty"`
	Size              uint64 `json:"size"`
	DeflateOnOom      bool   `json:"deflate_on_oom,omitempty"`
	FreePageReporting bool   `json:"free_page_reporting,omitempty"`
}

// PlatformConfig sets SMBIOS identity. SerialNumber and UUID use the input names every
// version accepts; v53 echoes them as system_serial_number and system_uuid, which decode
// into SystemSerialNumber and SystemUUID.
type PlatformConfig struct {
	SerialNumber       string   `json:"serial_number,omitempty"`
	UUID               string   `json:"uuid,omitempty"`
	OemStrings         []string `json:"oem_strings,omitempty"`
	SystemSerialNumber string   `json:"system_serial_number,omitempty"`
	SystemUUID         string   `json:"system_uuid,omitempty"`
}

// DeviceConfig passes a host PCI device through with VFIO.
type DeviceConfig struct {
	ID    string `json:"id,omitempty"`
	Path  string `json:"path"`
	Iommu bool   `json:"iommu,omitempty"`
}

// VmInfo is the answer of vm.info.
type VmInfo struct {
	Config           VmConfig              `json:"config"`
	State            string                `json:"state"`
	MemoryActualSize uint64                `json:"memory_actual_size,omitempty"`
	DeviceTree       map[string]DeviceNode `json:"device_tree,omitempty"`
}

// VM states reported by vm.info. After a shutdown CH reports Created, not Shutdown.
const (
	StateCreated  = "Created"
	StateRunning  = "Running"
	StatePaused   = "Paused"
	StateShutdown = "Shutdown"
)

// DeviceNode is one entry of vm.info's device tree.
type DeviceNode struct {
	ID       string   `json:"id"`
	Parent   string   `json:"parent,omitempty"`
	Children []string `json:"children,omitempty"`
	PciBdf   string   `json:"pci_bdf,omitempty"`
}

// VmmPingResponse is the answer of vmm.ping.
type VmmPingResponse struct {
	BuildVersion string   `json:"build_version"`
	Version      string   `json:"version"`
	Pid          int      `json:"pid"`
	Features     []string `json:"features"`
}

// PciDeviceInfo names a hot-added device and its PCI address ("0000:00:06.0").
type PciDeviceInfo struct {
	ID  string `json:"id"`
	Bdf string `json:"bdf"`
}

// VmRemoveDevice is the body of vm.remove-device.
type VmRemoveDevice struct {
	ID string `json:"id"`
}

// VmResize is the body of vm.resize; RAM and balloon sizes are bytes. Zero or nil fields
// are omitted (CH leaves those unchanged); DesiredBalloon is a pointer because 0 deflates
// the balloon.
type VmResize struct {
	DesiredVcpus   int     `json:"desired_vcpus,omitempty"`
	DesiredRam     uint64  `json:"desired_ram,omitempty"`
	DesiredBalloon *uint64 `json:"desired_balloon,omitempty"`
}
