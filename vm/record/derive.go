package record

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"

	"vmhost/config"
)

// Pure derivations over records: the effective interface, names of
// devices, volumes, taps and hosts, and CPU sets.

// MaxNets is how many interfaces a VM may have: TapName stays within
// IFNAMSIZ for each.
const MaxNets = 64

// MaxHostnameBytes is the longest hostname (one DNS label).
const MaxHostnameBytes = 63

// NetView is one interface (VmNetwork).
type NetView struct {
	Mode             string     `json:"mode"`
	Bridge           string     `json:"bridge"`
	TapName          string     `json:"tap_name"`
	MAC              string     `json:"mac"`
	NetworkID        string     `json:"network_id,omitempty"`
	VLANTag          *uint32    `json:"vlan_tag,omitempty"`
	IPv4             *NetIPSpec `json:"ipv4,omitempty"`
	IPv6             *NetIPSpec `json:"ipv6,omitempty"`
	MTU              uint32     `json:"mtu,omitempty"`
	Isolated         *bool      `json:"isolated,omitempty"`
	SpoofGuard       *bool      `json:"spoof_guard,omitempty"`
	RateLimitMbps    *uint32    `json:"rate_limit_mbps,omitempty"`
	AllowedIPs       []string   `json:"allowed_ips,omitempty"`
	DHCPSnoopedIPv4  string     `json:"dhcp_snooped_ipv4,omitempty"`
	LastObservedIPv4 string     `json:"last_observed_ipv4,omitempty"`
}

// ResolveNet is the effective interface of nic: the request's values (np,
// nil for the default interface of a cloud-init VM) over its network's
// (explicit, by bridge, or the default network) and the host's defaults.
func ResolveNet(cfg *config.Config, np *NetSpec, nic NIC) NetView {
	var n NetSpec
	if np != nil {
		n = *np
	}
	nv := NetView{
		Mode:          "bridge",
		Bridge:        n.Bridge,
		TapName:       nic.Tap,
		MAC:           nic.MAC,
		NetworkID:     n.NetworkID,
		VLANTag:       n.VLANTag,
		IPv4:          n.IPv4,
		IPv6:          n.IPv6,
		Isolated:      n.Isolated,
		SpoofGuard:    n.SpoofGuard,
		RateLimitMbps: n.RateLimitMbps,
		AllowedIPs:    n.AllowedIPs,
	}
	if n.MTU != nil {
		nv.MTU = *n.MTU
	}
	if nv.NetworkID == "" && nv.Bridge == "" {
		nv.NetworkID = cfg.DefaultNetwork
	}
	if nv.NetworkID == "" {
		if nw, ok := cfg.NetworkByBridge(nv.Bridge); ok {
			nv.NetworkID = nw.ID
		}
	}
	if nw, ok := cfg.Network(nv.NetworkID); ok {
		if nv.Bridge == "" {
			nv.Bridge = nw.Bridge
		}
		if nv.MTU == 0 {
			nv.MTU = uint32(nw.MTU)
		}
	}
	if nv.MTU == 0 && cfg.DefaultMTU > 0 {
		nv.MTU = uint32(cfg.DefaultMTU)
	}
	return nv
}

// DeviceName is the guest block device of disk index i in disk order:
// 0 → /dev/vda, 25 → /dev/vdz, 26 → /dev/vdaa (the kernel's virtio naming).
func DeviceName(i int) string {
	if i >= 0 && i < len(deviceNames) {
		return deviceNames[i]
	}
	return deviceName(i)
}

// VolumeDevice is the guest device of rec's volume i as the next boot
// presents it: vda is the root disk, then the seed when there is one, then
// the volumes in order, a hot attach in progress left out.
func VolumeDevice(rec *Record, i int) string {
	dev := 1
	if rec.Spec.CloudInit != nil {
		dev++
	}
	for _, v := range rec.Spec.Volumes[:i] {
		if v.Pending != PendingAttach {
			dev++
		}
	}
	return DeviceName(dev)
}

func deviceName(i int) string {
	var b []byte
	for i++; i > 0; i = (i - 1) / 26 {
		b = append([]byte{byte('a' + (i-1)%26)}, b...)
	}
	return "/dev/vd" + string(b)
}

// Mount is a data volume as its guest mounts it.
type Mount struct {
	Device     string
	Mountpoint string
	ReadOnly   bool
}

// Mounts are the volumes rec's guest mounts (those with a mountpoint: an
// AppVM's), in disk order, each with the device the next boot presents it
// as; one whose hot attach is still in progress is not mounted yet. It is
// the one rule of where volumes appear in a guest: the guest agent's spec
// and the AppVM view both use it.
func (r *Record) Mounts() []Mount {
	var out []Mount
	for i, v := range r.Spec.Volumes {
		if v.Mounted() && v.Pending != PendingAttach {
			out = append(out, Mount{Device: VolumeDevice(r, i), Mountpoint: v.Mountpoint, ReadOnly: v.Readonly})
		}
	}
	return out
}

// DiscoveredIPv4 is a VM's discovered_ipv4: the first DHCP-snooped
// address of any interface, else the first one the neighbour table showed.
func DiscoveredIPv4(nics []NIC) string {
	for _, n := range nics {
		if n.DHCPSnoopedIPv4 != "" {
			return n.DHCPSnoopedIPv4
		}
	}
	for _, n := range nics {
		if n.LastObservedIPv4 != "" {
			return n.LastObservedIPv4
		}
	}
	return ""
}

// CloudInitIdentity is who a cloud-init VM is to its guest: its hostname,
// the user cloud-init configures and its NoCloud instance-id.
type CloudInitIdentity struct {
	Hostname   string
	User       string
	InstanceID string
}

// Identity is the identity of VM id with ci: each value the request's, or
// its default (the hostname ClassicHostname(id), the user root, the
// instance-id the VM id). It is the one place those defaults are: the view
// shows what the seed is rendered from.
func (ci *CloudInitSpec) Identity(id string) CloudInitIdentity {
	c := CloudInitIdentity{Hostname: ClassicHostname(id), User: "root", InstanceID: id}
	if ci.Hostname != nil {
		c.Hostname = *ci.Hostname
	}
	if ci.User != nil {
		c.User = *ci.User
	}
	if ci.InstanceID != nil {
		c.InstanceID = *ci.InstanceID
	}
	return c
}

// ClassicHostname derives a hostname from a VM id: '_' and '.' become '-',
// the result is cut to 63 bytes and trimmed of '-' at either end ("vm" if
// nothing is left).
func ClassicHostname(id string) string {
	h := strings.Map(func(r rune) rune {
		if r == '_' || r == '.' {
			return '-'
		}
		return r
	}, id)
	if len(h) > MaxHostnameBytes {
		h = h[:MaxHostnameBytes]
	}
	h = strings.Trim(h, "-")
	if h == "" {
		return "vm"
	}
	return h
}

var volumeIDs, deviceNames [32]string

func init() {
	for i := range volumeIDs {
		volumeIDs[i] = "data" + strconv.Itoa(i)
		deviceNames[i] = deviceName(i)
	}
}

// VolumeID is the id of data volume i: "data<i>".
func VolumeID(i int) string {
	if i < len(volumeIDs) {
		return volumeIDs[i]
	}
	return "data" + strconv.Itoa(i)
}

// TapName is the host tap of interface index of a VM: "vmh", 8 hex digits
// of a hash of id and index, then the index: at most 15 bytes (IFNAMSIZ)
// for the MaxNets interfaces a VM may have.
func TapName(id string, index int) string { return AgentTapName("", id, index) }

// AgentTapName is the host tap of interface index of a VM of agent (an
// agentid): TapName with the agent id hashed in, so that agents sharing a
// network namespace name the taps of VMs with the same id apart. An empty
// agent gives TapName, the name of VMs created before agents had ids.
// Taps are named once, at create, and the name is recorded (NIC.Tap).
func AgentTapName(agent, id string, index int) string {
	key := fmt.Sprintf("%s/%d", id, index)
	if agent != "" {
		key = agent + "/" + key
	}
	h := sha256.Sum256([]byte(key))
	return "vmh" + hex.EncodeToString(h[:4]) + strconv.Itoa(index)
}

// ParseCPUSet parses cpuset notation ("0-3,8,10-11") into sorted, distinct
// CPU numbers. Empty input, reversed ranges and CPUs above 8191 are errors.
func ParseCPUSet(s string) ([]int, error) { return AppendCPUSet(nil, s) }

// AppendCPUSet is ParseCPUSet appending to dst (which it sorts and
// compacts together with the new CPUs).
func AppendCPUSet(cpus []int, s string) ([]int, error) {
	if s == "" {
		return nil, errors.New("empty CPU list")
	}
	const maxCPU = 8191
	for rest := s; rest != ""; {
		// A plain loop rather than strings.SplitSeq: views parse the
		// affinity on every read.
		part := rest
		if i := strings.IndexByte(rest, ','); i >= 0 {
			part, rest = rest[:i], rest[i+1:]
			if rest == "" {
				return nil, fmt.Errorf("bad CPU %q in %q", "", s)
			}
		} else {
			rest = ""
		}
		lo, hi, isRange := strings.Cut(part, "-")
		a, err := parseCPU(lo)
		if err != nil {
			return nil, fmt.Errorf("bad CPU %q in %q", lo, s)
		}
		b := a
		if isRange {
			if b, err = parseCPU(hi); err != nil {
				return nil, fmt.Errorf("bad CPU %q in %q", hi, s)
			}
			if b < a {
				return nil, fmt.Errorf("reversed range %q", part)
			}
		}
		if b > maxCPU {
			return nil, fmt.Errorf("CPU %d above %d", b, maxCPU)
		}
		for c := a; c <= b; c++ {
			cpus = append(cpus, c)
		}
	}
	if !slices.IsSorted(cpus) {
		slices.Sort(cpus)
	}
	return slices.Compact(cpus), nil
}

func parseCPU(s string) (int, error) {
	if s == "" || len(s) > 5 || strings.TrimLeft(s, "0123456789") != "" {
		return 0, errors.New("not a CPU number")
	}
	return strconv.Atoi(s)
}
