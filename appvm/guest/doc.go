// Package guest is the AppVM guest agent, `vmhost guest`: the /init of an
// AppVM's initramfs. It dials the host over vsock, says Hello, receives the
// workload Spec (package proto), sets up the guest (network, hostname,
// tmpfs and data mounts, then /etc/hosts, resolv.conf, config and secret
// files, so that a file under a mountpoint lands in the mount),
// runs the workload in the image root as its user, and reports heartbeats,
// the DHCP lease, start, health, output and exit. As PID 1 it reaps every
// zombie and forwards SIGTERM, SIGINT, SIGHUP, SIGUSR1 and SIGUSR2 to the
// workload. When the workload ends it powers the guest off, unless the Spec
// says keepalive.
//
// # Operations
//
// From protocol version 3 on the agent also listens for the host's
// operation connections (proto.OpPort; one connection per operation, see
// package proto): exec runs a process beside the workload (its root,
// chrooted as it is, its environment with the secret variables, its user
// and working directory unless the request names others) on pipes or on a
// pseudo-terminal (/dev/ptmx, TIOCGPTN, the slave as controlling terminal
// through setsid and TIOCSCTTY, TIOCSWINSZ for resizes), with a timeout
// that kills its process group; output is forwarded as it comes, and a
// host that does not read holds the process back (no buffer of ours grows);
// a host that vanishes gets the process, its group and its descendants
// killed. Files go out as a tar archive (owners as numbers, secret files
// left out, a secret path refused) and come in as one that is checked
// member by member (proto.TarChecker) and extracted into a staging
// directory inside the destination, moved into place only once the whole
// archive passed. A signal goes to the workload's process. Operations
// answer "not set up" until the workload's root is ready.
//
// # Modes
//
// VM mode (PID 1): mounts /proc, /sys, /dev (and a devpts instance of its
// own at /dev/pts), loads the kernel modules the
// initramfs lists (initramfs.ModuleList, dependencies first; see the
// appvm_modules setting), waits up to 10 s for the root disk, mounts it
// at /mnt/root, configures the network over netlink (static) or its own DHCP
// client, and runs the workload chrooted into /mnt/root; poweroff is
// reboot(2). Kernel command-line knobs: vmhost.root= (root device, default
// /dev/vda), vmhost.rootfstype= (default ext4), vmhost.port= (vsock port,
// default proto.Port). No secret is ever read from the command line. The
// flags --transport, --root, --root-device, --root-fstype and --device-wait
// also apply, for tests that run VM mode as PID 1 of a PID namespace; init's
// other arguments are ignored. A disk or NIC that never appears, and a
// kernel without AF_VSOCK, are reported with their likely cause (a driver
// neither built in nor in appvm_modules); that is never retried. A guest
// that cannot reach its host writes the cause on /dev/console (the serial
// console) before it powers off.
//
// Process mode (the simulator and tests): the agent is an ordinary process:
//
//	vmhost guest --transport unix:<path> --root <dir> [--chroot] [--mounts]
//	             [--network] [--listen unix:<prefix>] [--heartbeat 5s]
//	             [--vmm-fd N]
//
// It dials the unix socket instead of AF_VSOCK (chsim passes the hybrid vsock
// listener `<vsock socket>_<port>`), makes itself a child subreaper, writes
// the hostname, hosts, resolv.conf and injected files under --root, and runs
// the workload on the host; with --chroot (root only) the workload and exec
// health checks are chrooted into --root, otherwise commands resolve on the
// host and only the working directory is taken inside --root. --mounts
// performs the tmpfs and data mounts (root, meant for a private mount
// namespace; otherwise the mountpoints are only created), --network applies
// the Spec's network to the current network namespace (root). --listen
// takes operation connections on the unix socket <prefix>_<port> instead
// of AF_VSOCK port <port> (chsim routes a host's CONNECT there; VM mode
// listens on AF_VSOCK unless told otherwise). Poweroff exits the process
// with status 0 ([ExitPoweroff]); agent failures exit 1. [HaltSignal]
// (chsim's VM stop) kills every process below the agent, reaps them and exits [ExitHalted]: as
// subreaper the agent is the parent of every orphan of the workload, so a
// simulated VM leaves no process behind however it ends. --vmm-fd names a
// pipe whose write end the simulator holds: once every holder has closed
// it (the simulator ended, or dropped a suspended guest it kept) the agent
// halts the same way; a guest whose state is saved outlives one simulator
// and is handed to the next.
//
// # Secrets
//
// Secret env values and secret file contents reach the workload's
// environment and files only; the agent never writes them to its stderr or
// into any message it sends.
//
// The package is Linux-only: elsewhere only its path helpers build.
package guest
