package chclient

import (
	"context"
	"errors"
	"fmt"
	"os"
	"syscall"
	"time"

	"vmhost/proc"
)

// LaunchConfig says how to start one CH process.
type LaunchConfig struct {
	// Binary is the cloud-hypervisor executable (from the agent's config; never looked up
	// in $PATH). PreArgs come first, e.g. ["sim-ch"] when Binary is vmhost itself.
	Binary  string
	PreArgs []string

	APISocket    string // --api-socket path=…
	EventMonitor string // --event-monitor path=…
	LogFile      string // --log-file; CH truncates it
	// OutputFile receives CH's stdout and stderr (appended); empty means LogFile+".out".
	OutputFile string
	// VsockSocket and SerialSocket are removed before the start: CH binds them itself and
	// fails when a previous instance left them behind.
	VsockSocket  string
	SerialSocket string
	ExtraArgs    []string // appended after CH's flags, e.g. "-v"
	Env          []string // nil means the agent's environment
	// StartTimeout bounds the wait for the API socket (on top of ctx); 0 means
	// DefaultStartTimeout.
	StartTimeout time.Duration
	// Confine, when set, starts CH confined (package jail gives the VM's
	// jail); nil starts it as the agent's own child.
	Confine proc.Confiner
}

// DefaultStartTimeout is how long Launch waits for the API socket unless told otherwise.
// CH serves its API within milliseconds of starting; seconds mean something is wrong.
const DefaultStartTimeout = 30 * time.Second

// Process is one CH process: a child this agent started (Launch), or one adopted after an
// agent restart (Adopt). Its methods are safe for concurrent use.
type Process struct {
	Pid       int
	StartTime uint64 // field 22 of /proc/PID/stat
	APISocket string

	client  *Client
	child   *proc.Child
	adopted *proc.Adopted
}

// Launch removes stale sockets (the API socket, its .lock, the vsock and serial sockets),
// starts CH in its own session, and waits until the API socket accepts connections. If the
// process exits first, the error carries the tail of its log and output; if ctx or
// StartTimeout ends first, the process is killed. The caller owns the returned Process.
func Launch(ctx context.Context, cfg LaunchConfig) (*Process, error) {
	if cfg.Binary == "" || cfg.APISocket == "" || cfg.EventMonitor == "" || cfg.LogFile == "" {
		return nil, errors.New("launching cloud hypervisor: binary, API socket, event monitor and log file are required")
	}
	for _, p := range []string{cfg.APISocket, cfg.APISocket + ".lock", cfg.VsockSocket, cfg.SerialSocket} {
		if p == "" {
			continue
		}
		if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
			return nil, fmt.Errorf("launching cloud hypervisor: removing stale %s: %w", p, err)
		}
	}
	out := cfg.OutputFile
	if out == "" {
		out = cfg.LogFile + ".out"
	}
	args := append([]string{}, cfg.PreArgs...)
	args = append(args, "--api-socket", "path="+cfg.APISocket, "--event-monitor", "path="+cfg.EventMonitor,
		"--log-file", cfg.LogFile)
	args = append(args, cfg.ExtraArgs...)
	child, err := proc.Spawn(proc.SpawnConfig{Path: cfg.Binary, Args: args, Env: cfg.Env, LogFile: out, Confine: cfg.Confine})
	if err != nil {
		return nil, fmt.Errorf("launching cloud hypervisor: %w", err)
	}
	timeout := cfg.StartTimeout
	if timeout <= 0 {
		timeout = DefaultStartTimeout
	}
	wctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	if err := proc.WaitSocket(wctx, cfg.APISocket, child.Done(), cfg.LogFile); err != nil {
		child.Signal(syscall.SIGKILL)
		st := child.Exit()
		msg := fmt.Sprintf("launching cloud hypervisor %s: %v", cfg.Binary, err)
		if tail := proc.LogTail(out, 20); tail != "" {
			msg += "\noutput tail:\n" + tail
		}
		return nil, &LaunchError{Exit: st, msg: msg, err: err}
	}
	return &Process{Pid: child.Pid, StartTime: child.StartTime, APISocket: cfg.APISocket,
		client: New(cfg.APISocket), child: child}, nil
}

// LaunchError is a CH process that did not come up. Exit says how it ended (it is killed
// when the wait times out); the message holds the log and output tails.
type LaunchError struct {
	Exit proc.ExitStatus
	msg  string
	err  error
}

// Error says why the process did not come up, with its log and output tails.
func (e *LaunchError) Error() string { return e.msg }

// Unwrap returns the wait error (*proc.EarlyExitError or a context error).
func (e *LaunchError) Unwrap() error { return e.err }

// Adopt takes over a CH process found after an agent restart. It refuses a pid whose start
// time differs from the recorded one (errors.Is(err, proc.ErrIdentityMismatch)), and fails
// with an error matching fs.ErrNotExist when the process is gone. Death is learned through a
// pidfd; the exit status of a process that is not our child cannot be known.
func Adopt(pid int, startTime uint64, apiSocket string) (*Process, error) {
	a, err := proc.Adopt(pid, startTime)
	if err != nil {
		return nil, fmt.Errorf("adopting cloud hypervisor: %w", err)
	}
	return &Process{Pid: pid, StartTime: startTime, APISocket: apiSocket, client: New(apiSocket), adopted: a}, nil
}

// Client returns the API client for this process.
func (p *Process) Client() *Client { return p.client }

// Done is closed when the process has exited.
func (p *Process) Done() <-chan struct{} {
	if p.child != nil {
		return p.child.Done()
	}
	return p.adopted.Done()
}

// Exit returns how a child ended (exit code or signal); it blocks until Done. ok is false
// for an adopted process, whose status only its real parent can read.
func (p *Process) Exit() (st proc.ExitStatus, ok bool) {
	if p.child == nil {
		<-p.adopted.Done()
		return proc.ExitStatus{}, false
	}
	return p.child.Exit(), true
}

// Signal sends sig to the process (through the pidfd when adopted, so a reused pid is never
// hit). It returns os.ErrProcessDone once the process is gone.
func (p *Process) Signal(sig syscall.Signal) error {
	if p.child != nil {
		return p.child.Signal(sig)
	}
	return p.adopted.Signal(sig)
}

// Stop ends the process: vmm.shutdown, then SIGTERM after grace, then SIGKILL after another
// grace. It returns when the process is gone or ctx ends.
func (p *Process) Stop(ctx context.Context, grace time.Duration) error {
	select {
	case <-p.Done():
		return nil
	default:
	}
	sctx, cancel := context.WithTimeout(ctx, grace)
	p.client.ShutdownVMM(sctx)
	cancel()
	for _, sig := range []syscall.Signal{syscall.SIGTERM, syscall.SIGKILL} {
		t := time.NewTimer(grace)
		select {
		case <-p.Done():
			t.Stop()
			return nil
		case <-ctx.Done():
			t.Stop()
			return fmt.Errorf("stopping cloud hypervisor pid %d: %w", p.Pid, ctx.Err())
		case <-t.C:
		}
		if err := p.Signal(sig); err != nil && !errors.Is(err, os.ErrProcessDone) {
			return fmt.Errorf("stopping cloud hypervisor pid %d: %w", p.Pid, err)
		}
	}
	select {
	case <-p.Done():
		return nil
	case <-ctx.Done():
		return fmt.Errorf("stopping cloud hypervisor pid %d: %w", p.Pid, ctx.Err())
	}
}

// Close releases the pidfd of an adopted process and idle API connections; the process
// keeps running.
func (p *Process) Close() error {
	p.client.Close()
	if p.adopted != nil {
		return p.adopted.Close()
	}
	return nil
}
