package disk

import (
	"context"
	"errors"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// stallingServer answers with headers and the first 100 bytes of body, then
// sends nothing until the client goes.
func stallingServer(t *testing.T, body []byte) *httptest.Server {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", strconv.Itoa(len(body)))
		w.Write(body[:100])
		w.(http.Flusher).Flush()
		<-r.Context().Done()
	}))
	t.Cleanup(srv.Close)
	return srv
}

// TestFetchIdleTimeout: a server that stops sending (after the headers, or
// before them) fails the download after IdleTimeout with an error naming
// the timeout, leaving nothing; a slow server that keeps sending is not
// cut off, though the whole transfer takes longer than the timeout.
func TestFetchIdleTimeout(t *testing.T) {
	img := qcow2Bytes(t, 1<<30)
	silent := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		<-r.Context().Done() // no headers at all
	}))
	defer silent.Close()
	slow := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", strconv.Itoa(len(img)))
		step := len(img)/5 + 1
		for off := 0; off < len(img); off += step {
			w.Write(img[off:min(off+step, len(img))])
			w.(http.Flusher).Flush()
			time.Sleep(400 * time.Millisecond) // 2 s in all, each gap under 1 s
		}
	}))
	defer slow.Close()

	for _, tc := range []struct {
		name, url string
		ok        bool
	}{
		{"stall after headers", stallingServer(t, img).URL, false},
		{"no headers", silent.URL, false},
		{"slow but steady", slow.URL, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			c, err := NewCache(dir, CacheOptions{IdleTimeout: time.Second})
			if err != nil {
				t.Fatal(err)
			}
			// The deadline only keeps a broken idle timeout from hanging
			// the test.
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			_, err = c.Fetch(ctx, tc.url+"/img.qcow2", digest(img), nil)
			if tc.ok {
				if err != nil {
					t.Fatalf("Fetch from a slow server: %v", err)
				}
				return
			}
			if !errors.Is(err, ErrIdleTimeout) || !strings.Contains(err.Error(), "download idle timeout: nothing received for 1s") {
				t.Fatalf("Fetch = %v, want the idle timeout", err)
			}
			if names := dirEntries(t, dir); len(names) != 0 {
				t.Errorf("files left after the idle timeout: %v", names)
			}
		})
	}
}

// TestFetchCancelStalled: cancelling the context of a download stalled
// mid-body (idle timeout far away) returns promptly, and by the time Fetch
// returns the partial file is gone.
func TestFetchCancelStalled(t *testing.T) {
	img := qcow2Bytes(t, 1<<30)
	srv := stallingServer(t, img)
	dir := t.TempDir()
	c, err := NewCache(dir, CacheOptions{}) // default idle timeout: 60 s
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var received atomic.Int64
	done := make(chan error, 1)
	go func() {
		_, err := c.Fetch(ctx, srv.URL, digest(img), func(n, _ int64) { received.Store(n) })
		done <- err
	}()
	// Wait for the partial file: the temp file holding the first bytes.
	deadline := time.Now().Add(10 * time.Second)
	for len(dirEntries(t, dir)) == 0 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	if names := dirEntries(t, dir); len(names) != 1 {
		t.Fatalf("cache directory while downloading = %v, want one temp file", names)
	}
	cancel()
	select {
	case err := <-done:
		if !errors.Is(err, context.Canceled) {
			t.Errorf("Fetch = %v, want context.Canceled", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Fetch did not return after its context was cancelled")
	}
	if names := dirEntries(t, dir); len(names) != 0 {
		t.Errorf("files left when Fetch returned: %v", names)
	}
}

// countingServer counts the connections made to it.
func countingServer(t *testing.T, network, addr string, h http.Handler) (*httptest.Server, *atomic.Int32) {
	t.Helper()
	ln, err := net.Listen(network, addr)
	if err != nil {
		t.Skipf("cannot listen on %s %s: %v", network, addr, err)
	}
	var conns atomic.Int32
	srv := httptest.NewUnstartedServer(h)
	srv.Listener.Close()
	srv.Listener = ln
	srv.Config.ConnState = func(_ net.Conn, s http.ConnState) {
		if s == http.StateNew {
			conns.Add(1)
		}
	}
	srv.Start()
	t.Cleanup(srv.Close)
	return srv, &conns
}

// TestFetchDeny: with 127.0.0.0/8 denied, a server on 127.0.0.1 is never
// connected to, whether named directly, by a host name resolving to it, or
// as a redirect from an allowed server on [::1]; the error names the rule.
// The allowed server serves normally.
func TestFetchDeny(t *testing.T) {
	img := qcow2Bytes(t, 1<<20)
	serveImg := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.Write(img) })
	denied, deniedConns := countingServer(t, "tcp4", "127.0.0.1:0", serveImg)
	allowed, _ := countingServer(t, "tcp6", "[::1]:0", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/hop" {
			http.Redirect(w, r, denied.URL+"/img.qcow2", http.StatusFound)
			return
		}
		serveImg(w, r)
	}))
	_, port, _ := net.SplitHostPort(denied.Listener.Addr().String())
	deny := []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8"), netip.MustParsePrefix("127.0.0.0/8")}

	for _, tc := range []struct{ name, url string }{
		{"direct", denied.URL + "/img.qcow2"},
		{"by name", "http://localhost:" + port + "/img.qcow2"},
		{"redirect", allowed.URL + "/hop"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			c, err := NewCache(dir, CacheOptions{Deny: deny})
			if err != nil {
				t.Fatal(err)
			}
			_, err = c.Fetch(context.Background(), tc.url, digest(img), nil)
			var de *DeniedError
			if !errors.As(err, &de) || de.Addr != netip.MustParseAddr("127.0.0.1") {
				t.Fatalf("Fetch(%s) = %v, want a *DeniedError for 127.0.0.1", tc.url, err)
			}
			if want := "address 127.0.0.1 is denied by fetch_deny rule 127.0.0.0/8"; !strings.Contains(err.Error(), want) {
				t.Errorf("error %q does not say %q", err, want)
			}
			if n := deniedConns.Load(); n != 0 {
				t.Errorf("the denied server saw %d connections", n)
			}
			if names := dirEntries(t, dir); len(names) != 0 {
				t.Errorf("files left: %v", names)
			}
		})
	}
	t.Run("allowed", func(t *testing.T) {
		c, err := NewCache(t.TempDir(), CacheOptions{Deny: deny})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := c.Fetch(context.Background(), allowed.URL+"/img.qcow2", digest(img), nil); err != nil {
			t.Errorf("Fetch from an allowed address: %v", err)
		}
	})
}

// TestCheckDeny: the forms a resolved address takes that a plain
// Prefix.Contains would miss.
func TestCheckDeny(t *testing.T) {
	deny := []netip.Prefix{netip.MustParsePrefix("169.254.0.0/16"), netip.MustParsePrefix("fe80::/10")}
	for _, tc := range []struct {
		addr, rule string // rule "" = allowed
	}{
		{"169.254.169.254:80", "169.254.0.0/16"},
		{"[::ffff:169.254.169.254]:80", "169.254.0.0/16"},
		{"[fe80::1%lo]:80", "fe80::/10"},
		{"[fe80::1]:443", "fe80::/10"},
		{"10.1.2.3:80", ""},
		{"[2001:db8::1]:80", ""},
	} {
		err := checkDeny(deny, tc.addr)
		var de *DeniedError
		switch {
		case tc.rule == "" && err != nil:
			t.Errorf("checkDeny(%s) = %v, want allowed", tc.addr, err)
		case tc.rule != "" && (!errors.As(err, &de) || de.Rule.String() != tc.rule):
			t.Errorf("checkDeny(%s) = %v, want denied by %s", tc.addr, err, tc.rule)
		}
	}
}
