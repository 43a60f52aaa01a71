package chclient

import (
	"bufio"
	"context"
	"errors"
	"net"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

// pingServer answers vmm.ping on a unix socket as CH does (keep-alive),
// counting connections; answer decides each response ("" = never).
func pingServer(t *testing.T, answer func(n int) string) (sock string, conns *atomic.Int32) {
	t.Helper()
	sock = filepath.Join(t.TempDir(), "ch.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	conns = new(atomic.Int32)
	var reqs atomic.Int32
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			conns.Add(1)
			go func() {
				defer c.Close()
				br := bufio.NewReader(c)
				for {
					line, err := br.ReadString('\n')
					if err != nil {
						return
					}
					if line != "\r\n" {
						continue
					}
					a := answer(int(reqs.Add(1)))
					if a == "" {
						time.Sleep(time.Hour)
					}
					c.Write([]byte(a))
				}
			}()
		}
	}()
	return sock, conns
}

const pongBody = `{"build_version":"v53","version":"53"}`

var pong = "HTTP/1.1 200 \r\nServer: Cloud Hypervisor API\r\nConnection: keep-alive\r\nContent-Type: application/json\r\nContent-Length: " +
	strconv.Itoa(len(pongBody)) + "\r\n\r\n" + pongBody

// TestPingerKeepsConnection: pings reuse one connection; a bad answer
// closes it and the next ping dials again.
func TestPingerKeepsConnection(t *testing.T) {
	sock, conns := pingServer(t, func(n int) string {
		if n == 4 {
			return "HTTP/1.1 500 \r\nContent-Length: 2\r\n\r\n[]"
		}
		return pong
	})
	p := NewPinger(sock)
	defer p.Close()
	ctx := context.Background()
	for i := range 3 {
		if err := p.Ping(ctx); err != nil {
			t.Fatalf("ping %d: %v", i, err)
		}
	}
	if n := conns.Load(); n != 1 {
		t.Errorf("3 pings used %d connections, want 1", n)
	}
	if err := p.Ping(ctx); err == nil || !strings.Contains(err.Error(), "500") {
		t.Fatalf("ping answered 500 = %v", err)
	}
	if err := p.Ping(ctx); err != nil {
		t.Fatal(err)
	}
	if n := conns.Load(); n != 2 {
		t.Errorf("after a failed ping: %d connections, want 2 (re-dialled)", n)
	}
}

// TestPingerErrors: no socket is ENOENT, a VMM that does not answer is
// context.DeadlineExceeded within the deadline.
func TestPingerErrors(t *testing.T) {
	p := NewPinger(filepath.Join(t.TempDir(), "none.sock"))
	if err := p.Ping(context.Background()); !errors.Is(err, syscall.ENOENT) {
		t.Errorf("ping without a socket = %v, want ENOENT", err)
	}
	sock, _ := pingServer(t, func(int) string { return "" })
	p = NewPinger(sock)
	defer p.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	start := time.Now()
	if err := p.Ping(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("ping of a hung VMM = %v, want DeadlineExceeded", err)
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Errorf("the hung ping took %v", d)
	}
}

// TestReadCounters: vm.counters is read and decoded over a raw
// connection; an error status is an *APIError with CH's message.
func TestReadCounters(t *testing.T) {
	body := `{"_disk0":{"read_bytes":4096,"write_ops":3}}`
	sock, _ := pingServer(t, func(n int) string {
		if n == 2 {
			b := `["The VM info is not available"]`
			return "HTTP/1.1 500 \r\nContent-Length: " + strconv.Itoa(len(b)) + "\r\n\r\n" + b
		}
		return "HTTP/1.1 200 \r\nContent-Type: application/json\r\nContent-Length: " + strconv.Itoa(len(body)) + "\r\n\r\n" + body
	})
	got, err := ReadCounters(context.Background(), sock)
	if err != nil || got["_disk0"]["read_bytes"] != 4096 || got["_disk0"]["write_ops"] != 3 {
		t.Fatalf("ReadCounters = %v, %v", got, err)
	}
	var ae *APIError
	if _, err := ReadCounters(context.Background(), sock); !errors.As(err, &ae) || ae.Status != 500 || ae.Last() != "The VM info is not available" {
		t.Errorf("ReadCounters of a VM without counters = %v", err)
	}
}
