package proc

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// fakeConfiner rewrites the command as a confinement would and reports the
// outcome it was told to.
type fakeConfiner struct {
	fail     error // what started returns
	startErr error // what started was given
	called   bool
}

func (f *fakeConfiner) Prepare(cmd *exec.Cmd) (func(error) error, error) {
	cmd.Env = append(cmd.Environ(), "CONFINED=yes")
	return func(err error) error {
		f.called, f.startErr = true, err
		return f.fail
	}, nil
}

// Spawn runs the command a Confiner rewrote, and tells it how Start went.
func TestSpawnConfined(t *testing.T) {
	log := filepath.Join(t.TempDir(), "child.log")
	f := &fakeConfiner{}
	c, err := Spawn(SpawnConfig{Path: "/bin/sh", Args: []string{"-c", `echo "confined=$CONFINED"`}, LogFile: log, Confine: f})
	if err != nil {
		t.Fatal(err)
	}
	waitDone(t, c.Done(), 5*time.Second)
	if b, _ := os.ReadFile(log); strings.TrimSpace(string(b)) != "confined=yes" {
		t.Errorf("output %q: the rewritten command did not run", b)
	}
	if !f.called || f.startErr != nil {
		t.Errorf("started called %v with %v", f.called, f.startErr)
	}
}

// A confinement that did not take hold fails the spawn, and the process is
// killed and reaped: nothing runs unconfined.
func TestSpawnConfinementFailure(t *testing.T) {
	dir := t.TempDir()
	f := &fakeConfiner{fail: errors.New("the jail could not be built")}
	marker := filepath.Join(dir, "ran")
	_, err := Spawn(SpawnConfig{Path: "/bin/sh", Args: []string{"-c", "sleep 0.3; touch " + marker},
		LogFile: filepath.Join(dir, "log"), Confine: f})
	if err == nil || !strings.Contains(err.Error(), "the jail could not be built") {
		t.Fatalf("Spawn = %v, want the confinement's error", err)
	}
	time.Sleep(500 * time.Millisecond)
	if _, err := os.Stat(marker); err == nil {
		t.Error("the process went on running after its confinement failed")
	}

	// A start that fails is reported to the confiner, which releases what
	// it holds.
	f = &fakeConfiner{}
	if _, err := Spawn(SpawnConfig{Path: filepath.Join(dir, "missing"), Confine: f}); err == nil {
		t.Fatal("Spawn of a missing program succeeded")
	}
	if !f.called || f.startErr == nil {
		t.Errorf("started called %v with %v, want Start's error", f.called, f.startErr)
	}
}

// The log is never opened through a link nor as anything but a regular
// file: its directory may be a confined VM's.
func TestLogRefusesLinksAndFIFOs(t *testing.T) {
	dir := t.TempDir()
	target := filepath.Join(dir, "target")
	if err := os.WriteFile(target, []byte("not the log\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(dir, "ch.log")
	if err := os.Symlink(target, link); err != nil {
		t.Fatal(err)
	}
	if _, err := Spawn(SpawnConfig{Path: "/bin/true", LogFile: link}); err == nil {
		t.Error("Spawn appended to a log that is a symbolic link")
	}
	if got := LogTail(link, 5); got != "" {
		t.Errorf("LogTail read through a link: %q", got)
	}
	fifo := filepath.Join(dir, "fifo.log")
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	done := make(chan string)
	go func() { done <- LogTail(fifo, 5) }()
	select {
	case got := <-done:
		if got != "" {
			t.Errorf("LogTail of a FIFO: %q", got)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("LogTail blocked on a FIFO")
	}
	if _, err := Spawn(SpawnConfig{Path: "/bin/true", LogFile: fifo}); err == nil {
		t.Error("Spawn logged into a FIFO")
	}
}

// Members reads the processes a cgroup lists: live ones with their start
// time and command line; gone ones and zombies are left out.
func TestMembers(t *testing.T) {
	// The sleep 0 exits and stays a zombie: the shell exec'd the sleep 30,
	// which never reaps it.
	a, _ := spawnSh(t, "sleep 0 & exec sleep 30")
	defer a.Signal(syscall.SIGKILL)
	var zombie int
	deadline := time.Now().Add(5 * time.Second)
	for zombie == 0 {
		cmd, _ := os.ReadFile("/proc/" + strconv.Itoa(a.Pid) + "/cmdline")
		kids, _ := os.ReadFile("/proc/" + strconv.Itoa(a.Pid) + "/task/" + strconv.Itoa(a.Pid) + "/children")
		if strings.HasPrefix(string(cmd), "sleep\x0030") {
			for _, k := range strings.Fields(string(kids)) {
				if _, state, err := readStat(atoi(k)); err == nil && state == 'Z' {
					zombie = atoi(k)
				}
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("no zombie child of %d", a.Pid)
		}
		time.Sleep(5 * time.Millisecond)
	}
	gone, _ := spawnSh(t, "exit 0")
	waitDone(t, gone.Done(), 5*time.Second)
	ms, err := Members([]int{a.Pid, zombie, gone.Pid, 1 << 30})
	if err != nil {
		t.Fatal(err)
	}
	if len(ms) != 1 || ms[0].Pid != a.Pid || ms[0].StartTime != a.StartTime || !slices.Equal(ms[0].Args, []string{"sleep", "30"}) {
		t.Errorf("Members = %+v, want only pid %d (sleep 30, start %d)", ms, a.Pid, a.StartTime)
	}
	if got := splitCmdline([]byte("a\x00b c\x00\x00")); !slices.Equal(got, []string{"a", "b c", ""}) {
		t.Errorf("splitCmdline = %q", got)
	}
}

func atoi(s string) int {
	n, _ := strconv.Atoi(s)
	return n
}
