// Package tap builds the host side of a VM's network interfaces: persistent
// TAP devices, their bridge ports, anti-spoof rules, and the two ways the host
// learns a guest's IPv4 address.
//
// Everything talks to the kernel directly: TUN/TAP ioctls on /dev/net/tun,
// rtnetlink for links, bridge ports and neighbours, nf_tables netlink
// messages for the anti-spoof rules, and an AF_PACKET socket with a classic
// BPF filter for DHCP snooping. No ip, bridge, tc or nft command runs.
//
// # What it does
//
//   - Create makes a persistent tap (IFF_TAP|IFF_NO_PI|IFF_VNET_HDR) with an
//     MTU, an owner, state up and the ifalias
//     "vmhost:<agent_id>:<vm_id>:<index>"; Delete removes a tap and its
//     anti-spoof chain. Both are idempotent.
//   - Several agents may share a namespace (see "Agents" below): ListOwned
//     finds the Handle's own agent's taps, so its orphans can be reaped;
//     ListMarked finds every vmhost tap and says whose it is; Adopt marks
//     an unmarked tap (one made before agents had ids) that the agent's
//     records name as the agent's.
//   - Attach makes a tap a port of a bridge, sets port isolation
//     (IFLA_BRPORT_ISOLATED) and, on a bridge with VLAN filtering, makes the
//     VLAN the port's untagged PVID and removes the default VLAN 1. On a
//     bridge without VLAN filtering the VLAN is metadata only.
//   - Guard programs anti-spoof rules into the agent's bridge-family
//     nftables table "vmhost-<agent_id>": one base chain per tap (hook prerouting) that drops frames
//     from the tap whose source MAC is not the VM's, or whose IPv4/IPv6 source
//     is not the pinned address or one of the allowed prefixes. DHCP
//     discovery from 0.0.0.0, ARP probes, ARP for an allowed address, and
//     IPv6 link-local and unspecified sources pass; DHCP server replies and
//     frames of any other ethertype (including VLAN-tagged ones) from the
//     guest are dropped.
//   - Snoop watches frames the host sends to a tap and reports the address a
//     DHCPACK assigns to the VM's MAC; FollowDHCP keeps snooping and
//     re-applies the guard with each newly learned address.
//   - LastIPv4 reads the neighbour table for the newest IPv4 address of a MAC.
//
// Handle.Create, Delete, Attach, Guard and Unguard are idempotent, so a
// caller recovering after a restart can simply apply its records again.
//
// # Agents
//
// Every object a Handle makes carries the agent id of its Config (package
// agentid): tap ifaliases "vmhost:<agent_id>:<vm_id>:<index>", the table
// "vmhost-<agent_id>", and the ifalias "vmhost:<agent_id>:bridge" of a
// bridge CreateBridge makes, which RemoveBridge alone removes (when no
// interface is its port). An agent touches only what carries its own id:
// another agent's taps, chains and bridges, and unmarked ones
// ("vmhost:<vm_id>:<index>", table "vmhost"), are never reaped. An
// unmarked tap the agent's records name is adopted (Adopt, or Create of
// the same VM and index): its alias is re-marked, and its chain moves from
// the unmarked table into the agent's at the next Guard. A Handle without
// an AgentID makes and lists the unmarked forms.
//
// # Limits
//
// Rate limits are not handled here (Cloud Hypervisor's net rate limiter does
// that). IPv6 addresses are not learned: a guard pins only the static IPv6
// address and the allowed prefixes, plus any link-local source and "::" so
// that neighbour discovery works (a guest can therefore forge link-local
// sources). Allowed prefixes take effect only while the interface has a
// pinned IPv4 address (static or learned), as the API contract says, and
// there are at most MaxAllowedIPs of them. Each guarded tap adds one base
// chain that every bridged frame enters (and leaves at its first rule unless
// it came from that tap), so the cost per frame grows with the number of
// guarded taps on the host. Until a guest's address is pinned, its IPv4
// traffic other than DHCP is dropped; a caller that loses a snooped binding
// (by restarting) should keep it in its records. VLAN filtering needs a
// kernel with CONFIG_BRIDGE_VLAN_FILTERING. On systems other than Linux
// every operation fails with ErrNotSupported.
//
// # Network namespaces
//
// A Handle works in the network namespace given by Config.NetNS (an open
// file descriptor of a namespace, as from /proc/PID/ns/net), or in the
// caller's namespace when it is zero. Tests use this to run every
// privileged test in a namespace of their own.
package tap
