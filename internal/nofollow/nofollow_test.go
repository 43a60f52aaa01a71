package nofollow

import (
	"context"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// listen serves "hello from <name>" on a unix socket at path.
func listen(t *testing.T, path string) net.Listener {
	t.Helper()
	l, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			io.WriteString(c, "hello from "+filepath.Base(path))
			c.Close()
		}
	}()
	return l
}

func TestDialUnix(t *testing.T) {
	dir := t.TempDir()
	listen(t, dir+"/own.sock")
	listen(t, dir+"/other.sock")
	c, err := DialUnix(context.Background(), dir+"/own.sock")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(c)
	c.Close()
	if string(b) != "hello from own.sock" {
		t.Errorf("read %q", b)
	}

	// A VM swaps its socket for a link to another VM's: refused.
	if err := os.Symlink(dir+"/other.sock", dir+"/link.sock"); err != nil {
		t.Fatal(err)
	}
	if c, err := DialUnix(context.Background(), dir+"/link.sock"); err == nil || !errors.Is(err, syscall.ELOOP) {
		if c != nil {
			c.Close()
		}
		t.Errorf("dialing a link: %v, want ELOOP", err)
	}
	// Missing, not a socket, nobody listening: the errors net.Dial gives.
	if _, err := DialUnix(context.Background(), dir+"/missing.sock"); !errors.Is(err, syscall.ENOENT) {
		t.Errorf("missing socket: %v, want ENOENT", err)
	}
	if err := os.WriteFile(dir+"/file", nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := DialUnix(context.Background(), dir+"/file"); err == nil {
		t.Error("dialing a regular file succeeded")
	}
	dead, err := net.Listen("unix", dir+"/dead.sock")
	if err != nil {
		t.Fatal(err)
	}
	dead.(*net.UnixListener).SetUnlinkOnClose(false)
	dead.Close()
	if _, err := DialUnix(context.Background(), dir+"/dead.sock"); !errors.Is(err, syscall.ECONNREFUSED) {
		t.Errorf("socket without listener: %v, want ECONNREFUSED", err)
	}
	if _, err := DialUnix(context.Background(), dir+"/missing.sock"); err == nil || !strings.Contains(err.Error(), dir+"/missing.sock") {
		t.Errorf("error %v does not name the socket", err)
	}
}

func TestOpen(t *testing.T) {
	dir := t.TempDir()
	secret := dir + "/secret"
	if err := os.WriteFile(secret, []byte("key"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(dir+"/log", []byte("line\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if b, err := ReadFile(dir + "/log"); err != nil || string(b) != "line\n" {
		t.Errorf("ReadFile = %q, %v", b, err)
	}
	if err := os.Symlink(secret, dir+"/events"); err != nil {
		t.Fatal(err)
	}
	if b, err := ReadFile(dir + "/events"); !errors.Is(err, syscall.ELOOP) {
		t.Errorf("reading through a link: %q, %v, want ELOOP", b, err)
	}
	if err := syscall.Mkfifo(dir+"/fifo", 0o600); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { _, err := ReadFile(dir + "/fifo"); done <- err }()
	select {
	case err := <-done:
		if err == nil {
			t.Error("reading a FIFO succeeded")
		}
	case <-time.After(5 * time.Second):
		t.Fatal("opening a FIFO blocked")
	}
	if _, err := Open(dir); err == nil {
		t.Error("opening a directory succeeded")
	}
}

func TestChmod(t *testing.T) {
	dir := t.TempDir()
	target := dir + "/target"
	if err := os.WriteFile(target, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(target, dir+"/link"); err != nil {
		t.Fatal(err)
	}
	if err := Chmod(dir+"/link", 0o600); !errors.Is(err, syscall.ELOOP) {
		t.Errorf("chmod through a link: %v, want ELOOP", err)
	}
	if fi, _ := os.Stat(target); fi.Mode().Perm() != 0o644 {
		t.Errorf("the link's target became %v", fi.Mode().Perm())
	}
	listen(t, dir+"/s.sock")
	if err := Chmod(dir+"/s.sock", 0o600); err != nil {
		t.Fatal(err)
	}
	if fi, _ := os.Lstat(dir + "/s.sock"); fi.Mode().Perm() != 0o600 || fi.Mode().Type() != os.ModeSocket {
		t.Errorf("socket mode %v", fi.Mode())
	}
}
