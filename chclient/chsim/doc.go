// Package chsim is a Cloud Hypervisor (v53) simulator: one process that speaks CH's REST
// API on a unix socket closely enough that everything above the process boundary — the
// client, launch and supervision, the VM lifecycle, events, the serial console socket and
// the hybrid vsock — can be tested for real without KVM. `vmhost sim-ch` runs Main.
//
// It follows docs/ref/cloud-hypervisor.md: the same paths, methods, statuses, headers and error
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
// After boot the guest's drivers take its virtio devices after a short delay, as a stock
// Linux kernel's would (every device but the virtio-watchdog, which only CH's kernel fork
// drives). As CH v53, a virtio-device activated event follows for each device CH
// implements itself — disks on a file, nets on a tap, console, rng, balloon, vsock — and
// none for a vhost-user disk or net (docs/ref/cloud-hypervisor.md §11); a guest reboot or
// poweroff resets them all, vhost-user ones included (virtio-device reset). A guest that is
// up powers off 50 ms after the ACPI power button, as systemd does, unless
// /sim/v1/power-button tells it to ignore the button; one that is not up ignores it; an
// AppVM's guest agent gets SIGPWR for it and stops its workload first.
// Its serial port prints a boot line and echoes input. Its vsock ports are listened on by
// an echo service unless Config.GuestVsock replaces it.
//
// A test-control namespace on the API socket drives what a guest would do; see control.go
// for the list: activate, poweroff, reboot, panic, hang, crash (die by a signal), serial
// output, vsock listen/unlisten/connect, DHCP, the guest agent, counters, eject, the power
// button, and status.
//
// The simulated guest acks a hot-unplug (vm.remove-device on a booted VM) 50 ms after the
// request: the device leaves the config and vm device-removed {id, bdf} follows. After
// `PUT /sim/v1/eject {"refuse":true}` it ignores eject requests, as a guest that holds on to
// the device would: vm.remove-device still answers 204, but nothing is removed and no event
// follows, for every request made until `{"refuse":false}` (a request is not remembered).
//
// # Snapshot and restore
//
// vm.snapshot and vm.restore follow CH v53 (docs/ref/cloud-hypervisor.md). vm.snapshot
// needs a Paused VM: before a boot it is 500 "VM is not running"; on a Running VM it emits
// vm snapshotting and fails "Trying to snapshot while VM is running". Paused, it emits vm snapshotting and vm snapshotted and writes, each file
// created anew (an existing one fails it, with what was written before left behind),
// into the directory of destination_url (file://, which must exist):
//   - config.json: the config vm.info echoes (generated ids, defaults);
//   - state.json: CH's component tree ({"snapshots":{…},"snapshot_data":{"state":"…"}}):
//     cpu-manager with one component per vCPU; memory-manager with the RAM ranges as CH
//     lays them out on x86_64 (below 3 GiB, the rest from 4 GiB), boot_ram and
//     current_ram; device-manager with the device tree (PCI addresses), the generated-id
//     counter, each device's counters and each virtio-pci transport's device_activated;
//     and at the root, under "chsim", the simulated guest: the backend, whether its
//     drivers are up, its vsock listeners, the eject refusal and the device order;
//   - memory-ranges: the ranges back to back, as holes (the simulated guest has no memory).
//
// The VM stays Paused.
//
// vm.restore answers "VM is already created" once a config exists (a fresh process, or
// one whose VM was deleted). It reads config.json and state.json (CH's chains for a
// missing or damaged file, for a source_url without file:// or not a directory, and for
// prefault with memory_restore_mode OnDemand), then, holding the config: binds the serial
// socket, opens memory-ranges, reopens what a boot opens (disk images, vhost-user sockets,
// taps by name, the vsock socket, which must not exist), opens the initramfs as v53's
// Vm::new does, emits virtio-device activated for each device whose transport was
// activated (CH's own devices only, as at a boot), then vm restoring and vm restored. A
// failure from the config on drops it (vm deleted) and releases everything. The VM is Paused, with its ids, PCI addresses,
// counters, id counter and guest vsock listeners; resume=true runs it (vm resuming,
// vm resumed). A snapshot restores only under the backend that took it. prefault and
// OnDemand are accepted and change nothing; net_fds is ignored (no net here is built
// from fds).
//
// In process mode the AppVM guest is its agent's processes, frozen while the VM is paused
// (keep_linux.go). A paused VM whose state was saved since it last ran, and that then
// stops (the VMM exits, as a suspend has it), keeps its guest: a keeper process holds the
// agent's --vmm-fd pipe and the saved state.json files; the simulator that restores one of
// those states adopts the agent and continues it with the resume (same processes, no
// boot); the keeper ends the guest once none of its saved states exists. The agent's host
// connection runs straight to the host, so the host's end closing it (vmhost ends its
// session at a suspend) is the reset CH would queue. A snapshot of a guest that ran on
// afterwards has no process to keep (a process cannot be copied): its restore starts the
// agent afresh at the first resume, the workload again, with the guest's root directory
// put back as the snapshot saved it (chsim-guest-root.tar, guestroot.go).
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
//	--sim-guest-chroot       the guest agent chroots the workload into its root (below)
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
// and its workload (unless the state was saved: above); a reboot starts it again; pause
// and resume stop and continue it and every process below it.
// The workload runs on the host (process mode: no chroot or mounts), unless
// --sim-guest-chroot: then the agent gets --chroot and runs it chrooted into the root,
// which the host has filled with the VM's root file system (serve --dev unpacks the root
// disk there before each boot), so the image's entrypoint and libraries are found;
// without root the agent runs in a user namespace of its own mapping uid and gid 0 to the
// simulator's (and no other id), where it may chroot, and runs the workload as that one
// user whatever the image names. As root, when the
// VM's first interface has a tap, the agent runs with --network in a network namespace of
// its own holding eth0, a tap with the VM's MAC whose frames the simulator pumps to and
// from the VM's tap (as virtio-net would): the agent's static or DHCP configuration and
// the workload's traffic then really cross the host's bridge.
//
// # The qemu backend
//
// With --sim-backend qemu the API, the state table, the serial socket and the event stream
// stay the simulator's, but vm.boot runs the guest for real in qemu-system-x86_64 (7.2), so
// vmhost can drive real guests through its normal configuration (the real-guest lane):
//
//	--sim-backend sim|qemu       sim (default) or qemu
//	--sim-qemu PATH              the qemu binary (default qemu-system-x86_64 from PATH)
//	--sim-accel auto|kvm|tcg     auto: KVM if /dev/kvm opens and is kvm_intel or kvm_amd;
//	                             TCG (-accel tcg,thread=multi -cpu max) otherwise, including
//	                             on a PVM host (kvm_pvm), where -cpu host aborts and the
//	                             default CPU hangs; a module check, not a probe boot
//	--sim-vsock-backend PATH     vhost-device-vsock (default from PATH, else
//	                             /var/cache/vmhost-lane/..., where
//	                             e2e/realguest/fetch-vhost-device-vsock.sh puts it)
//
// The simulated-guest flags (--sim-activate-delay, --sim-no-activate, --sim-guest-ports,
// --sim-poweroff-at-boot, --sim-no-guest-agent, --sim-no-guest-network, --sim-guest-chroot,
// --sim-guest-heartbeat) are refused with it; /sim/v1/ answers 404 and no guest agent runs
// on the host (the real guest runs its own from its initramfs).
//
// The CH config maps to qemu (qemu_args.go; testdata/qemu-argv-*.golden are transcripts):
// payload kernel/initramfs/cmdline → -kernel/-initrd/-append (a bzImage, as CH boots it),
// or payload firmware → -bios (e.g. OVMF: the guest's own boot loader and kernel; an
// initramfs then is refused and the cmdline is the firmware's business, as under CH);
// cpus → -smp (topology too); memory → a memfd backend, shared as memory.shared says
// (vhost-user needs it), on q35; every device at the PCI slot CH would give it, so the
// device_tree of vm.info is true and disks keep CH's order (vda, vdb, …); vhost-user disks →
// vhost-user-blk-pci on the socket (qemu-storage-daemon's export), path disks →
// virtio-blk-pci (raw, or qcow2 for image_type Qcow2; readonly, direct, serial, queues);
// taps by name → -netdev tap (vhost=off) + virtio-net-pci with the MAC, host_mtu, queue
// pairs and offloads; rng → virtio-rng-pci; balloon → virtio-balloon-pci; pvpanic →
// pvpanic-pci (CH's 1b36:0011; the guest needs CONFIG_PVPANIC_PCI); platform serial/uuid/
// manufacturer/product and OEM strings → -smbios; console Off (or Null); serial Socket →
// relayed (below), File → -serial file:, Null, Off. vsock {cid, socket} →
// `vhost-device-vsock --guest-cid cid --socket <socket>.vhost-user --uds-path socket` and
// vhost-user-vsock-pci behind a root port of its own (not at CH's address; see Snapshots
// below): it follows CH's hybrid convention (CONNECT <port> on socket; the guest's
// connections to port P reach socket_P), so vmhost's host side is unchanged.
// Virtio devices are modern-only (disable-legacy=on), as CH's are: a firmware driving
// vhost-user-blk in legacy mode would make qemu-storage-daemon abort.
// What qemu cannot honour fails vm.boot with 500 rather than boot a different VM: VFIO
// devices, watchdog, iommu, rate limits (disk and net), a serial on a vhost-user disk
// (vhost-user-blk has none), memory zones, nets without a tap or with ip/mask or vhost-user,
// console modes other than Off/Null, serial Pty/Tty, fs/pmem/vdpa/numa and the other sections the simulator only echoes. Ignored on
// purpose: memory hotplug_size (no hot-add), cpu affinity, nested, max_phys_bits.
//
// qemu starts stopped (-S) with its monitor and serial port on socketpairs (fds 3 and 4):
// no socket paths to race for or leave behind, and the backend is the monitor's only client
// from the start; it continues the guest once connected, and vm.boot answers then. The CH
// serial socket is the simulator's as before (bound at vm.create, one client at a time,
// output buffered until a client connects, unlinked at stop); it relays to and from qemu's
// serial port. qemu's and vhost-device-vsock's output go to <log file minus .log>.qemu.log
// (stderr without --log-file). Both children get Pdeathsig SIGKILL and are ended (QMP quit,
// then SIGKILL after 5 s) on every stop, delete and exit; the vsock sockets are removed.
//
// Events come from what qemu reports, never from a timer:
//   - virtio-device activated/reset: x-query-virtio-status is polled every 100 ms for every
//     virtio device; DRIVER_OK appearing is activated (not for a vhost-user disk, whose
//     activation CH does not announce), disappearing is reset. -boot
//     strict=on keeps SeaBIOS off the virtio disks, so with a kernel payload the first
//     DRIVER_OK is the guest kernel's, as under CH, which has no firmware in between; with a
//     firmware payload it is the firmware's (it reads the disk to boot), as under CH too. A reset and re-activation
//     between two polls is not seen. Devices without a driver in the guest never activate.
//   - guest poweroff: qemu's SHUTDOWN (guest) under -action shutdown=pause; then, as CH:
//     vm shutdown, vm deleted, vmm shutdown and exit 0 (with --no-shutdown: vm shutdown and
//     Created).
//   - guest reset: RESET (guest) → vm rebooting, vm rebooted, in the same qemu and process.
//   - pvpanic: GUEST_PANICKED → guest panic {event: panic}, GUEST_CRASHLOADED → crash_loaded
//     (-action panic=none: the VM stays Running, as in CH).
//   - API calls: vm.power-button → system_powerdown (what follows is the guest's choice);
//     vm.shutdown/vm.delete/vmm.shutdown → qemu quits; vm.pause/resume → stop/cont;
//     vm.reboot → system_reset (and cont when paused).
//   - vm device-removed: qemu's DEVICE_DELETED for a hot-plugged disk (below).
//
// Hot-plug (qemu_hotplug.go): q35's root bus cannot hot-plug, so every VM also gets four
// spare pcie-root-ports, the functions of slot 0x1e (above the cold devices' CH-style slots;
// a config whose devices would reach it fails vm.boot). vm.add-disk on a running or paused
// VM takes vhost-user disks only: chardev-add (a client socket on vhost_socket) and
// device_add vhost-user-blk-pci on a free port. It answers {id, bdf} with the address the
// guest's kernel sees, read back from query-pci: the port's secondary bus as the guest's
// firmware numbered it, slot 0, function 0 (e.g. 0000:01:00.0); before the firmware has run
// it answers 500. The disk joins the config and vm.info's device tree at that address, and
// no virtio-device activated follows when the guest's driver takes it (vhost-user). vm.remove-
// device of a hot-plugged disk sends device_del (an ACPI eject request) and answers 204 at
// once; when the guest has ejected it (DEVICE_DELETED) the disk leaves the config, its
// chardev is removed (the backend sees the vhost-user connection close) and vm device-
// removed {id, bdf} is emitted. A guest that never ejects keeps the disk, and no event
// comes. A disk still in the config at the next boot is a cold one on a CH-style slot.
//
// Snapshots (qemu_snapshot.go): vm.snapshot has qemu write its migration stream, which
// holds the guest's memory and device state, into <dir>/qemu-migration (the file is passed
// to qemu's monitor with getfd, then migrate fd:, qemu's 128 MiB/s default rate limit
// lifted), beside config.json and state.json; state.json then lists no memory range (CH's
// rule for memory it does not copy itself) and names the stream. vm.restore starts a new
// qemu from the config with -incoming fd:N, stopped; once qemu has loaded the stream it
// polls the devices (activated events for those the guest's drivers had, vhost-user disks
// aside) and emits vm restoring and vm restored. qemu refusing the stream (a damaged file) exits it, and the
// restore fails with qemu's words. Refused before anything is written: a VM with
// hot-plugged disks (the restore's qemu would not have them on the same root ports), and
// a second save of a guest that has not run since the last (qemu: "Can't migrate the vm
// that was paused due to previous migration"). Disks served by qemu-storage-daemon
// (vhost-user-blk), path disks, taps, the serial relay, rng, balloon and pvpanic all
// migrate. vhost-user-vsock does not, whatever its backend offers (qemu marks the device
// itself unmigratable: "non-migratable device: …/vhost-user-vsock"), so the vsock device
// sits on a root port of its own (rpvsock) and leaves for the save (qemu_vsock.go):
// vm.snapshot lets the paused guest run until it has ejected the device (tens of
// milliseconds; a guest that does not within 30 s fails the snapshot), pauses it again,
// ends vhost-device-vsock and saves the guest without the device; a restore's qemu starts
// without it; whenever the guest runs again (vm.resume, restore with resume, vm.reboot of
// a paused VM) a new vhost-device-vsock with the same CID and sockets serves a device
// plugged back before the guest runs. The guest sees its vsock device go and come back:
// its vsock connections reset, and the AppVM guest agent connects again. Facts:
// docs/ref/qemu-vhost-user-migration.md.
//
// Not observed or not supported with qemu: vm.counters answers 500 (qemu has no counters
// for vhost-user disks or taps; zeros would be a lie); on a booted VM, vm.add-disk of a disk
// image (path), of more than four disks at once, or with rate limits or a serial,
// vm.remove-device of a device plugged at boot (on the root bus), and vm.resize other than
// the balloon answer 500 "the qemu backend does not support …" (on a created VM they edit
// the config as in CH). A triple fault resets
// the guest (qemu) where CH would exit. qemu dying on its own is a VMM crash: the process
// exits 1 without further events. vhost-device-vsock answers CONNECT with "OK <port>" of its
// own numbering, not CH's ≥ 2^30 host ports, keeps running across a guest reset (CH re-binds
// the vsock socket and drops connections), and its death leaves the guest without vsock
// (logged). A Null console is a virtio-console whose output goes nowhere.
//
// # Limits and deviations (simulated guest)
//
// Nothing runs: counters stay zero, memory is not allocated, PTY console modes get no
// device. Unlike CH running as root, it never creates a tap that does not exist (so tap
// wiring mistakes fail the boot). Only vm.add-disk and vm.remove-device of the hotplug
// calls are simulated; other known routes answer 500. Error texts follow CH's where known;
// deep chains below "The VM could not boot" are plausible rather than verbatim.
package chsim
