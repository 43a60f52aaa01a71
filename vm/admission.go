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
// pending record. It refuses an explicit MAC another
// VM uses (400), and counts vCPUs and memory of
// active VMs against host totals times the overcommit ratios, the vCPUs of
// a pinned VM against its pinned CPUs, PCI devices against every other
// VM's claim, and the base image size against free space in the state dir.
func (s *Service) admission(rec *Record) func(others []*Record) error {
	// The host is read here, before reserve takes the registry lock: no
	// file read or statfs runs under it, as every VM read waits on it.
	cfg := s.o.Config
	cpus, memMB, hostErr := s.hostTotals()
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
		var usedCPU, usedMem uint64
		for _, o := range others {
			if active(o) {
				usedCPU += uint64(o.Spec.Vcpus)
				usedMem += o.Spec.MemoryMB
			}
		}
		cpuCap := uint64(math.Floor(float64(cpus) * ratio(cfg.Overcommit.CPU, 4)))
		// Written as "need > cap - used" so huge requests cannot wrap around.
		if usedCPU > cpuCap || uint64(rec.Spec.Vcpus) > cpuCap-usedCPU {
			return &CapacityError{Resource: "vcpus", Msg: fmt.Sprintf("%d requested, %d of %d in use (%d host CPUs x overcommit %g)",
				rec.Spec.Vcpus, usedCPU, cpuCap, cpus, ratio(cfg.Overcommit.CPU, 4))}
		}
		memCap := uint64(math.Floor(float64(memMB) * ratio(cfg.Overcommit.Memory, 1)))
		if usedMem > memCap || rec.Spec.MemoryMB > memCap-usedMem {
			return &CapacityError{Resource: "memory_mb", Msg: fmt.Sprintf("%d MiB requested, %d of %d MiB in use (%d MiB x overcommit %g)",
				rec.Spec.MemoryMB, usedMem, memCap, memMB, ratio(cfg.Overcommit.Memory, 1))}
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
		need := diskBytes(rec)
		if need > 0 {
			for _, o := range others {
				if o.Provisioning() {
					need += diskBytes(o)
				}
			}
			if freeErr != nil {
				return &CapacityError{Resource: "disk", Msg: freeErr.Error()}
			}
			if need > free {
				return &CapacityError{Resource: "disk", Msg: fmt.Sprintf("new disks need %d bytes, %d free in the state directory", need, free)}
			}
		}
		return nil
	}
}

// hostTotals are the host's CPUs and memory before overcommit: the
// config's host_cpus and host_memory_mb, else what the host has (a
// *CapacityError when that cannot be read).
func (s *Service) hostTotals() (cpus int, memMB uint64, err error) {
	cfg := s.o.Config
	cpus, memMB = cfg.HostCPUs, uint64(cfg.HostMemoryMB)
	if cpus == 0 {
		online, err := s.facts.OnlineCPUs()
		if err != nil {
			return 0, 0, &CapacityError{Resource: "vcpus", Msg: err.Error()}
		}
		cpus = len(online)
	}
	if memMB == 0 {
		m, err := s.facts.MemoryMB()
		if err != nil {
			return 0, 0, &CapacityError{Resource: "memory_mb", Msg: err.Error()}
		}
		memMB = m
	}
	return cpus, memMB, nil
}

// Capacity is what admission counts: the vCPUs and memory VMs may hold
// (host totals times the overcommit ratios) and what active VMs (neither
// stopped nor failed, creates in flight included) hold now.
type Capacity struct {
	VCPUs, VCPUsUsed       uint64
	MemoryMB, MemoryMBUsed uint64
}

// Capacity reads the host totals and sums the active VMs, as the next
// admission would.
func (s *Service) Capacity() (Capacity, error) {
	cpus, memMB, err := s.hostTotals()
	if err != nil {
		return Capacity{}, err
	}
	cfg := s.o.Config
	c := Capacity{
		VCPUs:    uint64(math.Floor(float64(cpus) * ratio(cfg.Overcommit.CPU, 4))),
		MemoryMB: uint64(math.Floor(float64(memMB) * ratio(cfg.Overcommit.Memory, 1))),
	}
	s.recs.Each(func(r *Record) {
		if active(r) {
			c.VCPUsUsed += uint64(r.Spec.Vcpus)
			c.MemoryMBUsed += r.Spec.MemoryMB
		}
	})
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
