package vm

import (
	"encoding/binary"
	"strconv"
	"sync"
	"time"
	"unicode/utf8"
)

// AppendJSON appends the JSON encoding of v to b: the same bytes as
// encoding/json (with HTML escaping off) gives for v, without reflection.
// GET /api/vms/{id} is the hot read of the agent; TestAppendJSONMatches
// keeps the two encodings identical. View deliberately has no MarshalJSON,
// since the AppVM view embeds it and would lose its own fields.
func (v *View) AppendJSON(b []byte) []byte {
	b = append(b, `{"id":`...)
	b = appendString(b, v.ID)
	b = append(b, `,"state":`...)
	b = appendString(b, string(v.State))
	b = append(b, `,"display_state":`...)
	b = appendString(b, v.DisplayState)
	b = append(b, `,"vcpus":`...)
	b = strconv.AppendUint(b, uint64(v.Vcpus), 10)
	b = append(b, `,"memory_mb":`...)
	b = strconv.AppendUint(b, v.MemoryMB, 10)
	b = append(b, `,"kernel_path":`...)
	b = appendNullable(b, v.KernelPath)
	b = append(b, `,"firmware_path":`...)
	b = appendNullable(b, v.FirmwarePath)
	b = append(b, `,"disk_path":`...)
	b = appendString(b, v.DiskPath)
	b = append(b, `,"volumes":`...)
	if v.Volumes == nil {
		b = append(b, "null"...)
	} else {
		b = append(b, '[')
		for i := range v.Volumes {
			if i > 0 {
				b = append(b, ',')
			}
			b = v.Volumes[i].appendJSON(b)
			if v.holes != nil { // EncodeView: disk_bytes goes before the '}'
				*v.holes = append(*v.holes, len(b)-1)
			}
		}
		b = append(b, ']')
	}
	if d := v.SeedDisk; d != nil {
		b = append(b, `,"seed_disk":{"device":`...)
		b = appendString(b, d.Device)
		b = append(b, `,"size_bytes":`...)
		b = strconv.AppendUint(b, d.SizeBytes, 10)
		b = append(b, '}')
	}
	b = append(b, `,"cmdline":`...)
	b = appendString(b, v.Cmdline)
	b = append(b, `,"console_socket_path":`...)
	b = appendString(b, v.ConsoleSocketPath)
	if f := v.FailureReason; f != nil {
		b = append(b, `,"failure_reason":`...)
		b = f.appendJSON(b)
	}
	if v.PID != 0 {
		b = append(b, `,"pid":`...)
		b = strconv.AppendInt(b, int64(v.PID), 10)
	}
	b = append(b, `,"nets":`...)
	if v.Nets == nil {
		b = append(b, "null"...)
	} else {
		b = append(b, '[')
		for i := range v.Nets {
			if i > 0 {
				b = append(b, ',')
			}
			b = v.Nets[i].appendJSON(b)
		}
		b = append(b, ']')
	}
	if p := v.Platform; p != nil {
		b = append(b, `,"platform":{`...)
		if p.SerialNumber != "" {
			b = append(b, `"serial_number":`...)
			b = appendString(b, p.SerialNumber)
		}
		b = append(b, '}')
	}
	if d := v.Disk; d != nil {
		b = append(b, `,"disk":{"mode":`...)
		b = appendString(b, d.Mode)
		b = append(b, `,"base_path":`...)
		b = appendString(b, d.BasePath)
		b = append(b, `,"virtual_size_bytes":`...)
		b = strconv.AppendUint(b, d.VirtualSizeBytes, 10)
		b = append(b, `,"owned":`...)
		b = strconv.AppendBool(b, d.Owned)
		if d.ImageFmt != "" {
			b = append(b, `,"image_fmt":`...)
			b = appendString(b, d.ImageFmt)
		}
		if d.QSDPid != 0 {
			b = append(b, `,"qsd_pid":`...)
			b = strconv.AppendInt(b, int64(d.QSDPid), 10)
		}
		if d.QSDStartTime != 0 {
			b = append(b, `,"qsd_start_time":`...)
			b = strconv.AppendUint(b, d.QSDStartTime, 10)
		}
		b = appendOptString(b, "qsd_blk_socket", d.QSDBlkSocket)
		b = appendOptString(b, "qsd_qmp_socket", d.QSDQMPSocket)
		if r := d.Runtime; r != nil {
			b = append(b, `,"runtime":{"backend":`...)
			b = appendString(b, r.Backend)
			b = append(b, `,"pid":`...)
			b = strconv.AppendInt(b, int64(r.Pid), 10)
			b = append(b, `,"start_time":`...)
			b = strconv.AppendUint(b, r.StartTime, 10)
			b = append(b, `,"blk_socket":`...)
			b = appendString(b, r.BlkSocket)
			b = append(b, `,"qmp_socket":`...)
			b = appendString(b, r.QMPSocket)
			b = append(b, '}')
		}
		b = append(b, '}')
	}
	if im := v.Image; im != nil {
		b = append(b, `,"image":{"image_id":`...)
		b = appendString(b, im.ImageID)
		b = appendOptString(b, "distro", im.Distro)
		b = appendOptString(b, "version", im.Version)
		b = append(b, '}')
	}
	if c := v.CloudInit; c != nil {
		b = append(b, `,"cloud_init":{"hostname":`...)
		b = appendString(b, c.Hostname)
		b = append(b, `,"user":`...)
		b = appendString(b, c.User)
		b = append(b, `,"ssh_authorized_keys":`...)
		b = appendStrings(b, c.SSHAuthorizedKeys)
		if n := c.Network; n != nil {
			b = append(b, `,"network":{"ipv4":`...)
			b = appendCloudInitIP(b, n.IPv4)
			if n.IPv6 != nil {
				b = append(b, `,"ipv6":`...)
				b = appendCloudInitIP(b, n.IPv6)
			}
			b = append(b, '}')
		}
		b = append(b, `,"instance_id":`...)
		b = appendString(b, c.InstanceID)
		b = append(b, `,"console_autologin":`...)
		b = strconv.AppendBool(b, c.ConsoleAutologin)
		b = append(b, `,"sudo":`...)
		b = strconv.AppendBool(b, c.Sudo)
		b = append(b, '}')
	}
	if l := v.IOLimit; l != nil {
		b = append(b, `,"io_limit":{`...)
		sep := false
		if l.BpsTotal != 0 {
			b = append(b, `"bps_total":`...)
			b = strconv.AppendUint(b, l.BpsTotal, 10)
			sep = true
		}
		if l.IopsTotal != 0 {
			if sep {
				b = append(b, ',')
			}
			b = append(b, `"iops_total":`...)
			b = strconv.AppendUint(b, l.IopsTotal, 10)
		}
		b = append(b, '}')
	}
	if v.Nested != nil {
		b = append(b, `,"nested":`...)
		b = strconv.AppendBool(b, *v.Nested)
	}
	if len(v.CPUAffinity) > 0 {
		b = append(b, `,"cpu_affinity":[`...)
		for i, c := range v.CPUAffinity {
			if i > 0 {
				b = append(b, ',')
			}
			b = strconv.AppendInt(b, int64(c), 10)
		}
		b = append(b, ']')
	}
	if t := v.CPUTopology; t != nil {
		b = append(b, `,"cpu_topology":{"sockets":`...)
		b = strconv.AppendUint(b, uint64(t.Sockets), 10)
		b = append(b, `,"cores":`...)
		b = strconv.AppendUint(b, uint64(t.Cores), 10)
		b = append(b, `,"threads":`...)
		b = strconv.AppendUint(b, uint64(t.Threads), 10)
		b = append(b, '}')
	}
	b = append(b, `,"pci_devices":`...)
	b = appendStrings(b, v.PCIDevices)
	if v.BalloonMB != 0 {
		b = append(b, `,"balloon_mb":`...)
		b = strconv.AppendUint(b, v.BalloonMB, 10)
	}
	if v.CreatedAt != nil {
		b = append(b, `,"created_at":`...)
		b = appendTime(b, *v.CreatedAt)
	}
	b = appendOptString(b, "discovered_ipv4", v.DiscoveredIPv4)
	if v.GuestPanickedAt != nil {
		b = append(b, `,"guest_panicked_at":`...)
		b = appendTime(b, *v.GuestPanickedAt)
	}
	if v.ShuttingDown {
		b = append(b, `,"shutting_down":true`...)
	}
	b = append(b, `,"mode":`...)
	b = appendString(b, string(v.Mode))
	return append(b, '}')
}

func (vv *VolumeView) appendJSON(b []byte) []byte {
	b = append(b, `{"id":`...)
	b = appendString(b, vv.ID)
	b = append(b, `,"path":`...)
	b = appendString(b, vv.Path)
	b = append(b, `,"virtual_size_bytes":`...)
	b = strconv.AppendUint(b, vv.VirtualSizeBytes, 10)
	b = append(b, `,"fmt":`...)
	b = appendString(b, vv.Fmt)
	b = append(b, `,"readonly":`...)
	b = strconv.AppendBool(b, vv.Readonly)
	b = append(b, `,"owned":`...)
	b = strconv.AppendBool(b, vv.Owned)
	b = appendOptString(b, "volume_id", vv.VolumeID)
	b = append(b, `,"device":`...)
	b = appendString(b, vv.Device)
	if vv.DiskBytes != nil {
		b = append(b, `,"disk_bytes":`...)
		b = strconv.AppendUint(b, *vv.DiskBytes, 10)
	}
	return append(b, '}')
}

func (f *FailureReason) appendJSON(b []byte) []byte {
	b = append(b, `{"detected_at":`...)
	b = appendTime(b, f.DetectedAt)
	b = append(b, `,"summary":`...)
	b = appendString(b, f.Summary)
	d := &f.Detail
	b = append(b, `,"detail":{"kind":`...)
	b = appendString(b, d.Kind)
	appendOptInt := func(b []byte, name string, p *int) []byte {
		if p == nil {
			return b
		}
		b = append(b, `,"`...)
		b = append(b, name...)
		b = append(b, `":`...)
		return strconv.AppendInt(b, int64(*p), 10)
	}
	b = appendOptInt(b, "code", d.Code)
	b = appendOptInt(b, "signum", d.Signum)
	b = appendOptString(b, "path", d.Path)
	b = appendOptString(b, "id", d.ID)
	b = appendOptInt(b, "seconds", d.Seconds)
	b = append(b, `},"cause":`...)
	b = appendString(b, f.Cause)
	return append(b, '}')
}

func (n *NetView) appendJSON(b []byte) []byte {
	b = append(b, `{"mode":`...)
	b = appendString(b, n.Mode)
	b = append(b, `,"bridge":`...)
	b = appendString(b, n.Bridge)
	b = append(b, `,"tap_name":`...)
	b = appendString(b, n.TapName)
	b = append(b, `,"mac":`...)
	b = appendString(b, n.MAC)
	b = appendOptString(b, "network_id", n.NetworkID)
	if n.VLANTag != nil {
		b = append(b, `,"vlan_tag":`...)
		b = strconv.AppendUint(b, uint64(*n.VLANTag), 10)
	}
	if n.IPv4 != nil {
		b = append(b, `,"ipv4":`...)
		b = appendNetIP(b, n.IPv4)
	}
	if n.IPv6 != nil {
		b = append(b, `,"ipv6":`...)
		b = appendNetIP(b, n.IPv6)
	}
	if n.MTU != 0 {
		b = append(b, `,"mtu":`...)
		b = strconv.AppendUint(b, uint64(n.MTU), 10)
	}
	if n.Isolated != nil {
		b = append(b, `,"isolated":`...)
		b = strconv.AppendBool(b, *n.Isolated)
	}
	if n.SpoofGuard != nil {
		b = append(b, `,"spoof_guard":`...)
		b = strconv.AppendBool(b, *n.SpoofGuard)
	}
	if n.RateLimitMbps != nil {
		b = append(b, `,"rate_limit_mbps":`...)
		b = strconv.AppendUint(b, uint64(*n.RateLimitMbps), 10)
	}
	if len(n.AllowedIPs) > 0 {
		b = append(b, `,"allowed_ips":`...)
		b = appendStrings(b, n.AllowedIPs)
	}
	b = appendOptString(b, "dhcp_snooped_ipv4", n.DHCPSnoopedIPv4)
	b = appendOptString(b, "last_observed_ipv4", n.LastObservedIPv4)
	return append(b, '}')
}

func appendNetIP(b []byte, ip *NetIPSpec) []byte {
	b = append(b, `{"address":`...)
	b = appendString(b, ip.Address)
	b = appendOptString(b, "gateway", ip.Gateway)
	if len(ip.DNSServers) > 0 {
		b = append(b, `,"dns_servers":`...)
		b = appendStrings(b, ip.DNSServers)
	}
	return append(b, '}')
}

func appendCloudInitIP(b []byte, ip *CloudInitIP) []byte {
	if ip == nil {
		return append(b, "null"...)
	}
	b = append(b, `{"address":`...)
	b = appendString(b, ip.Address)
	b = appendOptString(b, "gateway", ip.Gateway)
	if len(ip.DNS) > 0 {
		b = append(b, `,"dns":`...)
		b = appendStrings(b, ip.DNS)
	}
	return append(b, '}')
}

func appendNullable(b []byte, s *string) []byte {
	if s == nil {
		return append(b, "null"...)
	}
	return appendString(b, *s)
}

// appendOptString appends ,"name":"s" unless s is empty (omitempty).
func appendOptString(b []byte, name, s string) []byte {
	if s == "" {
		return b
	}
	b = append(b, `,"`...)
	b = append(b, name...)
	b = append(b, `":`...)
	return appendString(b, s)
}

func appendStrings(b []byte, ss []string) []byte {
	if ss == nil {
		return append(b, "null"...)
	}
	b = append(b, '[')
	for i, s := range ss {
		if i > 0 {
			b = append(b, ',')
		}
		b = appendString(b, s)
	}
	return append(b, ']')
}

func appendTime(b []byte, t time.Time) []byte {
	b = append(b, '"')
	b = t.AppendFormat(b, time.RFC3339Nano)
	return append(b, '"')
}

const hexDigits = "0123456789abcdef"

// plain marks the bytes a JSON string holds unescaped: printable ASCII but
// '"' and '\\'. Everything else takes appendString's slow path.
var plain = func() (t [256]bool) {
	for c := 0x20; c < utf8.RuneSelf; c++ {
		t[c] = c != '"' && c != '\\'
	}
	return t
}()

// appendString appends s as a JSON string the way encoding/json does with
// HTML escaping off: \" \\ \b \f \n \r \t, other control characters as
// \u00XX, U+2028 and U+2029 escaped, invalid UTF-8 as \ufffd.
func appendString(b []byte, s string) []byte {
	b = append(b, '"')
	i := 0
	// Eight bytes at a time while none needs escaping (SWAR): a byte
	// below 0x20, '"', '\\' or one with the high bit set stops the scan.
	for ; i+8 <= len(s); i += 8 {
		w := binary.LittleEndian.Uint64([]byte(s[i : i+8]))
		const ones, highs = 0x0101010101010101, 0x8080808080808080
		lt20 := (w - 0x20*ones) & ^w
		quote := w ^ ('"' * ones)
		bslash := w ^ ('\\' * ones)
		if (lt20|(quote-ones)&^quote|(bslash-ones)&^bslash|w)&highs != 0 {
			break
		}
	}
	for i < len(s) && plain[s[i]] {
		i++
	}
	if i == len(s) {
		b = append(b, s...)
		return append(b, '"')
	}
	start := 0
	for i < len(s) {
		c := s[i]
		if plain[c] {
			i++
			continue
		}
		if c < utf8.RuneSelf {
			b = append(b, s[start:i]...)
			switch c {
			case '"', '\\':
				b = append(b, '\\', c)
			case '\b':
				b = append(b, '\\', 'b')
			case '\f':
				b = append(b, '\\', 'f')
			case '\n':
				b = append(b, '\\', 'n')
			case '\r':
				b = append(b, '\\', 'r')
			case '\t':
				b = append(b, '\\', 't')
			default:
				b = append(b, '\\', 'u', '0', '0', hexDigits[c>>4], hexDigits[c&0xf])
			}
			i++
			start = i
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && size == 1 {
			b = append(b, s[start:i]...)
			b = append(b, `\ufffd`...)
			i += size
			start = i
			continue
		}
		if r == '\u2028' || r == '\u2029' {
			b = append(b, s[start:i]...)
			b = append(b, '\\', 'u', '2', '0', '2', hexDigits[r&0xf])
			i += size
			start = i
			continue
		}
		i += size
	}
	b = append(b, s[start:]...)
	return append(b, '"')
}

// diskUsageMaxAge bounds how stale a reported disk_bytes may be: the
// single-VM read stats each volume at most once per this interval, since
// a stat per volume per read dominated the read's cost.
const diskUsageMaxAge = time.Second

type usageEntry struct {
	bytes uint64
	ok    bool
	at    time.Time
}

// diskUsage caches allocatedBytes per path for diskUsageMaxAge.
type diskUsage struct {
	mu sync.Mutex
	m  map[string]usageEntry
}

func (d *diskUsage) get(path string) (uint64, bool) {
	now := time.Now()
	d.mu.Lock()
	e, hit := d.m[path]
	d.mu.Unlock()
	if !hit || now.Sub(e.at) > diskUsageMaxAge {
		p := allocatedBytes(path)
		if p == nil {
			return 0, false // not cached: the file may appear any moment
		}
		e = usageEntry{bytes: *p, ok: true, at: now}
		d.mu.Lock()
		if d.m == nil || len(d.m) > 1<<16 {
			d.m = map[string]usageEntry{} // bound the cache; VMs come and go
		}
		d.m[path] = e
		d.mu.Unlock()
	}
	return e.bytes, e.ok
}
