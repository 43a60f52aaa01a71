//go:build linux

package e2e

import (
	"bytes"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// cli runs the vmhost client against s and returns its output and exit
// status.
func (s *server) cli(stdin io.Reader, args ...string) (string, string, int) {
	s.t.Helper()
	cmd := exec.Command(vmhostBin, args...)
	cmd.Env = append(os.Environ(), "VMHOST_API=unix:"+s.sock, "VMHOST_TOKEN="+s.token)
	cmd.Stdin = stdin
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	var ee *exec.ExitError
	code := 0
	switch {
	case errors.As(err, &ee):
		code = ee.ExitCode()
	case err != nil:
		s.t.Fatalf("vmhost %q: %v", args, err)
	}
	return out.String(), errb.String(), code
}

// guestRoot is where the simulated guest of AppVM id keeps its workload
// root (chsim's GuestRoot).
func (s *server) guestRoot(id string) string {
	return filepath.Join(s.runDir, "vms", id, "vsock.sock.root")
}

// TestAppVMGuestOperations: through the real binary (the agent over the
// engine's hybrid vsock dial, chsim routing the CONNECT to the guest
// agent's operation port) and its client: exec with the command's status
// and streams, secret values redacted; a tree copied in and out byte for
// byte; a signal reaching the workload; and all of it again after the
// agent was killed and restarted.
func TestAppVMGuestOperations(t *testing.T) {
	const secret = "e2e-exec-S3cret-value"
	s := startAppVMServer(t, map[string]string{"ops": `trap 'echo hup >> hup.out' HUP; while :; do sleep 0.05; done`})
	if st, b := s.do("POST", "/api/appvm/vms", `{"vm_id":"ops","image_id":"ops","vcpus":1,"memory_mb":128,"disk_gib":1,`+
		`"ip":"10.80.0.9","prefix":24,"gateway":"10.80.0.1","secret_env":["TOKEN=`+secret+`"]}`); st != http.StatusCreated {
		t.Fatalf("create = %d %s", st, b)
	}
	s.appvmWait("ops", "display running", 30*time.Second, func(v appvmView) bool { return v.DisplayState == "running" })
	var all strings.Builder
	run := func(stdin io.Reader, args ...string) (string, string, int) {
		t.Helper()
		out, errOut, code := s.cli(stdin, args...)
		all.WriteString(out + errOut)
		return out, errOut, code
	}
	check := func(round string) {
		t.Helper()
		out, errOut, code := run(nil, "appvm", "exec", "ops", "--", "sh", "-c", "echo out; echo err >&2; exit 3")
		if code != 3 || out != "out\n" || errOut != "err\n" {
			t.Errorf("%s: exec = %d %q %q", round, code, out, errOut)
		}
		out, _, code = run(strings.NewReader("piped\n"), "appvm", "exec", "-i", "ops", "--", "sh", "-c", `cat; echo "$TOKEN"`)
		if code != 0 || out != "piped\n[redacted]\n" {
			t.Errorf("%s: exec -i = %d %q", round, code, out)
		}

		// A tree of files copied in and back out, byte for byte.
		src := filepath.Join(t.TempDir(), "tree")
		blob := make([]byte, 3<<20+17)
		rand.Read(blob)
		os.MkdirAll(filepath.Join(src, "sub"), 0o755)
		os.WriteFile(filepath.Join(src, "blob.bin"), blob, 0o640)
		os.WriteFile(filepath.Join(src, "sub", "note.txt"), []byte("note\n"), 0o600)
		os.Symlink("blob.bin", filepath.Join(src, "link"))
		if _, errOut, code := run(nil, "appvm", "cp", src, "ops:/"); code != 0 {
			t.Fatalf("%s: cp in = %d %s", round, code, errOut)
		}
		if got, err := os.ReadFile(filepath.Join(s.guestRoot("ops"), "tree", "blob.bin")); err != nil || !bytes.Equal(got, blob) {
			t.Errorf("%s: the guest's copy differs (%v)", round, err)
		}
		dst := filepath.Join(t.TempDir(), "back")
		if _, errOut, code := run(nil, "appvm", "cp", "ops:/tree", dst); code != 0 {
			t.Fatalf("%s: cp out = %d %s", round, code, errOut)
		}
		if got, err := os.ReadFile(filepath.Join(dst, "blob.bin")); err != nil || !bytes.Equal(got, blob) {
			t.Errorf("%s: the copy out differs (%v)", round, err)
		}
		if fi, err := os.Stat(filepath.Join(dst, "blob.bin")); err != nil || fi.Mode().Perm() != 0o640 {
			t.Errorf("%s: blob.bin mode %v (%v)", round, fi.Mode(), err)
		}
		if l, err := os.Readlink(filepath.Join(dst, "link")); err != nil || l != "blob.bin" {
			t.Errorf("%s: link %q (%v)", round, l, err)
		}
		if b, _ := os.ReadFile(filepath.Join(dst, "sub", "note.txt")); string(b) != "note\n" {
			t.Errorf("%s: sub/note.txt %q", round, b)
		}
		os.RemoveAll(filepath.Join(s.guestRoot("ops"), "tree"))

		hup := filepath.Join(s.guestRoot("ops"), "hup.out")
		os.Remove(hup)
		if out, errOut, code := run(nil, "appvm", "kill", "ops", "--signal", "HUP"); code != 0 {
			t.Errorf("%s: kill = %d %s %s", round, code, out, errOut)
		}
		waitForFile(t, hup)
	}
	check("first agent")

	// The agent dies; the next one adopts the AppVM and, once the guest
	// agent resumed its session, reaches its operations again.
	// The view alone cannot tell: the agent answers before its background
	// adoption marks the session detached, so an exec is tried until the
	// guest agent is back.
	s.kill()
	s.restart()
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		_, errOut, code := run(nil, "appvm", "exec", "ops", "--", "true")
		if code == 0 {
			break
		}
		if !strings.Contains(errOut, "not connected") || time.Now().After(deadline) {
			t.Fatalf("exec after an agent restart = %d %s", code, errOut)
		}
	}
	check("after an agent restart")

	if strings.Contains(all.String(), secret) {
		t.Error("the client's output holds the secret")
	}
	if _, errOut, code := run(nil, "appvm", "exec", "nope", "--", "true"); code != 1 || !strings.Contains(errOut, "NOT_FOUND") {
		t.Errorf("exec in an unknown AppVM = %d %s", code, errOut)
	}
}

func waitForFile(t *testing.T, p string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		if _, err := os.Stat(p); err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s never appeared", p)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// openPTY opens a pseudo-terminal pair of size cols × rows.
func openPTY(t *testing.T, cols, rows int) (master, slave *os.File) {
	t.Helper()
	m, err := os.OpenFile("/dev/ptmx", os.O_RDWR|syscall.O_NOCTTY, 0)
	if err != nil {
		t.Skipf("no pseudo-terminals: %v", err)
	}
	if err := unix.IoctlSetPointerInt(int(m.Fd()), unix.TIOCSPTLCK, 0); err != nil {
		t.Fatal(err)
	}
	n, err := unix.IoctlGetInt(int(m.Fd()), unix.TIOCGPTN)
	if err != nil {
		t.Fatal(err)
	}
	sl, err := os.OpenFile("/dev/pts/"+strconv.Itoa(n), os.O_RDWR|syscall.O_NOCTTY, 0)
	if err != nil {
		t.Fatal(err)
	}
	setSize(t, m, cols, rows)
	t.Cleanup(func() { m.Close(); sl.Close() })
	return m, sl
}

func setSize(t *testing.T, f *os.File, cols, rows int) {
	t.Helper()
	if err := unix.IoctlSetWinsize(int(f.Fd()), unix.TIOCSWINSZ, &unix.Winsize{Col: uint16(cols), Row: uint16(rows)}); err != nil {
		t.Fatal(err)
	}
}

// screen collects what a terminal shows.
type screen struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *screen) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *screen) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// waitText waits until the screen shows want at least n times.
func (s *screen) waitText(t *testing.T, want string, n int) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for strings.Count(s.String(), want) < n {
		if time.Now().After(deadline) {
			t.Fatalf("the terminal never showed %q %d times; it shows:\n%q", want, n, s.String())
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestAppVMExecTerminal: `vmhost appvm exec -it ID -- sh` in a terminal
// (a pseudo-terminal the test holds): the shell runs commands typed at
// it, sees the terminal's size and its changes (SIGWINCH), exits with its
// status, and the client leaves the terminal as it found it.
func TestAppVMExecTerminal(t *testing.T) {
	s := startAppVMServer(t, map[string]string{"tty": "exec sleep 300"})
	if st, b := s.do("POST", "/api/appvm/vms", `{"vm_id":"tty","image_id":"tty","vcpus":1,"memory_mb":128,"disk_gib":1,`+
		`"ip":"10.80.0.10","prefix":24,"gateway":"10.80.0.1"}`); st != http.StatusCreated {
		t.Fatalf("create = %d %s", st, b)
	}
	s.appvmWait("tty", "display running", 30*time.Second, func(v appvmView) bool { return v.DisplayState == "running" })
	master, slave := openPTY(t, 91, 27)
	before, err := unix.IoctlGetTermios(int(slave.Fd()), unix.TCGETS)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(vmhostBin, "appvm", "exec", "-it", "tty", "--", "sh")
	cmd.Env = append(os.Environ(), "VMHOST_API=unix:"+s.sock, "VMHOST_TOKEN="+s.token)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = slave, slave, slave
	// The client's own session, the terminal its controlling one: it gets
	// the terminal's SIGWINCH.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Setctty: true, Ctty: 0}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	var scr screen
	go io.Copy(&scr, master)
	waited := make(chan error, 1)
	go func() { waited <- cmd.Wait() }()
	defer cmd.Process.Kill()

	type_ := func(s string) {
		if _, err := master.WriteString(s); err != nil {
			t.Fatal(err)
		}
	}
	type_("stty size; echo one-$((40+2))\r")
	scr.waitText(t, "one-42", 1)
	scr.waitText(t, "27 91", 1)
	// Raw mode here: ^C is a byte for the remote terminal, whose shell
	// survives it.
	type_("sleep 100\r")
	time.Sleep(300 * time.Millisecond)
	type_("\x03")
	type_("echo two-$((40+3))\r")
	scr.waitText(t, "two-43", 1)
	setSize(t, master, 132, 50)
	deadline := time.Now().Add(20 * time.Second)
	for i := 0; !strings.Contains(scr.String(), "50 132"); i++ {
		if time.Now().After(deadline) {
			t.Fatalf("the window change never reached the shell; the terminal shows:\n%q", scr.String())
		}
		type_("stty size\r")
		time.Sleep(200 * time.Millisecond)
	}
	type_("exit 5\r")
	select {
	case err := <-waited:
		var ee *exec.ExitError
		if !errors.As(err, &ee) || ee.ExitCode() != 5 {
			t.Errorf("vmhost appvm exec -it ended with %v, want exit status 5; the terminal shows:\n%q", err, scr.String())
		}
	case <-time.After(30 * time.Second):
		t.Fatalf("the client did not end after exit; the terminal shows:\n%q", scr.String())
	}
	after, err := unix.IoctlGetTermios(int(slave.Fd()), unix.TCGETS)
	if err != nil {
		t.Fatal(err)
	}
	if *after != *before {
		t.Errorf("the terminal was not restored:\n%+v\nwant\n%+v", *after, *before)
	}
	if t.Failed() {
		fmt.Println(scr.String())
	}
}
