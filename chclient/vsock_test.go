package chclient_test

import (
	"bufio"
	"errors"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"vmhost/chclient"
)

// bootVsockVM creates and boots a VM with a vsock device on the simulator, whose guest
// listens on port 1024.
func bootVsockVM(t *testing.T) (fixture, *chclient.Process) {
	t.Helper()
	f, p := launchSim(t, "--sim-guest-ports", "1024")
	ctx := ctxT(t)
	cfg := &chclient.VmConfig{
		Payload: &chclient.PayloadConfig{Kernel: touch(t, filepath.Join(f.dir, "vmlinux"))},
		Console: &chclient.ConsoleConfig{Mode: chclient.ConsoleOff},
		Vsock:   &chclient.VsockConfig{Cid: 3, Socket: f.vsock},
	}
	if err := p.Client().CreateVM(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	if err := p.Client().BootVM(ctx); err != nil {
		t.Fatal(err)
	}
	return f, p
}

func TestDialVsock(t *testing.T) {
	f, _ := bootVsockVM(t)
	ctx := ctxT(t)
	c, err := chclient.DialVsock(ctx, f.vsock, 1024)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if c.HostPort < 1<<30 {
		t.Errorf("host port = %d, want ≥ 2^30", c.HostPort)
	}
	// The guest echoes: the first bytes back are ours, so the handshake left no extra
	// line or byte behind.
	c.SetDeadline(time.Now().Add(5 * time.Second))
	io.WriteString(c, "hello\n")
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil || line != "hello\n" {
		t.Fatalf("echo = %q, %v", line, err)
	}
	c2, err := chclient.DialVsock(ctx, f.vsock, 1024)
	if err != nil {
		t.Fatal(err)
	}
	c2.Close()
	if c2.HostPort == c.HostPort {
		t.Errorf("two connections share host port %d", c.HostPort)
	}

	_, err = chclient.DialVsock(ctx, f.vsock, 9999)
	if !errors.Is(err, chclient.ErrVsockRefused) {
		t.Fatalf("DialVsock to a closed port = %v, want ErrVsockRefused", err)
	}
}

func TestListenVsock(t *testing.T) {
	f, _ := bootVsockVM(t)
	// A stale socket file from an earlier run is replaced.
	stale := chclient.VsockListenPath(f.vsock, 5000)
	if l, err := chclient.ListenVsock(f.vsock, 5000); err != nil {
		t.Fatal(err)
	} else {
		l.SetUnlinkOnClose(false)
		l.Close()
	}
	if _, err := os.Stat(stale); err != nil {
		t.Fatalf("stale socket not left for the test: %v", err)
	}
	l, err := chclient.ListenVsock(f.vsock, 5000)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	req, _ := http.NewRequest("PUT", "http://x/sim/v1/vsock/connect", strings.NewReader(`{"port":5000,"data":"from-guest"}`))
	resp, err := simHTTP(f).Do(req)
	if err != nil || resp.StatusCode != 204 {
		t.Fatalf("guest connect = %v, %v", resp, err)
	}
	resp.Body.Close()
	l.SetDeadline(time.Now().Add(5 * time.Second))
	c, err := l.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	got := make([]byte, len("from-guest"))
	if _, err := io.ReadFull(c, got); err != nil || string(got) != "from-guest" {
		t.Fatalf("host read %q, %v", got, err)
	}
	// The probe dial of a second ListenVsock lands in this listener's backlog; that is the
	// price of telling a live socket from a stale one.
	if _, err := chclient.ListenVsock(f.vsock, 5000); err == nil {
		t.Error("a second listener on a live socket succeeded")
	}
}
