// Package proc starts and supervises the long-lived helper processes vmhost
// runs per VM (cloud-hypervisor, qemu-storage-daemon), and re-attaches to
// them after an agent restart.
//
// A process is trusted by the pair (pid, start time): the start time is field
// 22 of /proc/PID/stat, in clock ticks since boot, and it changes when a pid is
// reused. Children are started in their own session (setsid) with output
// appended to a log file, so they outlive the agent; a process found again
// after a restart is not a child, so its death is learned through a pidfd.
//
// A process may be started confined (SpawnConfig.Confine; package jail gives
// the VM's jail), and the processes a cgroup lists after a restart are
// described by Members, so the agent can tell which is which and adopt them.
//
// The package targets Linux (/proc, pidfd) and imports none of vmhost's
// packages. It builds elsewhere, where Adopt and Signal fail with an error
// satisfying errors.Is(err, errors.ErrUnsupported).
package proc

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// ErrIdentityMismatch reports that a pid is alive but its start time is not
// the recorded one: the pid was reused by an unrelated process.
var ErrIdentityMismatch = errors.New("process start time does not match the record (pid reused)")

// StartTime returns field 22 of /proc/PID/stat: the process start time in
// clock ticks since boot. It fails with an error satisfying
// errors.Is(err, fs.ErrNotExist) when no such process exists.
func StartTime(pid int) (uint64, error) {
	st, _, err := readStat(pid)
	return st, err
}

// readStat returns the start time and the state letter (R, S, Z, ...) of pid.
func readStat(pid int) (uint64, byte, error) {
	var buf [1024]byte
	b, err := readProcFile("/proc/"+strconv.Itoa(pid)+"/stat", buf[:])
	if err != nil {
		return 0, 0, err
	}
	st, err := parseStartTime(b)
	if err != nil {
		return 0, 0, err
	}
	i := bytes.LastIndexByte(b, ')')
	state := byte('?')
	if i+2 < len(b) {
		state = b[i+2]
	}
	return st, state, nil
}

// readProcFile reads a small /proc file into buf with plain system calls
// (an agent adopting many processes reads one per process: os.ReadFile's
// stat, poller registration and growing buffer cost more than the read).
// A file larger than buf is an error; a missing one satisfies
// errors.Is(err, fs.ErrNotExist).
func readProcFile(path string, buf []byte) ([]byte, error) {
	fd, err := syscall.Open(path, syscall.O_RDONLY|syscall.O_CLOEXEC, 0)
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: path, Err: err}
	}
	defer syscall.Close(fd)
	n := 0
	for {
		if n == len(buf) {
			return nil, fmt.Errorf("%s is larger than %d bytes", path, len(buf))
		}
		m, err := syscall.Read(fd, buf[n:])
		if err == syscall.EINTR {
			continue
		}
		if err != nil {
			if err == syscall.ESRCH { // the process exited after the open
				err = syscall.ENOENT
			}
			return nil, &os.PathError{Op: "read", Path: path, Err: err}
		}
		if m == 0 {
			return buf[:n], nil
		}
		n += m
	}
}

// parseStartTime reads field 22 from a /proc/PID/stat line. The command
// name (field 2) is in parentheses and may itself hold spaces and ')', so
// fields are counted from the last ')'.
func parseStartTime(stat []byte) (uint64, error) {
	i := bytes.LastIndexByte(stat, ')')
	if i < 0 {
		return 0, fmt.Errorf("parsing /proc stat: no command name")
	}
	fields := strings.Fields(string(stat[i+1:]))
	// fields[0] is field 3 (state), so field 22 is fields[19].
	if len(fields) < 20 {
		return 0, fmt.Errorf("parsing /proc stat: %d fields after the command name, want at least 20", len(fields))
	}
	v, err := strconv.ParseUint(fields[19], 10, 64)
	if err != nil {
		return 0, fmt.Errorf("parsing /proc stat start time: %w", err)
	}
	return v, nil
}

// ExitStatus says how a child ended: a Code when it exited, a Signal when a
// signal killed it.
type ExitStatus struct {
	Code   int
	Signal syscall.Signal // 0 unless killed by a signal
}

// Signaled reports whether the process was killed by a signal.
func (e ExitStatus) Signaled() bool { return e.Signal != 0 }

func (e ExitStatus) String() string {
	if e.Signaled() {
		return fmt.Sprintf("killed by signal %d (%v)", int(e.Signal), e.Signal)
	}
	return fmt.Sprintf("exit code %d", e.Code)
}

// SpawnConfig describes a process to start.
type SpawnConfig struct {
	Path    string   // binary
	Args    []string // arguments, without argv[0]
	Dir     string   // working directory; empty means the agent's
	Env     []string // environment; nil means the agent's
	LogFile string   // stdout and stderr are appended here (created 0600)
	// ExtraFiles are inherited as fds 3, 4, ... (exec.Cmd.ExtraFiles).
	ExtraFiles []*os.File
	// Confine, when set, starts the process confined (package jail gives
	// one per VM); nil starts it as the agent's own child, unconfined.
	Confine Confiner
}

// A Confiner starts a process confined: Start does what cmd.Start does,
// and returns only once the process runs confined, or fails with nothing
// left running.
type Confiner interface {
	Start(cmd *exec.Cmd) error
}

// Child is a process this agent started. Its methods are safe for
// concurrent use.
type Child struct {
	Pid       int
	StartTime uint64

	cmd  *exec.Cmd
	done chan struct{}
	exit ExitStatus
}

// Spawn starts cfg.Path in a new session with its output appended to
// cfg.LogFile, and records its pid and start time. The returned Child is
// reaped by a goroutine; Done is closed when it has exited.
func Spawn(cfg SpawnConfig) (*Child, error) {
	var out *os.File
	if cfg.LogFile != "" {
		f, err := openLog(cfg.LogFile)
		if err != nil {
			return nil, err
		}
		defer f.Close() // the child holds its own copy
		out = f
	}
	cmd := exec.Command(cfg.Path, cfg.Args...)
	cmd.Dir = cfg.Dir
	cmd.Env = cfg.Env
	cmd.ExtraFiles = cfg.ExtraFiles
	if out != nil {
		cmd.Stdout, cmd.Stderr = out, out
	}
	// setsid: the child must not share the agent's session or process group,
	// so a terminal's SIGINT or systemd stopping the agent leaves VMs running.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	start := cmd.Start
	if cfg.Confine != nil {
		start = func() error { return cfg.Confine.Start(cmd) }
	}
	if err := start(); err != nil {
		return nil, fmt.Errorf("starting %s: %w", cfg.Path, err)
	}
	// The child cannot be reaped before cmd.Wait, so /proc/PID/stat exists
	// even if it already exited (a zombie keeps its stat).
	st, err := StartTime(cmd.Process.Pid)
	if err != nil {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		return nil, fmt.Errorf("reading start time of pid %d: %w", cmd.Process.Pid, err)
	}
	c := &Child{Pid: cmd.Process.Pid, StartTime: st, cmd: cmd, done: make(chan struct{})}
	go c.reap()
	return c, nil
}

// openLog opens a process's log file for appending, creating it 0600. It
// refuses a symbolic link or anything but a regular file: the directory may
// be a confined process's, which must not make the agent write elsewhere.
func openLog(path string) (*os.File, error) {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_APPEND|syscall.O_NOFOLLOW|syscall.O_NONBLOCK, 0o600)
	if err != nil {
		return nil, fmt.Errorf("opening log file: %w", err)
	}
	if fi, err := f.Stat(); err != nil || !fi.Mode().IsRegular() {
		f.Close()
		if err == nil {
			err = fmt.Errorf("%s is a %v, not a regular file", path, fi.Mode().Type())
		}
		return nil, fmt.Errorf("opening log file: %w", err)
	}
	return f, nil
}

func (c *Child) reap() {
	err := c.cmd.Wait()
	var st ExitStatus
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
			st.Signal = ws.Signal()
		} else {
			st.Code = ee.ExitCode()
		}
	}
	c.exit = st
	close(c.done)
}

// Done is closed once the child has exited and been reaped.
func (c *Child) Done() <-chan struct{} { return c.done }

// Exit returns how the child ended. It blocks until Done is closed.
func (c *Child) Exit() ExitStatus {
	<-c.done
	return c.exit
}

// Signal sends sig to the child unless it has already been reaped.
func (c *Child) Signal(sig os.Signal) error {
	select {
	case <-c.done:
		return os.ErrProcessDone
	default:
	}
	return c.cmd.Process.Signal(sig)
}

// EarlyExitError reports that a process exited before its socket appeared.
type EarlyExitError struct {
	Socket  string
	LogTail string // last lines of the process's log, possibly empty
}

func (e *EarlyExitError) Error() string {
	if e.LogTail == "" {
		return fmt.Sprintf("process exited before %s appeared (log is empty)", e.Socket)
	}
	return fmt.Sprintf("process exited before %s appeared; log tail:\n%s", e.Socket, e.LogTail)
}

// WaitSocket waits until a unix socket at path accepts a connection. It
// fails at once with an *EarlyExitError carrying the tail of logPath when
// exited is closed first, and with ctx's error (and the log tail) when ctx
// ends first. A nil exited channel is never closed.
func WaitSocket(ctx context.Context, path string, exited <-chan struct{}, logPath string) error {
	tick := time.NewTicker(2 * time.Millisecond)
	defer tick.Stop()
	for {
		if c, err := net.DialTimeout("unix", path, time.Second); err == nil {
			c.Close()
			return nil
		}
		select {
		case <-exited:
			return &EarlyExitError{Socket: path, LogTail: LogTail(logPath, 20)}
		case <-ctx.Done():
			tail := LogTail(logPath, 20)
			if tail != "" {
				return fmt.Errorf("waiting for %s: %w; log tail:\n%s", path, ctx.Err(), tail)
			}
			return fmt.Errorf("waiting for %s: %w", path, ctx.Err())
		case <-tick.C:
		}
	}
}

// LogTail returns at most the last n lines of the file at path (reading at
// most its last 8 KiB), or "" when it cannot be read.
func LogTail(path string, n int) string {
	if path == "" || n <= 0 {
		return ""
	}
	// The directory may be a confined process's: never follow its links
	// (to a file it must not read through the agent) nor block on a FIFO.
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NOFOLLOW|syscall.O_NONBLOCK, 0)
	if err != nil {
		return ""
	}
	defer f.Close()
	const max = 8 << 10
	fi, err := f.Stat()
	if err != nil || !fi.Mode().IsRegular() {
		return ""
	}
	off := fi.Size() - max
	if off < 0 {
		off = 0
	}
	b, err := io.ReadAll(io.NewSectionReader(f, off, max))
	if err != nil {
		return ""
	}
	s := strings.TrimRight(string(b), "\n")
	lines := strings.Split(s, "\n")
	if off > 0 && len(lines) > 1 {
		lines = lines[1:] // the first line was cut by the 8 KiB window
	}
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// Adopted is a process this agent did not start (or started before a
// restart), identified by pid and start time, watched through a pidfd.
type Adopted struct {
	Pid       int
	StartTime uint64

	pidfd     *os.File
	done      chan struct{}
	closeOnce sync.Once
}

// Done is closed when the process exits. It is never closed if Close is
// called first.
func (a *Adopted) Done() <-chan struct{} { return a.done }

// Close stops watching and releases the pidfd.
func (a *Adopted) Close() error {
	var err error
	a.closeOnce.Do(func() { err = a.pidfd.Close() })
	return err
}

// Alive reports whether pid runs (is not a zombie) and has the given start
// time.
func Alive(pid int, startTime uint64) bool {
	st, state, err := readStat(pid)
	return err == nil && st == startTime && state != 'Z' && state != 'X'
}

// Member is a live process found by its membership of a cgroup, as the
// agent finds a VM's processes after a restart: the cgroup lists pids, and
// the pid, start time and command line say which process is which.
type Member struct {
	Pid       int
	StartTime uint64
	Args      []string // its command line (/proc/PID/cmdline)
}

// Members describes the live processes among pids (a cgroup's
// cgroup.procs), in order. A pid that is gone or a zombie is left out; a
// process that exits while it is read is left out too.
func Members(pids []int) ([]Member, error) {
	var ms []Member
	for _, pid := range pids {
		st, state, err := readStat(pid)
		if errors.Is(err, os.ErrNotExist) || errors.Is(err, syscall.ESRCH) || err == nil && (state == 'Z' || state == 'X') {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("reading pid %d: %w", pid, err)
		}
		b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cmdline")
		if errors.Is(err, os.ErrNotExist) || errors.Is(err, syscall.ESRCH) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("reading pid %d: %w", pid, err)
		}
		// Read the start time again: the command line is the one of the
		// process whose start time is reported, not of a pid reused between.
		if st2, _, err := readStat(pid); err != nil || st2 != st {
			continue
		}
		ms = append(ms, Member{Pid: pid, StartTime: st, Args: splitCmdline(b)})
	}
	return ms, nil
}

// splitCmdline splits /proc/PID/cmdline (arguments ended by NUL bytes).
func splitCmdline(b []byte) []string {
	b = bytes.TrimSuffix(b, []byte{0})
	if len(b) == 0 {
		return nil
	}
	return strings.Split(string(b), "\x00")
}
