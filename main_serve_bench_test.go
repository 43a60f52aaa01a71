package main

import (
	"bytes"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"vmhost/auth"
)

// BenchmarkHostileClients measures what a keyed client waits for
// `GET /api/vms` while a hostile source holds connections open against
// the agent, beside the same request to an agent without hostile load,
// alternating the two, one request each per iteration. Both agents are
// the real binary (simulators, no VMs) on loopback.
//
// The hostile side, from 127.0.0.2, keeps VMHOST_BENCH_HOSTILE (default
// 1000) connections open, reconnecting each one VMHOST_BENCH_RECONNECT
// (default 100ms) after the agent closes it: a third connect and idle, a
// third ask /healthz and idle, a third trickle their headers one byte a
// second (slowloris). The keyed client, from 127.0.0.1 (or
// VMHOST_BENCH_KEYED_SOURCE), opens a new connection per request, as the
// CLI does. Reported: median and p99 of
// both sides in ms, requests that failed (5 s timeout), and the hostile
// connects made.
//
// VMHOST_BENCH_BINARY runs another vmhost binary (for instance one built
// from an earlier commit) instead of the one this package builds.
// Run: bench/hostile-clients.sh, or
// go test -run '^$' -bench HostileClients -benchtime 200x .
func BenchmarkHostileClients(b *testing.B) {
	bin := os.Getenv("VMHOST_BENCH_BINARY")
	if bin == "" {
		if buildErr != nil {
			b.Fatal(buildErr)
		}
		bin = builtBinary
	}
	hostileConns := envInt(b, "VMHOST_BENCH_HOSTILE", 1000)
	reconnect := time.Duration(envInt(b, "VMHOST_BENCH_RECONNECT_MS", 100)) * time.Millisecond
	raiseNoFile(b, uint64(hostileConns)+1024)

	quiet, besieged := startBenchAgent(b, bin), startBenchAgent(b, bin)

	stop := make(chan struct{})
	var connects, open atomic.Int64
	var wg sync.WaitGroup
	for i := range hostileConns {
		wg.Add(1)
		go func() {
			defer wg.Done()
			hostile(besieged.addr, i%3, reconnect, stop, &connects, &open)
		}()
	}
	defer func() {
		close(stop)
		wg.Wait()
	}()
	// Let the siege set in: every hostile connection dialled at least once.
	for deadline := time.Now().Add(30 * time.Second); connects.Load() < int64(hostileConns) && time.Now().Before(deadline); {
		time.Sleep(50 * time.Millisecond)
	}
	time.Sleep(2 * time.Second)

	keyed := keyedBenchClient()
	type side struct {
		name     string
		a        *benchAgent
		ms       []float64
		failures int
	}
	sides := []*side{{name: "quiet", a: quiet}, {name: "besieged", a: besieged}}
	startConnects := connects.Load()
	b.ResetTimer()
	for range b.N {
		for _, s := range sides {
			t0 := time.Now()
			if err := benchGet(keyed, s.a); err != nil {
				s.failures++
				if s.failures <= 2 {
					b.Logf("keyed GET /api/vms (%s): %v", s.name, err)
				}
				continue
			}
			s.ms = append(s.ms, float64(time.Since(t0).Microseconds())/1000)
		}
	}
	b.StopTimer()
	for _, s := range sides {
		b.ReportMetric(percentile(s.ms, 50), s.name+"-p50-ms")
		b.ReportMetric(percentile(s.ms, 99), s.name+"-p99-ms")
		b.ReportMetric(float64(s.failures), s.name+"-failed")
	}
	b.ReportMetric(float64(connects.Load()-startConnects)/b.Elapsed().Seconds(), "hostile-connects/s")
	b.ReportMetric(float64(open.Load()), "hostile-open-at-end")
}

func envInt(b *testing.B, name string, def int) int {
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	n, err := strconv.Atoi(v)
	if err != nil || n <= 0 {
		b.Fatalf("%s=%q: want a positive number", name, v)
	}
	return n
}

// raiseNoFile lets this process hold n descriptors.
func raiseNoFile(b *testing.B, n uint64) {
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		b.Fatal(err)
	}
	if lim.Cur >= n {
		return
	}
	lim.Cur = min(n, lim.Max)
	if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil || lim.Cur < n {
		b.Fatalf("RLIMIT_NOFILE: need %d descriptors, can have %d (%v): raise the hard limit (ulimit -Hn)", n, lim.Cur, err)
	}
}

// benchAgent is a running `vmhost serve` with a readwrite key.
type benchAgent struct {
	addr, token string
}

var benchServingLine = regexp.MustCompile(`msg=serving listen=(\S+)`)

func startBenchAgent(b *testing.B, bin string) *benchAgent {
	dir, err := os.MkdirTemp("", "vhb")
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { os.RemoveAll(dir) })
	state := filepath.Join(dir, "state")
	os.MkdirAll(state, 0o700)
	token, err := auth.Add(filepath.Join(state, "keys.json"), "bench", auth.ScopeReadWrite, nil)
	if err != nil {
		b.Fatal(err)
	}
	var stderr lockedBuffer
	cmd := exec.Command(bin, "serve", "--listen", "127.0.0.1:0", "--state-dir", state, "--run-dir", filepath.Join(dir, "run"), "--simulate", "ch,qsd")
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		cmd.Process.Signal(syscall.SIGTERM)
		cmd.Wait()
	})
	a := &benchAgent{token: token}
	for deadline := time.Now().Add(30 * time.Second); a.addr == ""; time.Sleep(20 * time.Millisecond) {
		if m := benchServingLine.FindStringSubmatch(stderr.String()); m != nil {
			a.addr = m[1]
		} else if time.Now().After(deadline) {
			b.Fatalf("vmhost serve did not start:\n%s", stderr.String())
		}
	}
	// Recovery done: the API answers.
	c := keyedBenchClient()
	for deadline := time.Now().Add(30 * time.Second); benchGet(c, a) != nil; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			b.Fatalf("vmhost serve does not answer:\n%s", stderr.String())
		}
	}
	return a
}

// keyedBenchClient makes each request on a new connection, from
// VMHOST_BENCH_KEYED_SOURCE (default 127.0.0.1; 127.0.0.2 is the hostile
// source's own address).
func keyedBenchClient() *http.Client {
	src := net.IPv4(127, 0, 0, 1)
	if s := os.Getenv("VMHOST_BENCH_KEYED_SOURCE"); s != "" {
		src = net.ParseIP(s)
	}
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: src}}
	return &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{DialContext: d.DialContext, DisableKeepAlives: true}}
}

func benchGet(c *http.Client, a *benchAgent) error {
	req, _ := http.NewRequest("GET", "http://"+a.addr+"/api/vms", nil)
	req.Header.Set("Authorization", "Bearer "+a.token)
	resp, err := c.Do(req)
	if err != nil {
		return err
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || !bytes.HasPrefix(body, []byte(`{"vms":[`)) {
		return fmt.Errorf("%d %q", resp.StatusCode, body)
	}
	return nil
}

// hostile holds one connection to addr from 127.0.0.2 open for as long as
// the agent lets it, and opens it again after reconnect, until stop:
// kind 0 sends nothing, 1 asks /healthz and idles, 2 trickles its headers
// a byte a second.
func hostile(addr string, kind int, reconnect time.Duration, stop <-chan struct{}, connects, open *atomic.Int64) {
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.IPv4(127, 0, 0, 2)}, Timeout: 5 * time.Second}
	for {
		select {
		case <-stop:
			return
		default:
		}
		c, err := d.Dial("tcp", addr)
		if err != nil {
			select {
			case <-stop:
				return
			case <-time.After(reconnect):
			}
			continue
		}
		connects.Add(1)
		open.Add(1)
		closed := make(chan struct{})
		go func() {
			io.Copy(io.Discard, c) // until the agent closes it
			close(closed)
		}()
		switch kind {
		case 1:
			io.WriteString(c, "GET /healthz HTTP/1.1\r\nHost: vmhost\r\n\r\n")
		case 2:
			go func() {
				req := []byte("GET /api/vms HTTP/1.1\r\nHost: vmhost\r\nX-Slow: " + string(bytes.Repeat([]byte("a"), 1000)))
				for _, ch := range req {
					select {
					case <-closed:
						return
					case <-stop:
						return
					case <-time.After(time.Second):
					}
					if _, err := c.Write([]byte{ch}); err != nil {
						return
					}
				}
			}()
		}
		select {
		case <-closed:
		case <-stop:
		}
		c.Close()
		open.Add(-1)
		select {
		case <-stop:
			return
		case <-time.After(reconnect):
		}
	}
}

// percentile is the p-th percentile of xs (nearest rank); 0 when empty.
func percentile(xs []float64, p float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	i := int(float64(len(s))*p/100+0.5) - 1
	return s[max(0, min(i, len(s)-1))]
}
