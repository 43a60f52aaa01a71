package dirlock

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// The test binary re-executed with DIRLOCK_HELPER set acts as another
// process: "hold" takes the lock of DIRLOCK_DIR, starts a long-lived child
// (which must not inherit the lock), prints "locked <child pid>" and waits
// to be killed; "try" attempts the lock once and exits 1 with the error.
func TestMain(m *testing.M) {
	switch os.Getenv("DIRLOCK_HELPER") {
	case "":
		os.Exit(m.Run())
	case "hold":
		l, err := Acquire(os.Getenv("DIRLOCK_DIR"), "state directory")
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		child := exec.Command("sleep", "60")
		if err := child.Start(); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		fmt.Printf("locked %d\n", child.Process.Pid)
		time.Sleep(time.Minute)
		l.Close()
		os.Exit(0)
	case "orphan":
		// Dies at once, leaving the lock's descriptor with a child, as a
		// child forked just before a kill -9 holds it until its exec.
		l, err := Acquire(os.Getenv("DIRLOCK_DIR"), "state directory")
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		child := exec.Command("sleep", "1")
		child.ExtraFiles = []*os.File{l.f}
		if err := child.Start(); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		fmt.Printf("locked %d\n", child.Process.Pid)
		os.Exit(0)
	case "try":
		l, err := Acquire(os.Getenv("DIRLOCK_DIR"), "state directory")
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		l.Close()
		os.Exit(0)
	}
}

func helper(mode, dir string) *exec.Cmd {
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "DIRLOCK_HELPER="+mode, "DIRLOCK_DIR="+dir)
	return cmd
}

// TestAcquireAcrossProcesses: while one process holds the lock, another
// process is refused with the holder's pid in the message; once the holder
// is killed (its own child, which outlives it, still running) the lock is
// free again.
func TestAcquireAcrossProcesses(t *testing.T) {
	dir := t.TempDir()
	holder := helper("hold", dir)
	out, err := holder.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	holder.Stderr = os.Stderr
	if err := holder.Start(); err != nil {
		t.Fatal(err)
	}
	defer holder.Process.Kill()
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil {
		t.Fatalf("holder did not report the lock: %v", err)
	}
	grandchild, err := strconv.Atoi(strings.TrimSpace(strings.TrimPrefix(line, "locked ")))
	if err != nil {
		t.Fatalf("holder said %q", line)
	}
	defer syscall.Kill(grandchild, syscall.SIGKILL)

	try := helper("try", dir)
	msg, err := try.CombinedOutput()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != 1 {
		t.Fatalf("second process: %v (%s), want exit status 1", err, msg)
	}
	want := fmt.Sprintf("state directory %s is in use by another vmhost (pid %d)", dir, holder.Process.Pid)
	if strings.TrimSpace(string(msg)) != want {
		t.Errorf("second process said %q, want %q", msg, want)
	}

	// In this process too, with the error's type.
	_, err = Acquire(dir, "run directory")
	var held *HeldError
	if !errors.As(err, &held) || held.PID != holder.Process.Pid || held.What != "run directory" {
		t.Errorf("Acquire while held = %v, want a *HeldError naming pid %d", err, holder.Process.Pid)
	}

	holder.Process.Kill()
	holder.Wait()
	if err := syscall.Kill(grandchild, 0); err != nil {
		t.Fatalf("the holder's child should still run: %v", err)
	}
	l, err := Acquire(dir, "state directory")
	if err != nil {
		t.Fatalf("Acquire after the holder died: %v", err)
	}
	defer l.Close()
	data, err := os.ReadFile(filepath.Join(dir, FileName))
	if err != nil || string(data) != strconv.Itoa(os.Getpid())+"\n" {
		t.Errorf("lock file holds %q (%v), want this process's pid", data, err)
	}
}

// TestAcquireAfterAnOrphanedDescriptor: a holder that died while a child
// of its still held the lock's descriptor (forked, not yet exec'd) does
// not refuse the next Acquire: it waits until the descriptor is gone,
// then takes the lock.
func TestAcquireAfterAnOrphanedDescriptor(t *testing.T) {
	dir := t.TempDir()
	holder := helper("orphan", dir)
	out, err := holder.Output()
	if err != nil {
		t.Fatalf("holder: %v", err)
	}
	child, err := strconv.Atoi(strings.TrimSpace(strings.TrimPrefix(string(out), "locked ")))
	if err != nil {
		t.Fatalf("holder said %q", out)
	}
	defer syscall.Kill(child, syscall.SIGKILL)
	if err := syscall.Kill(child, 0); err != nil {
		t.Fatalf("the child holding the descriptor is gone already: %v", err)
	}
	start := time.Now()
	l, err := Acquire(dir, "state directory")
	if err != nil {
		t.Fatalf("Acquire after the holder died: %v", err)
	}
	defer l.Close()
	t.Logf("took the lock %v after the dead holder's child let go", time.Since(start))
}

// TestAcquireCloseAndMode: Close frees the lock; the lock file is 0600 even
// when an older one was wider, and a longer stale pid is overwritten whole.
func TestAcquireCloseAndMode(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, FileName)
	if err := os.WriteFile(path, []byte("123456789012\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	l, err := Acquire(dir, "state directory")
	if err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(path)
	if err != nil || fi.Mode().Perm() != 0o600 {
		t.Errorf("lock file mode = %v (%v), want 0600", fi.Mode().Perm(), err)
	}
	if data, _ := os.ReadFile(path); string(data) != strconv.Itoa(os.Getpid())+"\n" {
		t.Errorf("lock file holds %q", data)
	}
	if _, err := Acquire(dir, "state directory"); err == nil {
		t.Fatal("a second Acquire while held succeeded")
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	l2, err := Acquire(dir, "state directory")
	if err != nil {
		t.Fatalf("Acquire after Close: %v", err)
	}
	l2.Close()

	fresh := t.TempDir()
	l3, err := Acquire(fresh, "run directory")
	if err != nil {
		t.Fatal(err)
	}
	defer l3.Close()
	if fi, err := os.Stat(filepath.Join(fresh, FileName)); err != nil || fi.Mode().Perm() != 0o600 {
		t.Errorf("new lock file mode = %v (%v), want 0600", fi.Mode().Perm(), err)
	}
}

// TestAcquireRefusesSymlink: a symlink at the lock path is not followed.
func TestAcquireRefusesSymlink(t *testing.T) {
	dir := t.TempDir()
	target := filepath.Join(t.TempDir(), "elsewhere")
	if err := os.Symlink(target, filepath.Join(dir, FileName)); err != nil {
		t.Fatal(err)
	}
	if l, err := Acquire(dir, "state directory"); err == nil {
		l.Close()
		t.Fatal("Acquire through a symlink succeeded")
	}
	if _, err := os.Lstat(target); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("symlink target created: %v", err)
	}
}
