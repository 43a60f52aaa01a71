package chclient_test

import (
	"context"
	"errors"
	"io/fs"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"vmhost/chclient"
	"vmhost/proc"

	"golang.org/x/sys/unix"
)

func TestLaunchEarlyExitCarriesLogTail(t *testing.T) {
	f := newFixture(t)
	cfg := f.config()
	cfg.Env = childEnv("CHCLIENT_TEST_MODE=fail-early")
	// A generous deadline: the error must come from the exit, not from the deadline.
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	_, err := chclient.Launch(ctx, cfg)
	var early *proc.EarlyExitError
	var le *chclient.LaunchError
	if !errors.As(err, &early) || !errors.As(err, &le) {
		t.Fatalf("Launch = %v, want an early-exit LaunchError", err)
	}
	if le.Exit.Code != 1 {
		t.Errorf("exit = %v, want code 1", le.Exit)
	}
	if !strings.Contains(err.Error(), "boom-in-log") || !strings.Contains(err.Error(), "boom-on-stderr") {
		t.Errorf("error %q lacks the log and output tails", err)
	}
	if ctx.Err() != nil {
		t.Error("Launch waited for the deadline")
	}
}

func TestLaunchRemovesStaleFiles(t *testing.T) {
	f := newFixture(t)
	for _, p := range []string{f.sock, f.sock + ".lock", f.vsock, f.serial} {
		touch(t, p)
	}
	p, err := chclient.Launch(ctxT(t), f.config())
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	for _, p := range []string{f.vsock, f.serial} {
		if _, err := os.Stat(p); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("%s survived Launch: %v", p, err)
		}
	}
	st, err := proc.StartTime(p.Pid)
	if err != nil || st != p.StartTime {
		t.Errorf("recorded start time %d, /proc says %d (%v)", p.StartTime, st, err)
	}
	// The process runs in its own session.
	if sid, err := unix.Getsid(p.Pid); err != nil || sid != p.Pid {
		t.Errorf("sid = %d, %v; want %d", sid, err, p.Pid)
	}
	if err := p.Stop(ctxT(t), 2*time.Second); err != nil {
		t.Fatal(err)
	}
	if st, ok := p.Exit(); !ok || st.Code != 0 || st.Signaled() {
		t.Errorf("exit after Stop = %v", st)
	}
	if _, err := os.Stat(f.sock); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("API socket left after a clean exit: %v", err)
	}
}

func TestLaunchReportsSignal(t *testing.T) {
	f, p := launchSim(t)
	simPut(t, f, "crash", `{"signal":11}`)
	select {
	case <-p.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("the simulator did not die")
	}
	st, ok := p.Exit()
	if !ok || st.Signal != syscall.SIGSEGV {
		t.Fatalf("exit = %v, want signal 11", st)
	}
}

func TestLaunchSIGTERMExitsZero(t *testing.T) {
	_, p := launchSim(t)
	p.Signal(syscall.SIGTERM)
	if st, ok := p.Exit(); !ok || st.Code != 0 || st.Signaled() {
		t.Fatalf("exit after SIGTERM = %v, want code 0", st)
	}
}

// startOrphan starts the simulator as a grandchild that is not our child, as a CH left
// running across an agent restart, and returns its pid.
func startOrphan(t *testing.T, f fixture) int {
	t.Helper()
	cmd := exec.Command(os.Args[0], "--api-socket", "path="+f.sock, "--event-monitor", "path="+f.events, "--log-file", f.log)
	cmd.Env = childEnv("CHCLIENT_TEST_MODE=orphan")
	out, err := cmd.Output()
	if err != nil {
		t.Fatal(err)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(out)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { syscall.Kill(pid, syscall.SIGKILL) })
	if err := proc.WaitSocket(ctxT(t), f.sock, nil, f.log); err != nil {
		t.Fatal(err)
	}
	return pid
}

func TestAdopt(t *testing.T) {
	f := newFixture(t)
	pid := startOrphan(t, f)
	st, err := proc.StartTime(pid)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := chclient.Adopt(pid, st+1, f.sock); !errors.Is(err, proc.ErrIdentityMismatch) {
		t.Fatalf("Adopt with a wrong start time = %v, want ErrIdentityMismatch", err)
	}
	p, err := chclient.Adopt(pid, st, f.sock)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	if ping, err := p.Client().Ping(ctxT(t)); err != nil || ping.Pid != pid {
		t.Fatalf("Ping of the adopted process = %+v, %v", ping, err)
	}
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	select {
	case <-p.Done():
	case <-time.After(time.Second):
		t.Fatal("the adopted process's death was not noticed within a second")
	}
	if _, ok := p.Exit(); ok {
		t.Error("Exit claims to know the status of a process that is not our child")
	}
}

// TestLaunchTimeoutKills covers a CH that never opens its socket: Launch gives up after
// StartTimeout and kills it.
func TestLaunchTimeoutKills(t *testing.T) {
	f := newFixture(t)
	cfg := f.config()
	cfg.StartTimeout = 300 * time.Millisecond
	// A process that takes CH's flags as positional parameters and never listens.
	cfg.Binary = "/bin/sh"
	cfg.PreArgs = []string{"-c", "sleep 30", "sh"}
	_, err := chclient.Launch(context.Background(), cfg)
	var le *chclient.LaunchError
	if !errors.As(err, &le) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Launch = %v, want a LaunchError wrapping context.DeadlineExceeded", err)
	}
	if le.Exit.Signal != syscall.SIGKILL {
		t.Errorf("exit = %v, want killed", le.Exit)
	}
}
