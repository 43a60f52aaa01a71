package server

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"
)

// TestLongExchangesOutliveLimits: an upgraded connection the handler took
// over (an interactive exec) and a request whose answer comes long after
// its headers (a one-shot exec of up to an hour) are cut by none of the
// server's limits: not the header deadline, not the idle timeout, not the
// eviction of a full listener, while both stay silent longer than each.
func TestLongExchangesOutliveLimits(t *testing.T) {
	rl := defaultRequestLimits
	rl.readHeader, rl.idle = 100*time.Millisecond, 150*time.Millisecond
	const silence = 600 * time.Millisecond
	ts := newTestServer(t, listenerLimits{maxConns: 3, maxUnkeyedPerSource: 2, grace: 50 * time.Millisecond}, rl,
		http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			switch r.URL.Path {
			case "/upgrade":
				c, brw, err := http.NewResponseController(w).Hijack()
				if err != nil {
					t.Error(err)
					return
				}
				defer c.Close()
				c.SetDeadline(time.Time{})
				io.WriteString(c, "HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: test\r\n\r\n")
				// Echo lines until the client closes.
				for {
					line, err := brw.ReadString('\n')
					if err != nil {
						return
					}
					io.WriteString(c, "echo "+line)
				}
			case "/slow":
				time.Sleep(silence)
				io.WriteString(w, "done\n")
			}
		}))
	up, err := net.Dial("tcp", ts.addr)
	if err != nil {
		t.Fatal(err)
	}
	defer up.Close()
	fmt.Fprintf(up, "GET /upgrade HTTP/1.1\r\nHost: vmhost\r\nAuthorization: Bearer %s\r\nConnection: Upgrade\r\nUpgrade: test\r\n\r\n", ts.token)
	br := bufio.NewReader(up)
	resp, err := http.ReadResponse(br, nil)
	if err != nil || resp.StatusCode != 101 {
		t.Fatalf("upgrade: %v %v", resp, err)
	}
	slowDone := make(chan string, 1)
	go func() {
		c, err := net.Dial("tcp", ts.addr)
		if err != nil {
			slowDone <- err.Error()
			return
		}
		defer c.Close()
		resp, body, err := request(c, "/slow", ts.token)
		if err != nil {
			slowDone <- err.Error()
			return
		}
		slowDone <- fmt.Sprint(resp.StatusCode, " ", body)
	}()
	// Meanwhile clients without a key fill the listener again and again.
	stop := make(chan struct{})
	defer close(stop)
	go func() {
		for {
			select {
			case <-stop:
				return
			case <-time.After(20 * time.Millisecond):
			}
			if c, err := net.Dial("tcp", ts.addr); err == nil {
				defer c.Close()
			}
		}
	}()
	for i := range 3 {
		time.Sleep(silence / 3)
		up.SetDeadline(time.Now().Add(5 * time.Second))
		fmt.Fprintf(up, "line %d\n", i)
		got, err := br.ReadString('\n')
		if err != nil || got != fmt.Sprintf("echo line %d\n", i) {
			t.Fatalf("upgraded connection after %v of silence: %q, %v", time.Duration(i+1)*silence/3, got, err)
		}
	}
	time.Sleep(silence)
	fmt.Fprintf(up, "last\n")
	if got, err := br.ReadString('\n'); err != nil || !strings.HasPrefix(got, "echo last") {
		t.Fatalf("upgraded connection after %v of silence: %q, %v", silence, got, err)
	}
	select {
	case got := <-slowDone:
		if got != "200 done\n" {
			t.Errorf("a request answered after %v: %s", silence, got)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the slow request never ended")
	}
}
