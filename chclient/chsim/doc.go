// Package chsim is a Cloud Hypervisor (v53) simulator: one process that speaks CH's REST
// API on a unix socket closely enough that everything above the process boundary — the
// client, launch and supervision, the VM lifecycle, events, the serial console socket and
// the hybrid vsock — can be tested for real without KVM. `vmhost sim-ch` runs Main.
//
// It follows ref/cloud-hypervisor.md: the same paths, methods, statuses, headers and error
// chains; a 51,200-byte body limit and no chunked bodies (micro_http); the state table;
// vm.create stores the config and vm.info echoes it with CH's defaults and generated ids
// (_disk0, _net1, …, one shared counter); vm.boot runs the validation CH does there and
// opens what CH would open (payload files, disk images, vhost-user sockets, taps by
// TUNSETIFF, the vsock socket), answering 500 with CH's chain when something is wrong;
// the event-monitor stream is pretty-printed JSON separated by blank lines. It exits 0 on
// vmm.shutdown, SIGTERM/SIGINT and a guest poweroff (unless --no-shutdown), removing its
// sockets; v53's <api-socket>.lock is taken and left behind.
//
// # The simulated guest
//
// After boot the guest "activates" its virtio devices after a short delay (one
// virtio-device activated event per device, disks first), as a real guest's drivers
// would. A guest that is up honours the ACPI power button; one that is not ignores it.
// Its serial port prints a boot line and echoes input. Its vsock ports are listened on by
// an echo service unless Config.GuestVsock replaces it.
//
// A test-control namespace on the API socket drives what a guest would do; see control.go
// for the list: activate, poweroff, reboot, panic, hang, crash (die by a signal), serial
// output, vsock listen/unlisten/connect, and status.
//
// # Knobs
//
//	--sim-activate-delay D   delay before the guest activates its devices (default 200ms)
//	--sim-no-activate        the guest never activates on its own (use /sim/v1/activate)
//	--sim-guest-ports P,…    vsock ports the guest listens on from boot
//	--no-shutdown            guest poweroff keeps the process (CH v52+)
//	--sim-no-guest-agent     never run the AppVM guest agent
//	--sim-poweroff-at-boot   the guest powers off right after vm.boot answers
//	--sim-guest-heartbeat D  the guest agent's heartbeat interval (default 1s)
//	--sim-no-guest-network   no network namespace and NIC for the guest agent
//
// # The AppVM guest agent
//
// At boot of a VM with a vsock device and an initramfs (an AppVM), the simulator runs the
// real guest agent as a host process in its own process group: `<vmhost> guest --transport
// unix:<vsock socket>_1024 --root <vsock socket>.root --heartbeat D` (GuestRoot), with
// CHSIM_GUEST_AGENT=1 in its environment and its output in <vsock socket>.guest.log. Its
// unix transport reaches the host exactly as the guest's vsock connection to CID 2 port
// 1024 would through CH's hybrid vsock. The agent's exit is the guest's poweroff; its
// death by a signal leaves the VM running without it. Stop, delete and VMM exit kill it
// and its workload; a reboot starts it again; pause and resume stop and continue it.
// The workload runs on the host (process mode: no chroot or mounts). As root, when the
// VM's first interface has a tap, the agent runs with --network in a network namespace of
// its own holding eth0, a tap with the VM's MAC whose frames the simulator pumps to and
// from the VM's tap (as virtio-net would): the agent's static or DHCP configuration and
// the workload's traffic then really cross the host's bridge.
//
// # Limits and deviations
//
// Nothing runs: counters stay zero, memory is not allocated, PTY console modes get no
// device. Unlike CH running as root, it never creates a tap that does not exist (so tap
// wiring mistakes fail the boot). Only vm.add-disk and vm.remove-device of the hotplug
// calls are simulated; other known routes answer 500. Error texts follow CH's where known;
// deep chains below "The VM could not boot" are plausible rather than verbatim.
package chsim
