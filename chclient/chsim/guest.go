package chsim

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// GuestAgentEnv is set to "1" in the environment of the guest agent the simulator starts,
// so a test binary that re-executes itself can tell it must run the agent.
const GuestAgentEnv = "CHSIM_GUEST_AGENT"

// DefaultGuestHeartbeat is the heartbeat interval passed to the guest agent unless
// --sim-guest-heartbeat says otherwise.
const DefaultGuestHeartbeat = time.Second

// guestVsockPort is the host port the guest agent dials (appvm/guest/proto.Port); chsim
// cannot import the protocol package (it is a leaf), so the number is repeated here.
const guestVsockPort = 1024

// guestHaltSignal is appvm/guest.HaltSignal, repeated for the same reason: it ends a
// process-mode agent with every process below it (the agent kills and reaps them first).
// The agent also halts once its --vmm-fd pipe is closed by every holder (this simulator,
// or the keeper of a suspended guest): it outlives a simulator only while a saved state
// needs it.
const guestHaltSignal = syscall.Signal(40)

// guestHaltWait bounds the wait for a halted agent; then its process group is killed.
const guestHaltWait = 5 * time.Second

// guestAgent is one run of the AppVM guest agent as a host process: what an AppVM's
// initramfs /init would be inside a real VM. It is this simulator's child, or one a
// simulator before it started and kept with a saved state (adopted: keep_linux.go).
type guestAgent struct {
	pid  int
	done chan struct{}
	nic  *guestNIC // the guest's NIC when the agent runs in its own network namespace
	// listen is the agent's GuestListenPrefix: its vsock ports are <listen>_<port>.
	listen string
	// vmm is the write end of the agent's --vmm-fd pipe: the agent halts once every
	// holder has closed it (this simulator's exit, however it comes).
	vmm *os.File

	mu     sync.Mutex
	exited bool
	// halting is set when the simulator halts the agent: its exit is then no poweroff.
	halting bool
}

// wantsGuestAgentLocked reports whether the booted VM is an AppVM the simulator should run
// the guest agent for: it has a vsock device and boots a kernel with an initramfs (the
// vmhost initramfs holds the agent as /init).
func (s *sim) wantsGuestAgentLocked() bool {
	return !s.cfg.NoGuestAgent && !s.qemuMode() && s.vm != nil && s.vm.Vsock != nil && s.vm.Payload != nil &&
		s.vm.Payload.Initramfs != nil
}

// guestNetworkLocked reports whether the guest agent gets a network namespace and a NIC:
// as root, unless --sim-no-guest-network, for a VM whose first interface has a tap the
// simulator attached.
func (s *sim) guestNetworkLocked() bool {
	return !s.cfg.NoGuestNetwork && os.Geteuid() == 0 && len(s.vm.Net) > 0 && s.vm.Net[0].Tap != nil && len(s.taps) > 0
}

// GuestRoot is the directory the simulator gives the guest agent as its workload root for
// the VM whose hybrid vsock socket is vsockSocket: "<socket>.root". It stands in for the
// guest's root disk and is kept across boots.
func GuestRoot(vsockSocket string) string { return vsockSocket + ".root" }

// GuestListenPrefix is where the guest agent listens for what reaches its vsock ports:
// the unix socket "<prefix>_<port>" for guest port port, "<socket>.guest_<port>". A host
// CONNECT to a port with such a socket is routed there (vsock.go).
func GuestListenPrefix(vsockSocket string) string { return vsockSocket + ".guest" }

// startGuestAgentLocked starts the guest agent for the current boot. Its exit is the
// guest's poweroff; its death by a signal leaves the VM running without an agent (a real
// guest whose init died panics and stops answering).
func (s *sim) startGuestAgentLocked() error {
	if !s.wantsGuestAgentLocked() {
		return nil
	}
	bin := s.cfg.GuestAgentBinary
	if bin == "" {
		exe, err := os.Executable()
		if err != nil {
			return fmt.Errorf("finding the vmhost binary for the guest agent: %w", err)
		}
		bin = exe
	}
	root := GuestRoot(s.vm.Vsock.Socket)
	if err := os.MkdirAll(root, 0o755); err != nil {
		return fmt.Errorf("creating guest root: %w", err)
	}
	hb := s.cfg.GuestHeartbeat
	if hb <= 0 {
		hb = DefaultGuestHeartbeat
	}
	args := []string{"guest", "--transport", fmt.Sprintf("unix:%s_%d", s.vm.Vsock.Socket, guestVsockPort),
		"--root", root, "--heartbeat", hb.String(), "--listen", "unix:" + GuestListenPrefix(s.vm.Vsock.Socket)}
	if s.cfg.GuestChroot {
		args = append(args, "--chroot")
	}
	// The agent's end of the VMM: fd 3, the read end of a pipe only this process writes.
	vmmR, vmmW, err := os.Pipe()
	if err != nil {
		return fmt.Errorf("starting the guest agent: %w", err)
	}
	defer vmmR.Close()
	args = append(args, "--vmm-fd", "3")
	cmd := exec.Command(bin, args...)
	cmd.ExtraFiles = []*os.File{vmmR}
	cmd.Env = append(os.Environ(), GuestAgentEnv+"=1")
	// The agent's stderr is the guest's console: it goes to the serial port's log here,
	// the simulator's own log.
	logPath := filepath.Join(filepath.Dir(s.vm.Vsock.Socket), filepath.Base(s.vm.Vsock.Socket)+".guest.log")
	logFile, err := os.OpenFile(logPath, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		vmmW.Close()
		return fmt.Errorf("opening guest agent log: %w", err)
	}
	defer logFile.Close()
	cmd.Stdout, cmd.Stderr = logFile, logFile
	cmd.SysProcAttr = agentProcAttr()
	if s.cfg.GuestChroot && os.Geteuid() != 0 {
		// Without root, chroot needs a user namespace: the agent is root in one
		// that maps only the simulator's own ids, so it owns the tree the host
		// unpacked (as root), and runs the workload as itself whatever user the
		// image names.
		rootless(cmd.SysProcAttr)
	}
	g := &guestAgent{done: make(chan struct{}), listen: GuestListenPrefix(s.vm.Vsock.Socket), vmm: vmmW}
	if s.guestNetworkLocked() {
		// As root, the guest gets a network namespace whose eth0 is wired to the VM's
		// first tap, and the agent configures it.
		cmd.Args = append(cmd.Args, "--network")
		nic, err := startInNetns(cmd, s.vm.Net[0].Mac)
		if err != nil {
			vmmW.Close()
			return fmt.Errorf("starting the guest agent in its network namespace: %w", err)
		}
		g.nic = nic
		nic.pump(s.taps[0])
	} else if err := cmd.Start(); err != nil {
		vmmW.Close()
		return fmt.Errorf("starting the guest agent: %w", err)
	}
	g.pid = cmd.Process.Pid
	s.agent = g
	gen := s.bootGen
	s.logf(1, "guest agent started, pid %d", g.pid)
	go func() {
		err := cmd.Wait()
		g.mu.Lock()
		g.exited = true
		g.mu.Unlock()
		close(g.done)
		st := cmd.ProcessState
		if ws, ok := st.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
			s.logf(0, "guest agent killed by signal %d; the guest keeps running without it", ws.Signal())
			return
		}
		s.logf(1, "guest agent exited (%v): the guest powers off", err)
		s.guestPoweroff(gen)
	}()
	return nil
}

// signal sends sig to the agent's process group unless it has already exited.
func (g *guestAgent) signal(sig syscall.Signal) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.exited {
		return fmt.Errorf("the guest agent has exited")
	}
	return unix.Kill(-g.pid, sig)
}

// stopGuestAgentLocked ends the guest (stop, delete, VMM exit, or a reset before a
// reboot): it halts the agent, which kills and reaps its workload and every process below
// it (orphans and processes that left their session included, as the agent is their
// subreaper), and waits for that; an agent that does not end in guestHaltWait has its
// process group killed. The agent's listening sockets go with the guest's vsock ports.
func (s *sim) stopGuestAgentLocked() {
	g := s.agent
	if g == nil || s.keepGuestAgentLocked() {
		return
	}
	s.agent = nil
	g.haltOnly()
	// A stopped (paused) agent must run to take the halt.
	g.signal(syscall.SIGCONT)
	select {
	case <-g.done:
	case <-time.After(guestHaltWait):
		s.logf(0, "guest agent did not end %v after the halt; killing it", guestHaltWait)
		g.signal(syscall.SIGKILL)
		g.signal(syscall.SIGCONT)
	}
	g.vmm.Close()
	if g.nic != nil {
		g.nic.close()
	}
	socks, _ := filepath.Glob(g.listen + "_*")
	for _, p := range socks {
		os.Remove(p)
	}
}

// haltOnly sends the halt to the agent process alone (not its group: the agent itself
// ends its workload), unless it has already exited.
func (g *guestAgent) haltOnly() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.halting = true
	if !g.exited {
		unix.Kill(g.pid, guestHaltSignal)
	}
}

// hasExited reports whether the agent's process has ended.
func (g *guestAgent) hasExited() bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.exited
}

// pauseGuestAgentLocked freezes (SIGSTOP) or thaws (SIGCONT) the guest with the VM: the
// agent and every process below it (the workload runs in a process group of its own).
func (s *sim) pauseGuestAgentLocked(pause bool) {
	if s.agent == nil {
		return
	}
	sig := syscall.SIGCONT
	if pause {
		sig = syscall.SIGSTOP
	}
	s.agent.signalTree(sig)
}

// signalTree sends sig to the agent and to every process below it. For SIGSTOP it looks
// again until a pass finds no process it has not stopped, so a child forked meanwhile
// (by a process not yet stopped) is stopped too.
func (g *guestAgent) signalTree(sig syscall.Signal) {
	if g.hasExited() {
		return
	}
	done := map[int]bool{}
	for range 10 {
		fresh := false
		for _, pid := range processTree(g.pid) {
			if !done[pid] {
				done[pid] = true
				fresh = true
				unix.Kill(pid, sig)
			}
		}
		if !fresh || sig != syscall.SIGSTOP {
			return
		}
	}
}

// agentPidLocked is the agent's pid, 0 when none runs.
func (s *sim) agentPidLocked() int {
	if s.agent == nil {
		return 0
	}
	s.agent.mu.Lock()
	defer s.agent.mu.Unlock()
	if s.agent.exited {
		return 0
	}
	return s.agent.pid
}

// signalAgentOnly sends sig to the agent process alone (not its workload), for
// /sim/v1/guest-agent.
func (s *sim) signalAgentOnly(sig syscall.Signal) error {
	s.mu.Lock()
	pid := s.agentPidLocked()
	s.mu.Unlock()
	if pid == 0 {
		return fmt.Errorf("no guest agent is running")
	}
	return unix.Kill(pid, sig)
}

// processTree is pid and every process below it, parents before their children, read
// from /proc.
func processTree(pid int) []int {
	ents, _ := os.ReadDir("/proc")
	children := map[int][]int{}
	for _, e := range ents {
		p, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile("/proc/" + e.Name() + "/stat")
		if err != nil {
			continue
		}
		i := bytes.LastIndexByte(b, ')')
		if i < 0 {
			continue
		}
		f := strings.Fields(string(b[i+1:]))
		if len(f) < 2 {
			continue
		}
		if pp, err := strconv.Atoi(f[1]); err == nil {
			children[pp] = append(children[pp], p)
		}
	}
	out := []int{pid}
	for i := 0; i < len(out); i++ {
		out = append(out, children[out[i]]...)
	}
	return out
}
