package vm

import (
	"os"
	"syscall"
	"time"

	"vmhost/seed"
	"vmhost/vm/record"
)

// SeedSizeBytes is the fixed guest-visible size of the NoCloud seed disk:
// the size of the image the seed package writes.
const SeedSizeBytes = seed.Size

// View is the VmView of docs/api.md (The VM view), built from a record at read time.
// Field presence follows the contract: always-fields have no omitempty,
// nullable fields are pointers without omitempty, optional ones omit.
// It never holds a secret.
type View struct {
	ID                string         `json:"id"`
	State             State          `json:"state"`
	DisplayState      string         `json:"display_state"`
	Vcpus             uint32         `json:"vcpus"`
	MemoryMB          uint64         `json:"memory_mb"`
	KernelPath        *string        `json:"kernel_path"`
	FirmwarePath      *string        `json:"firmware_path"`
	DiskPath          string         `json:"disk_path"`
	Volumes           []VolumeView   `json:"volumes"`
	SeedDisk          *SeedDiskView  `json:"seed_disk,omitempty"`
	Cmdline           string         `json:"cmdline"`
	ConsoleSocketPath string         `json:"console_socket_path"`
	FailureReason     *FailureReason `json:"failure_reason,omitempty"`
	PID               int            `json:"pid,omitempty"`
	Nets              []NetView      `json:"nets"`
	Platform          *Platform      `json:"platform,omitempty"`
	Disk              *DiskView      `json:"disk,omitempty"`
	Image             *ImageView     `json:"image,omitempty"`
	CloudInit         *CloudInitView `json:"cloud_init,omitempty"`
	IOLimit           *IOLimitView   `json:"io_limit,omitempty"`
	Nested            *bool          `json:"nested,omitempty"`
	CPUAffinity       []int          `json:"cpu_affinity,omitempty"`
	CPUTopology       *CPUTopology   `json:"cpu_topology,omitempty"`
	PCIDevices        []string       `json:"pci_devices"`
	BalloonMB         uint64         `json:"balloon_mb,omitempty"`
	CreatedAt         *time.Time     `json:"created_at,omitempty"`
	DiscoveredIPv4    string         `json:"discovered_ipv4,omitempty"`
	GuestPanickedAt   *time.Time     `json:"guest_panicked_at,omitempty"`
	ShuttingDown      bool           `json:"shutting_down,omitempty"`
	Mode              Mode           `json:"mode"`
	// SuspendedAt is when the saved state a start resumes from was saved
	// (docs/api.md, Suspend and snapshots).
	SuspendedAt *time.Time `json:"suspended_at,omitempty"`
	// Labels are the VM's labels (docs/api.md, Labels); omitted when it
	// has none.
	Labels map[string]string `json:"labels,omitempty"`
	// Confinement is the VM's jail; absent while its processes run
	// unconfined.
	Confinement *record.Confinement `json:"confinement,omitempty"`

	store viewStore
}

// VolumeView is one attached data volume.
type VolumeView struct {
	ID               string  `json:"id"`
	Path             string  `json:"path"`
	VirtualSizeBytes uint64  `json:"virtual_size_bytes"`
	Fmt              string  `json:"fmt"`
	Readonly         bool    `json:"readonly"`
	Owned            bool    `json:"owned"`
	VolumeID         string  `json:"volume_id,omitempty"`
	Device           string  `json:"device"`
	DiskBytes        *uint64 `json:"disk_bytes,omitempty"`

	diskBytes     uint64 // storage behind DiskBytes
	haveDiskBytes bool
}

// SeedDiskView is the cloud-init seed disk.
type SeedDiskView struct {
	Device    string `json:"device"`
	SizeBytes uint64 `json:"size_bytes"`
}

// DiskView is the agent-managed root disk (VmDisk).
type DiskView struct {
	Mode             string `json:"mode"`
	BasePath         string `json:"base_path"`
	VirtualSizeBytes uint64 `json:"virtual_size_bytes"`
	Owned            bool   `json:"owned"`
	ImageFmt         string `json:"image_fmt,omitempty"`
	QSDPid           int    `json:"qsd_pid,omitempty"`
	QSDStartTime     uint64 `json:"qsd_start_time,omitempty"`
	QSDBlkSocket     string `json:"qsd_blk_socket,omitempty"`
	QSDQMPSocket     string `json:"qsd_qmp_socket,omitempty"`
	// Runtime is the storage process serving the disk, while one runs.
	Runtime *VolumeRef `json:"runtime,omitempty"`
}

// VolumeRef is the backend-independent runtime identity of a disk.
type VolumeRef struct {
	Backend   string `json:"backend"`
	Pid       int    `json:"pid"`
	StartTime uint64 `json:"start_time"`
	BlkSocket string `json:"blk_socket"`
	QMPSocket string `json:"qmp_socket"`
}

// ImageView is the source image identity (VmImage).
type ImageView struct {
	ImageID string `json:"image_id"`
	Distro  string `json:"distro,omitempty"`
	Version string `json:"version,omitempty"`
}

// CloudInitView is the cloud-init view; it has no password field at all.
type CloudInitView struct {
	Hostname          string        `json:"hostname"`
	User              string        `json:"user"`
	SSHAuthorizedKeys []string      `json:"ssh_authorized_keys"`
	Network           *CloudInitNet `json:"network,omitempty"`
	InstanceID        string        `json:"instance_id"`
	ConsoleAutologin  bool          `json:"console_autologin"`
	Sudo              bool          `json:"sudo"`
}

// IOLimitView is the root-disk throughput ceiling (DiskIoLimit).
type IOLimitView struct {
	BpsTotal  uint64 `json:"bps_total,omitempty"`
	IopsTotal uint64 `json:"iops_total,omitempty"`
}

// ViewOptions select what a view fills.
type ViewOptions struct {
	// DiskBytes fills volumes[].disk_bytes (the single-VM read does; lists
	// do not).
	DiskBytes bool
}

// View builds the VmView of rec; derived values (paths, device letters,
// hostname, the default interface, the effective command line, CPU
// numbers) are computed here from the record and the host configuration.
// For an AppVM it gives the base the appvm package extends.
func (s *Service) View(rec *Record, o ViewOptions) *View {
	v := new(View)
	s.ViewInto(v, rec, o)
	return v
}

// ViewInto is View writing into v, reusing its slices and storage, so a
// hot reader can keep Views in a pool. v's previous contents are dropped;
// the view shares immutable parts (strings, spec pointers) with rec.
func (s *Service) ViewInto(v *View, rec *Record, o ViewOptions) {
	sp := &rec.Spec
	vols, nets, pins := v.Volumes[:0], v.Nets[:0], v.CPUAffinity[:0]
	if vols == nil {
		vols = make([]VolumeView, 0, 4)
	}
	if nets == nil {
		nets = make([]NetView, 0, 2)
	}
	st := v.store
	*v = View{
		ID:            rec.ID,
		State:         rec.State,
		DisplayState:  rec.DisplayState,
		Vcpus:         sp.Vcpus,
		MemoryMB:      sp.MemoryMB,
		KernelPath:    sp.KernelPath,
		FirmwarePath:  sp.FirmwarePath,
		Volumes:       vols,
		FailureReason: rec.FailureReason,
		PID:           rec.PID,
		Nets:          nets,
		Platform:      sp.Platform,
		Nested:        sp.Nested,
		CPUTopology:   sp.CPUTopology,
		PCIDevices:    sp.PCIDevices,
		Mode:          rec.Mode,
		ShuttingDown:  rec.ShuttingDown,
		BalloonMB:     rec.BalloonMB,
		Labels:        sp.Labels, // records are never modified
		Confinement:   rec.Jail,  // records are never modified
		store:         st,
	}
	if rec.GuestPanickedAt != nil {
		v.GuestPanickedAt = rec.GuestPanickedAt // records are never modified
	}
	if rec.Suspended != nil {
		v.SuspendedAt = &rec.Suspended.At
	}
	if v.PCIDevices == nil {
		v.PCIDevices = []string{}
	}
	if !rec.CreatedAt.IsZero() {
		v.CreatedAt = &rec.CreatedAt // records are never modified
	}
	cfg := s.o.Config
	switch {
	case sp.Cmdline != nil:
		v.Cmdline = *sp.Cmdline
	case rec.Mode == ModeAppVM:
		v.Cmdline = cfg.AppVMCmdline
	default:
		v.Cmdline = cfg.DefaultCmdline
	}
	if rec.Mode == ModeAppVM && v.KernelPath == nil && v.FirmwarePath == nil {
		v.KernelPath = &cfg.AppVMKernel
	}
	if !rec.Provisioning() {
		v.ConsoleSocketPath = s.layout.ConsoleSocket(rec.ID)
	}
	absent := disksAbsent(rec)
	if !absent {
		v.DiskPath = s.layout.RootDisk(rec.ID)
	}
	dev := 1 // vda is the root disk
	if sp.CloudInit != nil {
		v.store.seed = SeedDiskView{Device: DeviceName(dev), SizeBytes: SeedSizeBytes}
		v.SeedDisk = &v.store.seed
		dev++
	}
	for _, vol := range sp.Volumes {
		if vol.Pending == record.PendingAttach {
			continue // not attached until the hot-plug commits
		}
		vv := VolumeView{
			ID:               vol.ID,
			VirtualSizeBytes: uint64(vol.SizeGiB) << 30,
			Fmt:              "qcow2",
			Readonly:         vol.Readonly,
			Owned:            vol.VolumeID == "",
			VolumeID:         vol.VolumeID,
			Device:           DeviceName(dev),
		}
		dev++
		if !absent || !vv.Owned {
			vv.Path = s.layout.VolumeFile(rec.ID, vol)
			if o.DiskBytes {
				vv.diskBytes, vv.haveDiskBytes = s.usage.get(vv.Path)
			}
		}
		v.Volumes = append(v.Volumes, vv)
	}
	for i := range v.Volumes {
		// Point into the final slice only after all appends.
		if vv := &v.Volumes[i]; vv.haveDiskBytes {
			vv.DiskBytes = &vv.diskBytes
		}
	}
	for i, nic := range rec.NICs {
		var n *NetSpec
		if i < len(sp.Nets) {
			n = &sp.Nets[i]
		}
		nv := record.ResolveNet(cfg, n, nic)
		nv.DHCPSnoopedIPv4, nv.LastObservedIPv4 = nic.DHCPSnoopedIPv4, nic.LastObservedIPv4
		v.Nets = append(v.Nets, nv)
	}
	v.DiscoveredIPv4 = record.DiscoveredIPv4(rec.NICs)
	if d := sp.Disk; d != nil || sp.Image != nil {
		dv := &v.store.disk
		*dv = DiskView{Mode: sp.DiskMode(), Owned: true, ImageFmt: "qcow2"}
		if rec.Base != nil {
			dv.BasePath = rec.Base.Path
			dv.VirtualSizeBytes = rec.Base.VirtualSizeBytes
		} else if sp.Image != nil {
			dv.BasePath = s.layout.ImageCache(sp.Image.ContentSHA256)
		}
		if d != nil && d.SizeGiB != nil {
			dv.VirtualSizeBytes = max(dv.VirtualSizeBytes, uint64(*d.SizeGiB)<<30)
		}
		if q := rec.Runtime.StorageDaemon(); q != nil {
			dv.QSDPid, dv.QSDStartTime, dv.QSDBlkSocket, dv.QSDQMPSocket = q.Pid, q.StartTime, q.RootSocket, q.QMPSocket
			v.store.volRef = VolumeRef{Backend: "qsd", Pid: q.Pid, StartTime: q.StartTime, BlkSocket: q.RootSocket, QMPSocket: q.QMPSocket}
			dv.Runtime = &v.store.volRef
		}
		v.Disk = dv
	}
	if im := sp.Image; im != nil {
		v.store.image = ImageView{ImageID: im.ImageID, Distro: im.Distro, Version: im.Version}
		v.Image = &v.store.image
	}
	if ci := sp.CloudInit; ci != nil {
		id := ci.Identity(rec.ID)
		cv := &v.store.cloudInit
		*cv = CloudInitView{
			Hostname:          id.Hostname,
			User:              id.User,
			SSHAuthorizedKeys: ci.SSHAuthorizedKeys,
			Network:           ci.Network,
			InstanceID:        id.InstanceID,
			ConsoleAutologin:  ci.ConsoleAutologin,
			Sudo:              ci.Sudo,
		}
		if cv.SSHAuthorizedKeys == nil {
			cv.SSHAuthorizedKeys = []string{}
		}
		v.CloudInit = cv
	}
	if sp.DiskBpsTotal > 0 || sp.DiskIopsTotal > 0 {
		v.store.ioLimit = IOLimitView{BpsTotal: sp.DiskBpsTotal, IopsTotal: sp.DiskIopsTotal}
		v.IOLimit = &v.store.ioLimit
	}
	if sp.CPUAffinity != nil {
		v.CPUAffinity, _ = record.AppendCPUSet(pins, *sp.CPUAffinity) // validated at create
	}
}

// disksAbsent reports whether rec's root disk and volumes are not on the
// host, so its view names no path for them (contract: disk_path is empty
// while the disk does not exist): a classic provision in progress has not
// made them yet, and a failed one removed what it had made.
func disksAbsent(rec *Record) bool {
	return rec.Provisioning() || rec.DisplayState == DisplayProvisionFailed
}

// viewStore backs the optional objects of a View, so building one does
// not allocate each of them.
type viewStore struct {
	seed      SeedDiskView
	disk      DiskView
	image     ImageView
	cloudInit CloudInitView
	ioLimit   IOLimitView
	volRef    VolumeRef
}

// allocatedBytes is the space a file occupies on the host, or nil when it
// cannot be read.
func allocatedBytes(path string) *uint64 {
	fi, err := os.Stat(path)
	if err != nil {
		return nil
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return nil
	}
	n := uint64(st.Blocks) * 512
	return &n
}
