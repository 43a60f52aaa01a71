package engine

import (
	"fmt"

	"vmhost/chclient"
	"vmhost/config"
	"vmhost/vm/record"
)

// CHConfigHost holds the host facts CHConfig needs beyond the record.
type CHConfigHost struct {
	// CPUs is the number of host CPUs: the vCPU hot-add ceiling.
	CPUs int
}

// maxVcpus is Cloud Hypervisor's x86_64 limit validation also enforces.
const maxVcpus = 254

// Memory hotplug on ACPI works in 128 MiB blocks.
const hotplugBlock = 128 << 20

// netRefillMillis is the refill period of a net rate limiter's bandwidth
// bucket: short enough to keep bursts small, long enough that the bucket
// holds more than one maximum-size frame at the lowest rate (1 Mbps ×
// 100 ms = 12500 bytes).
const netRefillMillis = 100

// CHConfig builds the vm.create body of rec: a pure function of the
// record, the host configuration, the path layout and the host's CPU
// count. It needs rec.Runtime.VsockCID to be allocated.
//
//   - payload: the kernel (an AppVM without one boots cfg.AppVMKernel) with
//     the effective command line, or the firmware (CH drops a command line
//     given with firmware, so none is sent).
//   - cpus: boot_vcpus = vcpus. Without cpu_topology, max_vcpus leaves
//     hot-add headroom up to the host's CPU count (never below vcpus, never
//     above 254); with it, max_vcpus = vcpus and the topology is sockets →
//     packages, cores → cores_per_die, threads → threads_per_core, one die.
//     cpu_affinity pins every vCPU, hot-added ones included, to the whole
//     set. nested is sent only when the request set it.
//   - memory: shared (vhost-user disks need it); hotplug_size = the boot
//     size rounded up to 128 MiB (the guest may double its memory) unless
//     pci_devices is set, since passthrough pins guest memory.
//   - disks in guest order: root (vhost-user, root.vhost), the seed (raw,
//     read-only) when cloud_init is set, data volumes (vhost-user,
//     data<N>.vhost). No ids are sent: CH names them _disk0, _disk1, ….
//     The classic VM's sign of life is the first `virtio-device activated`
//     of any device: CH v53 announces none for vhost-user disks, but does
//     for the seed, the NICs and the balloon every VM has.
//   - net: the recorded tap and MAC (the tap carries the resolved MTU), and for
//     rate_limit_mbps a bandwidth bucket refilled every 100 ms holding
//     mbps × 125 × 100 bytes (mbps × 10^6 / 8 bytes per second).
//   - serial on console.sock, console off, pvpanic, platform serial_number,
//     devices for pci_devices (/sys/bus/pci/devices/<bdf>/), and for an
//     AppVM the vsock its guest agent talks over. A classic VM has no vsock
//     device: nothing of vmhost talks to its guest over one, and a device
//     it does not use would only keep it from being saved where the
//     hypervisor cannot migrate vsock (QEMU 7.2 behind the simulator).
//   - balloon: always, sized to the recorded target, deflate_on_oom, so
//     POST .../balloon works on a running VM without a reboot.
func CHConfig(rec *record.Record, cfg *config.Config, l record.Layout, host CHConfigHost) (*chclient.VmConfig, error) {
	sp := &rec.Spec
	if rec.Runtime == nil || rec.Runtime.VsockCID < 3 {
		return nil, fmt.Errorf("building CH config of VM %q: no vsock CID allocated", rec.ID)
	}
	c := &chclient.VmConfig{
		Payload: &chclient.PayloadConfig{},
		Serial:  &chclient.ConsoleConfig{Mode: chclient.ConsoleSocket, Socket: l.ConsoleSocket(rec.ID)},
		Console: &chclient.ConsoleConfig{Mode: chclient.ConsoleOff},
		Pvpanic: true,
		Balloon: &chclient.BalloonConfig{Size: rec.BalloonMB << 20, DeflateOnOom: true},
	}

	if rec.Mode == record.ModeAppVM {
		c.Vsock = &chclient.VsockConfig{Cid: rec.Runtime.VsockCID, Socket: l.VsockSocket(rec.ID)}
	}
	switch {
	case sp.FirmwarePath != nil:
		c.Payload.Firmware = *sp.FirmwarePath
	case sp.KernelPath != nil:
		c.Payload.Kernel = *sp.KernelPath
	case rec.Mode == record.ModeAppVM:
		c.Payload.Kernel = cfg.AppVMKernel
	default:
		return nil, fmt.Errorf("building CH config of VM %q: neither kernel nor firmware", rec.ID)
	}
	if c.Payload.Kernel != "" {
		c.Payload.Cmdline = EffectiveCmdline(rec, cfg)
	}

	boot := int(sp.Vcpus)
	cpus := &chclient.CpusConfig{BootVcpus: boot, MaxVcpus: boot, Nested: sp.Nested}
	if t := sp.CPUTopology; t != nil {
		cpus.Topology = &chclient.CpuTopology{ThreadsPerCore: int(t.Threads), CoresPerDie: int(t.Cores),
			DiesPerPackage: 1, Packages: int(t.Sockets)}
	} else {
		cpus.MaxVcpus = max(boot, min(host.CPUs, maxVcpus))
	}
	if sp.CPUAffinity != nil {
		set, err := record.ParseCPUSet(*sp.CPUAffinity)
		if err != nil {
			return nil, fmt.Errorf("building CH config of VM %q: cpu_affinity: %w", rec.ID, err)
		}
		for i := range cpus.MaxVcpus {
			cpus.Affinity = append(cpus.Affinity, chclient.CpuAffinity{Vcpu: i, HostCpus: set})
		}
	}
	c.Cpus = cpus

	size := sp.MemoryMB << 20
	c.Memory = &chclient.MemoryConfig{Size: size, Shared: true}
	if len(sp.PCIDevices) == 0 {
		c.Memory.HotplugSize = (size + hotplugBlock - 1) / hotplugBlock * hotplugBlock
	}

	c.Disks = append(c.Disks, chclient.DiskConfig{VhostUser: true, VhostSocket: l.RootSocket(rec.ID)})
	if sp.CloudInit != nil {
		c.Disks = append(c.Disks, chclient.DiskConfig{Path: l.Seed(rec.ID), Readonly: true, ImageType: chclient.ImageRaw})
	}
	for _, v := range sp.Volumes {
		c.Disks = append(c.Disks, chclient.DiskConfig{ID: v.ID, VhostUser: true, VhostSocket: l.DataSocket(rec.ID, v.ID), Readonly: v.Readonly})
	}

	for i, nic := range rec.NICs {
		var np *record.NetSpec
		if i < len(sp.Nets) {
			np = &sp.Nets[i]
		}
		nv := record.ResolveNet(cfg, np, nic)
		// No mtu: given one, CH sets it on the tap (SIOCSIFMTU), which a
		// confined CH may not; without, it advertises the tap's, which the
		// agent set when it made the tap. No host_mac either: CH would set
		// that too; it reads the tap's.
		n := chclient.NetConfig{Tap: nic.Tap, Mac: nic.MAC}
		if nv.RateLimitMbps != nil && *nv.RateLimitMbps > 0 {
			n.RateLimiterConfig = &chclient.RateLimiterConfig{Bandwidth: &chclient.TokenBucket{
				Size: uint64(*nv.RateLimitMbps) * 125 * netRefillMillis, RefillTime: netRefillMillis}}
		}
		c.Net = append(c.Net, n)
	}

	if p := sp.Platform; p != nil && p.SerialNumber != "" {
		c.Platform = &chclient.PlatformConfig{SerialNumber: p.SerialNumber}
	}
	for _, bdf := range sp.PCIDevices {
		c.Devices = append(c.Devices, chclient.DeviceConfig{Path: "/sys/bus/pci/devices/" + bdf + "/"})
	}
	return c, nil
}

// EffectiveCmdline is the kernel command line rec boots with: its own, or
// the host default of its family.
func EffectiveCmdline(rec *record.Record, cfg *config.Config) string {
	switch {
	case rec.Spec.Cmdline != nil:
		return *rec.Spec.Cmdline
	case rec.Mode == record.ModeAppVM:
		return cfg.AppVMCmdline
	default:
		return cfg.DefaultCmdline
	}
}
