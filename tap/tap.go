package tap

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"net/netip"
	"strconv"
	"strings"
)

// ifNameMax is the longest interface name, IFNAMSIZ less the NUL.
const ifNameMax = 15

// Config configures a Handle. The zero value works in the caller's network
// namespace.
type Config struct {
	// NetNS is an open file descriptor of the network namespace to work in
	// (for example of /proc/PID/ns/net). Zero means the caller's namespace.
	// The Handle does not take ownership: the caller keeps it open while the
	// Handle is in use and closes it afterwards.
	NetNS int
	// AgentID is the agent whose objects this Handle makes and lists (see
	// package agentid; several agents may share a namespace): its taps get
	// the ifalias "vmhost:<AgentID>:<vm_id>:<index>", its anti-spoof chains
	// go to the table GuardTableOf(AgentID), a bridge CreateBridge makes
	// gets the ifalias BridgeAlias(AgentID), and ListOwned lists only its
	// taps. Empty means the unmarked forms of agents without an id:
	// "vmhost:<vm_id>:<index>" and the table "vmhost".
	AgentID string
}

// aliasPrefix starts the ifalias of every tap this package creates.
const aliasPrefix = "vmhost:"

// validAgentID reports whether id can mark objects: 1 to 32 lowercase
// letters and digits (package agentid makes 16 hex digits), so that the
// aliases stay parseable and the table name short.
func validAgentID(id string) bool {
	if id == "" || len(id) > 32 {
		return false
	}
	for i := 0; i < len(id); i++ {
		if c := id[i]; !('0' <= c && c <= '9' || 'a' <= c && c <= 'z') {
			return false
		}
	}
	return true
}

// TapConfig describes a tap to create.
type TapConfig struct {
	// Name is the interface name, at most 15 bytes (see Name).
	Name string
	// Owner is the uid allowed to attach to the tap without CAP_NET_ADMIN;
	// zero leaves the tap without an owner (only privileged processes may
	// attach), which is what a root agent needs.
	Owner int
	// MTU is the interface MTU; zero keeps the kernel default (1500).
	MTU int
	// VMID and Index are recorded in the ifalias "vmhost:<VMID>:<Index>",
	// which ListOwned reads back. VMID must not be empty or contain ':'.
	VMID  string
	Index int
	// MultiQueue creates the tap with IFF_MULTI_QUEUE, which Cloud
	// Hypervisor needs when an interface has more than one queue pair.
	MultiQueue bool
}

// Alias returns the unmarked ifalias "vmhost:<vm_id>:<index>": a tap made
// by vmhost for interface index of VM vmID, by an agent without an id (or
// before agents had one).
func Alias(vmID string, index int) string {
	return aliasPrefix + vmID + ":" + strconv.Itoa(index)
}

// AgentAlias returns the ifalias "vmhost:<agent_id>:<vm_id>:<index>" that
// marks a tap as agent's, for interface index of VM vmID. An empty agent
// gives Alias.
func AgentAlias(agent, vmID string, index int) string {
	if agent == "" {
		return Alias(vmID, index)
	}
	return aliasPrefix + agent + ":" + vmID + ":" + strconv.Itoa(index)
}

// BridgeAlias is the ifalias of a bridge agent made (CreateBridge of a
// Handle with that AgentID), "vmhost:<agent_id>:bridge": RemoveBridge
// removes only a bridge that carries its own.
func BridgeAlias(agent string) string { return aliasPrefix + agent + ":bridge" }

// Name returns a tap name for interface index of VM vmID: "vmh", 8 hex
// digits of a hash of the id, and the index, so an operator can tell a VM's
// taps apart. An index of more than 4 digits (or a negative one) gives "vmh"
// and 12 hex digits of a hash of both instead. The name always fits
// IFNAMSIZ-1 (15) bytes and is stable for the same inputs; callers record it.
func Name(vmID string, index int) string {
	idx := strconv.Itoa(index)
	if index < 0 || len(idx) > 4 {
		sum := sha256.Sum256([]byte(vmID + ":" + idx))
		return "vmh" + hex.EncodeToString(sum[:])[:12]
	}
	sum := sha256.Sum256([]byte(vmID))
	return "vmh" + hex.EncodeToString(sum[:])[:8] + idx
}

// ErrConflict is wrapped by errors about an existing interface that does not
// match what was asked for (a tap with other settings, or not a tap).
var ErrConflict = errors.New("interface exists with other settings")

func validName(name string) error {
	if name == "" || len(name) > ifNameMax {
		return fmt.Errorf("interface name %q: must be 1 to %d bytes", name, ifNameMax)
	}
	if name == "." || name == ".." || strings.ContainsAny(name, "/: \t\n\x00") {
		return fmt.Errorf("interface name %q: contains a character an interface name cannot have", name)
	}
	return nil
}

// Whose says whose a tap with a vmhost ifalias is, as a Handle sees it.
type Whose int

const (
	// Mine: marked with the Handle's own agent id.
	Mine Whose = iota + 1
	// OtherAgent: marked with another agent's id. Never touch it.
	OtherAgent
	// Unmarked: the alias "vmhost:<vm_id>:<index>" of an agent without an
	// id (or from before agents had one). Never touch it, unless one of
	// the agent's own records names it: then Adopt marks it as the
	// agent's.
	Unmarked
)

func (w Whose) String() string {
	switch w {
	case Mine:
		return "mine"
	case OtherAgent:
		return "other agent's"
	case Unmarked:
		return "unmarked"
	}
	return "Whose(" + strconv.Itoa(int(w)) + ")"
}

// Owned is a tap whose ifalias says vmhost made it.
type Owned struct {
	Name   string // interface name
	VMID   string // VM id from the alias
	Index  int    // interface index within the VM (nets[Index])
	Master int    // ifindex of the bridge it is attached to, or 0
	// Agent is the agent id in the alias; empty for an unmarked tap.
	Agent string
	// Whose is Agent as the listing Handle sees it. A Handle without an
	// AgentID sees every marked tap as OtherAgent's.
	Whose Whose
}

// tapAlias is a parsed vmhost tap alias.
type tapAlias struct {
	agent string // empty: unmarked
	vmID  string
	index int
}

// parseTapAlias reads either form of a tap's alias:
// "vmhost:<agent_id>:<vm_id>:<index>" or the unmarked
// "vmhost:<vm_id>:<index>". VM ids never contain ':', so the number of
// fields tells the forms apart.
func parseTapAlias(alias string) (tapAlias, bool) {
	rest, ok := strings.CutPrefix(alias, aliasPrefix)
	if !ok {
		return tapAlias{}, false
	}
	f := strings.Split(rest, ":")
	var a tapAlias
	switch len(f) {
	case 2:
	case 3:
		if !validAgentID(f[0]) {
			return tapAlias{}, false
		}
		a.agent, f = f[0], f[1:]
	default:
		return tapAlias{}, false
	}
	n, err := strconv.Atoi(f[1])
	if f[0] == "" || err != nil || n < 0 || f[1] != strconv.Itoa(n) {
		return tapAlias{}, false
	}
	a.vmID, a.index = f[0], n
	return a, true
}

// whose classifies a tap alias's agent for a Handle of agent self.
func whose(self, agent string) Whose {
	switch {
	case agent == "":
		return Unmarked
	case agent == self:
		return Mine
	}
	return OtherAgent
}

// notExist wraps a not-found error so that errors.Is(err, fs.ErrNotExist).
type notExist struct{ msg string }

func (e *notExist) Error() string        { return e.msg }
func (e *notExist) Is(target error) bool { return target == fs.ErrNotExist }

// PortOptions configures a tap's bridge port.
type PortOptions struct {
	// Isolated sets IFLA_BRPORT_ISOLATED: an isolated port cannot exchange
	// frames with other isolated ports of the bridge, only with the others.
	Isolated bool
	// VLAN, when not zero (1..4094), becomes the port's untagged PVID and
	// VLAN 1 is removed from the port, on a bridge that filters VLANs. On a
	// bridge without VLAN filtering it is metadata only and nothing is sent.
	VLAN uint16
}

// ErrNotBridge is wrapped by the error for a master that exists but is not a
// bridge.
var ErrNotBridge = errors.New("not a bridge")

// Port is what the kernel reports about a tap's bridge port.
type Port struct {
	Master   int  // ifindex of the bridge, or 0 when the tap is on none
	Isolated bool // IFLA_BRPORT_ISOLATED
	Up       bool // IFF_UP on the tap
	MTU      int
	Alias    string
}

func boolByte(b bool) uint8 {
	if b {
		return 1
	}
	return 0
}

// GuardTable is the bridge-family nftables table that holds the anti-spoof
// chains of a Handle without an AgentID; each guarded tap has a chain
// "guard-<tap>" there. An agent's Handle uses GuardTableOf(agent).
const GuardTable = "vmhost"

// GuardTableOf is the table of agent's anti-spoof chains,
// "vmhost-<agent_id>"; GuardTable for an empty agent.
func GuardTableOf(agent string) string {
	if agent == "" {
		return GuardTable
	}
	return GuardTable + "-" + agent
}

// GuardRule says what a tap's guest may send.
type GuardRule struct {
	// Tap is the interface the frames come from.
	Tap string
	// MAC is the VM's MAC: the only Ethernet (and ARP sender) source allowed.
	MAC net.HardwareAddr
	// IPv4 is the pinned IPv4 address: the interface's static address, or
	// the binding DHCP snooping learned. Invalid when there is neither; then
	// only DHCP discovery from 0.0.0.0 and ARP probes pass for IPv4.
	IPv4 netip.Addr
	// IPv6 is the interface's static IPv6 address, if any.
	IPv6 netip.Addr
	// AllowedIPs are further sources (addresses or prefixes, either family).
	// They take effect only while IPv4 is valid: an interface with neither a
	// static IPv4 nor a learned binding has nothing to extend.
	// At most MaxAllowedIPs entries.
	AllowedIPs []netip.Prefix
}

// MaxAllowedIPs bounds GuardRule.AllowedIPs: each entry is a rule that
// every frame from the tap may walk, and the whole chain is replaced in one
// netlink message.
const MaxAllowedIPs = 256

// guardChain names the anti-spoof chain of a tap.
func guardChain(tap string) string { return "guard-" + tap }
