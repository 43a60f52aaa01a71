package vm

// The peers' own limits on the numbers a request hands them
// (docs/ref/peer-limits.md): a value beyond one is refused here, 400
// naming the field and the limit, before anything is made, rather than by
// qemu-storage-daemon or Cloud Hypervisor afterwards (a 500).
const (
	// MaxIOLimit is the largest bytes/s or I/O/s limit a throttle group
	// of qemu-storage-daemon accepts (QEMU's THROTTLE_VALUE_MAX; above it
	// QSD refuses the group: "bps/iops/max values must be within [0,
	// 1000000000000000]").
	MaxIOLimit = 1_000_000_000_000_000

	// MaxMemoryMB is the most guest memory Cloud Hypervisor can place: its
	// guest physical address space is 46 bits (64 TiB) at most, and the
	// engine reserves a hot-plug area as large as the boot memory beside
	// the 32-bit hole and the device area, so 16 TiB is the ceiling on any
	// host (a host with fewer physical address bits holds less, and
	// admission counts its memory anyway). It also keeps memory_mb << 20
	// within 64 bits.
	MaxMemoryMB = 16 << 20

	// MaxThreadsPerCore is the most threads per core Cloud Hypervisor's
	// x86_64 CPU topology accepts (CpuTopologyThreadsPerCore).
	MaxThreadsPerCore = 2

	// PCISlots is how many devices one PCI segment of Cloud Hypervisor
	// holds (32 device numbers; 0 is the host bridge), and FixedDevices
	// how many of them every VM of this agent uses besides its disks and
	// interfaces: the root disk, the entropy device, vsock, the balloon and
	// pvpanic (the serial console is not a PCI device; the virtio console
	// is off). A cloud-init seed takes one more.
	PCISlots     = 31
	FixedDevices = 5
)

// CheckIOLimits refuses disk_bps_total and disk_iops_total above what the
// storage daemon accepts (0 is unlimited).
func CheckIOLimits(bps, iops uint64) error {
	if bps > MaxIOLimit {
		return bad("disk_bps_total", "at most %d (qemu-storage-daemon's throttle limit), got %d", uint64(MaxIOLimit), bps)
	}
	if iops > MaxIOLimit {
		return bad("disk_iops_total", "at most %d (qemu-storage-daemon's throttle limit), got %d", uint64(MaxIOLimit), iops)
	}
	return nil
}

// CheckMemory refuses memory_mb outside MinMemoryMB..MaxMemoryMB.
func CheckMemory(mb uint64) error {
	if mb < MinMemoryMB || mb > MaxMemoryMB {
		return bad("memory_mb", "must be %d..%d (Cloud Hypervisor's 46-bit guest address space, with an equal hot-plug area), got %d", MinMemoryMB, MaxMemoryMB, mb)
	}
	return nil
}

// pciDevices is how many PCI device slots a VM of spec s uses: the fixed
// devices, the seed of a cloud-init VM, its interfaces (a cloud-init VM
// without nets has one), its volumes and its passthrough devices.
func pciDevices(s *Spec) int {
	n := FixedDevices + len(s.Volumes) + len(s.PCIDevices) + len(s.Nets)
	if s.CloudInit != nil {
		n++ // the seed
		if len(s.Nets) == 0 {
			n++ // the default interface
		}
	}
	return n
}

// checkPCISlots refuses a spec whose devices do not fit Cloud Hypervisor's
// PCI segment; field names what the request added last.
func checkPCISlots(s *Spec, field string) error {
	if n := pciDevices(s); n > PCISlots {
		return bad(field, "the VM would have %d PCI devices, more than the %d Cloud Hypervisor's PCI segment holds (%d of them are the root disk, entropy, vsock, balloon and pvpanic devices; the rest are the seed, interfaces, volumes and pci_devices)",
			n, PCISlots, FixedDevices)
	}
	return nil
}
