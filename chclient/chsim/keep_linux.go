package chsim

import (
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"vmhost/proc"
)

// A suspended process-mode guest (docs/ref/cloud-hypervisor.md §10 for what CH does; this
// is the simulator's stand-in for guest memory). A real guest's memory is in the saved
// state's files; here the guest is the agent's processes, frozen (SIGSTOP) while the VM is
// paused. When a paused VM whose state was saved since its last resume is stopped (the
// VMM's exit, vm.shutdown, vm.delete), the simulator keeps its agent frozen instead of
// halting it: it starts a keeper, a small process of this binary that holds the agent's
// --vmm-fd pipe (so the agent outlives the simulator) and the saved states' state.json
// files open. The simulator that restores one of those states adopts the agent: it takes
// the pipe from the keeper over an abstract unix socket, watches the agent through a
// pidfd, reattaches its NIC, and continues it with the VM's resume. The keeper ends the
// agent (closing the pipe; the agent halts, killing everything below it) once none of the
// saved states exists any more (each state.json it holds is unlinked), so a discarded or
// deleted state leaves no process behind.
//
// Limits: a state taken from a VM that ran on afterwards has no process to keep (a host
// process cannot be copied); restoring it starts the agent afresh, its workload again,
// with the guest root as the state saved it (guestroot.go). An adopted agent is no child
// of the simulator, so its exit status is not known: any exit not asked for is a poweroff.

// keptAgent names, in a saved state (state.json's chsim.guest_agent), the agent holding
// the guest.
type keptAgent struct {
	Pid       int    `json:"pid"`
	StartTime uint64 `json:"start_time"`
	Netns     bool   `json:"netns,omitempty"` // its eth0 is in a network namespace of its own
}

// keeperFlag runs the keeper (Main).
const keeperFlag = "--sim-keep-guest"

// keeperAddr is the abstract unix socket of the keeper of agent pid (start time start).
func keeperAddr(pid int, start uint64) string { return fmt.Sprintf("@chsim-keep-%d-%d", pid, start) }

// saveGuestAgentLocked is the agent's part of a snapshot: who it is, so that a restore can
// adopt it if it is still kept.
func (s *sim) saveGuestAgentLocked() json.RawMessage {
	g := s.agent
	if g == nil || g.hasExited() {
		return nil
	}
	start, err := proc.StartTime(g.pid)
	if err != nil {
		return nil
	}
	b, _ := json.Marshal(keptAgent{Pid: g.pid, StartTime: start, Netns: g.nic != nil})
	return b
}

// noteSavedLocked records that the guest as it is now was saved in dir (a snapshot of the
// paused VM, or the state it was restored from): its agent is kept for that state if the
// VM stops before it runs again.
func (s *sim) noteSavedLocked(dir string) {
	if s.agent == nil {
		return
	}
	f, err := os.Open(filepath.Join(dir, snapshotStateFile))
	if err != nil {
		return
	}
	s.saved = append(s.saved, f)
}

// dropSavedLocked forgets the saved states: the guest runs on and differs from them.
func (s *sim) dropSavedLocked() {
	for _, f := range s.saved {
		f.Close()
	}
	s.saved = nil
}

// keepGuestAgentLocked hands the agent of a paused VM whose state was saved since its last
// resume to a keeper, instead of halting it, and reports whether it did.
func (s *sim) keepGuestAgentLocked() bool {
	g := s.agent
	if g == nil || s.state != statePaused || len(s.saved) == 0 || g.hasExited() || len(keeperArgv) == 0 {
		return false
	}
	start, err := proc.StartTime(g.pid)
	if err != nil {
		return false
	}
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: keeperAddr(g.pid, start), Net: "unix"})
	if err != nil {
		s.logf(0, "Error: keeping the guest agent: %v", err)
		return false
	}
	lf, err := l.File()
	l.Close()
	if err != nil {
		s.logf(0, "Error: keeping the guest agent: %v", err)
		return false
	}
	defer lf.Close()
	if g.nic != nil {
		if err := g.nic.persist(true); err != nil {
			s.logf(0, "Error: keeping the guest agent's NIC: %v", err)
			return false
		}
	}
	args := append(append([]string(nil), keeperArgv[1:]...), keeperFlag, s.vm.Vsock.Socket,
		strconv.Itoa(g.pid), strconv.FormatUint(start, 10), strconv.Itoa(len(s.saved)))
	cmd := exec.Command(keeperArgv[0], args...)
	cmd.ExtraFiles = append([]*os.File{lf, g.vmm}, s.saved...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		if g.nic != nil {
			g.nic.persist(false)
		}
		s.logf(0, "Error: starting the keeper of the guest agent: %v", err)
		return false
	}
	go cmd.Wait()
	s.logf(1, "guest agent pid %d kept with its saved state (keeper pid %d)", g.pid, cmd.Process.Pid)
	g.vmm.Close()
	if g.nic != nil {
		g.nic.close() // eth0 persists in the agent's namespace
	}
	s.dropSavedLocked()
	s.agent = nil
	return true
}

// adoptGuestAgentLocked takes over the agent k of a restored state from its keeper, or
// says why it cannot (no keeper: the agent was never kept, or is gone).
func (s *sim) adoptGuestAgentLocked(k keptAgent) (*guestAgent, error) {
	if k.Pid <= 0 {
		return nil, errors.New("the saved state names no guest agent")
	}
	a, err := proc.Adopt(k.Pid, k.StartTime)
	if err != nil {
		return nil, fmt.Errorf("guest agent pid %d: %w", k.Pid, err)
	}
	vmm, err := takeFromKeeper(keeperAddr(k.Pid, k.StartTime))
	if err != nil {
		a.Close()
		return nil, err
	}
	g := &guestAgent{pid: k.Pid, done: make(chan struct{}), listen: GuestListenPrefix(s.vm.Vsock.Socket), vmm: vmm}
	if k.Netns && len(s.taps) > 0 {
		nic, err := reopenGuestNIC(k.Pid)
		if err != nil {
			s.logf(0, "Error: reattaching the guest's NIC: %v", err)
		} else {
			nic.persist(false)
			g.nic = nic
			nic.pump(s.taps[0])
		}
	}
	gen := s.bootGen
	go func() {
		<-a.Done()
		a.Close()
		g.mu.Lock()
		g.exited = true
		halting := g.halting
		g.mu.Unlock()
		close(g.done)
		if !halting {
			s.logf(1, "guest agent pid %d exited: the guest powers off", k.Pid)
			s.guestPoweroff(gen)
		}
	}()
	s.logf(1, "guest agent pid %d adopted from its keeper", k.Pid)
	return g, nil
}

// takeFromKeeper connects to a keeper and receives the agent's --vmm-fd pipe; the keeper
// then exits.
func takeFromKeeper(addr string) (*os.File, error) {
	c, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: addr, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("no keeper holds the guest agent: %w", err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	buf, oob := make([]byte, 16), make([]byte, unix.CmsgSpace(4))
	_, oobn, _, _, err := c.ReadMsgUnix(buf, oob)
	if err != nil {
		return nil, fmt.Errorf("taking the guest agent from its keeper: %w", err)
	}
	msgs, err := unix.ParseSocketControlMessage(oob[:oobn])
	if err != nil || len(msgs) != 1 {
		return nil, fmt.Errorf("taking the guest agent from its keeper: no descriptor (%v)", err)
	}
	fds, err := unix.ParseUnixRights(&msgs[0])
	if err != nil || len(fds) != 1 {
		return nil, fmt.Errorf("taking the guest agent from its keeper: no descriptor (%v)", err)
	}
	unix.CloseOnExec(fds[0])
	return os.NewFile(uintptr(fds[0]), "guest-agent-vmm"), nil
}

// runKeeper is the keeper: args are the VM's vsock socket (for the process list), the
// agent's pid, its start time and how many saved states it holds; fd 3 is its listening
// socket, fd 4 the agent's pipe, fd 5 on the states' state.json files. It hands the pipe to
// the first simulator that connects, or ends the agent once every state is gone (or just
// exits when the agent is).
func runKeeper(args []string) int {
	if len(args) != 4 {
		fmt.Fprintln(os.Stderr, "usage: sim-ch "+keeperFlag+" VSOCK-SOCKET PID START-TIME STATES")
		return 2
	}
	pid, err1 := strconv.Atoi(args[1])
	start, err2 := strconv.ParseUint(args[2], 10, 64)
	n, err3 := strconv.Atoi(args[3])
	if err := errors.Join(err1, err2, err3); err != nil {
		fmt.Fprintln(os.Stderr, "keeper:", err)
		return 2
	}
	lf := os.NewFile(3, "keeper")
	vmm := os.NewFile(4, "vmm")
	var states []*os.File
	for i := range n {
		states = append(states, os.NewFile(uintptr(5+i), "state"))
	}
	l, err := net.FileListener(lf)
	lf.Close()
	if err != nil {
		fmt.Fprintln(os.Stderr, "keeper:", err)
		return 1
	}
	handed := make(chan struct{})
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			_, _, err = c.(*net.UnixConn).WriteMsgUnix([]byte("vmm"), unix.UnixRights(int(vmm.Fd())), nil)
			c.Close()
			if err == nil {
				close(handed)
				return
			}
		}
	}()
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-handed:
			return 0
		case <-tick.C:
		}
		if !proc.Alive(pid, start) {
			return 0
		}
		gone := true
		for _, f := range states {
			var st unix.Stat_t
			if unix.Fstat(int(f.Fd()), &st) == nil && st.Nlink > 0 {
				gone = false
			}
		}
		if !gone {
			continue
		}
		// No state needs the guest: it halts (killing its processes) once it runs and
		// finds the pipe closed.
		l.Close()
		vmm.Close()
		unix.Kill(pid, guestHaltSignal)
		unix.Kill(-pid, syscall.SIGCONT)
		deadline := time.Now().Add(guestHaltWait)
		for proc.Alive(pid, start) && time.Now().Before(deadline) {
			time.Sleep(20 * time.Millisecond)
		}
		if proc.Alive(pid, start) {
			unix.Kill(-pid, syscall.SIGKILL)
			unix.Kill(-pid, syscall.SIGCONT)
		}
		return 0
	}
}

// persist makes the guest's tap outlive its file descriptor (TUNSETPERSIST), or not.
func (n *guestNIC) persist(on bool) error {
	v := 0
	if on {
		v = 1
	}
	rc, err := n.file.SyscallConn()
	if err != nil {
		return err
	}
	var serr error
	if err := rc.Control(func(fd uintptr) { serr = unix.IoctlSetInt(int(fd), unix.TUNSETPERSIST, v) }); err != nil {
		return err
	}
	return serr
}

// reopenGuestNIC attaches to the persistent eth0 in the network namespace of process pid.
func reopenGuestNIC(pid int) (*guestNIC, error) {
	type result struct {
		nic *guestNIC
		err error
	}
	done := make(chan result, 1)
	go func() {
		runtime.LockOSThread()
		orig, err := os.Open("/proc/thread-self/ns/net")
		if err != nil {
			done <- result{err: err}
			runtime.UnlockOSThread()
			return
		}
		defer orig.Close()
		target, err := os.Open(fmt.Sprintf("/proc/%d/ns/net", pid))
		if err != nil {
			done <- result{err: err}
			runtime.UnlockOSThread()
			return
		}
		defer target.Close()
		if err := unix.Setns(int(target.Fd()), unix.CLONE_NEWNET); err != nil {
			done <- result{err: fmt.Errorf("entering the guest's network namespace: %w", err)}
			runtime.UnlockOSThread()
			return
		}
		nic, err := attachGuestTap()
		if serr := unix.Setns(int(orig.Fd()), unix.CLONE_NEWNET); serr == nil {
			runtime.UnlockOSThread()
		}
		done <- result{nic: nic, err: err}
	}()
	r := <-done
	return r.nic, r.err
}

// attachGuestTap opens the existing eth0 of the current thread's namespace as
// createGuestTap opened it.
func attachGuestTap() (*guestNIC, error) {
	fd, err := unix.Open("/dev/net/tun", unix.O_RDWR|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("opening /dev/net/tun: %w", err)
	}
	ifr, err := unix.NewIfreq(guestIfName)
	if err != nil {
		unix.Close(fd)
		return nil, err
	}
	ifr.SetUint16(unix.IFF_TAP | unix.IFF_NO_PI | unix.IFF_VNET_HDR)
	if err := unix.IoctlIfreq(fd, unix.TUNSETIFF, ifr); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("attaching to the guest tap: %w", err)
	}
	return &guestNIC{file: os.NewFile(uintptr(fd), "guest-tap:"+guestIfName)}, nil
}
