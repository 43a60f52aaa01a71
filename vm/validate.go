package vm

import (
	"errors"
	"fmt"
	"io/fs"
	"net"
	"net/netip"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"unicode/utf8"

	"vmhost/config"
	"vmhost/qcow2"
	"vmhost/seed"
	"vmhost/store"
)

func bad(field, format string, args ...any) *FieldError {
	return &FieldError{Field: field, Msg: fmt.Sprintf(format, args...)}
}

// CheckMountpoint applies the rule of an AppVM volume's mountpoint (at
// create and at attach): an absolute path of at most MaxMountpoint
// characters, not the root, without control characters, empty, "." or
// ".." segments.
func CheckMountpoint(p string) error {
	switch {
	case utf8.RuneCountInString(p) > MaxMountpoint:
		return fmt.Errorf("longer than %d characters", MaxMountpoint)
	case strings.ContainsFunc(p, func(r rune) bool { return r < 0x20 || r == 0x7f }):
		return errors.New("contains NUL or a control character")
	case !strings.HasPrefix(p, "/"):
		return errors.New("must be an absolute path")
	case p == "/":
		return errors.New("must not be /")
	}
	for seg := range strings.SplitSeq(p[1:], "/") {
		switch seg {
		case "":
			return errors.New("contains an empty path segment")
		case ".", "..":
			return fmt.Errorf("contains a %q segment", seg)
		}
	}
	return nil
}

// Limits of docs/api.md (its tables of fields) and of the hypervisor.
const (
	MinMemoryMB    = 64
	MaxVcpus       = 254 // Cloud Hypervisor's x86_64 limit
	MaxSizeGiB     = 65535
	MaxSerialBytes = 512

	MaxRateMbps = 100000

	// MaxVolumes is how many data volumes a classic create may ask for:
	// each is a disk (and a QSD export) on the hypervisor's command line,
	// and thousands overflow it ("argument list too long").
	MaxVolumes = 16

	// MaxMountpoint is the longest mountpoint of an AppVM's volume, in
	// characters.
	MaxMountpoint = 256

	maxCmdlineBytes = 4096
	maxUserBytes    = 32
	maxInstanceID   = 128
)

var (
	hostnamePattern = regexp.MustCompile(`^[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?$`)
	userPattern     = regexp.MustCompile(`^[a-z_][a-z0-9_-]*$`)
	sha256Pattern   = regexp.MustCompile(`^[0-9a-f]{64}$`)
)

// checked is what validation learned from the host for a classic spec.
type checked struct {
	base *BaseImage // nil with an image: the download provides it
}

// validateSpec checks every rule of docs/api.md (POST /api/vms) that goes beyond
// types, including host preconditions read through facts. It returns a
// *FieldError for the first rule broken, in field order.
func validateSpec(s *Spec, cfg *config.Config, facts HostFacts, layout Layout) (*checked, error) {
	paths := hostPaths{roots: cfg.HostPathRoots, refused: []string{layout.StateDir, layout.RunDir}}
	var c checked
	if s.VMID != "" && !store.ValidID(s.VMID) {
		return nil, bad("vm_id", "must match ^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
	}
	if err := checkCPUMemory(s.Vcpus, s.MemoryMB); err != nil {
		return nil, err
	}
	if err := CheckLabels(s.Labels); err != nil {
		return nil, err
	}
	switch {
	case s.KernelPath != nil && s.FirmwarePath != nil:
		return nil, bad("kernel_path", "exactly one of kernel_path and firmware_path is required, both are given")
	case s.KernelPath == nil && s.FirmwarePath == nil:
		return nil, bad("kernel_path", "exactly one of kernel_path and firmware_path is required, neither is given")
	case s.KernelPath != nil:
		if err := checkHostFile("kernel_path", *s.KernelPath, paths); err != nil {
			return nil, err
		}
	default:
		if err := checkHostFile("firmware_path", *s.FirmwarePath, paths); err != nil {
			return nil, err
		}
	}
	if s.Image != nil {
		if err := checkImage(s.Image); err != nil {
			return nil, err
		}
	}
	switch {
	case s.FromSnapshot != "" && s.Disk != nil:
		return nil, bad("disk", "not with from_snapshot: the VM's disks are copies of the snapshot's")
	case s.FromSnapshot != "" && s.Image != nil:
		return nil, bad("image", "not with from_snapshot: the VM's disks are copies of the snapshot's")
	case s.FromSnapshot != "" && len(s.Volumes) > 0:
		return nil, bad("volumes", "not with from_snapshot: the VM gets copies of the snapshot's volumes (attach more later)")
	case s.FromSnapshot != "" && !store.ValidID(s.FromSnapshot):
		return nil, bad("from_snapshot", "must match ^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
	case s.FromSnapshot != "":
	case s.Disk == nil && s.Image == nil:
		return nil, bad("disk", "required unless image or from_snapshot is given")
	case s.Disk != nil:
		base, err := checkDisk(s.Disk, s.Image != nil, paths)
		if err != nil {
			return nil, err
		}
		c.base = base
	}
	if len(s.Volumes) > MaxVolumes {
		return nil, bad("volumes", "at most %d volumes, got %d", MaxVolumes, len(s.Volumes))
	}
	for i, v := range s.Volumes {
		if v.SizeGiB < 1 || v.SizeGiB > MaxSizeGiB {
			return nil, bad(fmt.Sprintf("volumes[%d].size_gib", i), "must be 1..%d, got %d", MaxSizeGiB, v.SizeGiB)
		}
	}
	if s.Cmdline != nil {
		if len(*s.Cmdline) > maxCmdlineBytes {
			return nil, bad("cmdline", "longer than %d bytes", maxCmdlineBytes)
		}
		if hasControl(*s.Cmdline) {
			return nil, bad("cmdline", "contains a control character")
		}
	}
	if err := checkNets(s.Nets, s.CloudInit, cfg, facts); err != nil {
		return nil, err
	}
	if err := checkPCISlots(s, "nets"); err != nil {
		return nil, err
	}
	if err := CheckIOLimits(s.DiskBpsTotal, s.DiskIopsTotal); err != nil {
		return nil, err
	}
	if s.Platform != nil {
		sn := s.Platform.SerialNumber
		if len(sn) > MaxSerialBytes {
			return nil, bad("platform.serial_number", "longer than %d bytes", MaxSerialBytes)
		}
		if hasControl(sn) {
			return nil, bad("platform.serial_number", "contains a control character, NUL, newline or carriage return")
		}
	}
	if s.CloudInit != nil {
		if err := checkCloudInit(s.CloudInit); err != nil {
			return nil, err
		}
	}
	if s.Nested != nil && *s.Nested && !facts.NestedSupported() {
		return nil, bad("nested", "this host does not support nested virtualization")
	}
	if s.CPUAffinity != nil {
		if err := checkAffinity(*s.CPUAffinity, facts); err != nil {
			return nil, err
		}
	}
	if t := s.CPUTopology; t != nil {
		if t.Sockets < 1 || t.Cores < 1 || t.Threads < 1 {
			return nil, bad("cpu_topology", "sockets, cores and threads must each be at least 1")
		}
		if t.Threads > MaxThreadsPerCore {
			return nil, bad("cpu_topology", "threads must be 1..%d (Cloud Hypervisor's x86_64 limit), got %d", MaxThreadsPerCore, t.Threads)
		}
		if uint64(t.Sockets)*uint64(t.Cores)*uint64(t.Threads) != uint64(s.Vcpus) {
			return nil, bad("cpu_topology", "sockets x cores x threads = %d x %d x %d must equal vcpus (%d)", t.Sockets, t.Cores, t.Threads, s.Vcpus)
		}
	}
	if err := checkPCI(s.PCIDevices, facts); err != nil {
		return nil, err
	}
	return &c, nil
}

func checkCPUMemory(vcpus uint32, memoryMB uint64) error {
	if vcpus < 1 || vcpus > MaxVcpus {
		return bad("vcpus", "must be 1..%d, got %d", MaxVcpus, vcpus)
	}
	return CheckMemory(memoryMB)
}

func hasControl(s string) bool {
	return strings.ContainsFunc(s, func(r rune) bool { return r < 0x20 || r == 0x7f })
}

// checkHostFile requires an absolute path to an existing regular file
// that paths allows.
func checkHostFile(field, path string, paths hostPaths) error {
	if !filepath.IsAbs(path) {
		return bad(field, "must be an absolute path")
	}
	st, err := os.Stat(path)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return bad(field, "%s does not exist", path)
	case err != nil:
		return bad(field, "%v", err)
	case !st.Mode().IsRegular():
		return bad(field, "%s is not a regular file", path)
	}
	canon, err := filepath.EvalSymlinks(path)
	if err != nil {
		return bad(field, "%v", err)
	}
	return paths.check(field, path, canon)
}

// hostPaths are the places a create may name host files in (docs/api.md
// §9, host_path_roots): under one of roots (any, when there are none), and
// never under a refused directory (the agent's state and run directories:
// another VM's live disk, a socket, a key file).
type hostPaths struct {
	roots   []string
	refused []string
}

// check tells whether canon, path with its symlinks resolved, is allowed.
// The directories are resolved too, at each check: a root may be a
// symlink, or be created after the agent started.
func (p hostPaths) check(field, path, canon string) error {
	shown := path
	if canon != path {
		shown = fmt.Sprintf("%s (%s)", path, canon)
	}
	for _, dir := range p.refused {
		if within(canon, resolveDir(dir)) {
			return bad(field, "%s is inside the agent's state or run directory", shown)
		}
	}
	if len(p.roots) == 0 {
		return nil
	}
	for _, root := range p.roots {
		if within(canon, resolveDir(root)) {
			return nil
		}
	}
	return bad(field, "%s is not under any of host_path_roots (%s)", shown, strings.Join(p.roots, ", "))
}

// resolveDir is dir with its symlinks resolved, or cleaned when it does
// not exist (nothing can be under it then).
func resolveDir(dir string) string {
	if r, err := filepath.EvalSymlinks(dir); err == nil {
		return r
	}
	return filepath.Clean(dir)
}

// within reports whether path is dir or lies under it; both are clean.
func within(path, dir string) bool {
	return path == dir || strings.HasPrefix(path, strings.TrimSuffix(dir, "/")+"/")
}

// imageIDPattern admits registry image ids: SimpleStreams ones are
// <product>:<version> (com.ubuntu.cloud:server:24.04:amd64:20251101,
// debian:bookworm:amd64:cloud:20251101_05:24). The id is shown, never a
// file name.
var imageIDPattern = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.:+~-]{0,254}$`)

func checkImage(im *ImageSpec) error {
	if !imageIDPattern.MatchString(im.ImageID) {
		return bad("image.image_id", "must match %s", imageIDPattern)
	}
	if !sha256Pattern.MatchString(im.ContentSHA256) {
		return bad("image.content_sha256", "must be 64 lower-case hex digits")
	}
	u, err := url.Parse(im.FetchURL)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return bad("image.fetch_url", "must be an http or https URL")
	}
	return nil
}

// checkDisk validates the disk object and, without an image, the base
// image itself. It returns the canonical base image.
func checkDisk(d *DiskSpec, haveImage bool, paths hostPaths) (*BaseImage, error) {
	if d.Mode != "" && d.Mode != "copy" {
		return nil, bad("disk.mode", "only copy is supported, got %q", d.Mode)
	}
	if d.SizeGiB != nil && (*d.SizeGiB < 1 || *d.SizeGiB > MaxSizeGiB) {
		return nil, bad("disk.size_gib", "must be 1..%d, got %d", MaxSizeGiB, *d.SizeGiB)
	}
	if haveImage {
		if d.BasePath != "" {
			return nil, bad("disk.base_path", "must be omitted when image is given (the image becomes the base)")
		}
		return nil, nil
	}
	if d.BasePath == "" {
		return nil, bad("disk.base_path", "required when image is not given")
	}
	if !filepath.IsAbs(d.BasePath) {
		return nil, bad("disk.base_path", "must be an absolute path")
	}
	canon, err := filepath.EvalSymlinks(d.BasePath)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil, bad("disk.base_path", "%s does not exist", d.BasePath)
		}
		return nil, bad("disk.base_path", "%v", err)
	}
	if st, err := os.Stat(canon); err != nil || !st.Mode().IsRegular() {
		return nil, bad("disk.base_path", "%s is not a regular file", d.BasePath)
	}
	if err := paths.check("disk.base_path", d.BasePath, canon); err != nil {
		return nil, err
	}
	h, err := qcow2.ReadHeaderFile(canon)
	if err != nil {
		return nil, bad("disk.base_path", "%s: %v", d.BasePath, err)
	}
	if err := h.CheckBase(); err != nil {
		return nil, bad("disk.base_path", "%s: %v", d.BasePath, err)
	}
	if d.SizeGiB != nil && uint64(*d.SizeGiB)<<30 < h.Size {
		return nil, bad("disk.size_gib", "%d GiB is below the base image's virtual size of %d bytes", *d.SizeGiB, h.Size)
	}
	return &BaseImage{Path: canon, VirtualSizeBytes: h.Size}, nil
}

func checkNets(nets []NetSpec, ci *CloudInitSpec, cfg *config.Config, facts HostFacts) error {
	if len(nets) > MaxNets {
		return bad("nets", "at most %d interfaces, got %d", MaxNets, len(nets))
	}
	var gw4, gw6 []int
	macs := map[string]int{}
	for i, n := range nets {
		f := func(name string) string { return fmt.Sprintf("nets[%d].%s", i, name) }
		if n.Mode != "" && n.Mode != "bridge" {
			return bad(f("mode"), "only bridge is supported, got %q", n.Mode)
		}
		if n.NetworkID != "" {
			netw, ok := cfg.Network(n.NetworkID)
			if !ok {
				return bad(f("network_id"), "unknown network %q", n.NetworkID)
			}
			if n.Bridge != "" && n.Bridge != netw.Bridge {
				return bad(f("bridge"), "%q is not the bridge of network %q (%q)", n.Bridge, n.NetworkID, netw.Bridge)
			}
		} else if n.Bridge != "" {
			if _, ok := cfg.NetworkByBridge(n.Bridge); !ok && !facts.BridgeExists(n.Bridge) {
				return bad(f("bridge"), "unknown bridge %q", n.Bridge)
			}
		}
		if n.MAC != "" {
			hw, err := net.ParseMAC(n.MAC)
			switch {
			case err != nil || len(hw) != 6:
				return bad(f("mac"), "not a MAC address: %q", n.MAC)
			case hw[0]&1 != 0:
				return bad(f("mac"), "%s is a multicast address", n.MAC)
			case hw.String() == "00:00:00:00:00:00":
				return bad(f("mac"), "the zero address is not allowed")
			}
			if j, dup := macs[hw.String()]; dup {
				return bad(f("mac"), "same MAC as nets[%d]", j)
			}
			macs[hw.String()] = i
		}
		if n.VLANTag != nil && (*n.VLANTag < 1 || *n.VLANTag > 4094) {
			return bad(f("vlan_tag"), "must be 1..4094, got %d", *n.VLANTag)
		}
		if n.IPv4 != nil {
			if err := checkIP(f("ipv4"), n.IPv4.Address, n.IPv4.Gateway, n.IPv4.DNSServers, "dns_servers", false); err != nil {
				return err
			}
			if n.IPv4.Gateway != "" {
				gw4 = append(gw4, i)
			}
		}
		if n.IPv6 != nil {
			if err := checkIP(f("ipv6"), n.IPv6.Address, n.IPv6.Gateway, n.IPv6.DNSServers, "dns_servers", true); err != nil {
				return err
			}
			if n.IPv6.Gateway != "" {
				gw6 = append(gw6, i)
			}
		}
		// Cloud Hypervisor refuses a net MTU below 1280 (the IPv6 minimum);
		// the kernel caps a tap at 65535 less its 14-byte Ethernet header.
		if n.MTU != nil && (*n.MTU < 1280 || *n.MTU > 65521) {
			return bad(f("mtu"), "must be 1280..65521 (Cloud Hypervisor's minimum, a tap's maximum), got %d", *n.MTU)
		}
		if n.RateLimitMbps != nil && (*n.RateLimitMbps < 1 || *n.RateLimitMbps > MaxRateMbps) {
			return bad(f("rate_limit_mbps"), "must be 1..%d, got %d", MaxRateMbps, *n.RateLimitMbps)
		}
		for j, a := range n.AllowedIPs {
			if _, err := netip.ParsePrefix(a); err == nil {
				continue
			}
			if _, err := netip.ParseAddr(a); err != nil {
				return bad(fmt.Sprintf("nets[%d].allowed_ips[%d]", i, j), "not an IP address or CIDR: %q", a)
			}
		}
	}
	// The cloud-init network block configures the first interface.
	if ci != nil && ci.Network != nil {
		if ci.Network.IPv4 != nil && ci.Network.IPv4.Gateway != "" && !slices.Contains(gw4, 0) {
			gw4 = append([]int{0}, gw4...)
		}
		if ci.Network.IPv6 != nil && ci.Network.IPv6.Gateway != "" && !slices.Contains(gw6, 0) {
			gw6 = append([]int{0}, gw6...)
		}
	}
	if len(gw4) > 1 {
		return bad(fmt.Sprintf("nets[%d].ipv4.gateway", gw4[1]), "at most one interface may carry an IPv4 gateway (nets[%d] already does)", gw4[0])
	}
	if len(gw6) > 1 {
		return bad(fmt.Sprintf("nets[%d].ipv6.gateway", gw6[1]), "at most one interface may carry an IPv6 gateway (nets[%d] already does)", gw6[0])
	}
	return nil
}

// checkIP checks one address block: address in CIDR form, gateway without
// a suffix, DNS servers as plain addresses, all of the block's family.
func checkIP(field, address, gateway string, dns []string, dnsName string, v6 bool) error {
	family := "IPv4"
	if v6 {
		family = "IPv6"
	}
	p, err := netip.ParsePrefix(address)
	if err != nil || p.Addr().Is6() != v6 || p.Addr().Is4In6() {
		return bad(field+".address", "must be an %s address in CIDR form (such as %s)", family, map[bool]string{false: "192.0.2.10/24", true: "2001:db8::10/64"}[v6])
	}
	if gateway != "" {
		g, err := netip.ParseAddr(gateway)
		// As the seed renderer requires: no zone, no IPv4-mapped IPv6.
		if err != nil || g.Is6() != v6 || g.Is4In6() || g.Zone() != "" {
			return bad(field+".gateway", "must be an %s address without a prefix length", family)
		}
	}
	for i, d := range dns {
		if a, err := netip.ParseAddr(d); err != nil || a.Zone() != "" {
			return bad(fmt.Sprintf("%s.%s[%d]", field, dnsName, i), "not an IP address without a zone: %q", d)
		}
	}
	return nil
}

// ValidHostname reports whether s is a valid explicit hostname: 1..63
// bytes of letters, digits and '-', not starting or ending with '-'.
func ValidHostname(s string) bool {
	return len(s) <= MaxHostnameBytes && hostnamePattern.MatchString(s)
}

func checkCloudInit(ci *CloudInitSpec) error {
	if ci.Hostname != nil && !ValidHostname(*ci.Hostname) {
		return bad("cloud_init.hostname", "at most %d bytes of letters, digits and -, not starting or ending with -", MaxHostnameBytes)
	}
	if ci.User != nil && (len(*ci.User) > maxUserBytes || !userPattern.MatchString(*ci.User)) {
		return bad("cloud_init.user", "must match ^[a-z_][a-z0-9_-]*$ and be at most %d bytes", maxUserBytes)
	}
	// The seed renderer's own rule for one-line values (it also refuses
	// C1 controls and U+2028/U+2029, which YAML reads as line breaks).
	for i, k := range ci.SSHAuthorizedKeys {
		if strings.TrimSpace(k) == "" || seed.PlainTextProblem(k) != "" {
			return bad(fmt.Sprintf("cloud_init.ssh_authorized_keys[%d]", i), "must be one non-empty line without control characters")
		}
	}
	if seed.PlainTextProblem(ci.Password.Reveal()) != "" {
		// Which character is not said: nothing of a password is told.
		return bad("cloud_init.password", "contains a control character or line separator")
	}
	if n := ci.Network; n != nil {
		if err := checkIP("cloud_init.network.ipv4", n.IPv4.Address, n.IPv4.Gateway, n.IPv4.DNS, "dns", false); err != nil {
			return err
		}
		if n.IPv6 != nil {
			if err := checkIP("cloud_init.network.ipv6", n.IPv6.Address, n.IPv6.Gateway, n.IPv6.DNS, "dns", true); err != nil {
				return err
			}
		}
	}
	if id := ci.InstanceID; id != nil {
		if *id == "" || len(*id) > maxInstanceID || strings.ContainsFunc(*id, func(r rune) bool { return r <= ' ' || r == 0x7f }) || seed.PlainTextProblem(*id) != "" {
			return bad("cloud_init.instance_id", "must be 1..%d bytes without spaces or control characters", maxInstanceID)
		}
	}
	if len(ci.RawUserData) > 0 && string(ci.RawUserData) != "null" {
		return bad("cloud_init.raw_user_data", "reserved; must be null or omitted")
	}
	if len(ci.RawNetworkConfig) > 0 && string(ci.RawNetworkConfig) != "null" {
		return bad("cloud_init.raw_network_config", "reserved; must be null or omitted")
	}
	return nil
}

func checkAffinity(s string, facts HostFacts) error {
	pins, err := ParseCPUSet(s)
	if err != nil {
		return bad("cpu_affinity", "not a cpuset: %v", err)
	}
	online, err := facts.OnlineCPUs()
	if err != nil {
		return bad("cpu_affinity", "cannot check against online CPUs: %v", err)
	}
	for _, c := range pins {
		if _, found := slices.BinarySearch(online, c); !found {
			return bad("cpu_affinity", "CPU %d is not online", c)
		}
	}
	return nil
}

func checkPCI(devs []string, facts HostFacts) error {
	for i, d := range devs {
		f := fmt.Sprintf("pci_devices[%d]", i)
		if !ValidBDF(d) {
			return bad(f, "%q is not a full lower-case BDF such as 0000:01:00.0", d)
		}
		if j := slices.Index(devs, d); j < i {
			return bad(f, "%s is listed twice", d)
		}
		group, members, err := facts.IOMMUGroup(d)
		if errors.Is(err, fs.ErrNotExist) {
			return bad(f, "no PCI device %s on this host", d)
		}
		if err != nil {
			return bad(f, "%v", err)
		}
		for _, m := range members {
			if !slices.Contains(devs, m) {
				return bad(f, "%s shares IOMMU group %s with %s, which must be listed too", d, group, m)
			}
		}
		if err := facts.PassthroughReady(d); err != nil {
			return bad(f, "%s is not ready for passthrough: %v", d, err)
		}
	}
	return nil
}
