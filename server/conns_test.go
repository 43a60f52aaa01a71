package server

import (
	"bufio"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/big"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"vmhost/auth"
)

// testServer is an HTTP server as Run builds it (keyedOnly over a handler,
// limited listeners, request limits) over a real keyring, on loopback.
type testServer struct {
	addr  string
	token string
	ln    *limitedListener
	srv   *http.Server
}

func newTestServer(t *testing.T, ll listenerLimits, rl requestLimits, h http.Handler) *testServer {
	t.Helper()
	path := filepath.Join(t.TempDir(), "keys.json")
	token, err := auth.Add(path, "ops", auth.ScopeRead, nil)
	if err != nil {
		t.Fatal(err)
	}
	keys, err := auth.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	if h == nil {
		// What the API does with the key: 401 without one.
		h = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path == "/healthz" {
				io.WriteString(w, "ok\n")
				return
			}
			if _, err := keys.Authorize(r.Header.Get("Authorization"), "GET /api/vms", false); err != nil {
				http.Error(w, `{"code":"UNAUTHORIZED"}`, http.StatusUnauthorized)
				return
			}
			io.WriteString(w, "[]\n")
		})
	}
	raw, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ts := &testServer{addr: raw.Addr().String(), token: token, ln: limitListener(raw, ll)}
	ts.srv = newHTTPServer(keyedOnly{keys: keys, next: h}, rl, slog.New(slog.DiscardHandler))
	served := make(chan error, 1)
	go func() { served <- ts.srv.Serve(ts.ln) }()
	t.Cleanup(func() {
		ts.srv.Close()
		if err := <-served; !errors.Is(err, http.ErrServerClosed) {
			t.Errorf("Serve = %v", err)
		}
	})
	return ts
}

// dialFrom connects to addr from the loopback address src (127.0.0.x): a
// source of its own.
func dialFrom(src, addr string) (net.Conn, error) {
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(src)}, Timeout: 5 * time.Second}
	return d.Dial("tcp", addr)
}

// request writes one GET on c and reads the answer.
func request(c net.Conn, path, token string) (*http.Response, string, error) {
	c.SetDeadline(time.Now().Add(10 * time.Second))
	defer c.SetDeadline(time.Time{})
	auth := ""
	if token != "" {
		auth = "Authorization: Bearer " + token + "\r\n"
	}
	if _, err := fmt.Fprintf(c, "GET %s HTTP/1.1\r\nHost: vmhost\r\n%s\r\n", path, auth); err != nil {
		return nil, "", err
	}
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		return nil, "", err
	}
	b, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	return resp, string(b), err
}

// closedWithin reports whether the server closes c (a read gives EOF or a
// reset, after whatever it sent last) within d.
func closedWithin(c net.Conn, d time.Duration) bool {
	c.SetReadDeadline(time.Now().Add(d))
	_, err := io.Copy(io.Discard, c)
	var ne net.Error
	return !(errors.As(err, &ne) && ne.Timeout())
}

// keyedClient makes requests with the key, each on a connection of its
// own, from src.
func keyedClient(src, token string) *http.Client {
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(src)}, Timeout: 5 * time.Second}
	return &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{DialContext: d.DialContext, DisableKeepAlives: true}}
}

func getVMs(c *http.Client, addr, token string) (int, error) {
	req, _ := http.NewRequest("GET", "http://"+addr+"/api/vms", nil)
	req.Header.Set("Authorization", "Bearer "+token)
	resp, err := c.Do(req)
	if err != nil {
		return 0, err
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode, nil
}

// TestRequestsWithoutKeyClose: /healthz and a 401 (no key, a wrong key)
// are answered with Connection: close and the connection is closed at
// once, not left to idle; a request with a key keeps its connection for
// the next one.
func TestRequestsWithoutKeyClose(t *testing.T) {
	ts := newTestServer(t, networkLimits, defaultRequestLimits, nil)
	for _, tt := range []struct {
		path, token string
		status      int
	}{
		{"/healthz", "", 200},
		{"/api/vms", "", 401},
		{"/api/vms", "vmh_" + strings.Repeat("x", 43), 401},
	} {
		c, err := net.Dial("tcp", ts.addr)
		if err != nil {
			t.Fatal(err)
		}
		resp, _, err := request(c, tt.path, tt.token)
		if err != nil {
			t.Fatalf("GET %s: %v", tt.path, err)
		}
		if resp.StatusCode != tt.status || !resp.Close {
			t.Errorf("GET %s = %d, close %t; want %d with Connection: close", tt.path, resp.StatusCode, resp.Close, tt.status)
		}
		if !closedWithin(c, 2*time.Second) {
			t.Errorf("the connection of GET %s without a key is still open 2 s after the answer", tt.path)
		}
		c.Close()
	}
	c, err := net.Dial("tcp", ts.addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	for i := range 3 {
		resp, body, err := request(c, "/api/vms", ts.token)
		if err != nil || resp.StatusCode != 200 || resp.Close || body != "[]\n" {
			t.Fatalf("keyed request #%d on one connection = %v, %v, %q", i+1, resp, err, body)
		}
	}
	// A keyed /healthz keeps the connection too.
	if resp, _, err := request(c, "/healthz", ts.token); err != nil || resp.Close {
		t.Errorf("keyed /healthz = %v, %v; want the connection kept", resp, err)
	}
	if closedWithin(c, 300*time.Millisecond) {
		t.Error("the server closed a keyed connection that idled 300 ms")
	}
}

// TestKeyedClientsUnderIdleFlood: eight sources each open more idle
// connections (and connections that asked /healthz and hold) than the
// listener admits; keyed clients, from another source and from a flooding
// one, still get every answer, and a keyed connection opened before the
// flood is never evicted. No source holds more connections without a key
// than its bound.
func TestKeyedClientsUnderIdleFlood(t *testing.T) {
	ll := listenerLimits{maxConns: 16, maxUnkeyedPerSource: 4, grace: 200 * time.Millisecond}
	ts := newTestServer(t, ll, defaultRequestLimits, nil)
	early, err := net.Dial("tcp", ts.addr)
	if err != nil {
		t.Fatal(err)
	}
	defer early.Close()
	if resp, _, err := request(early, "/api/vms", ts.token); err != nil || resp.StatusCode != 200 {
		t.Fatalf("keyed request before the flood: %v, %v", resp, err)
	}

	var hostile []net.Conn
	var mu sync.Mutex
	defer func() {
		mu.Lock()
		defer mu.Unlock()
		for _, c := range hostile {
			c.Close()
		}
	}()
	var wg sync.WaitGroup
	for s := 2; s < 10; s++ {
		src := fmt.Sprintf("127.0.0.%d", s)
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 12 {
				c, err := dialFrom(src, ts.addr)
				if err != nil {
					t.Errorf("hostile dial: %v", err)
					return
				}
				if i%3 == 0 {
					// Half a request: the headers never end.
					io.WriteString(c, "GET /healthz HTTP/1.1\r\nHost: x\r\n")
				}
				mu.Lock()
				hostile = append(hostile, c)
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	time.Sleep(ll.grace) // they have sat without a key
	for _, src := range []string{"127.0.0.1", "127.0.0.2"} {
		c := keyedClient(src, ts.token)
		for i := range 20 {
			if st, err := getVMs(c, ts.addr, ts.token); err != nil || st != 200 {
				t.Fatalf("keyed GET #%d from %s during the flood = %d, %v", i+1, src, st, err)
			}
		}
	}
	if resp, _, err := request(early, "/api/vms", ts.token); err != nil || resp.StatusCode != 200 {
		t.Errorf("the keyed connection from before the flood: %v, %v", resp, err)
	}
	ts.ln.mu.Lock()
	defer ts.ln.mu.Unlock()
	if ts.ln.open > ll.maxConns {
		t.Errorf("%d connections open, more than %d", ts.ln.open, ll.maxConns)
	}
	for src, cs := range ts.ln.unkeyed {
		if len(cs) > ll.maxUnkeyedPerSource {
			t.Errorf("source %s holds %d connections without a key, more than %d", src, len(cs), ll.maxUnkeyedPerSource)
		}
	}
}

// TestSlowlorisTimesOut: a connection that trickles its headers, one that
// sends nothing, and a keyed connection that trickles its second request's
// headers are all closed at the header deadline, unanswered.
func TestSlowlorisTimesOut(t *testing.T) {
	rl := defaultRequestLimits
	rl.readHeader = 300 * time.Millisecond
	var served atomic.Int32
	ts := newTestServer(t, networkLimits, rl, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		served.Add(1)
	}))
	trickle := func(c net.Conn, stop <-chan struct{}) {
		for _, b := range []byte("GET /api/vms HTTP/1.1\r\nHost: vmhost\r\nX-Slow: " + strings.Repeat("a", 100)) {
			select {
			case <-stop:
				return
			case <-time.After(50 * time.Millisecond):
			}
			if _, err := c.Write([]byte{b}); err != nil {
				return
			}
		}
	}
	check := func(name string, c net.Conn) {
		t.Helper()
		start := time.Now()
		if !closedWithin(c, 5*time.Second) {
			t.Errorf("%s: still open 5 s later with a 300 ms header deadline", name)
		} else if d := time.Since(start); d < 200*time.Millisecond {
			t.Errorf("%s: closed after %v, before the header deadline", name, d)
		}
	}
	stop := make(chan struct{})
	defer close(stop)
	slow, err := net.Dial("tcp", ts.addr)
	if err != nil {
		t.Fatal(err)
	}
	defer slow.Close()
	go trickle(slow, stop)
	check("trickled headers", slow)

	silent, err := net.Dial("tcp", ts.addr)
	if err != nil {
		t.Fatal(err)
	}
	defer silent.Close()
	check("a connection that sends nothing", silent)

	keyed, err := net.Dial("tcp", ts.addr)
	if err != nil {
		t.Fatal(err)
	}
	defer keyed.Close()
	if resp, _, err := request(keyed, "/api/vms", ts.token); err != nil || resp.StatusCode != 200 {
		t.Fatalf("keyed request: %v, %v", resp, err)
	}
	go trickle(keyed, stop)
	check("a keyed connection trickling its next headers", keyed)
	if n := served.Load(); n != 1 {
		t.Errorf("%d requests served, want only the keyed one", n)
	}
}

// TestLimitListenerKeyedWait: with a cap of 2 and two keyed connections
// whose requests block in the handler, three more clients wait (connected
// in the backlog, not accepted); as the first ones close, the others get
// in, and all five are answered. Closing the listener ends an Accept that
// waits for room.
func TestLimitListenerKeyedWait(t *testing.T) {
	var inside, most atomic.Int32
	release := make(chan struct{})
	entered := make(chan struct{}, 5)
	ts := newTestServer(t, listenerLimits{maxConns: 2, grace: time.Second}, defaultRequestLimits, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := inside.Add(1)
		for m := most.Load(); n > m && !most.CompareAndSwap(m, n); m = most.Load() {
		}
		entered <- struct{}{}
		<-release
		inside.Add(-1)
		w.Header().Set("Connection", "close") // the slot frees when the answer is sent
		fmt.Fprint(w, "ok")
	}))
	var wg sync.WaitGroup
	errs := make(chan error, 5)
	get := func() {
		defer wg.Done()
		if st, err := getVMs(keyedClient("127.0.0.1", ts.token), ts.addr, ts.token); err != nil || st != 200 {
			errs <- fmt.Errorf("GET = %d, %v", st, err)
		}
	}
	wg.Add(2)
	go get()
	go get()
	<-entered
	<-entered
	// The first two are keyed now: the next three cannot evict them.
	wg.Add(3)
	for range 3 {
		go get()
	}
	time.Sleep(300 * time.Millisecond)
	if n := inside.Load(); n != 2 {
		t.Errorf("%d handlers running with a cap of 2 keyed connections", n)
	}
	close(release)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if m := most.Load(); m > 2 {
		t.Errorf("up to %d handlers ran at once, want at most 2", m)
	}

	// A full listener's waiting Accept ends when the listener closes.
	raw, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	full := limitListener(raw, listenerLimits{maxConns: 1})
	dialed, err := net.Dial("tcp", raw.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer dialed.Close()
	first, err := full.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer first.Close()
	first.(*limitedConn).markKeyed()
	waiting := make(chan error, 1)
	go func() {
		c, err := full.Accept()
		if c != nil {
			c.Close()
		}
		waiting <- err
	}()
	select {
	case err := <-waiting:
		t.Fatalf("Accept on a listener full of keyed connections returned %v", err)
	case <-time.After(100 * time.Millisecond):
	}
	full.Close()
	select {
	case err := <-waiting:
		if !errors.Is(err, net.ErrClosed) {
			t.Errorf("Accept after Close = %v, want net.ErrClosed", err)
		}
	case <-time.After(20 * time.Second):
		t.Error("Accept waiting for room did not end when the listener closed")
	}
}

// TestEvictionOrder: a source at its bound loses its own oldest connection
// without a key; a full listener takes the oldest one of the source that
// holds the most; a keyed connection is never taken; a closed connection
// gives its slot back once.
func TestEvictionOrder(t *testing.T) {
	raw, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	l := limitListener(raw, listenerLimits{maxConns: 5, maxUnkeyedPerSource: 2})
	defer l.Close()
	accepted := make(chan *limitedConn, 1)
	go func() {
		for {
			s, err := l.Accept()
			if err != nil {
				close(accepted)
				return
			}
			t.Cleanup(func() { s.Close() })
			accepted <- s.(*limitedConn)
		}
	}()
	accept := func(src string) (client net.Conn, server *limitedConn) {
		t.Helper()
		c, err := dialFrom(src, raw.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		select {
		case s := <-accepted:
			return c, s
		case <-time.After(5 * time.Second):
			t.Fatalf("connection from %s not accepted", src)
			return nil, nil
		}
	}
	a1c, a1 := accept("127.0.0.2")
	_, a2 := accept("127.0.0.2")
	a2.markKeyed()
	a3c, _ := accept("127.0.0.2")
	a4c, _ := accept("127.0.0.2") // the source's third without a key: a1 goes
	if !closedWithin(a1c, time.Second) || !a1.gone {
		t.Error("a source past its bound kept its oldest connection without a key")
	}
	if a2.gone {
		t.Error("a keyed connection was evicted")
	}
	b1c, _ := accept("127.0.0.3")
	accept("127.0.0.4") // 5 open: a2 (keyed), a3, a4, b1, c1
	accept("127.0.0.1") // full: the busiest source (.2) loses its oldest, a3
	if !closedWithin(a3c, time.Second) {
		t.Error("a full listener did not evict the busiest source's oldest connection")
	}
	if closedWithin(a4c, 100*time.Millisecond) || closedWithin(b1c, 100*time.Millisecond) {
		t.Error("eviction took more than one connection")
	}
	l.mu.Lock()
	open := l.open
	l.mu.Unlock()
	if open != 5 {
		t.Errorf("%d connections counted, want 5", open)
	}
	a2.Close()
	a2.Close()
	l.mu.Lock()
	open = l.open
	l.mu.Unlock()
	if open != 4 {
		t.Errorf("after closing one twice: %d counted, want 4", open)
	}

	// A source at its bound loses its oldest whatever its age; a full
	// listener holds a new connection until the oldest is past its grace.
	raw2, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	const grace = 300 * time.Millisecond
	g := limitListener(raw2, listenerLimits{maxConns: 3, maxUnkeyedPerSource: 2, grace: grace})
	defer g.Close()
	got := make(chan *limitedConn, 8)
	go func() {
		for {
			s, err := g.Accept()
			if err != nil {
				return
			}
			t.Cleanup(func() { s.Close() })
			got <- s.(*limitedConn)
		}
	}()
	dial := func(src string) net.Conn {
		t.Helper()
		c, err := dialFrom(src, raw2.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	y1 := dial("127.0.0.2")
	<-got
	y2 := dial("127.0.0.2")
	<-got
	dial("127.0.0.2") // at the bound: the young y1 goes
	<-got
	if !closedWithin(y1, time.Second) || closedWithin(y2, 50*time.Millisecond) {
		t.Error("a source at its bound: want its oldest closed, the next kept")
	}
	dial("127.0.0.3")
	<-got // full now: 3 open, all young
	start := time.Now()
	dial("127.0.0.4")
	select {
	case <-got:
		if d := time.Since(start); d < grace/2 {
			t.Errorf("a full listener of young connections let a new one in after %v, within the grace", d)
		}
		if !closedWithin(y2, time.Second) {
			t.Error("once old enough, the busiest source's oldest connection was not the one evicted")
		}
	case <-time.After(5 * time.Second):
		t.Error("the held connection was not let in once the grace passed")
	}
}

func TestSourceOf(t *testing.T) {
	for _, tt := range []struct {
		addr net.Addr
		want string
	}{
		{&net.TCPAddr{IP: net.ParseIP("192.0.2.7"), Port: 1}, "192.0.2.7"},
		{&net.TCPAddr{IP: net.ParseIP("::ffff:192.0.2.7"), Port: 1}, "192.0.2.7"},
		{&net.TCPAddr{IP: net.ParseIP("2001:db8:1:2:3:4:5:6"), Port: 1}, "2001:db8:1:2::/64"},
		{&net.TCPAddr{IP: net.ParseIP("2001:db8:1:2:ffff::1"), Port: 9}, "2001:db8:1:2::/64"},
		{&net.UnixAddr{Name: "@", Net: "unix"}, ""},
	} {
		if got := sourceOf(tt.addr); got != tt.want {
			t.Errorf("sourceOf(%v) = %q, want %q", tt.addr, got, tt.want)
		}
	}
}

// TestErrorLogLimited: the HTTP server's complaints are logged up to the
// burst per window; the rest are counted and the count logged when the
// next window starts.
func TestErrorLogLimited(t *testing.T) {
	var buf strings.Builder
	var mu sync.Mutex
	now := time.Unix(1000, 0)
	w := &limitedLog{log: slog.New(slog.NewTextHandler(lockedWriter{&mu, &buf}, nil)), now: func() time.Time { return now }}
	for i := range errorLogBurst + 30 {
		fmt.Fprintf(w, "http: TLS handshake error from 192.0.2.1:%d: EOF\n", i)
	}
	now = now.Add(errorLogWindow)
	fmt.Fprintf(w, "http: one more\n")
	out := buf.String()
	if n := strings.Count(out, "TLS handshake error"); n != errorLogBurst {
		t.Errorf("%d complaints logged, want %d", n, errorLogBurst)
	}
	if !strings.Contains(out, "dropped=30") || !strings.Contains(out, "one more") {
		t.Errorf("log:\n%s\nwant the dropped count and the next window's line", out)
	}
}

type lockedWriter struct {
	mu *sync.Mutex
	w  io.Writer
}

func (l lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}

// TestKeyedOverTLS: under TLS the request's connection is found beneath
// the TLS layer: a keyed request keys it (it leaves the evictable ones),
// one without a key gets Connection: close.
func TestKeyedOverTLS(t *testing.T) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert := tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}
	path := filepath.Join(t.TempDir(), "keys.json")
	token, err := auth.Add(path, "ops", auth.ScopeRead, nil)
	if err != nil {
		t.Fatal(err)
	}
	keys, err := auth.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	raw, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ll := limitListener(raw, networkLimits)
	srv := newHTTPServer(keyedOnly{keys: keys, next: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") })},
		defaultRequestLimits, slog.New(slog.DiscardHandler))
	go srv.Serve(tls.NewListener(ll, &tls.Config{Certificates: []tls.Certificate{cert}, NextProtos: nextProtos}))
	defer srv.Close()
	pool := x509.NewCertPool()
	leaf, _ := x509.ParseCertificate(der)
	pool.AddCert(leaf)
	c, err := tls.Dial("tcp", raw.Addr().String(), &tls.Config{RootCAs: pool})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	resp, _, err := request(c, "/x", token)
	if err != nil || resp.Close {
		t.Fatalf("keyed request over TLS = %v, %v", resp, err)
	}
	ll.mu.Lock()
	n := ll.nUnkeyed
	ll.mu.Unlock()
	if n != 0 {
		t.Errorf("%d connections not keyed after a keyed request over TLS, want 0", n)
	}
	c2, err := tls.Dial("tcp", raw.Addr().String(), &tls.Config{RootCAs: pool})
	if err != nil {
		t.Fatal(err)
	}
	defer c2.Close()
	if resp, _, err := request(c2, "/x", ""); err != nil || !resp.Close {
		t.Errorf("request without a key over TLS = %v, %v; want Connection: close", resp, err)
	}
}
