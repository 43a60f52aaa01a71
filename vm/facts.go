package vm

// Guest facts (docs/api.md, The VM view): what the host learns about a running
// guest without asking it. Package vm/engine gathers them into the record
// (its facts.go); the view shows them.
//
//   - nets[].dhcp_snooped_ipv4: the address of the last DHCP ACK snooped on
//     the tap for the guest's MAC (tap.FollowDHCP), for interfaces without a
//     static ipv4. It is stored in the record, and FollowDHCP re-pins the
//     anti-spoof rule to it, so the guard keeps passing the guest's traffic
//     after an agent restart too.
//   - nets[].last_observed_ipv4: the last IPv4 the neighbour table showed for
//     the MAC, polled every factsInterval while the VM runs; stored, so it
//     survives ARP expiry.
//   - discovered_ipv4: the first interface's snooped address, else the first
//     observed one (record.DiscoveredIPv4: snooped first, since it is
//     authoritative; the neighbour table only says what the guest asserts).
//   - disk.qsd_* and disk.runtime: the recorded qemu-storage-daemon serving
//     the root disk, while one runs.
//   - pid: the running Cloud Hypervisor (Record.PID, cleared when the VM
//     ends, even while a hung process is still being killed).
