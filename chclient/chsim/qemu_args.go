package chsim

import (
	"fmt"
	"strconv"
	"strings"
)

// qemuLaunch is what the qemu command line needs beyond the VM config.
type qemuLaunch struct {
	Accel        string // "kvm" or "tcg"
	QMPFD        int    // qemu's end of the QMP socketpair, as numbered in the child
	SerialFD     int    // qemu's end of the serial relay socketpair; -1 without a Socket serial
	VsockBackend string // vhost-user socket of vhost-device-vsock; "" without vsock
	// NoVsock leaves the vsock device out (its root port stays): a restore's qemu, which
	// loads a guest saved without it (qemu_vsock.go).
	NoVsock bool
	// TapMTU is the MTU of each tap (by name) a net without mtu uses: CH
	// then advertises the tap's own MTU to the guest, as host_mtu does.
	TapMTU map[string]int
}

// qemuDevice ties one device of the CH config to its qemu id, so events about the qemu
// device are reported under the CH id.
type qemuDevice struct {
	chID   string
	qemuID string
	virtio bool // polled for activation (x-query-virtio-status)
	// vhostUser: a vhost-user-blk disk, whose activation CH does not announce (its reset
	// it does; docs/ref/cloud-hypervisor.md §11).
	vhostUser bool
	hot       bool // hot-plugged (on a root port)
	seq       int  // 0 for a device of the command line; numbers hot-plugged ones
}

// qemuPath is the QOM path of a virtio-*-pci device's virtio backend, as x-query-virtio
// names it.
func (d qemuDevice) qomPath() string { return "/machine/peripheral/" + d.qemuID + "/virtio-backend" }

// qemuID turns a CH device id (which may start with "_", like _disk0) into a qemu id (a
// letter first; letters, digits, '-', '.', '_').
func qemuID(chID string) string {
	var b strings.Builder
	b.WriteString("ch")
	for _, r := range chID {
		if r < 0x80 && (r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-' || r == '.' || r == '_') {
			b.WriteRune(r)
		} else {
			fmt.Fprintf(&b, "-%x-", r)
		}
	}
	return b.String()
}

// qemuOpt escapes a value for qemu's key=value option syntax (a comma is doubled).
func qemuOpt(v string) string { return strings.ReplaceAll(v, ",", ",,") }

// qemuArgs maps a CH VmConfig, after vm.boot's validation and device id assignment (bdfs:
// CH id → PCI address), to a qemu-system-x86_64 command line, and lists the devices whose
// activation the backend watches. The guest starts stopped (-S): the backend connects and
// then continues it. Anything of the config qemu cannot honour is an error, so a boot never
// silently differs from what was asked (see doc.go for what is ignored on purpose).
func qemuArgs(c *vmConfig, bdfs map[string]string, l qemuLaunch) ([]string, []qemuDevice, error) {
	if c.Payload == nil || (c.Payload.Kernel == nil && c.Payload.Firmware == nil) {
		return nil, nil, fmt.Errorf("the VM has no payload: neither kernel nor firmware")
	}
	if len(c.Devices) > 0 {
		return nil, nil, fmt.Errorf("the qemu backend has no VFIO passthrough")
	}
	if c.Watchdog {
		return nil, nil, fmt.Errorf("the qemu backend has no virtio-watchdog")
	}
	if c.Iommu {
		return nil, nil, fmt.Errorf("the qemu backend has no virtual IOMMU")
	}
	if len(c.other) > 0 {
		var keys []string
		for k := range c.other {
			keys = append(keys, k)
		}
		return nil, nil, fmt.Errorf("the qemu backend does not map %s", strings.Join(keys, ", "))
	}
	if len(c.Memory.Zones) > 0 {
		return nil, nil, fmt.Errorf("the qemu backend does not map memory zones")
	}

	a := []string{"-nodefaults", "-no-user-config", "-display", "none",
		// -S: nothing runs until the backend has its QMP connection and says cont.
		"-S",
		// strict: SeaBIOS initializes no virtio-blk device (none is in the boot order), so
		// the first DRIVER_OK qemu reports is the guest kernel's, as under CH, which has no
		// firmware in between.
		"-boot", "strict=on",
		// A guest poweroff stops qemu (SHUTDOWN event) instead of exiting it, and a panic
		// changes nothing (GUEST_PANICKED only): CH's behaviour; the backend decides.
		"-action", "shutdown=pause", "-action", "panic=none",
	}
	switch l.Accel {
	case "kvm":
		a = append(a, "-accel", "kvm", "-cpu", "host")
	case "tcg":
		a = append(a, "-accel", "tcg,thread=multi", "-cpu", "max")
	default:
		return nil, nil, fmt.Errorf("unknown accelerator %q", l.Accel)
	}

	smp := fmt.Sprintf("cpus=%d,maxcpus=%d", c.Cpus.BootVcpus, c.Cpus.MaxVcpus)
	if t := c.Cpus.Topology; t != nil {
		smp += fmt.Sprintf(",sockets=%d,dies=%d,cores=%d,threads=%d", t.Packages, t.DiesPerPackage, t.CoresPerDie, t.ThreadsPerCore)
	}
	a = append(a, "-smp", smp)

	mem := fmt.Sprintf("memory-backend-memfd,id=mem,size=%d,share=%s", c.Memory.Size, onOff(c.Memory.Shared))
	if c.Memory.Hugepages {
		mem += ",hugetlb=on"
		if c.Memory.HugepageSize != nil {
			mem += fmt.Sprintf(",hugetlbsize=%d", *c.Memory.HugepageSize)
		}
	}
	a = append(a, "-m", fmt.Sprintf("%dB", c.Memory.Size), "-object", mem, "-machine", "q35,memory-backend=mem")

	if c.Payload.Firmware != nil {
		a = append(a, "-bios", *c.Payload.Firmware)
	} else {
		a = append(a, "-kernel", *c.Payload.Kernel)
	}
	if p := c.Payload.Initramfs; p != nil {
		if c.Payload.Kernel == nil {
			return nil, nil, fmt.Errorf("an initramfs needs a kernel payload (firmware loads its own)")
		}
		a = append(a, "-initrd", *p)
	}
	if p := c.Payload.Cmdline; p != nil && c.Payload.Kernel != nil {
		a = append(a, "-append", *p)
	}

	if p := c.Platform; p != nil {
		var smbios []string
		if p.SystemSerialNumber != nil {
			smbios = append(smbios, "serial="+qemuOpt(*p.SystemSerialNumber))
		}
		if p.SystemUUID != nil {
			smbios = append(smbios, "uuid="+qemuOpt(*p.SystemUUID))
		}
		if p.SystemManufacturer != nil {
			smbios = append(smbios, "manufacturer="+qemuOpt(*p.SystemManufacturer))
		}
		if p.SystemProductName != nil {
			smbios = append(smbios, "product="+qemuOpt(*p.SystemProductName))
		}
		if len(smbios) > 0 {
			a = append(a, "-smbios", "type=1,"+strings.Join(smbios, ","))
		}
		for _, s := range p.OemStrings {
			a = append(a, "-smbios", "type=11,value="+qemuOpt(s))
		}
	}

	a = append(a, "-chardev", fmt.Sprintf("socket,id=qmp,fd=%d", l.QMPFD), "-mon", "chardev=qmp,mode=control")

	switch c.Serial.Mode {
	case "Socket":
		if l.SerialFD < 0 {
			return nil, nil, fmt.Errorf("serial socket without a relay")
		}
		a = append(a, "-chardev", fmt.Sprintf("socket,id=serial0,fd=%d", l.SerialFD), "-serial", "chardev:serial0")
	case "File":
		a = append(a, "-serial", "file:"+deref(c.Serial.File))
	case "Null":
		a = append(a, "-serial", "null")
	case "Off":
	default:
		return nil, nil, fmt.Errorf("the qemu backend has no serial mode %s (Socket, File, Null or Off)", c.Serial.Mode)
	}

	addr := func(id string) (string, error) {
		bdf, ok := bdfs[id]
		if !ok {
			return "", fmt.Errorf("device %s has no PCI address", id)
		}
		// 0000:00:SS.0 → SS
		if len(bdf) != 12 || !strings.HasPrefix(bdf, "0000:00:") || !strings.HasSuffix(bdf, ".0") {
			return "", fmt.Errorf("device %s: unexpected PCI address %s", id, bdf)
		}
		if slot, err := strconv.ParseUint(bdf[8:10], 16, 8); err != nil || slot >= hotplugSlot {
			return "", fmt.Errorf("device %s: PCI address %s is at or above the hot-plug ports' slot %#x (too many devices for the qemu backend)", id, bdf, hotplugSlot)
		}
		return "0x" + bdf[8:10], nil
	}
	var devs []qemuDevice
	device := func(chID, driver string, props ...string) error {
		slot, err := addr(chID)
		if err != nil {
			return err
		}
		d := qemuDevice{chID: chID, qemuID: qemuID(chID), virtio: strings.HasPrefix(driver, "v"),
			vhostUser: driver == "vhost-user-blk-pci"}
		if d.virtio {
			props = append(props, "disable-legacy=on")
		}
		a = append(a, "-device", strings.Join(append([]string{driver, "id=" + d.qemuID, "addr=" + slot}, props...), ","))
		devs = append(devs, d)
		return nil
	}

	switch c.Console.Mode {
	case "Off":
	case "Null":
		// CH's virtio-console comes first in its PCI order; its output goes nowhere.
		a = append(a, "-chardev", "null,id=console0")
		if err := device("__console", "virtio-serial-pci"); err != nil {
			return nil, nil, err
		}
		a = append(a, "-device", "virtconsole,chardev=console0")
	default:
		return nil, nil, fmt.Errorf("the qemu backend has no console mode %s (Off or Null)", c.Console.Mode)
	}

	for i, d := range c.Disks {
		id := deref(d.ID)
		if d.RateLimiterConfig != nil || d.RateLimitGroup != nil {
			return nil, nil, fmt.Errorf("disk %s: the qemu backend does not map rate limits", id)
		}
		props := []string{fmt.Sprintf("num-queues=%d", d.NumQueues), fmt.Sprintf("queue-size=%d", d.QueueSize)}
		if d.Serial != nil {
			props = append(props, "serial="+qemuOpt(*d.Serial))
		}
		if d.VhostUser {
			if d.Serial != nil {
				// vhost-user-blk has no serial property: the backend answers the guest.
				return nil, nil, fmt.Errorf("disk %s: the qemu backend cannot give a vhost-user disk a serial", id)
			}
			chardev := fmt.Sprintf("vhost-disk%d", i)
			a = append(a, "-chardev", fmt.Sprintf("socket,id=%s,path=%s", chardev, qemuOpt(deref(d.VhostSocket))))
			if err := device(id, "vhost-user-blk-pci", append([]string{"chardev=" + chardev}, props...)...); err != nil {
				return nil, nil, err
			}
			continue
		}
		format := "raw"
		switch d.ImageType {
		case "Qcow2":
			format = "qcow2"
		case "Raw", "Unknown":
		default:
			return nil, nil, fmt.Errorf("disk %s: the qemu backend maps raw and qcow2 images, not %s", id, d.ImageType)
		}
		drive := fmt.Sprintf("file=%s,if=none,id=drive%d,format=%s,readonly=%s", qemuOpt(deref(d.Path)), i, format, onOff(d.Readonly))
		if d.Direct {
			drive += ",cache.direct=on"
		}
		a = append(a, "-drive", drive)
		if err := device(id, "virtio-blk-pci", append([]string{fmt.Sprintf("drive=drive%d", i)}, props...)...); err != nil {
			return nil, nil, err
		}
	}

	for i, n := range c.Net {
		id := deref(n.ID)
		if n.VhostUser {
			return nil, nil, fmt.Errorf("net %s: the qemu backend has no vhost-user net", id)
		}
		if n.Tap == nil {
			return nil, nil, fmt.Errorf("net %s: the qemu backend attaches existing taps only (no tap name)", id)
		}
		if n.RateLimiterConfig != nil {
			return nil, nil, fmt.Errorf("net %s: the qemu backend does not map rate limits", id)
		}
		if n.IP != nil {
			return nil, nil, fmt.Errorf("net %s: the qemu backend does not configure the host side of a tap (ip, mask)", id)
		}
		netdev := fmt.Sprintf("tap,id=netdev%d,ifname=%s,script=no,downscript=no,vhost=off", i, qemuOpt(*n.Tap))
		props := []string{fmt.Sprintf("netdev=netdev%d", i), "mac=" + n.Mac}
		if pairs := n.NumQueues / 2; pairs > 1 {
			netdev += fmt.Sprintf(",queues=%d", pairs)
			props = append(props, "mq=on", fmt.Sprintf("vectors=%d", 2*pairs+2))
		}
		if n.Mtu != nil {
			props = append(props, fmt.Sprintf("host_mtu=%d", *n.Mtu))
		} else if mtu := l.TapMTU[*n.Tap]; mtu != 0 {
			props = append(props, fmt.Sprintf("host_mtu=%d", mtu))
		}
		if !n.OffloadCsum {
			props = append(props, "csum=off", "guest_csum=off")
		}
		if !n.OffloadTso {
			props = append(props, "host_tso4=off", "host_tso6=off", "guest_tso4=off", "guest_tso6=off")
		}
		if !n.OffloadUfo {
			props = append(props, "host_ufo=off", "guest_ufo=off")
		}
		a = append(a, "-netdev", netdev)
		if err := device(id, "virtio-net-pci", props...); err != nil {
			return nil, nil, err
		}
	}

	a = append(a, "-object", "rng-random,id=rng0,filename="+qemuOpt(c.Rng.Src))
	if err := device("__rng", "virtio-rng-pci", "rng=rng0"); err != nil {
		return nil, nil, err
	}
	if b := c.Balloon; b != nil {
		props := []string{"deflate-on-oom=" + onOff(b.DeflateOnOom), "free-page-reporting=" + onOff(b.FreePageReporting)}
		if err := device(deref(b.ID), "virtio-balloon-pci", props...); err != nil {
			return nil, nil, err
		}
	}
	if c.Pvpanic {
		// pvpanic-pci is CH's device (1b36:0011); the guest needs CONFIG_PVPANIC_PCI.
		if err := device("__pvpanic", "pvpanic-pci"); err != nil {
			return nil, nil, err
		}
	}
	// Spare root ports for vm.add-disk (pcie.0 cannot hot-plug): the functions of one slot
	// above the cold devices' (qemu_hotplug.go). Each needs a chassis of its own.
	for i := range hotplugPorts {
		port := fmt.Sprintf("pcie-root-port,id=%s,bus=pcie.0,addr=0x%02x.%d,chassis=%d", rootPortID(i), hotplugSlot, i, i+1)
		if i == 0 {
			port += ",multifunction=on"
		}
		a = append(a, "-device", port)
	}
	if v := c.Vsock; v != nil {
		// On a root port of its own, so that a snapshot can unplug it (qemu_vsock.go).
		a = append(a, "-device", fmt.Sprintf("pcie-root-port,id=%s,bus=pcie.0,addr=0x%02x.%d,chassis=%d",
			vsockPortID, hotplugSlot, hotplugPorts, hotplugPorts+1))
		if !l.NoVsock {
			if l.VsockBackend == "" {
				return nil, nil, fmt.Errorf("vsock needs the vhost-device-vsock backend")
			}
			d := vsockDevice(v)
			a = append(a, "-chardev", "socket,id="+vsockChardev+",path="+qemuOpt(l.VsockBackend),
				"-device", "vhost-user-vsock-pci,id="+d.qemuID+",bus="+vsockPortID+",chardev="+vsockChardev+",disable-legacy=on")
			devs = append(devs, d)
		}
	}
	return a, devs, nil
}

func onOff(b bool) string {
	if b {
		return "on"
	}
	return "off"
}

// vsockBackendArgs is the vhost-device-vsock command line for CH's hybrid vsock: the guest
// CID, the vhost-user socket qemu connects to, and the unix socket of the host side, which
// follows CH's convention (CONNECT <port> on it; guest connections to port P reach <it>_P).
func vsockBackendArgs(cid uint32, vhostUser, udsPath string) []string {
	return []string{"--guest-cid", strconv.FormatUint(uint64(cid), 10), "--socket", vhostUser, "--uds-path", udsPath}
}
