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

// fakeConfiner starts the command as a confinement would, with a change
// of its own, and fails as it was told to (after the start, like a
// confinement whose last step failed, or instead of it).
type fakeConfiner struct {
	failAfter  error
	failBefore error
}

func (f *fakeConfiner) Start(cmd *exec.Cmd) error {
	if f.failBefore != nil {
		return f.failBefore
	}
	cmd.Env = append(cmd.Environ(), "CONFINED=yes")
	if err := cmd.Start(); err != nil {
		return err
	}
	if f.failAfter != nil {
		cmd.Process.Kill()
		cmd.Wait()
		return f.failAfter
	}
	return nil
}

// Spawn starts the command through its Confiner.
func TestSpawnConfined(t *testing.T) {
	log := filepath.Join(t.TempDir(), "child.log")
	c, err := Spawn(SpawnConfig{Path: "/bin/sh", Args: []string{"-c", `echo "confined=$CONFINED"`}, LogFile: log, Confine: &fakeConfiner{}})
	if err != nil {
		t.Fatal(err)
	}
	waitDone(t, c.Done(), 5*time.Second)
	if b, _ := os.ReadFile(log); strings.TrimSpace(string(b)) != "confined=yes" {
		t.Errorf("output %q: the confiner's command did not run", b)
	}
}

// A confinement that fails fails the spawn with its reason.
func TestSpawnConfinementFailure(t *testing.T) {
	dir := t.TempDir()
	for _, f := range []*fakeConfiner{{failAfter: errors.New("the jail could not be built")}, {failBefore: errors.New("the jail could not be built")}} {
		_, err := Spawn(SpawnConfig{Path: "/bin/sh", Args: []string{"-c", "true"}, LogFile: filepath.Join(dir, "log"), Confine: f})
		if err == nil || !strings.Contains(err.Error(), "the jail could not be built") {
			t.Errorf("Spawn = %v, want the confinement's error", err)
		}
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
