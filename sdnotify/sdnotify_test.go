package sdnotify

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// listen opens a unixgram socket as systemd's notify socket.
func listen(t *testing.T, name string) *net.UnixConn {
	t.Helper()
	c, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: name, Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func recv(t *testing.T, c *net.UnixConn) string {
	t.Helper()
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	b := make([]byte, 4096)
	n, err := c.Read(b)
	if err != nil {
		t.Fatalf("reading a notification: %v", err)
	}
	return string(b[:n])
}

func TestNotifyPath(t *testing.T) {
	path := filepath.Join(t.TempDir(), "notify")
	c := listen(t, path)
	n, err := New(path)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range []string{Ready, Reloading, "STATUS=recovering 3 VMs\nREADY=1", Stopping} {
		if err := n.Notify(s); err != nil {
			t.Fatalf("Notify(%q) = %v", s, err)
		}
		if got := recv(t, c); got != s {
			t.Errorf("datagram = %q, want %q", got, s)
		}
	}
}

func TestNotifyAbstract(t *testing.T) {
	name := fmt.Sprintf("@vmhost-sdnotify-test-%d", os.Getpid())
	c := listen(t, name)
	t.Setenv(Env, name)
	n, err := FromEnv()
	if err != nil {
		t.Fatal(err)
	}
	if v, ok := os.LookupEnv(Env); ok {
		t.Errorf("FromEnv left %s=%q for the children", Env, v)
	}
	if err := n.Notify(Ready); err != nil {
		t.Fatal(err)
	}
	if got := recv(t, c); got != Ready {
		t.Errorf("datagram = %q, want %q", got, Ready)
	}
}

func TestNotifyDisabled(t *testing.T) {
	t.Setenv(Env, "")
	n, err := FromEnv()
	if err != nil {
		t.Fatal(err)
	}
	if n.Enabled() {
		t.Error("a notifier without NOTIFY_SOCKET is enabled")
	}
	if err := n.Notify(Ready); err != nil {
		t.Errorf("Notify without a socket = %v, want nil", err)
	}
	var nilN *Notifier
	if err := nilN.Notify(Ready); err != nil {
		t.Errorf("Notify on nil = %v, want nil", err)
	}
}

func TestNewRefuses(t *testing.T) {
	for _, p := range []string{"relative/path", "@", "vsock:2:1234"} {
		if _, err := New(p); err == nil {
			t.Errorf("New(%q) = nil error, want a refusal", p)
		}
	}
	// A socket nobody listens on is an error the caller can log.
	n, err := New(filepath.Join(t.TempDir(), "absent"))
	if err != nil {
		t.Fatal(err)
	}
	if err := n.Notify(Ready); err == nil {
		t.Error("Notify to a missing socket = nil, want an error")
	}
}
