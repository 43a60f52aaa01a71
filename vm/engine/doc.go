// Package engine is the VM supervisor: the production vm.Host. It
// provisions VMs (image download, root disk copy, data volumes, the seed,
// taps, qemu-storage-daemon), builds the Cloud Hypervisor config
// (chconfig.go), boots and carries out the lifecycle actions
// (engine*.go), watches every running VM (monitor.go) and learns guest
// addresses (facts.go), and at Recover reconciles the host with the records
// after an agent restart (recover.go).
//
// The engine imports neither package vm nor appvm: it works on the
// records' owner, package vm/records (Options.Records), and records its
// results there. What the AppVM family adds to a boot is handed down: its
// data volumes hold ext4 (made here), and the host end of its guest agent
// is a Guest (guest.go), an interface the engine owns and appvm.Guests
// implements, wired once in Options. The record types are package
// vm/record's.
//
// # Provisioning
//
// The create's record, stored before any host work, is the intent. A
// provision records its result once: the steps done (Record.Runtime.Steps),
// the vsock CID, the storage daemon's identity and display created; a
// failed one records the steps it did, so Rollback removes exactly what
// was made. A boot records CH, the storage daemon (when it launched one)
// and state running in one write once the guest boots. An agent that dies
// in between finds unrecorded work: it reaps processes no record names,
// rolls back a synchronous create by name, and redoes the unrecorded
// steps of a background one (each step can be redone).
//
// # Confinement
//
// With Options.Jail enabled (an agent running as root), every VM's
// qemu-storage-daemon and Cloud Hypervisor run confined (package jail): a
// uid and gid of the VM's own, recorded first thing in its provision so
// the records are the intent of every cgroup and uid on the host; no
// capabilities; a private root of only their files; one cgroup with the
// VM's limits, killed at a stop and removed at a delete. jail.go says what
// each process gets and what the VM owns.
//
// # Supervision and recovery
//
// Every running or paused VM has one monitor: the CH child's exit (or, for
// a process adopted after an agent restart, its pidfd), the event stream
// (a device activated, guest panic, shutdown), the API socket's presence
// and answers, pings, the root disk file, and QSD's death; each ends the
// VM with the failure_reason docs/design.md §5 maps it to. At Recover, live
// processes whose pid and start time match are adopted, dead ones end
// their VM, cut-short provisions are resumed or rolled back, cut-short
// deletes finished, VMs that lost their root disk failed, and taps,
// run dirs and processes that no record owns are reaped. Close releases
// the watched VMs without stopping them.
package engine
