package netnstest

import (
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"
)

// nsID identifies the network namespace of the calling thread.
func nsID(t *testing.T) uint64 {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Stat("/proc/thread-self/ns/net", &st); err != nil {
		t.Fatal(err)
	}
	return st.Ino
}

func fdID(t *testing.T, fd int) uint64 {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		t.Fatal(err)
	}
	return st.Ino
}

func TestNewRunAndRunIn(t *testing.T) {
	host := fdID(t, int(mustOpen(t, "/proc/self/ns/net").Fd()))
	ns := New(t)
	if fdID(t, ns.FD) == host {
		t.Fatal("New's namespace is the host's")
	}
	var inside uint64
	if err := ns.Run(func() error { inside = nsID(t); return nil }); err != nil {
		t.Fatal(err)
	}
	if inside != fdID(t, ns.FD) {
		t.Errorf("Run ran in namespace %d, want %d", inside, fdID(t, ns.FD))
	}
	// A process started by Run lives in the namespace: only lo there.
	var out []byte
	ns.Run(func() (err error) {
		out, err = exec.Command("cat", "/proc/net/dev").Output()
		return err
	})
	if n := strings.Count(string(out), "\n") - 2; n != 1 || !strings.Contains(string(out), "lo:") {
		t.Errorf("a process started by Run sees %d interfaces, want only lo:\n%s", n, out)
	}
	var viaFD uint64
	if err := RunIn(ns.FD, func() error { viaFD = nsID(t); return nil }); err != nil {
		t.Fatal(err)
	}
	if viaFD != fdID(t, ns.FD) {
		t.Errorf("RunIn ran in namespace %d, want %d", viaFD, fdID(t, ns.FD))
	}
	// The test's own thread never moved.
	if ifs, _ := net.Interfaces(); len(ifs) < 1 {
		t.Error("host namespace lost its interfaces")
	}
}

func TestEnter(t *testing.T) {
	before := nsID(t)
	Enter(t)
	if after := nsID(t); after == before {
		t.Errorf("Enter left the goroutine in namespace %d", before)
	}
}

func TestRunInBadFD(t *testing.T) {
	RequireRoot(t)
	f := mustOpen(t, "/proc/self/status") // not a namespace
	err := RunIn(int(f.Fd()), func() error { t.Error("f ran"); return nil })
	if err == nil || !strings.Contains(err.Error(), "entering network namespace") {
		t.Errorf("RunIn(not a namespace) = %v, want a setns error", err)
	}
}

// TestSkipsWhenNotRoot runs TestEnter as nobody: it must skip, saying how
// to run it, rather than fail.
func TestSkipsWhenNotRoot(t *testing.T) {
	RequireRoot(t)
	// The test binary sits in a 0700 build directory: copy it where nobody
	// can run it.
	dir, err := os.MkdirTemp("/tmp", "netnstest")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	os.Chmod(dir, 0o755)
	bin, err := os.ReadFile(os.Args[0])
	if err != nil {
		t.Fatal(err)
	}
	exe := filepath.Join(dir, "netnstest.test")
	if err := os.WriteFile(exe, bin, 0o755); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(exe, "-test.run", "^TestEnter$", "-test.v")
	cmd.Dir = dir
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("test binary as nobody: %v\n%s", err, out)
	}
	if !strings.Contains(string(out), "--- SKIP: TestEnter") || !strings.Contains(string(out), "run go test as root") {
		t.Errorf("as nobody, TestEnter did not skip with the advice:\n%s", out)
	}
}

func mustOpen(t *testing.T, path string) *os.File {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return f
}
