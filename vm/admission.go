package vm

import (
	"fmt"
	"math"
	"slices"

	"golang.org/x/sys/unix"
)

// CapacityError is a create that host admission rejected (409
// CAPACITY_CONFLICT). Resource names what ran out: vcpus, memory_mb,
// cpu_affinity, pci_devices or disk.
type CapacityError struct {
	Resource string
	Msg      string
}

// Error names the resource and why it does not fit.
func (e *CapacityError) Error() string { return e.Resource + ": " + e.Msg }

// active reports whether a VM holds CPU and memory: every state but stopped
// and failed (a created VM is about to boot).
func active(r *Record) bool { return r.State != StateStopped && r.State != StateFailed }

// admission reads the host's CPUs, memory and free space, then returns the
// check reserve runs, under the registry lock, with every other stored or
// pending record. It refuses an explicit MAC another VM uses (400), and
// counts vCPUs and memory of active VMs against host totals times the
// overcommit ratios, the vCPUs of a pinned VM against its pinned CPUs, PCI
// devices against every other VM's claim, and the new disks against the
// free space in the state dir less what provisions in flight will still
// write. The capacity numbers are those of Capacity (GET /api/host): the
// same limits and the same count of the others.
func (s *Service) admission(rec *Record) func(others []*Record) error {
	// The host is read here, before reserve takes the registry lock: no
	// file read or statfs runs under it, as every VM read waits on it.
	cfg := s.o.Config
	lim, hostErr := s.limits()
	var (
		free    uint64
		freeErr error
	)
	if diskBytes(rec) > 0 {
		free, freeErr = s.o.DiskFree()
	}
	return func(others []*Record) error {
		if hostErr != nil {
			return hostErr
		}
		var used usage
		for _, o := range others {
			used.add(o)
		}
		// Written as "need > cap - used" so huge requests cannot wrap around.
		if used.vcpus > lim.vcpus || uint64(rec.Spec.Vcpus) > lim.vcpus-used.vcpus {
			return &CapacityError{Resource: "vcpus", Msg: fmt.Sprintf("%d requested, %d of %d in use (%d host CPUs x overcommit %g)",
				rec.Spec.Vcpus, used.vcpus, lim.vcpus, lim.cpus, ratio(cfg.Overcommit.CPU, 4))}
		}
		if used.memMB > lim.memMB || rec.Spec.MemoryMB > lim.memMB-used.memMB {
			return &CapacityError{Resource: "memory_mb", Msg: fmt.Sprintf("%d MiB requested, %d of %d MiB in use (%d MiB x overcommit %g)",
				rec.Spec.MemoryMB, used.memMB, lim.memMB, lim.hostMemMB, ratio(cfg.Overcommit.Memory, 1))}
		}
		if rec.Spec.CPUAffinity != nil {
			// Validation has just checked that the pinned CPUs are online.
			pins, err := ParseCPUSet(*rec.Spec.CPUAffinity)
			if err != nil {
				return &CapacityError{Resource: "cpu_affinity", Msg: err.Error()}
			}
			pinCap := uint64(math.Floor(float64(len(pins)) * ratio(cfg.Overcommit.CPU, 4)))
			if uint64(rec.Spec.Vcpus) > pinCap {
				return &CapacityError{Resource: "cpu_affinity", Msg: fmt.Sprintf("%d vCPUs on %d pinned CPUs exceed overcommit %g", rec.Spec.Vcpus, len(pins), ratio(cfg.Overcommit.CPU, 4))}
			}
		}
		// An explicit MAC another VM uses would break both on the bridge.
		for i, n := range rec.Spec.Nets {
			if n.MAC == "" || i >= len(rec.NICs) {
				continue
			}
			for _, o := range others {
				for _, on := range o.NICs {
					if on.MAC == rec.NICs[i].MAC {
						return bad(fmt.Sprintf("nets[%d].mac", i), "%s is already used by VM %q", on.MAC, o.ID)
					}
				}
			}
		}
		for _, d := range rec.Spec.PCIDevices {
			for _, o := range others {
				if slices.Contains(o.Spec.PCIDevices, d) {
					return &CapacityError{Resource: "pci_devices", Msg: fmt.Sprintf("%s is already assigned to VM %q", d, o.ID)}
				}
			}
		}
		if need := diskBytes(rec); need > 0 {
			if freeErr != nil {
				return &CapacityError{Resource: "disk", Msg: freeErr.Error()}
			}
			if used.disk > free || need > free-used.disk {
				return &CapacityError{Resource: "disk", Msg: fmt.Sprintf("new disks need %d bytes, %d free in the state directory of which provisions in flight will still write %d",
					need, free, used.disk)}
			}
		}
		return nil
	}
}

// limits are the totals admission counts against: the host's CPUs and
// memory, and those times the overcommit ratios (what VMs may hold).
type limits struct {
	cpus      int
	hostMemMB uint64
	vcpus     uint64
	memMB     uint64
}

// limits reads the host totals (the config's host_cpus and
// host_memory_mb, else what the host has; a *CapacityError when that
// cannot be read) and applies the overcommit ratios.
func (s *Service) limits() (limits, error) {
	cfg := s.o.Config
	l := limits{cpus: cfg.HostCPUs, hostMemMB: uint64(cfg.HostMemoryMB)}
	if l.cpus == 0 {
		online, err := s.facts.OnlineCPUs()
		if err != nil {
			return limits{}, &CapacityError{Resource: "vcpus", Msg: err.Error()}
		}
		l.cpus = len(online)
	}
	if l.hostMemMB == 0 {
		m, err := s.facts.MemoryMB()
		if err != nil {
			return limits{}, &CapacityError{Resource: "memory_mb", Msg: err.Error()}
		}
		l.hostMemMB = m
	}
	l.vcpus = uint64(math.Floor(float64(l.cpus) * ratio(cfg.Overcommit.CPU, 4)))
	l.memMB = uint64(math.Floor(float64(l.hostMemMB) * ratio(cfg.Overcommit.Memory, 1)))
	return l, nil
}

// usage is what admission counts of the VMs already there (stored, or
// creates in flight): the vCPUs and memory of the active ones (neither
// stopped nor failed) and the disks provisions in flight have yet to
// write, which free space does not show yet.
type usage struct {
	vcpus, memMB, disk uint64
}

func (u *usage) add(r *Record) {
	if active(r) {
		u.vcpus += uint64(r.Spec.Vcpus)
		u.memMB += r.Spec.MemoryMB
	}
	if r.Provisioning() {
		u.disk += diskBytes(r)
	}
}

// Capacity is what admission decides with (GET /api/host): the host
// totals, what VMs may hold (the totals times the overcommit ratios), what
// they hold now, and the state directory's space. A create fits when its
// vCPUs are at most VCPUs-VCPUsUsed, its memory at most
// MemoryMB-MemoryMBUsed, and its new disks at most DiskFree-DiskCommitted.
type Capacity struct {
	HostCPUs, VCPUs, VCPUsUsed           uint64
	HostMemoryMB, MemoryMB, MemoryMBUsed uint64
	// DiskTotal and DiskFree are the state directory's file system's size
	// and the space available to the agent; DiskCommitted is what
	// provisions in flight will still write there.
	DiskTotal, DiskFree, DiskCommitted uint64
}

// Capacity reads the host as an admission does and counts every stored VM
// and create in flight with admission's own count.
func (s *Service) Capacity() (Capacity, error) {
	lim, err := s.limits()
	if err != nil {
		return Capacity{}, err
	}
	var used usage
	s.recs.Each(used.add)
	c := Capacity{
		HostCPUs: uint64(lim.cpus), VCPUs: lim.vcpus, VCPUsUsed: used.vcpus,
		HostMemoryMB: lim.hostMemMB, MemoryMB: lim.memMB, MemoryMBUsed: used.memMB,
		DiskCommitted: used.disk,
	}
	if c.DiskFree, err = s.o.DiskFree(); err != nil {
		return Capacity{}, &CapacityError{Resource: "disk", Msg: err.Error()}
	}
	if c.DiskTotal, err = diskTotal(s.layout.StateDir); err != nil {
		return Capacity{}, &CapacityError{Resource: "disk", Msg: err.Error()}
	}
	return c, nil
}

// diskBytes is the space a create's disks may take: the root-disk copy
// (the base image's virtual size, or the requested size when the base is
// not known yet) and its new volumes' virtual sizes (thin qcow2 images
// that may fill up).
func diskBytes(r *Record) uint64 {
	var n uint64
	if r.Base != nil {
		n = r.Base.VirtualSizeBytes
	} else if r.Spec.Disk != nil && r.Spec.Disk.SizeGiB != nil {
		n = uint64(*r.Spec.Disk.SizeGiB) << 30
	}
	for _, v := range r.Spec.Volumes {
		if v.VolumeID == "" {
			n += uint64(v.SizeGiB) << 30
		}
	}
	return n
}

func ratio(r, def float64) float64 {
	if r <= 0 {
		return def
	}
	return r
}

func diskFree(dir string) (uint64, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return 0, fmt.Errorf("statfs %s: %w", dir, err)
	}
	return uint64(st.Bavail) * uint64(st.Bsize), nil // Bavail is int64 on some systems
}

// diskTotal is the size of the file system holding dir.
func diskTotal(dir string) (uint64, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return 0, fmt.Errorf("statfs %s: %w", dir, err)
	}
	return uint64(st.Blocks) * uint64(st.Bsize), nil
}
