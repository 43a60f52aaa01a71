package proc

import (
	"context"
	"errors"
	"io/fs"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// The test binary doubles as a helper process: with PROC_TEST_LISTEN set it
// listens on that unix socket path until killed.
func TestMain(m *testing.M) {
	if p := os.Getenv("PROC_TEST_LISTEN"); p != "" {
		time.Sleep(50 * time.Millisecond) // make the waiter poll at least once
		l, err := net.Listen("unix", p)
		if err != nil {
			os.Exit(2)
		}
		for {
			c, err := l.Accept()
			if err != nil {
				os.Exit(3)
			}
			c.Close()
		}
	}
	os.Exit(m.Run())
}

func TestParseStartTime(t *testing.T) {
	// A command name with spaces and a ')' must not shift the fields.
	line := "4242 (a b) c) S 1 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 1000 10"
	got, err := parseStartTime([]byte(line))
	if err != nil || got != 987654 {
		t.Fatalf("parseStartTime = %d, %v; want 987654", got, err)
	}
	if _, err := parseStartTime([]byte("1 (x) S 1 2")); err == nil {
		t.Error("parseStartTime of a short line succeeded")
	}
}

func TestStartTimeSelf(t *testing.T) {
	st, err := StartTime(os.Getpid())
	if err != nil || st == 0 {
		t.Fatalf("StartTime(self) = %d, %v", st, err)
	}
	if _, err := StartTime(1 << 30); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("StartTime(no such pid) = %v, want fs.ErrNotExist", err)
	}
}

func spawnSh(t *testing.T, script string) (*Child, string) {
	t.Helper()
	log := filepath.Join(t.TempDir(), "child.log")
	c, err := Spawn(SpawnConfig{Path: "/bin/sh", Args: []string{"-c", script}, LogFile: log})
	if err != nil {
		t.Fatal(err)
	}
	return c, log
}

func waitDone(t *testing.T, done <-chan struct{}, d time.Duration) {
	t.Helper()
	select {
	case <-done:
	case <-time.After(d):
		t.Fatalf("process not done within %v", d)
	}
}

func TestSpawnExitCodeAndSession(t *testing.T) {
	c, log := spawnSh(t, `echo "sid $(cut -d' ' -f6 /proc/$$/stat) pid $$"; exit 3`)
	waitDone(t, c.Done(), 5*time.Second)
	if got := c.Exit(); got != (ExitStatus{Code: 3}) {
		t.Errorf("Exit() = %v, want exit code 3", got)
	}
	b, _ := os.ReadFile(log)
	want := "sid " + strconv.Itoa(c.Pid) + " pid " + strconv.Itoa(c.Pid)
	if strings.TrimSpace(string(b)) != want {
		t.Errorf("log = %q, want %q (the child leads its own session)", b, want)
	}
	if c.StartTime == 0 {
		t.Error("StartTime not recorded")
	}
}

func TestSpawnSignal(t *testing.T) {
	c, _ := spawnSh(t, `kill -SEGV $$`)
	waitDone(t, c.Done(), 5*time.Second)
	got := c.Exit()
	if !got.Signaled() || got.Signal != syscall.SIGSEGV || int(got.Signal) != 11 {
		t.Errorf("Exit() = %v, want signal 11", got)
	}
	if err := c.Signal(syscall.SIGTERM); !errors.Is(err, os.ErrProcessDone) {
		t.Errorf("Signal after exit = %v, want os.ErrProcessDone", err)
	}
}

func TestWaitSocketEarlyExit(t *testing.T) {
	c, log := spawnSh(t, `echo "first line"; echo "fatal: cannot open /nope" >&2; exit 1`)
	sock := filepath.Join(t.TempDir(), "api.sock")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	start := time.Now()
	err := WaitSocket(ctx, sock, c.Done(), log)
	var ee *EarlyExitError
	if !errors.As(err, &ee) {
		t.Fatalf("WaitSocket = %v, want *EarlyExitError", err)
	}
	if !strings.Contains(ee.LogTail, "fatal: cannot open /nope") || !strings.Contains(err.Error(), "first line") {
		t.Errorf("error %q lacks the log tail", err)
	}
	// Fails on the exit, not on the deadline.
	if time.Since(start) > 5*time.Second {
		t.Errorf("WaitSocket took %v, want it to fail on exit", time.Since(start))
	}
}

func TestWaitSocketReadyAndDeadline(t *testing.T) {
	dir, err := os.MkdirTemp("", "proc")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	sock := filepath.Join(dir, "s")
	self, _ := os.Executable()
	log := filepath.Join(dir, "log")
	c, err := Spawn(SpawnConfig{Path: self, LogFile: log, Env: append(os.Environ(), "PROC_TEST_LISTEN="+sock)})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = c.Signal(syscall.SIGKILL); <-c.Done() }()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := WaitSocket(ctx, sock, c.Done(), log); err != nil {
		t.Fatalf("WaitSocket = %v, want nil", err)
	}

	ctx2, cancel2 := context.WithTimeout(context.Background(), 30*time.Millisecond)
	defer cancel2()
	if err := WaitSocket(ctx2, filepath.Join(dir, "never"), nil, ""); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("WaitSocket(never) = %v, want deadline exceeded", err)
	}
}

func TestLogTail(t *testing.T) {
	p := filepath.Join(t.TempDir(), "log")
	var b strings.Builder
	for i := 0; i < 5000; i++ {
		b.WriteString("line " + strconv.Itoa(i) + "\n")
	}
	os.WriteFile(p, []byte(b.String()), 0o600)
	got := LogTail(p, 3)
	if got != "line 4997\nline 4998\nline 4999" {
		t.Errorf("LogTail = %q", got)
	}
	if LogTail(filepath.Join(t.TempDir(), "none"), 3) != "" {
		t.Error("LogTail of a missing file is not empty")
	}
}

// orphan starts a sleep whose parent exits at once, so it is not our child.
func orphan(t *testing.T) int {
	t.Helper()
	out, err := exec.Command("/bin/sh", "-c", "setsid sleep 60 >/dev/null 2>&1 & echo $!").Output()
	if err != nil {
		t.Fatal(err)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(out)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = syscall.Kill(pid, syscall.SIGKILL) })
	return pid
}

func TestAdoptNoticesDeath(t *testing.T) {
	pid := orphan(t)
	st, err := StartTime(pid)
	if err != nil {
		t.Fatal(err)
	}
	a, err := Adopt(pid, st)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	select {
	case <-a.Done():
		t.Fatal("Done closed while the process lives")
	case <-time.After(50 * time.Millisecond):
	}
	if err := a.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	waitDone(t, a.Done(), time.Second)
}

func TestAdoptRefusesMismatchAndMissing(t *testing.T) {
	pid := orphan(t)
	st, err := StartTime(pid)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := Adopt(pid, st+1); !errors.Is(err, ErrIdentityMismatch) {
		t.Errorf("Adopt(wrong start time) = %v, want ErrIdentityMismatch", err)
	}
	if !Alive(pid, st) || Alive(pid, st+1) {
		t.Error("Alive disagrees with the start time")
	}
	c, _ := spawnSh(t, "exit 0")
	waitDone(t, c.Done(), 5*time.Second)
	if _, err := Adopt(c.Pid, c.StartTime); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("Adopt(reaped pid) = %v, want fs.ErrNotExist", err)
	}
}

func TestAdoptRefusesZombie(t *testing.T) {
	// A child that has exited but is not yet reaped is a zombie: dead,
	// though its /proc entry and start time remain.
	cmd := exec.Command("/bin/sh", "-c", "exit 0")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Wait()
	pid := cmd.Process.Pid
	var st uint64
	deadline := time.Now().Add(5 * time.Second)
	for {
		s, state, err := readStat(pid)
		if err != nil {
			t.Fatal(err)
		}
		if state == 'Z' {
			st = s
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("child did not become a zombie")
		}
		time.Sleep(5 * time.Millisecond)
	}
	if Alive(pid, st) {
		t.Error("Alive(zombie) = true")
	}
	if _, err := Adopt(pid, st); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("Adopt(zombie) = %v, want fs.ErrNotExist", err)
	}
}

func TestAdoptCloseStopsWatching(t *testing.T) {
	pid := orphan(t)
	st, _ := StartTime(pid)
	a, err := Adopt(pid, st)
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	select {
	case <-a.Done():
		t.Error("Done closed after Close while the process lives")
	case <-time.After(50 * time.Millisecond):
	}
}
