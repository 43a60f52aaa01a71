package guest

import (
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"vmhost/appvm/guest/proto"
)

// execChunk is the most output one frame carries.
const execChunk = 32 << 10

// After the process ended its output is forwarded until end of file, or
// until it stayed silent for execDrainIdle (a child keeps it open), or for
// at most execDrainMax in all (a child keeps writing).
const (
	execDrainIdle = time.Second
	execDrainMax  = 10 * time.Second
)

// stdinQueue bounds the input frames held while the process does not read:
// beyond it the agent stops reading the connection (back-pressure).
const stdinQueue = 8

// defaultCols and defaultRows size a terminal the request left unsized.
const defaultCols, defaultRows = 80, 24

// stdinItem is one input frame, or the end of input.
type stdinItem struct {
	data []byte
	eof  bool
}

// execOp is one running exec.
type execOp struct {
	a   *agent
	c   net.Conn
	fc  *proto.FrameConn
	pid int
	tty *os.File // the terminal's master, nil without a TTY
	// stdin is where input goes (the pipe's write end, or the master).
	stdin *os.File
	// outputs are read until end of file (the pipes' read ends, or the
	// master).
	outputs []*os.File
	queue   chan stdinItem

	// ended is set once the process was reaped: no kill after it, and
	// the output is drained from then on (endedAt).
	ended   atomic.Bool
	endedAt time.Time
	// timedOut is set when the timeout killed the process.
	timedOut atomic.Bool
	// gone is closed when the host vanished (or broke the protocol).
	gone     chan struct{}
	goneOnce sync.Once
}

// opExec starts req beside the workload and runs it to its end. Errors
// before the start are returned (FrameError); afterwards the end is the
// Exit frame.
func (a *agent) opExec(c net.Conn, fc *proto.FrameConn, oc *opsContext, req *proto.ExecRequest) error {
	root := a.opts.root
	acc := oc.acc
	if req.User != "" {
		u, err := lookupUser(root, req.User)
		if err != nil {
			return opFail(proto.ErrBadRequest, "user: %v", err)
		}
		acc = u
	}
	workdir := req.Workdir
	if workdir == "" {
		workdir = oc.spec.Workdir
	}
	if workdir == "" {
		workdir = "/"
	}
	// An exec creates nothing: its working directory must exist.
	if h, err := inRoot(root, workdir); err != nil {
		return opFail(proto.ErrBadRequest, "workdir: %v", err)
	} else if fi, err := os.Stat(h); err != nil || !fi.IsDir() {
		return opFail(proto.ErrBadRequest, "workdir %q is not a directory in the workload's root", workdir)
	}
	env := oc.env
	if req.User != "" {
		// Another user's HOME, as a login would give (unless Env sets one).
		env = mergeEnv(env, []string{"HOME=" + acc.home})
	}
	cmd, err := a.command(req.Command, mergeEnv(env, req.Env), workdir, acc)
	if err != nil {
		return opFail(proto.ErrBadRequest, "%v", err)
	}
	x := &execOp{a: a, c: c, fc: fc, queue: make(chan stdinItem, stdinQueue), gone: make(chan struct{})}
	var childEnds []*os.File
	closeAll := func(fs []*os.File) {
		for _, f := range fs {
			f.Close()
		}
	}
	if req.TTY {
		master, slave, err := openPTY()
		if err != nil {
			return fmt.Errorf("opening a terminal: %w", err)
		}
		cols, rows := req.Cols, req.Rows
		if cols == 0 || rows == 0 {
			cols, rows = defaultCols, defaultRows
		}
		if err := setWinsize(master, cols, rows); err != nil {
			closeAll([]*os.File{master, slave})
			return fmt.Errorf("sizing the terminal: %w", err)
		}
		if switchesUsers() {
			// The terminal belongs to its user, as login programs make it.
			slave.Chown(int(acc.uid), int(acc.gid))
			slave.Chmod(0o620)
		}
		cmd.Stdin, cmd.Stdout, cmd.Stderr = slave, slave, slave
		// A session of its own whose controlling terminal is the slave
		// (setsid, then TIOCSCTTY on the child's fd 0).
		cmd.SysProcAttr.Setpgid = false
		cmd.SysProcAttr.Setsid = true
		cmd.SysProcAttr.Setctty = true
		cmd.SysProcAttr.Ctty = 0
		x.tty, x.stdin, x.outputs = master, master, []*os.File{master}
		childEnds = []*os.File{slave}
	} else {
		var ends [6]*os.File
		for i := 0; i < 6; i += 2 {
			if ends[i], ends[i+1], err = os.Pipe(); err != nil {
				closeAll(ends[:i])
				return err
			}
		}
		cmd.Stdin, cmd.Stdout, cmd.Stderr = ends[0], ends[3], ends[5]
		x.stdin, x.outputs = ends[1], []*os.File{ends[2], ends[4]}
		childEnds = []*os.File{ends[0], ends[3], ends[5]}
	}
	pid, status, err := a.reaper.start(cmd)
	closeAll(childEnds)
	if err != nil {
		closeAll(append(x.outputs, x.stdin))
		return opFail(proto.ErrBadRequest, "starting %q: %v", req.Command[0], err)
	}
	x.pid = pid
	a.log.Info("exec started", "pid", pid, "tty", req.TTY)
	if err := x.write(proto.FrameStarted, []byte(`{"pid":`+strconv.Itoa(pid)+`}`)); err != nil {
		x.hostGone()
	}
	x.run(status, time.Duration(req.TimeoutSecs)*time.Second)
	return nil
}

// run forwards input and output until the process ends, then sends its
// exit status.
func (x *execOp) run(status <-chan syscall.WaitStatus, timeout time.Duration) {
	var pumps sync.WaitGroup
	for i, f := range x.outputs {
		typ := proto.FrameStdout
		if i == 1 {
			typ = proto.FrameStderr
		}
		pumps.Add(1)
		go func() {
			defer pumps.Done()
			x.pump(typ, f)
		}()
	}
	// The feeder and the host reader end with the connection, which
	// closes after the exit frame.
	go x.feed()
	go x.readHost()

	timer := time.NewTimer(timeout)
	defer timer.Stop()
	gone := x.gone
	var ws syscall.WaitStatus
wait:
	for {
		select {
		case ws = <-status:
			break wait
		case <-timer.C:
			x.timedOut.Store(true)
			x.kill()
		case <-gone:
			x.kill()
			// Once: the process dies, and its status follows.
			gone = nil
		}
	}
	// Output the process wrote before its end comes first, all of it
	// however slow the host; a child that keeps the output open must not
	// hold the exit for long.
	x.endedAt = time.Now()
	x.ended.Store(true)
	for _, f := range x.outputs {
		f.SetReadDeadline(x.drainDeadline())
	}
	pumps.Wait()
	// Input nobody reads any more: a feeder blocked on it fails and
	// drops the rest.
	x.stdin.Close()
	for _, f := range x.outputs {
		f.Close()
	}
	x.write(proto.FrameExit, exitPayload(ws, x.timedOut.Load()))
	x.a.log.Info("exec ended", "pid", x.pid, "status", fmt.Sprint(ws))
	// The connection closes (serveOp); the host reader ends with it.
}

// exitPayload encodes the exit status.
func exitPayload(ws syscall.WaitStatus, timedOut bool) []byte {
	e := exitMessage(ws)
	var b strings.Builder
	if e.Signal != 0 {
		b.WriteString(`{"signal":` + strconv.Itoa(e.Signal))
		if timedOut {
			b.WriteString(`,"timed_out":true`)
		}
	} else {
		b.WriteString(`{"exit_code":` + strconv.Itoa(*e.Code))
	}
	b.WriteString("}")
	return []byte(b.String())
}

// drainDeadline is when a read of the output gives up once the process
// ended. Call it only after ended is set.
func (x *execOp) drainDeadline() time.Time {
	idle, last := time.Now().Add(execDrainIdle), x.endedAt.Add(execDrainMax)
	if idle.After(last) {
		return last
	}
	return idle
}

// write sends one frame; a host that takes none for stallTimeout is gone.
func (x *execOp) write(t proto.FrameType, p []byte) error {
	x.c.SetWriteDeadline(time.Now().Add(stallTimeout))
	return x.fc.WriteFrame(t, p)
}

// pump forwards one output as frames until its end of file. The frame
// write blocks while the host does not read, and the process's writes
// block once the pipe (or the terminal) is full: back-pressure without a
// buffer of ours.
func (x *execOp) pump(t proto.FrameType, f *os.File) {
	buf := make([]byte, execChunk)
	for {
		if x.ended.Load() {
			f.SetReadDeadline(x.drainDeadline())
		}
		n, err := f.Read(buf)
		if n > 0 {
			if werr := x.write(t, buf[:n]); werr != nil {
				x.hostGone()
				return
			}
		}
		if err != nil {
			// A terminal's master reads EIO once no one holds the slave.
			return
		}
	}
}

// readHost takes the host's frames: input, end of input, resizes. The
// connection's end (or a frame the host may not send) means the host is
// gone.
func (x *execOp) readHost() {
	defer close(x.queue)
	eof := false
	for {
		t, p, err := x.fc.ReadFrame()
		if err != nil {
			x.hostGone()
			return
		}
		switch t {
		case proto.FrameStdin:
			if len(p) > 0 && !eof {
				x.queue <- stdinItem{data: append([]byte(nil), p...)}
			}
		case proto.FrameStdinClosed:
			if !eof {
				eof = true
				x.queue <- stdinItem{eof: true}
			}
		case proto.FrameResize:
			var r proto.Resize
			if err := proto.DecodeJSON(p, &r); err != nil || r.Cols < 0 || r.Cols > 0xffff || r.Rows < 0 || r.Rows > 0xffff {
				x.a.log.Warn("exec: a malformed resize from the host", "err", err)
				x.hostGone()
				return
			}
			if x.tty != nil {
				setWinsize(x.tty, r.Cols, r.Rows)
			}
		default:
			x.a.log.Warn("exec: a frame the host may not send", "type", t)
			x.hostGone()
			return
		}
	}
}

// feed writes the queued input to the process. Without a terminal the end
// of input closes the pipe; with one it types the end-of-file character.
// Once the input fails (the process ended) the rest is dropped.
func (x *execOp) feed() {
	broken := false
	for it := range x.queue {
		if broken {
			continue
		}
		var err error
		switch {
		case it.eof && x.tty != nil:
			_, err = x.stdin.Write([]byte{0x04})
		case it.eof:
			err = x.stdin.Close()
		default:
			_, err = x.stdin.Write(it.data)
		}
		broken = err != nil
	}
}

// hostGone records that the host vanished: run kills the process.
func (x *execOp) hostGone() {
	x.goneOnce.Do(func() { close(x.gone) })
}

// kill ends the process, its process group (or session) and every
// descendant still below it, unless it was already reaped.
func (x *execOp) kill() {
	if x.ended.Load() {
		return
	}
	desc := descendants(x.pid)
	x.a.reaper.signalGroup(x.pid, syscall.SIGKILL)
	for _, p := range desc {
		unix.Kill(p, syscall.SIGKILL)
	}
}

// descendants lists the processes below pid (children first).
func descendants(pid int) []int {
	var out []int
	queue := []int{pid}
	for len(queue) > 0 && len(out) < 100000 {
		kids := childrenOf(queue[0])
		queue = append(queue[1:], kids...)
		out = append(out, kids...)
	}
	return out
}

// mergeEnv returns base with the KEY=VALUE items of extra added, an item
// replacing one of base with the same key.
func mergeEnv(base, extra []string) []string {
	out := append([]string(nil), base...)
	for _, e := range extra {
		k, _, _ := strings.Cut(e, "=")
		replaced := false
		for i, b := range out {
			if bk, _, _ := strings.Cut(b, "="); bk == k {
				out[i], replaced = e, true
				break
			}
		}
		if !replaced {
			out = append(out, e)
		}
	}
	return out
}

// openPTY opens a pseudo-terminal pair: /dev/ptmx, unlocked, and the slave
// it names (TIOCGPTN). The master is non-blocking (for deadlines and
// Close to interrupt reads); the slave is for the child.
func openPTY() (master, slave *os.File, err error) {
	fd, err := unix.Open("/dev/ptmx", unix.O_RDWR|unix.O_NOCTTY|unix.O_CLOEXEC|unix.O_NONBLOCK, 0)
	if err != nil {
		return nil, nil, fmt.Errorf("opening /dev/ptmx: %w", err)
	}
	fail := func(what string, err error) (*os.File, *os.File, error) {
		unix.Close(fd)
		return nil, nil, fmt.Errorf("%s: %w", what, err)
	}
	if err := unix.IoctlSetPointerInt(fd, unix.TIOCSPTLCK, 0); err != nil {
		return fail("unlocking the terminal", err)
	}
	n, err := unix.IoctlGetUint32(fd, unix.TIOCGPTN)
	if err != nil {
		return fail("finding the terminal's number", err)
	}
	name := "/dev/pts/" + strconv.FormatUint(uint64(n), 10)
	sfd, err := unix.Open(name, unix.O_RDWR|unix.O_NOCTTY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fail("opening "+name, err)
	}
	return os.NewFile(uintptr(fd), "/dev/ptmx"), os.NewFile(uintptr(sfd), name), nil
}

// setWinsize sets the terminal's size (TIOCSWINSZ on the master; the
// foreground process group gets SIGWINCH).
func setWinsize(master *os.File, cols, rows int) error {
	rc, err := master.SyscallConn()
	if err != nil {
		return err
	}
	var ierr error
	err = rc.Control(func(fd uintptr) {
		ierr = unix.IoctlSetWinsize(int(fd), unix.TIOCSWINSZ, &unix.Winsize{Row: uint16(rows), Col: uint16(cols)})
	})
	if err != nil {
		return err
	}
	return ierr
}
