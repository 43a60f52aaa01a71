package server

import (
	"bufio"
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"vmhost/agentid"
	"vmhost/auth"
	"vmhost/internal/netnstest"
	"vmhost/tap"
)

// logBuffer is the agent's log, read while Run writes it.
type logBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (l *logBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *logBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// run is one Run in the background.
type run struct {
	log  *logBuffer
	out  *logBuffer // Stdout
	done chan error
}

func startRun(t *testing.T, o Options, ns NewService) *run { return startRunIn(t, 0, o, ns) }

// startRunIn runs Run on a thread in the network namespace netns (0: the
// caller's), where Run makes and removes the dev bridge.
func startRunIn(t *testing.T, netns int, o Options, ns NewService) *run {
	t.Helper()
	r := &run{log: &logBuffer{}, out: &logBuffer{}, done: make(chan error, 1)}
	o.Log = slog.New(slog.NewTextHandler(r.log, nil))
	o.Stdout = r.out
	go func() {
		if netns != 0 {
			runtime.LockOSThread() // never unlocked: the thread ends with the goroutine
			if err := setNetNS(netns); err != nil {
				r.done <- err
				return
			}
		}
		r.done <- Run(o, ns)
	}()
	t.Cleanup(func() {
		// Signals reach Run once it serves (it catches them from before);
		// until then a SIGTERM would end the test binary.
		for !servingRE.MatchString(r.log.String()) {
			select {
			case err := <-r.done:
				r.done <- err
				return
			case <-time.After(10 * time.Millisecond):
			}
		}
		select {
		case <-r.done:
		default:
			syscall.Kill(os.Getpid(), syscall.SIGTERM)
			<-r.done
		}
	})
	return r
}

var servingRE = regexp.MustCompile(`msg=serving listen=(\S+)`)

// addr waits for the "serving" line and returns the address.
func (r *run) addr(t *testing.T) string {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) {
		if m := servingRE.FindStringSubmatch(r.log.String()); m != nil {
			return m[1]
		}
		select {
		case err := <-r.done:
			t.Fatalf("Run ended before serving: %v\n%s", err, r.log)
		case <-time.After(10 * time.Millisecond):
		}
	}
	t.Fatalf("Run did not serve:\n%s", r.log)
	return ""
}

// stop sends sig and waits for Run.
func (r *run) stop(t *testing.T, sig syscall.Signal) error {
	t.Helper()
	syscall.Kill(os.Getpid(), sig)
	select {
	case err := <-r.done:
		r.done <- err // for the cleanup
		return err
	case <-time.After(30 * time.Second):
		t.Fatalf("Run did not end after %v:\n%s", sig, r.log)
		return nil
	}
}

func waitLog(t *testing.T, r *run, want string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !strings.Contains(r.log.String(), want) {
		if time.Now().After(deadline) {
			t.Fatalf("log never said %q:\n%s", want, r.log)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// client speaks HTTP to a listen address (host:port or unix:/path).
func client(addr string) (*http.Client, string) {
	if path, ok := strings.CutPrefix(addr, "unix:"); ok {
		tr := &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", path)
		}}
		return &http.Client{Transport: tr, Timeout: 10 * time.Second}, "http://vmhost"
	}
	return &http.Client{Timeout: 10 * time.Second}, "http://" + addr
}

func get(t *testing.T, addr, path, token string) (int, string) {
	t.Helper()
	c, base := client(addr)
	req, _ := http.NewRequest("GET", base+path, nil)
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatalf("GET %s: %v", path, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// stubService is a NewService that records what it was given, waits for
// release before it returns (recovery), and serves "svc <path>" to keyed
// requests.
type stubService struct {
	release      chan struct{}
	env          Env
	closed       atomic.Int32
	streamsEnded atomic.Int32
}

func newStub() *stubService { return &stubService{release: make(chan struct{})} }

func (s *stubService) build(env Env) (*Service, error) {
	s.env = env
	<-s.release
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if _, err := env.Keys.Authorize(r.Header.Get("Authorization"), "GET /x", false); err != nil {
			http.Error(w, "unauthorized", http.StatusUnauthorized)
			return
		}
		io.WriteString(w, "svc "+r.URL.Path)
	})
	return &Service{Handler: h,
		Close:        func() error { s.closed.Add(1); return nil },
		CloseStreams: func() { s.streamsEnded.Add(1) }}, nil
}

// TestRun: Run locks its directories, loads the agent id and gives it to
// the service with the simulators asked for; it listens before recovery
// (healthz 503, API requests held, then answered), serves the local socket
// too, reloads keys on SIGHUP, and on SIGTERM stops, ends the streams and
// closes the service once.
func TestRun(t *testing.T) {
	dir := shortTempDir(t)
	state, runDir := filepath.Join(dir, "state"), filepath.Join(dir, "run")
	os.MkdirAll(state, 0o700)
	token, err := auth.Add(KeysFile(state), "ops", auth.ScopeRead, nil)
	if err != nil {
		t.Fatal(err)
	}
	stub := newStub()
	r := startRun(t, Options{Listen: "127.0.0.1:0", StateDir: state, RunDir: runDir, Simulate: "ch, qsd"}, stub.build)
	addr := r.addr(t)

	if st, body := get(t, addr, "/healthz", ""); st != 503 || !strings.HasPrefix(body, "starting") {
		t.Errorf("healthz during recovery = %d %q", st, body)
	}
	held := make(chan string, 1)
	go func() {
		st, body := get(t, addr, "/api/vms", token)
		held <- http.StatusText(st) + " " + body
	}()
	select {
	case got := <-held:
		t.Fatalf("a request during recovery was answered before the service was built: %s", got)
	case <-time.After(200 * time.Millisecond):
	}
	// A second agent on the same directories is refused while this one
	// runs (before it touches anything).
	if err := Run(Options{Listen: "127.0.0.1:0", StateDir: state, RunDir: filepath.Join(dir, "run2")}, stub.build); err == nil || !strings.Contains(err.Error(), "in use by another vmhost") {
		t.Errorf("a second Run on the same state directory = %v", err)
	}
	close(stub.release)
	if got := <-held; got != "OK svc /api/vms" {
		t.Errorf("the held request = %q", got)
	}
	if st, body := get(t, addr, "/healthz", ""); st != 200 || body != "ok\n" {
		t.Errorf("healthz after recovery = %d %q", st, body)
	}

	id, err := agentid.Load(state)
	if err != nil || stub.env.AgentID != id || !agentid.Valid(id) {
		t.Errorf("the service got agent id %q; the state directory has %q (%v)", stub.env.AgentID, id, err)
	}
	if !stub.env.SimCH || !stub.env.SimQSD || stub.env.StateDir != state || stub.env.RunDir != runDir || stub.env.Store == nil || stub.env.DevBridge != "" {
		t.Errorf("env = %+v", stub.env)
	}
	if !strings.Contains(r.log.String(), "agent_id="+id) {
		t.Errorf("the serving line does not name the agent id:\n%s", r.log)
	}

	// The local socket serves the same API, 0600.
	sock := filepath.Join(runDir, LocalSocket)
	if fi, err := os.Stat(sock); err != nil || fi.Mode().Perm() != 0o600 || fi.Mode().Type() != os.ModeSocket {
		t.Errorf("local socket: %v, %v", fi, err)
	}
	if st, body := get(t, "unix:"+sock, "/api/vms", token); st != 200 || body != "svc /api/vms" {
		t.Errorf("GET over the local socket = %d %q", st, body)
	}

	late, err := auth.Add(KeysFile(state), "late", auth.ScopeRead, nil)
	if err != nil {
		t.Fatal(err)
	}
	if st, _ := get(t, addr, "/api/vms", late); st != 401 {
		t.Errorf("a new key before SIGHUP = %d", st)
	}
	syscall.Kill(os.Getpid(), syscall.SIGHUP)
	waitLog(t, r, "reloaded keys")
	if st, _ := get(t, addr, "/api/vms", late); st != 200 {
		t.Errorf("a new key after SIGHUP = %d", st)
	}

	if err := r.stop(t, syscall.SIGTERM); err != nil {
		t.Errorf("Run after SIGTERM = %v", err)
	}
	if stub.closed.Load() != 1 || stub.streamsEnded.Load() != 1 {
		t.Errorf("service closed %d times, streams ended %d times; want 1 and 1", stub.closed.Load(), stub.streamsEnded.Load())
	}
	if _, err := os.Stat(sock); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the local socket outlived the server: %v", err)
	}
}

// shortTempDir is a temp dir short enough for unix socket paths.
func shortTempDir(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "vhs")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

// scanExports reads the export lines --dev printed.
func scanExports(out string) map[string]string {
	m := map[string]string{}
	sc := bufio.NewScanner(strings.NewReader(out))
	for sc.Scan() {
		if k, v, ok := strings.Cut(strings.TrimPrefix(sc.Text(), "export "), "="); ok && strings.HasPrefix(sc.Text(), "export ") {
			m[k] = v
		}
	}
	return m
}

// TestRunDev: a --dev start whose service fails prints nothing and makes
// no key; the next start, which succeeds, makes the key only then and
// prints VMHOST_API and VMHOST_TOKEN once serving, and the token works; a
// later start prints VMHOST_API only. As root the dev bridge is made
// (marked with the agent id) and removed at the clean exit, unless a tap
// is its port. Runs in a network namespace of its own, over a unix socket.
func TestRunDev(t *testing.T) {
	root := os.Geteuid() == 0
	var ns *netnstest.NS
	var fd int
	if root {
		ns = netnstest.New(t) // the dev bridge is made in this namespace
		fd = ns.FD
	}
	// bridgeThere reports whether the bridge exists in the namespace.
	bridgeThere := func(name string) bool {
		t.Helper()
		var there bool
		if err := ns.Run(func() error {
			_, err := net.InterfaceByName(name)
			there = err == nil
			return nil
		}); err != nil {
			t.Fatal(err)
		}
		return there
	}
	dir := shortTempDir(t)
	t.Chdir(dir)
	sock := filepath.Join(dir, "api.sock")
	opts := Options{Dev: true, Listen: "unix:" + sock}

	failing := func(Env) (*Service, error) { return nil, errors.New("recovery failed") }
	r := startRunIn(t, fd, opts, failing)
	if err := <-r.done; err == nil || !strings.Contains(err.Error(), "recovery failed") {
		t.Fatalf("Run with a failing service = %v", err)
	}
	r.done <- nil
	if out := r.out.String(); out != "" {
		t.Errorf("a failed start printed:\n%s", out)
	}
	if _, err := os.Stat(KeysFile(DevStateDir)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("a failed start left keys.json: %v", err)
	}

	stub := newStub()
	close(stub.release)
	r = startRunIn(t, fd, opts, stub.build)
	r.addr(t)
	waitFor(t, func() bool { return strings.Contains(r.out.String(), "VMHOST_TOKEN") }, "the shell lines")
	ex := scanExports(r.out.String())
	if ex["VMHOST_API"] != "unix:"+sock || !strings.HasPrefix(ex["VMHOST_TOKEN"], auth.TokenPrefix) {
		t.Fatalf("first start printed:\n%s", r.out)
	}
	if st, body := get(t, ex["VMHOST_API"], "/api/vms", ex["VMHOST_TOKEN"]); st != 200 || body != "svc /api/vms" {
		t.Errorf("the printed token = %d %q", st, body)
	}
	if !stub.env.Dev {
		t.Error("the service of a dev agent was not told it is one")
	}
	if root {
		if stub.env.DevBridge == "" || !bridgeThere(stub.env.DevBridge) {
			t.Fatalf("no dev bridge %q as root", stub.env.DevBridge)
		}
		// A VM's tap on the bridge keeps it at exit.
		h := tap.New(&tap.Config{NetNS: fd, AgentID: stub.env.AgentID})
		vmTap := tap.Name("devvm", 0)
		if err := h.Create(t.Context(), tap.TapConfig{Name: vmTap, VMID: "devvm"}); err != nil {
			t.Fatal(err)
		}
		if err := h.Attach(t.Context(), vmTap, stub.env.DevBridge, tap.PortOptions{}); err != nil {
			t.Fatal(err)
		}
		if err := r.stop(t, syscall.SIGTERM); err != nil {
			t.Fatal(err)
		}
		if !bridgeThere(stub.env.DevBridge) {
			t.Error("the dev bridge went though a tap is its port")
		}
		if err := h.Delete(t.Context(), vmTap); err != nil {
			t.Fatal(err)
		}
	} else if err := r.stop(t, syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}

	stub = newStub()
	close(stub.release)
	r = startRunIn(t, fd, opts, stub.build)
	r.addr(t)
	waitFor(t, func() bool { return strings.Contains(r.out.String(), "VMHOST_API") }, "the shell lines")
	if ex := scanExports(r.out.String()); ex["VMHOST_API"] != "unix:"+sock || ex["VMHOST_TOKEN"] != "" || strings.Contains(r.out.String(), auth.TokenPrefix) {
		t.Errorf("a later start printed:\n%s", r.out)
	}
	if err := r.stop(t, syscall.SIGINT); err != nil {
		t.Fatal(err)
	}
	if root && bridgeThere(stub.env.DevBridge) {
		t.Errorf("the dev bridge %s, unused, outlived a clean exit:\n%s", stub.env.DevBridge, r.log)
	}
}

func waitFor(t *testing.T, cond func() bool, what string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
