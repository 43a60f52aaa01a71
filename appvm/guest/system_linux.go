package guest

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/mdlayher/vsock"
	"golang.org/x/sys/unix"

	"vmhost/appvm/guest/proto"
	"vmhost/initramfs"
)

// vmRoot is where VM mode mounts the root disk.
const vmRoot = "/mnt/root"

// system holds the duties that differ between a VM (PID 1) and process
// mode. It exists so that process mode (the simulator, tests) can run the
// rest of the agent unchanged.
type system interface {
	// prepare runs first: VM mode mounts the pseudo filesystems and the root
	// disk; process mode becomes a child subreaper.
	prepare() error
	// vsockPort is the host port to dial over vsock.
	vsockPort() uint32
	// configureNetwork applies n; in DHCP mode it returns the lease, and
	// renewals go to report. The wait for a lease ends with ctx.
	configureNetwork(ctx context.Context, n proto.Network, hostname string, report func(*proto.Lease)) (*proto.Lease, error)
	setHostname(name string) error
	mountTmpfs(target string, t proto.TmpfsMount) error
	mountData(device, target string, readOnly bool) error
	// blockDevice finds the disk at a PCI address (a hot-plugged volume);
	// process mode without mounts has none and answers "".
	blockDevice(bdf string) (string, error)
	// unmountData unmounts a data volume (EBUSY while in use).
	unmountData(target string) error
	// watchPowerButton calls press for each press of the VM's power
	// button and returns how many buttons it watches.
	watchPowerButton(press func()) int
	// prepareRoot readies the workload root (VM: /proc, /sys, /dev inside it).
	prepareRoot(root string) error
	// poweroff ends the guest: VM mode never returns; process mode kills
	// what is left of the workload and returns, and Main exits with code.
	poweroff(code int)
}

func dialVsock(port uint32) (net.Conn, error) {
	return vsock.Dial(proto.HostCID, port, nil)
}

// tmpfsOptions is the data argument of a tmpfs mount.
func tmpfsOptions(t proto.TmpfsMount) string {
	mode := t.Mode
	if mode == 0 {
		mode = 0o1777
	}
	opts := "mode=" + strconv.FormatUint(uint64(mode), 8)
	if t.SizeBytes > 0 {
		opts += ",size=" + strconv.FormatUint(t.SizeBytes, 10)
	}
	return opts
}

func mountTmpfs(target string, t proto.TmpfsMount) error {
	return unix.Mount("tmpfs", target, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, tmpfsOptions(t))
}

func mountData(device, target string, readOnly bool) error {
	var flags uintptr
	if readOnly {
		flags |= unix.MS_RDONLY
	}
	return unix.Mount(device, target, "ext4", flags, "")
}

// processSystem is process mode.
type processSystem struct {
	mounts, network bool
	// sysfs is where blockDevice looks up PCI addresses (tests point it
	// at a tree of their own).
	sysfs      string
	deviceWait time.Duration
	log        *slog.Logger
}

// HaltSignal ends a process-mode agent at once, with everything below it:
// it kills its descendants (every orphan of the workload came to it as
// subreaper), reaps them, and exits with ExitHalted. The simulator sends
// it when the VM stops (and the end of its --vmm-fd pipe does the same
// when the simulator is killed outright: haltWithVMM). It is a real-time
// signal (SIGRTMIN+8 in the kernel's numbering): nothing
// else sends it, and unlike SIGKILL it lets the agent clean up.
const HaltSignal = syscall.Signal(40)

// haltOnSignal ends the agent on HaltSignal, whatever it is doing.
func (s *processSystem) haltOnSignal() {
	ch := make(chan os.Signal, 1)
	signal.Notify(ch, HaltSignal)
	go func() {
		<-ch
		s.log.Warn("halted: killing every process of the guest")
		s.poweroff(ExitHalted)
		os.Exit(ExitHalted)
	}()
}

// haltWithVMM ends the agent as HaltSignal does once the pipe at fd reads
// end of file: every holder of its write end (the VMM that runs this
// guest, or whoever keeps a suspended guest for the next one) has gone.
// It stands in for a parent-death signal, which would end a guest that
// must outlive its VMM while its state waits on disk.
func (s *processSystem) haltWithVMM(fd int) {
	unix.CloseOnExec(fd) // not the workload's
	f := os.NewFile(uintptr(fd), "vmm")
	go func() {
		io.Copy(io.Discard, f)
		s.log.Warn("the VMM is gone: halting, killing every process of the guest")
		s.poweroff(ExitHalted)
		os.Exit(ExitHalted)
	}()
}

func (s *processSystem) prepare() error {
	// Orphans of the workload come to us, as they would to PID 1.
	if err := unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0); err != nil {
		return fmt.Errorf("becoming a child subreaper: %w", err)
	}
	return nil
}

func (s *processSystem) vsockPort() uint32 { return proto.Port }

func (s *processSystem) configureNetwork(ctx context.Context, n proto.Network, hostname string, report func(*proto.Lease)) (*proto.Lease, error) {
	return applyNetwork(ctx, n, hostname, report)
}

// setHostname leaves the host's hostname alone; /etc/hostname in the root
// still gets it.
func (s *processSystem) setHostname(string) error { return nil }

func (s *processSystem) mountTmpfs(target string, t proto.TmpfsMount) error {
	if !s.mounts {
		return nil
	}
	return mountTmpfs(target, t)
}

func (s *processSystem) mountData(device, target string, readOnly bool) error {
	if !s.mounts {
		return nil
	}
	return mountData(device, target, readOnly)
}

func (s *processSystem) blockDevice(bdf string) (string, error) {
	if !s.mounts {
		return "", nil
	}
	return pciBlockDevice(s.sysfs, bdf, s.deviceWait)
}

func (s *processSystem) unmountData(target string) error {
	if !s.mounts {
		return nil
	}
	return unmountData(target)
}

func (s *processSystem) prepareRoot(string) error { return nil }

func (s *processSystem) watchPowerButton(press func()) int { return watchSIGPWR(press) }

// poweroff kills the descendants left behind (orphans parked on us as
// subreaper), so that nothing of the guest outlives it. Killing a child
// parks its own children on us in turn, so it goes round, reaping each
// round's dead, until none is left.
func (s *processSystem) poweroff(int) {
	// The bound only guards against a tree that keeps forking faster than
	// it is killed.
	for range 100 {
		kids := childrenOf(os.Getpid())
		if len(kids) == 0 {
			return
		}
		for _, pid := range kids {
			unix.Kill(pid, unix.SIGKILL)
		}
		for _, pid := range kids {
			unix.Wait4(pid, nil, 0, nil)
		}
	}
}

// childrenOf lists the children of pid from /proc/<pid>/task/*/children.
func childrenOf(pid int) []int {
	tasks, _ := os.ReadDir("/proc/" + strconv.Itoa(pid) + "/task")
	var out []int
	for _, t := range tasks {
		b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/task/" + t.Name() + "/children")
		if err != nil {
			continue
		}
		for _, f := range strings.Fields(string(b)) {
			if c, err := strconv.Atoi(f); err == nil {
				out = append(out, c)
			}
		}
	}
	return out
}

// vmSystem is VM mode: the agent is PID 1 of the guest.
type vmSystem struct {
	log *slog.Logger
	// root is where the root disk is mounted (the workload root).
	root       string
	rootDev    string
	rootFSType string
	// flagDev and flagFSType, when set, win over the kernel command line.
	flagDev, flagFSType string
	port                uint32
	// deviceWait bounds the wait for each disk and the NIC.
	deviceWait time.Duration
	// mounted lists mountpoints to detach at poweroff, innermost last.
	mounted []string
}

func newVMSystem(log *slog.Logger) *vmSystem {
	return &vmSystem{log: log, root: vmRoot, rootDev: "/dev/vda", rootFSType: "ext4", port: proto.Port, deviceWait: defaultDeviceWait}
}

// parseCmdline reads the vmhost.* knobs from the kernel command line.
func (s *vmSystem) parseCmdline(cmdline string) {
	for _, f := range strings.Fields(cmdline) {
		k, v, _ := strings.Cut(f, "=")
		switch k {
		case "vmhost.root":
			s.rootDev = v
		case "vmhost.rootfstype":
			s.rootFSType = v
		case "vmhost.port":
			if p, err := strconv.ParseUint(v, 10, 32); err == nil {
				s.port = uint32(p)
			}
		}
	}
}

func (s *vmSystem) mount(source, target, fstype string, flags uintptr, data string) error {
	if err := os.MkdirAll(target, 0o755); err != nil {
		return fmt.Errorf("creating mountpoint %s: %w", target, err)
	}
	if err := unix.Mount(source, target, fstype, flags, data); err != nil && !errors.Is(err, unix.EBUSY) {
		return fmt.Errorf("mounting %s on %s: %w", fstype, target, err)
	}
	s.mounted = append(s.mounted, target)
	return nil
}

func (s *vmSystem) prepare() error {
	const nodev = unix.MS_NOSUID | unix.MS_NODEV | unix.MS_NOEXEC
	steps := []struct {
		source, target, fstype string
		flags                  uintptr
		data                   string
	}{
		{"proc", "/proc", "proc", nodev, ""},
		{"sysfs", "/sys", "sysfs", nodev, ""},
		{"devtmpfs", "/dev", "devtmpfs", unix.MS_NOSUID, "mode=0755"},
		{"devpts", "/dev/pts", "devpts", unix.MS_NOSUID | unix.MS_NOEXEC, "gid=5,mode=620,ptmxmode=666"},
		{"tmpfs", "/dev/shm", "tmpfs", unix.MS_NOSUID | unix.MS_NODEV, "mode=1777"},
		{"tmpfs", "/run", "tmpfs", unix.MS_NOSUID | unix.MS_NODEV, "mode=0755"},
	}
	for _, m := range steps {
		if err := s.mount(m.source, m.target, m.fstype, m.flags, m.data); err != nil {
			return err
		}
	}
	if b, err := os.ReadFile("/proc/cmdline"); err == nil {
		s.parseCmdline(string(b))
	}
	if s.flagDev != "" {
		s.rootDev = s.flagDev
	}
	if s.flagFSType != "" {
		s.rootFSType = s.flagFSType
	}
	// Drivers first: on a distro kernel the disks, the NIC and vsock only
	// exist once their modules are in.
	start := time.Now()
	n, modErr := loadModules("/"+initramfs.ModuleList, "/"+initramfs.ModuleDir, finitModule)
	if n > 0 {
		s.log.Info("loaded kernel modules", "count", n, "took", time.Since(start).Round(time.Millisecond))
	}
	if modErr != nil {
		s.log.Error("kernel modules", "err", modErr)
	}
	if err := waitForDisk(s.rootDev, s.deviceWait); err != nil {
		return joinCauses(modErr, err)
	}
	if err := s.mount(s.rootDev, s.root, s.rootFSType, 0, ""); err != nil {
		return joinCauses(modErr, err)
	}
	s.log.Info("mounted the root disk", "device", s.rootDev, "fstype", s.rootFSType)
	return joinCauses(modErr, linkUp("lo"))
}

// defaultDeviceWait is how long the agent waits for a disk or a network
// interface to appear (virtio devices probe a moment after their driver
// loads).
const defaultDeviceWait = 10 * time.Second

// joinCauses joins the non-nil errors into one line, first cause first.
func joinCauses(errs ...error) error {
	var msgs []string
	for _, err := range errs {
		if err != nil {
			msgs = append(msgs, err.Error())
		}
	}
	if len(msgs) == 0 {
		return nil
	}
	return errors.New(strings.Join(msgs, "; "))
}

func (s *vmSystem) vsockPort() uint32 { return s.port }

func (s *vmSystem) configureNetwork(ctx context.Context, n proto.Network, hostname string, report func(*proto.Lease)) (*proto.Lease, error) {
	if n.Mode == proto.NetworkNone {
		return applyNetwork(ctx, n, hostname, report) // the loopback only
	}
	if err := waitForInterface(n.Interface, s.deviceWait); err != nil {
		return nil, err
	}
	return applyNetwork(ctx, n, hostname, report)
}

func (s *vmSystem) setHostname(name string) error { return unix.Sethostname([]byte(name)) }

func (s *vmSystem) mountTmpfs(target string, t proto.TmpfsMount) error {
	if err := mountTmpfs(target, t); err != nil {
		return err
	}
	s.mounted = append(s.mounted, target)
	return nil
}

func (s *vmSystem) mountData(device, target string, readOnly bool) error {
	if err := waitForDisk(device, s.deviceWait); err != nil {
		return err
	}
	if err := mountData(device, target, readOnly); err != nil {
		return err
	}
	s.mounted = append(s.mounted, target)
	return nil
}

func (s *vmSystem) blockDevice(bdf string) (string, error) {
	return pciBlockDevice("/sys", bdf, s.deviceWait)
}

func (s *vmSystem) unmountData(target string) error {
	if err := unmountData(target); err != nil {
		return err
	}
	for i, m := range s.mounted {
		if m == target {
			s.mounted = append(s.mounted[:i], s.mounted[i+1:]...)
			break
		}
	}
	return nil
}

func (s *vmSystem) watchPowerButton(press func()) int {
	return watchPowerButtons("/sys", "/dev", press)
}

// prepareRoot gives the workload its own /proc and /sys and the guest's
// /dev.
func (s *vmSystem) prepareRoot(root string) error {
	const nodev = unix.MS_NOSUID | unix.MS_NODEV | unix.MS_NOEXEC
	if err := s.mount("proc", root+"/proc", "proc", nodev, ""); err != nil {
		return err
	}
	if err := s.mount("sysfs", root+"/sys", "sysfs", nodev, ""); err != nil {
		return err
	}
	return s.mount("/dev", root+"/dev", "", unix.MS_BIND|unix.MS_REC, "")
}

// poweroff stops everything that is left, detaches the mounts so the
// filesystems are clean, and powers the VM off. It never returns.
func (s *vmSystem) poweroff(code int) {
	unix.Kill(-1, unix.SIGTERM)
	time.Sleep(500 * time.Millisecond)
	unix.Kill(-1, unix.SIGKILL)
	unix.Sync()
	for i := len(s.mounted) - 1; i >= 0; i-- {
		unix.Unmount(s.mounted[i], unix.MNT_DETACH)
	}
	unix.Sync()
	s.log.Info("powering off", "agent_status", code)
	for {
		if err := unix.Reboot(unix.LINUX_REBOOT_CMD_POWER_OFF); err != nil {
			s.log.Error("poweroff", "err", err)
		}
		// PID 1 must not exit: the kernel would panic.
		time.Sleep(time.Second)
	}
}
