package vm_test

import (
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"vmhost/config"
	"vmhost/qcow2"
	"vmhost/seed"
	"vmhost/vm"
	"vmhost/vm/vmtest"
)

func ptr[T any](v T) *T { return &v }

func baseSpec(e *vmtest.Env) vm.Spec {
	return vm.Spec{Vcpus: 2, MemoryMB: 512, KernelPath: ptr(e.Kernel), Disk: &vm.DiskSpec{BasePath: e.Base}}
}

const goodSHA = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"

// TestValidateRules pairs, for every rule of docs/api.md (POST /api/vms), a
// rejected value with the accepted boundary value beside it.
func TestValidateRules(t *testing.T) {
	e := vmtest.NewEnv(t)
	dir := t.TempDir()
	e.Config.HostPathRoots = append(e.Config.HostPathRoots, dir)
	raw := filepath.Join(dir, "raw.img")
	if err := os.WriteFile(raw, make([]byte, 4096), 0o644); err != nil {
		t.Fatal(err)
	}
	big := filepath.Join(dir, "big.qcow2")
	if err := qcow2.Create(big, 2<<30); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(dir, "link.qcow2")
	if err := os.Symlink(e.Base, link); err != nil {
		t.Fatal(err)
	}
	overlay := filepath.Join(dir, "overlay.qcow2")
	if out, err := exec.Command("qemu-img", "create", "-q", "-f", "qcow2", "-b", e.Base, "-F", "qcow2", overlay).CombinedOutput(); err != nil {
		t.Logf("qemu-img unavailable (%v: %s); writing the backing-file header by hand", err, out)
		writeOverlay(t, overlay, e.Base)
	}
	firmware := filepath.Join(dir, "fw.bin")
	if err := os.WriteFile(firmware, []byte("fw"), 0o644); err != nil {
		t.Fatal(err)
	}

	svc := e.Service(t)
	noNested := vmtest.NewEnv(t)
	noNested.Config.Nested = ptr(false)
	noNestedSvc := noNested.Service(t)

	type mut = func(*vm.Spec)
	tests := []struct {
		name, field    string
		reject, accept mut
		host           *vm.Service
	}{
		{"vm_id pattern", "vm_id", func(s *vm.Spec) { s.VMID = "-a" }, func(s *vm.Spec) { s.VMID = "a-" }, nil},
		{"vm_id length", "vm_id", func(s *vm.Spec) { s.VMID = strings.Repeat("a", 65) }, func(s *vm.Spec) { s.VMID = strings.Repeat("a", 64) }, nil},
		{"vm_id characters", "vm_id", func(s *vm.Spec) { s.VMID = "a/b" }, func(s *vm.Spec) { s.VMID = "a_b.c-d" }, nil},
		{"vcpus minimum", "vcpus", func(s *vm.Spec) { s.Vcpus = 0 }, func(s *vm.Spec) { s.Vcpus = 1 }, nil},
		{"vcpus maximum", "vcpus", func(s *vm.Spec) { s.Vcpus = 255 }, func(s *vm.Spec) { s.Vcpus = 254 }, nil},
		{"memory minimum", "memory_mb", func(s *vm.Spec) { s.MemoryMB = 63 }, func(s *vm.Spec) { s.MemoryMB = 64 }, nil},
		// The accepted maximum then meets admission (409), not validation.
		{"memory maximum", "memory_mb", func(s *vm.Spec) { s.MemoryMB = vm.MaxMemoryMB + 1 }, func(s *vm.Spec) { s.MemoryMB = 64 }, nil},
		{"memory wrapping in bytes", "memory_mb", func(s *vm.Spec) { s.MemoryMB = 1 << 44 }, func(s *vm.Spec) { s.MemoryMB = 64 }, nil},
		{"disk_bps_total maximum", "disk_bps_total", func(s *vm.Spec) { s.DiskBpsTotal = vm.MaxIOLimit + 1 }, func(s *vm.Spec) { s.DiskBpsTotal = vm.MaxIOLimit }, nil},
		{"disk_bps_total 2^64-1", "disk_bps_total", func(s *vm.Spec) { s.DiskBpsTotal = ^uint64(0) }, func(s *vm.Spec) { s.DiskBpsTotal = 1 }, nil},
		{"disk_iops_total maximum", "disk_iops_total", func(s *vm.Spec) { s.DiskIopsTotal = vm.MaxIOLimit + 1 }, func(s *vm.Spec) { s.DiskIopsTotal = vm.MaxIOLimit }, nil},
		{"cpu_topology threads", "cpu_topology", func(s *vm.Spec) { s.Vcpus = 4; s.CPUTopology = &vm.CPUTopology{Sockets: 1, Cores: 1, Threads: 4} }, func(s *vm.Spec) { s.Vcpus = 4; s.CPUTopology = &vm.CPUTopology{Sockets: 1, Cores: 2, Threads: 2} }, nil},
		{"PCI device slots", "nets", func(s *vm.Spec) {
			s.Volumes = make([]vm.VolumeSpec, vm.MaxVolumes)
			for i := range s.Volumes {
				s.Volumes[i].SizeGiB = 1
			}
			s.Nets = make([]vm.NetSpec, vm.PCISlots-vm.FixedDevices-vm.MaxVolumes+1)
		}, func(s *vm.Spec) {
			s.Volumes = make([]vm.VolumeSpec, vm.MaxVolumes)
			for i := range s.Volumes {
				s.Volumes[i].SizeGiB = 1
			}
			s.Nets = make([]vm.NetSpec, vm.PCISlots-vm.FixedDevices-vm.MaxVolumes)
		}, nil},
		{"both boot methods", "kernel_path", func(s *vm.Spec) { s.FirmwarePath = ptr(firmware) }, func(s *vm.Spec) {}, nil},
		{"no boot method", "kernel_path", func(s *vm.Spec) { s.KernelPath = nil }, func(s *vm.Spec) { s.KernelPath, s.FirmwarePath = nil, ptr(firmware) }, nil},
		{"kernel_path absolute", "kernel_path", func(s *vm.Spec) { s.KernelPath = ptr("boot/vmlinux") }, func(s *vm.Spec) {}, nil},
		{"kernel_path exists", "kernel_path", func(s *vm.Spec) { s.KernelPath = ptr(e.Kernel + ".missing") }, func(s *vm.Spec) {}, nil},
		{"kernel_path regular file", "kernel_path", func(s *vm.Spec) { s.KernelPath = ptr(dir) }, func(s *vm.Spec) {}, nil},
		{"firmware_path exists", "firmware_path", func(s *vm.Spec) { s.KernelPath, s.FirmwarePath = nil, ptr(firmware+".missing") }, func(s *vm.Spec) { s.KernelPath, s.FirmwarePath = nil, ptr(firmware) }, nil},
		{"firmware_path absolute", "firmware_path", func(s *vm.Spec) { s.KernelPath, s.FirmwarePath = nil, ptr("fw.bin") }, func(s *vm.Spec) { s.KernelPath, s.FirmwarePath = nil, ptr(firmware) }, nil},
		{"disk required", "disk", func(s *vm.Spec) { s.Disk = nil }, func(s *vm.Spec) {
			s.Disk = nil
			s.Image = &vm.ImageSpec{ImageID: "deb12", ContentSHA256: goodSHA, FetchURL: "https://images.example/deb12.qcow2"}
		}, nil},
		{"disk.base_path required", "disk.base_path", func(s *vm.Spec) { s.Disk.BasePath = "" }, func(s *vm.Spec) {}, nil},
		{"disk.base_path with image", "disk.base_path", func(s *vm.Spec) {
			s.Image = &vm.ImageSpec{ImageID: "deb12", ContentSHA256: goodSHA, FetchURL: "https://x/y"}
		}, func(s *vm.Spec) {
			s.Image = &vm.ImageSpec{ImageID: "deb12", ContentSHA256: goodSHA, FetchURL: "https://x/y"}
			s.Disk.BasePath = ""
		}, nil},
		{"disk.mode", "disk.mode", func(s *vm.Spec) { s.Disk.Mode = "link" }, func(s *vm.Spec) { s.Disk.Mode = "copy" }, nil},
		{"disk.base_path absolute", "disk.base_path", func(s *vm.Spec) { s.Disk.BasePath = "base.qcow2" }, func(s *vm.Spec) { s.Disk.BasePath = link }, nil},
		{"disk.base_path exists", "disk.base_path", func(s *vm.Spec) { s.Disk.BasePath = e.Base + ".missing" }, func(s *vm.Spec) {}, nil},
		{"disk.base_path qcow2", "disk.base_path", func(s *vm.Spec) { s.Disk.BasePath = raw }, func(s *vm.Spec) {}, nil},
		{"disk.base_path backing file", "disk.base_path", func(s *vm.Spec) { s.Disk.BasePath = overlay }, func(s *vm.Spec) {}, nil},
		{"disk.size_gib minimum", "disk.size_gib", func(s *vm.Spec) { s.Disk.SizeGiB = ptr[uint32](0) }, func(s *vm.Spec) { s.Disk.SizeGiB = ptr[uint32](1) }, nil},
		{"disk.size_gib maximum", "disk.size_gib", func(s *vm.Spec) { s.Disk.SizeGiB = ptr[uint32](65536) }, func(s *vm.Spec) { s.Disk.SizeGiB = ptr[uint32](65535) }, nil},
		{"disk.size_gib below base", "disk.size_gib", func(s *vm.Spec) { s.Disk.BasePath, s.Disk.SizeGiB = big, ptr[uint32](1) }, func(s *vm.Spec) { s.Disk.BasePath, s.Disk.SizeGiB = big, ptr[uint32](2) }, nil},
		{"image.content_sha256", "image.content_sha256", func(s *vm.Spec) {
			s.Disk = nil
			s.Image = &vm.ImageSpec{ImageID: "deb12", ContentSHA256: strings.ToUpper(goodSHA), FetchURL: "https://x/y"}
		}, func(s *vm.Spec) {
			s.Disk = nil
			s.Image = &vm.ImageSpec{ImageID: "deb12", ContentSHA256: goodSHA, FetchURL: "https://x/y"}
		}, nil},
		{"image.image_id", "image.image_id", func(s *vm.Spec) {
			s.Disk = nil
			s.Image = &vm.ImageSpec{ImageID: "ubuntu/24.04", ContentSHA256: goodSHA, FetchURL: "https://x/y"}
		}, func(s *vm.Spec) {
			s.Disk = nil // a SimpleStreams <product>:<version> id
			s.Image = &vm.ImageSpec{ImageID: "com.ubuntu.cloud:server:24.04:amd64:20251101", ContentSHA256: goodSHA, FetchURL: "https://x/y"}
		}, nil},
		{"image.fetch_url", "image.fetch_url", func(s *vm.Spec) {
			s.Disk = nil
			s.Image = &vm.ImageSpec{ImageID: "deb12", ContentSHA256: goodSHA, FetchURL: "ftp://x/y"}
		}, func(s *vm.Spec) {
			s.Disk = nil
			s.Image = &vm.ImageSpec{ImageID: "deb12", ContentSHA256: goodSHA, FetchURL: "http://x/y"}
		}, nil},
		{"volumes size minimum", "volumes[1].size_gib", func(s *vm.Spec) { s.Volumes = []vm.VolumeSpec{{SizeGiB: 1}, {SizeGiB: 0}} }, func(s *vm.Spec) { s.Volumes = []vm.VolumeSpec{{SizeGiB: 1}, {SizeGiB: 1}} }, nil},
		{"volumes size maximum", "volumes[0].size_gib", func(s *vm.Spec) { s.Volumes = []vm.VolumeSpec{{SizeGiB: 65536}} }, func(s *vm.Spec) { s.Volumes = []vm.VolumeSpec{{SizeGiB: 65535}} }, nil},
		{"volumes count", "volumes", func(s *vm.Spec) { s.Volumes = make([]vm.VolumeSpec, vm.MaxVolumes+1) }, func(s *vm.Spec) {
			s.Volumes = make([]vm.VolumeSpec, vm.MaxVolumes)
			for i := range s.Volumes {
				s.Volumes[i].SizeGiB = 1
			}
		}, nil},
		{"cmdline control", "cmdline", func(s *vm.Spec) { s.Cmdline = ptr("console=ttyS0\nx") }, func(s *vm.Spec) { s.Cmdline = ptr("console=ttyS0 x") }, nil},
		{"cpu_topology product", "cpu_topology", func(s *vm.Spec) { s.CPUTopology = &vm.CPUTopology{Sockets: 2, Cores: 2, Threads: 1} }, func(s *vm.Spec) { s.CPUTopology = &vm.CPUTopology{Sockets: 2, Cores: 1, Threads: 1} }, nil},
		{"cpu_topology zero", "cpu_topology", func(s *vm.Spec) { s.Vcpus = 2; s.CPUTopology = &vm.CPUTopology{Sockets: 0, Cores: 2, Threads: 1} }, func(s *vm.Spec) { s.CPUTopology = &vm.CPUTopology{Sockets: 1, Cores: 2, Threads: 1} }, nil},
		{"cpuset syntax", "cpu_affinity", func(s *vm.Spec) { s.CPUAffinity = ptr("0-") }, func(s *vm.Spec) { s.CPUAffinity = ptr("0-1") }, nil},
		{"cpuset reversed", "cpu_affinity", func(s *vm.Spec) { s.CPUAffinity = ptr("3-1") }, func(s *vm.Spec) { s.CPUAffinity = ptr("1-3,5") }, nil},
		{"cpuset online", "cpu_affinity", func(s *vm.Spec) { s.CPUAffinity = ptr("6-8") }, func(s *vm.Spec) { s.CPUAffinity = ptr("6-7") }, nil},
		{"nested unsupported", "nested", func(s *vm.Spec) { s.Nested = ptr(true) }, func(s *vm.Spec) { s.Nested = ptr(false) }, noNestedSvc},
		{"pci BDF syntax", "pci_devices[0]", func(s *vm.Spec) { s.PCIDevices = []string{"02:00.0"} }, func(s *vm.Spec) { s.PCIDevices = []string{"0000:02:00.0"} }, nil},
		{"pci exists", "pci_devices[0]", func(s *vm.Spec) { s.PCIDevices = []string{"0000:03:00.0"} }, func(s *vm.Spec) { s.PCIDevices = []string{"0000:02:00.0"} }, nil},
		{"pci whole IOMMU group", "pci_devices[0]", func(s *vm.Spec) { s.PCIDevices = []string{"0000:01:00.0"} }, func(s *vm.Spec) { s.PCIDevices = []string{"0000:01:00.0", "0000:01:00.1"} }, nil},
		{"pci not on vfio-pci", "pci_devices[0]", func(s *vm.Spec) { s.PCIDevices = []string{"0000:04:00.0"} }, func(s *vm.Spec) { s.PCIDevices = []string{"0000:02:00.0"} }, nil},
		{"pci listed twice", "pci_devices[1]", func(s *vm.Spec) { s.PCIDevices = []string{"0000:02:00.0", "0000:02:00.0"} }, func(s *vm.Spec) { s.PCIDevices = []string{"0000:02:00.0"} }, nil},
		{"serial_number length", "platform.serial_number", func(s *vm.Spec) { s.Platform = &vm.Platform{SerialNumber: strings.Repeat("s", 513)} }, func(s *vm.Spec) { s.Platform = &vm.Platform{SerialNumber: strings.Repeat("s", 512)} }, nil},
		{"serial_number characters", "platform.serial_number", func(s *vm.Spec) { s.Platform = &vm.Platform{SerialNumber: "SN\r1"} }, func(s *vm.Spec) { s.Platform = &vm.Platform{SerialNumber: "SN 1"} }, nil},
		{"serial_number NUL", "platform.serial_number", func(s *vm.Spec) { s.Platform = &vm.Platform{SerialNumber: "SN\x001"} }, func(s *vm.Spec) { s.Platform = &vm.Platform{SerialNumber: "SN-1"} }, nil},
		{"hostname length", "cloud_init.hostname", func(s *vm.Spec) { s.CloudInit = &vm.CloudInitSpec{Hostname: ptr(strings.Repeat("h", 64))} }, func(s *vm.Spec) { s.CloudInit = &vm.CloudInitSpec{Hostname: ptr(strings.Repeat("h", 63))} }, nil},
		{"hostname leading dash", "cloud_init.hostname", func(s *vm.Spec) { s.CloudInit = &vm.CloudInitSpec{Hostname: ptr("-web")} }, func(s *vm.Spec) { s.CloudInit = &vm.CloudInitSpec{Hostname: ptr("w-eb")} }, nil},
		{"hostname trailing dash", "cloud_init.hostname", func(s *vm.Spec) { s.CloudInit = &vm.CloudInitSpec{Hostname: ptr("web-")} }, func(s *vm.Spec) { s.CloudInit = &vm.CloudInitSpec{Hostname: ptr("web1")} }, nil},
		{"hostname characters", "cloud_init.hostname", func(s *vm.Spec) { s.CloudInit = &vm.CloudInitSpec{Hostname: ptr("web_1")} }, func(s *vm.Spec) { s.CloudInit = &vm.CloudInitSpec{Hostname: ptr("web-1")} }, nil},
		{"hostname empty", "cloud_init.hostname", func(s *vm.Spec) { s.CloudInit = &vm.CloudInitSpec{Hostname: ptr("")} }, func(s *vm.Spec) { s.CloudInit = &vm.CloudInitSpec{Hostname: ptr("w")} }, nil},
		{"cloud_init user", "cloud_init.user", func(s *vm.Spec) { s.CloudInit = &vm.CloudInitSpec{User: ptr("Bad User")} }, func(s *vm.Spec) { s.CloudInit = &vm.CloudInitSpec{User: ptr("ops_1")} }, nil},
		{"ssh key one line", "cloud_init.ssh_authorized_keys[0]", func(s *vm.Spec) { s.CloudInit = &vm.CloudInitSpec{SSHAuthorizedKeys: []string{"ssh-ed25519 AAAA\nx"}} }, func(s *vm.Spec) { s.CloudInit = &vm.CloudInitSpec{SSHAuthorizedKeys: []string{"ssh-ed25519 AAAA x"}} }, nil},
		{"instance_id", "cloud_init.instance_id", func(s *vm.Spec) { s.CloudInit = &vm.CloudInitSpec{InstanceID: ptr("i 1")} }, func(s *vm.Spec) { s.CloudInit = &vm.CloudInitSpec{InstanceID: ptr("i-1")} }, nil},
		{"raw_user_data non-null", "cloud_init.raw_user_data", func(s *vm.Spec) { s.CloudInit = &vm.CloudInitSpec{RawUserData: json.RawMessage(`"#cloud-config"`)} }, func(s *vm.Spec) { s.CloudInit = &vm.CloudInitSpec{RawUserData: json.RawMessage(`null`)} }, nil},
		{"raw_network_config non-null", "cloud_init.raw_network_config", func(s *vm.Spec) { s.CloudInit = &vm.CloudInitSpec{RawNetworkConfig: json.RawMessage(`{}`)} }, func(s *vm.Spec) { s.CloudInit = &vm.CloudInitSpec{RawNetworkConfig: json.RawMessage(`null`)} }, nil},
		{"cloud_init network CIDR", "cloud_init.network.ipv4.address", func(s *vm.Spec) {
			s.CloudInit = &vm.CloudInitSpec{Network: &vm.CloudInitNet{IPv4: &vm.CloudInitIP{Address: "10.0.0.5"}}}
		}, func(s *vm.Spec) {
			s.CloudInit = &vm.CloudInitSpec{Network: &vm.CloudInitNet{IPv4: &vm.CloudInitIP{Address: "10.0.0.5/32"}}}
		}, nil},
		{"cloud_init network dns", "cloud_init.network.ipv6.dns[0]", func(s *vm.Spec) {
			s.CloudInit = &vm.CloudInitSpec{Network: &vm.CloudInitNet{IPv4: &vm.CloudInitIP{Address: "10.0.0.5/24"}, IPv6: &vm.CloudInitIP{Address: "fd00::5/64", DNS: []string{"fd00::1::"}}}}
		}, func(s *vm.Spec) {
			s.CloudInit = &vm.CloudInitSpec{Network: &vm.CloudInitNet{IPv4: &vm.CloudInitIP{Address: "10.0.0.5/24"}, IPv6: &vm.CloudInitIP{Address: "fd00::5/64", DNS: []string{"fd00::1"}}}}
		}, nil},
		{"cloud_init network dns zone", "cloud_init.network.ipv6.dns[0]", func(s *vm.Spec) {
			s.CloudInit = &vm.CloudInitSpec{Network: &vm.CloudInitNet{IPv4: &vm.CloudInitIP{Address: "10.0.0.5/24"}, IPv6: &vm.CloudInitIP{Address: "fd00::5/64", DNS: []string{"fe80::1%eth0"}}}}
		}, func(s *vm.Spec) {
			s.CloudInit = &vm.CloudInitSpec{Network: &vm.CloudInitNet{IPv4: &vm.CloudInitIP{Address: "10.0.0.5/24"}, IPv6: &vm.CloudInitIP{Address: "fd00::5/64", DNS: []string{"fe80::1"}}}}
		}, nil},
		{"ipv6 gateway IPv4-mapped", "nets[0].ipv6.gateway", func(s *vm.Spec) {
			s.Nets = []vm.NetSpec{{IPv6: &vm.NetIPSpec{Address: "fd00::2/64", Gateway: "::ffff:10.0.0.1"}}}
		}, func(s *vm.Spec) {
			s.Nets = []vm.NetSpec{{IPv6: &vm.NetIPSpec{Address: "fd00::2/64", Gateway: "fd00::1"}}}
		}, nil},
		{"rate_limit minimum", "nets[0].rate_limit_mbps", func(s *vm.Spec) { s.Nets = []vm.NetSpec{{RateLimitMbps: ptr[uint32](0)}} }, func(s *vm.Spec) { s.Nets = []vm.NetSpec{{RateLimitMbps: ptr[uint32](1)}} }, nil},
		{"rate_limit maximum", "nets[0].rate_limit_mbps", func(s *vm.Spec) { s.Nets = []vm.NetSpec{{RateLimitMbps: ptr[uint32](100001)}} }, func(s *vm.Spec) { s.Nets = []vm.NetSpec{{RateLimitMbps: ptr[uint32](100000)}} }, nil},
		{"one IPv4 gateway", "nets[1].ipv4.gateway", func(s *vm.Spec) {
			s.Nets = []vm.NetSpec{{IPv4: &vm.NetIPSpec{Address: "10.0.0.2/24", Gateway: "10.0.0.1"}}, {IPv4: &vm.NetIPSpec{Address: "10.1.0.2/24", Gateway: "10.1.0.1"}}}
		}, func(s *vm.Spec) {
			s.Nets = []vm.NetSpec{{IPv4: &vm.NetIPSpec{Address: "10.0.0.2/24", Gateway: "10.0.0.1"}}, {IPv4: &vm.NetIPSpec{Address: "10.1.0.2/24"}}}
		}, nil},
		{"one IPv6 gateway", "nets[1].ipv6.gateway", func(s *vm.Spec) {
			s.Nets = []vm.NetSpec{{IPv6: &vm.NetIPSpec{Address: "fd00::2/64", Gateway: "fd00::1"}}, {IPv6: &vm.NetIPSpec{Address: "fd01::2/64", Gateway: "fd01::1"}}}
		}, func(s *vm.Spec) {
			s.Nets = []vm.NetSpec{{IPv6: &vm.NetIPSpec{Address: "fd00::2/64"}}, {IPv6: &vm.NetIPSpec{Address: "fd01::2/64", Gateway: "fd01::1"}}}
		}, nil},
		{"cloud_init gateway counts for nets[0]", "nets[1].ipv4.gateway", func(s *vm.Spec) {
			s.CloudInit = &vm.CloudInitSpec{Network: &vm.CloudInitNet{IPv4: &vm.CloudInitIP{Address: "10.0.0.2/24", Gateway: "10.0.0.1"}}}
			s.Nets = []vm.NetSpec{{}, {IPv4: &vm.NetIPSpec{Address: "10.1.0.2/24", Gateway: "10.1.0.1"}}}
		}, func(s *vm.Spec) {
			s.CloudInit = &vm.CloudInitSpec{Network: &vm.CloudInitNet{IPv4: &vm.CloudInitIP{Address: "10.0.0.2/24", Gateway: "10.0.0.1"}}}
			s.Nets = []vm.NetSpec{{IPv4: &vm.NetIPSpec{Address: "10.0.0.2/24", Gateway: "10.0.0.1"}}, {IPv4: &vm.NetIPSpec{Address: "10.1.0.2/24"}}}
		}, nil},
		{"ipv4 address CIDR", "nets[0].ipv4.address", func(s *vm.Spec) { s.Nets = []vm.NetSpec{{IPv4: &vm.NetIPSpec{Address: "10.0.0.2"}}} }, func(s *vm.Spec) { s.Nets = []vm.NetSpec{{IPv4: &vm.NetIPSpec{Address: "10.0.0.2/24"}}} }, nil},
		{"ipv4 address family", "nets[0].ipv4.address", func(s *vm.Spec) { s.Nets = []vm.NetSpec{{IPv4: &vm.NetIPSpec{Address: "fd00::2/64"}}} }, func(s *vm.Spec) { s.Nets = []vm.NetSpec{{IPv6: &vm.NetIPSpec{Address: "fd00::2/64"}}} }, nil},
		{"ipv4 gateway without suffix", "nets[0].ipv4.gateway", func(s *vm.Spec) {
			s.Nets = []vm.NetSpec{{IPv4: &vm.NetIPSpec{Address: "10.0.0.2/24", Gateway: "10.0.0.1/24"}}}
		}, func(s *vm.Spec) {
			s.Nets = []vm.NetSpec{{IPv4: &vm.NetIPSpec{Address: "10.0.0.2/24", Gateway: "10.0.0.1"}}}
		}, nil},
		{"dns_servers syntax", "nets[0].ipv4.dns_servers[1]", func(s *vm.Spec) {
			s.Nets = []vm.NetSpec{{IPv4: &vm.NetIPSpec{Address: "10.0.0.2/24", DNSServers: []string{"1.1.1.1", "dns.example"}}}}
		}, func(s *vm.Spec) {
			s.Nets = []vm.NetSpec{{IPv4: &vm.NetIPSpec{Address: "10.0.0.2/24", DNSServers: []string{"1.1.1.1", "2606:4700::1111"}}}}
		}, nil},
		{"ipv6 address CIDR", "nets[0].ipv6.address", func(s *vm.Spec) { s.Nets = []vm.NetSpec{{IPv6: &vm.NetIPSpec{Address: "fd00::2/129"}}} }, func(s *vm.Spec) { s.Nets = []vm.NetSpec{{IPv6: &vm.NetIPSpec{Address: "fd00::2/128"}}} }, nil},
		{"unknown network_id", "nets[0].network_id", func(s *vm.Spec) { s.Nets = []vm.NetSpec{{NetworkID: "nope"}} }, func(s *vm.Spec) { s.Nets = []vm.NetSpec{{NetworkID: "lab"}} }, nil},
		{"unknown bridge", "nets[0].bridge", func(s *vm.Spec) { s.Nets = []vm.NetSpec{{Bridge: "br9"}} }, func(s *vm.Spec) { s.Nets = []vm.NetSpec{{Bridge: "br0"}} }, nil},
		{"bridge of another network", "nets[0].bridge", func(s *vm.Spec) { s.Nets = []vm.NetSpec{{NetworkID: "lab", Bridge: "br0"}} }, func(s *vm.Spec) { s.Nets = []vm.NetSpec{{NetworkID: "lab", Bridge: "br1"}} }, nil},
		{"net mode", "nets[0].mode", func(s *vm.Spec) { s.Nets = []vm.NetSpec{{Mode: "macvtap"}} }, func(s *vm.Spec) { s.Nets = []vm.NetSpec{{Mode: "bridge"}} }, nil},
		{"mac syntax", "nets[0].mac", func(s *vm.Spec) { s.Nets = []vm.NetSpec{{MAC: "02:00:00:00:00"}} }, func(s *vm.Spec) { s.Nets = []vm.NetSpec{{MAC: "02:00:00:00:00:01"}} }, nil},
		{"mac multicast", "nets[0].mac", func(s *vm.Spec) { s.Nets = []vm.NetSpec{{MAC: "01:00:00:00:00:01"}} }, func(s *vm.Spec) { s.Nets = []vm.NetSpec{{MAC: "02:00:00:00:00:01"}} }, nil},
		{"mac duplicate", "nets[1].mac", func(s *vm.Spec) { s.Nets = []vm.NetSpec{{MAC: "02:00:00:00:00:01"}, {MAC: "02:00:00:00:00:01"}} }, func(s *vm.Spec) { s.Nets = []vm.NetSpec{{MAC: "02:00:00:00:00:01"}, {MAC: "02:00:00:00:00:02"}} }, nil},
		{"vlan range", "nets[0].vlan_tag", func(s *vm.Spec) { s.Nets = []vm.NetSpec{{VLANTag: ptr[uint32](4095)}} }, func(s *vm.Spec) { s.Nets = []vm.NetSpec{{VLANTag: ptr[uint32](4094)}} }, nil},
		{"mtu maximum", "nets[0].mtu", func(s *vm.Spec) { s.Nets = []vm.NetSpec{{MTU: ptr[uint32](65522)}} }, func(s *vm.Spec) { s.Nets = []vm.NetSpec{{MTU: ptr[uint32](65521)}} }, nil},
		{"mtu range", "nets[0].mtu", func(s *vm.Spec) { s.Nets = []vm.NetSpec{{MTU: ptr[uint32](1279)}} }, func(s *vm.Spec) { s.Nets = []vm.NetSpec{{MTU: ptr[uint32](1280)}} }, nil},
		{"allowed_ips syntax", "nets[0].allowed_ips[0]", func(s *vm.Spec) { s.Nets = []vm.NetSpec{{AllowedIPs: []string{"10.0.0.0/33"}}} }, func(s *vm.Spec) { s.Nets = []vm.NetSpec{{AllowedIPs: []string{"10.0.0.0/32", "fd00::9"}}} }, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			host := svc
			env := e
			if tt.host != nil {
				host, env = tt.host, noNested
			}
			spec := baseSpec(env)
			tt.reject(&spec)
			err := host.ValidateSpec(&spec)
			var fe *vm.FieldError
			if !errors.As(err, &fe) {
				t.Fatalf("rejected case: ValidateSpec = %v, want a *FieldError on %s", err, tt.field)
			}
			if fe.Field != tt.field {
				t.Errorf("rejected case: field = %q (%v), want %q", fe.Field, fe, tt.field)
			}
			spec = baseSpec(env)
			tt.accept(&spec)
			if err := host.ValidateSpec(&spec); err != nil {
				t.Errorf("accepted boundary: ValidateSpec = %v, want nil", err)
			}
		})
	}
}

// writeOverlay writes a minimal qcow2 v3 header with a backing file name.
func writeOverlay(t *testing.T, path, backing string) {
	t.Helper()
	if err := qcow2.Create(path, 1<<30); err != nil {
		t.Fatal(err)
	}
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	// backing_file_offset (8..16) and backing_file_size (16..20), name at 512.
	hdr := make([]byte, 12)
	hdr[6], hdr[7] = 0x02, 0x00 // offset 512
	hdr[11] = byte(len(backing))
	if _, err := f.WriteAt(hdr, 8); err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt([]byte(backing), 512); err != nil {
		t.Fatal(err)
	}
}

// TestValidateCloudInitMatchesSeed: a cloud_init value validation accepts
// is one the seed renders, and one the seed refuses is 400 at create, not a
// 500 STORAGE_ERROR when the seed is written. Every C0 and C1 control,
// DEL, U+2028 and U+2029 is tried in the ssh key, the password and the
// instance id, with printable neighbours for the accepted side.
func TestValidateCloudInitMatchesSeed(t *testing.T) {
	e := vmtest.NewEnv(t)
	svc := e.Service(t)
	var runes []rune
	for r := rune(0); r <= 0xa0; r++ {
		runes = append(runes, r)
	}
	runes = append(runes, 0x2027, 0x2028, 0x2029, 0x202a, 0xfeff)
	for _, r := range runes {
		for _, c := range []struct {
			field string
			set   func(*vm.CloudInitSpec, string)
			seed  func(*seed.Config, string)
		}{
			{"cloud_init.ssh_authorized_keys[0]", func(ci *vm.CloudInitSpec, v string) { ci.SSHAuthorizedKeys = []string{v} }, func(c *seed.Config, v string) { c.SSHAuthorizedKeys = []string{v} }},
			{"cloud_init.password", func(ci *vm.CloudInitSpec, v string) { ci.Password = vm.Secret(v) }, func(c *seed.Config, v string) { c.Password = v }},
			{"cloud_init.instance_id", func(ci *vm.CloudInitSpec, v string) { ci.InstanceID = ptr(v) }, func(c *seed.Config, v string) { c.InstanceID = v }},
		} {
			v := "ssh-ed25519" + string(r) + "AAAA"
			spec := baseSpec(e)
			spec.CloudInit = &vm.CloudInitSpec{}
			c.set(spec.CloudInit, v)
			verr := svc.ValidateSpec(&spec)
			id := spec.CloudInit.Identity("v1")
			sc := seed.Config{InstanceID: id.InstanceID, Hostname: id.Hostname, User: id.User}
			c.seed(&sc, v)
			_, rerr := seed.Render(sc)
			if r == 'x' && (verr != nil || rerr != nil) {
				t.Errorf("%s with a plain letter: ValidateSpec = %v, seed = %v; want both to accept", c.field, verr, rerr)
			}
			if rerr != nil && verr == nil {
				t.Errorf("%s with %U: validation accepts what the seed refuses (%v)", c.field, r, rerr)
			}
			var fe *vm.FieldError
			if verr != nil && (!errors.As(verr, &fe) || fe.Field != c.field) {
				t.Errorf("%s with %U: ValidateSpec = %v, want a FieldError on the field", c.field, r, verr)
			}
			if verr != nil && strings.ContainsRune(verr.Error(), r) && c.field == "cloud_init.password" {
				t.Errorf("password error %q tells the character", verr)
			}
		}
	}
}

// TestValidateHostPaths: kernel_path, firmware_path and disk.base_path
// must resolve, symlinks followed, under one of host_path_roots, and never
// under the agent's state or run directory, roots or not (400 naming the
// field).
func TestValidateHostPaths(t *testing.T) {
	e := vmtest.NewEnv(t)
	top := filepath.Dir(e.StateDir) // holds state/, run/ and boot/
	outside := t.TempDir()
	write := func(path string, qcow bool) string {
		t.Helper()
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			t.Fatal(err)
		}
		var err error
		if qcow {
			err = qcow2.Create(path, 1<<30)
		} else {
			err = os.WriteFile(path, []byte("k"), 0o644)
		}
		if err != nil {
			t.Fatal(err)
		}
		return path
	}
	link := func(target, path string) string {
		t.Helper()
		if err := os.Symlink(target, path); err != nil {
			t.Fatal(err)
		}
		return path
	}
	outKernel := write(filepath.Join(outside, "vmlinux"), false)
	outBase := write(filepath.Join(outside, "base.qcow2"), true)
	liveDisk := write(filepath.Join(e.StateDir, "vms", "other", "root.qcow2"), true) // another VM's disk
	runFile := write(filepath.Join(e.RunDir, "vms", "other", "fw.bin"), false)
	bootDir := filepath.Dir(e.Kernel)
	linkOut := link(outKernel, filepath.Join(bootDir, "to-outside"))
	linkIn := link(e.Kernel, filepath.Join(outside, "to-boot"))
	linkLive := link(liveDisk, filepath.Join(bootDir, "to-live.qcow2"))
	realRoot := t.TempDir()
	rootKernel := write(filepath.Join(realRoot, "vmlinux"), false)
	rootLink := link(realRoot, filepath.Join(outside, "root-link"))

	roots := []string{bootDir, rootLink}
	type mut = func(*vm.Spec)
	kernel := func(p string) mut { return func(s *vm.Spec) { s.KernelPath = &p } }
	firmware := func(p string) mut { return func(s *vm.Spec) { s.KernelPath, s.FirmwarePath = nil, &p } }
	base := func(p string) mut { return func(s *vm.Spec) { s.Disk.BasePath = p } }
	for _, c := range []struct {
		name  string
		roots []string
		set   mut
		field string // "" = accepted
		msg   string
	}{
		{"kernel under a root", roots, kernel(e.Kernel), "", ""},
		{"kernel outside the roots", roots, kernel(outKernel), "kernel_path", "host_path_roots"},
		{"symlink in a root to outside", roots, kernel(linkOut), "kernel_path", "host_path_roots"},
		{"symlink outside to a root", roots, kernel(linkIn), "", ""},
		{"root that is a symlink", roots, kernel(rootKernel), "", ""},
		{"/etc/passwd", roots, kernel("/etc/passwd"), "kernel_path", "host_path_roots"},
		{"firmware outside the roots", roots, firmware(outKernel), "firmware_path", "host_path_roots"},
		{"base outside the roots", roots, base(outBase), "disk.base_path", "host_path_roots"},
		{"base: another VM's live disk", []string{top}, base(liveDisk), "disk.base_path", "state or run directory"},
		{"base: symlink to a live disk", roots, base(linkLive), "disk.base_path", "state or run directory"},
		{"firmware in the run directory", []string{top}, firmware(runFile), "firmware_path", "state or run directory"},
		{"no roots: anywhere", nil, kernel(outKernel), "", ""},
		{"no roots: base anywhere", nil, base(outBase), "", ""},
		{"no roots: never the state directory", nil, base(liveDisk), "disk.base_path", "state or run directory"},
		{"no roots: never the run directory", nil, kernel(runFile), "kernel_path", "state or run directory"},
	} {
		t.Run(c.name, func(t *testing.T) {
			e.Config.HostPathRoots = c.roots
			svc := e.Service(t)
			spec := baseSpec(e)
			c.set(&spec)
			err := svc.ValidateSpec(&spec)
			if c.field == "" {
				if err != nil {
					t.Errorf("ValidateSpec = %v, want nil", err)
				}
				return
			}
			var fe *vm.FieldError
			if !errors.As(err, &fe) || fe.Field != c.field || !strings.Contains(fe.Msg, c.msg) {
				t.Errorf("ValidateSpec = %v, want a FieldError on %s saying %q", err, c.field, c.msg)
			}
		})
	}
	// The defaults (docs/operating.md) refuse what the probes used.
	e.Config.HostPathRoots = config.Default().HostPathRoots
	svc := e.Service(t)
	for _, p := range []string{"/etc/shadow", "/etc/passwd", "/proc/self/environ"} {
		spec := baseSpec(e)
		spec.KernelPath = &p
		var fe *vm.FieldError
		if err := svc.ValidateSpec(&spec); !errors.As(err, &fe) || fe.Field != "kernel_path" {
			t.Errorf("kernel_path %s with the default roots: ValidateSpec = %v, want 400 on kernel_path", p, err)
		}
	}
}
