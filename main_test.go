package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"vmhost/jail"
)

// builtBinary is the vmhost binary TestMain builds once, statically
// (CGO_ENABLED=0), so the tests run the real program: real flags, real
// signals, real exit codes.
var builtBinary, buildErr = "", error(nil)

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "vmhost-main-test-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	builtBinary = filepath.Join(dir, "vmhost")
	cmd := exec.Command(goToolPath(), "build", "-o", builtBinary, ".")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		buildErr = fmt.Errorf("go build: %v\n%s", err, out)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

func goToolPath() string {
	if p, err := exec.LookPath("go"); err == nil {
		return p
	}
	return filepath.Join(runtime.GOROOT(), "bin", "go")
}

func goTool(t *testing.T) string {
	t.Helper()
	p := goToolPath()
	if _, err := os.Stat(p); err != nil {
		t.Skipf("go tool not found (%v); install Go or put it in PATH", err)
	}
	return p
}

func binary(t *testing.T) string {
	t.Helper()
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return builtBinary
}

func exitStderr(err error) string {
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		return string(ee.Stderr)
	}
	return ""
}

// vmhost runs the binary to completion in dir and returns stdout, stderr and
// the exit code.
func vmhost(t *testing.T, dir string, args ...string) (stdout, stderr string, code int) {
	t.Helper()
	cmd := exec.Command(binary(t), args...)
	cmd.Dir = dir
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	var ee *exec.ExitError
	switch {
	case err == nil:
	case errors.As(err, &ee):
		code = ee.ExitCode()
	default:
		t.Fatalf("running vmhost %q: %v", args, err)
	}
	return out.String(), errb.String(), code
}

var tokenLine = regexp.MustCompile(`^vmh_[A-Za-z0-9_-]{43}\n$`)

func TestKeyCommands(t *testing.T) {
	state := filepath.Join(t.TempDir(), "state")
	keys := filepath.Join(state, "keys.json")

	out, errOut, code := vmhost(t, "", "key", "add", "--state-dir", state, "--name", "ops", "--scope", "readwrite")
	if code != 0 || !tokenLine.MatchString(out) {
		t.Fatalf("key add = %d, stdout %q, stderr %q; want 0 and the token alone on one line", code, out, errOut)
	}
	token := strings.TrimSpace(out)
	out, errOut, code = vmhost(t, "", "key", "add", "--state-dir", state, "--name", "viewer", "--scope", "read",
		"--allow", "GET /api/vms/{id}", "--allow", "GET /api/appvm/vms/{id}")
	if code != 0 || !tokenLine.MatchString(out) {
		t.Fatalf("key add viewer = %d, stdout %q, stderr %q", code, out, errOut)
	}

	fi, err := os.Stat(keys)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o600 {
		t.Errorf("keys.json mode = %o, want 600", fi.Mode().Perm())
	}
	data, err := os.ReadFile(keys)
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(data), strings.TrimPrefix(token, "vmh_")) {
		t.Errorf("keys.json contains the token:\n%s", data)
	}

	out, _, code = vmhost(t, "", "key", "list", "--state-dir", state)
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if code != 0 || len(lines) != 3 {
		t.Fatalf("key list = %d:\n%s\nwant a header and two keys", code, out)
	}
	if f := strings.Fields(lines[0]); strings.Join(f, " ") != "NAME SCOPE CREATED ALLOW" {
		t.Errorf("key list header = %q", lines[0])
	}
	if f := strings.Fields(lines[1]); len(f) != 4 || f[0] != "ops" || f[1] != "readwrite" || f[3] != "*" {
		t.Errorf("key list line = %q, want ops readwrite <time> *", lines[1])
	}
	if !strings.HasPrefix(lines[2], "viewer") || !strings.Contains(lines[2], "GET /api/vms/{id}, GET /api/appvm/vms/{id}") {
		t.Errorf("key list line = %q, want viewer with its allowlist", lines[2])
	}
	if strings.Contains(out, token) {
		t.Error("key list shows a token")
	}

	for _, tt := range []struct {
		args []string
		code int
	}{
		{[]string{"key", "add", "--state-dir", state, "--name", "ops", "--scope", "read"}, 1}, // name taken
		{[]string{"key", "add", "--state-dir", state, "--name", "x", "--scope", "admin"}, 2},
		{[]string{"key", "add", "--state-dir", state, "--scope", "read"}, 2},
		{[]string{"key", "add", "--name", "x", "--scope", "read"}, 2},
		{[]string{"key", "add", "--state-dir", state, "--name", "x", "--scope", "read", "--allow", "/api/vms"}, 2},
		{[]string{"key", "add", "--state-dir", state, "--name", "x", "--scope", "read", "--allow", "GET /api/vms/vm1"}, 2},
		{[]string{"key", "remove", "--state-dir", state, "--name", "nobody"}, 1},
		{[]string{"key", "frob", "--state-dir", state}, 2},
		{[]string{"key"}, 2},
		{[]string{"frob"}, 2},
	} {
		if out, errOut, code := vmhost(t, "", tt.args...); code != tt.code || out != "" {
			t.Errorf("vmhost %q = %d, stdout %q, stderr %q; want %d and no stdout", tt.args, code, out, errOut, tt.code)
		}
	}

	if _, errOut, code := vmhost(t, "", "key", "remove", "--state-dir", state, "--name", "ops"); code != 0 {
		t.Fatalf("key remove = %d, %s", code, errOut)
	}
	out, _, _ = vmhost(t, "", "key", "list", "--state-dir", state)
	if strings.Contains(out, "ops") || !strings.Contains(out, "viewer") {
		t.Errorf("key list after remove:\n%s", out)
	}
}

// server is a running `vmhost serve`.
type server struct {
	cmd    *exec.Cmd
	stdout *lockedBuffer
	stderr *lockedBuffer
	addr   string // host:port, or unix:path
	done   chan error
	exited bool // stop saw it exit
}

type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

var servingLine = regexp.MustCompile(`msg=serving listen=(\S+)`)

// startServer starts vmhost serve in dir and waits until it logs that it
// serves.
// devBridge is the bridge `serve --dev` creates as root (the default
// network's, config.Default).
const devBridge = "vmhost0"

// removeDevBridgeAfter deletes, when the test ends, the dev bridge that a
// `serve --dev` run as root creates in this network namespace, unless it
// was there before: tests leave no interface behind.
func removeDevBridgeAfter(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		return // without root dev mode creates no bridge
	}
	if _, err := os.Stat("/sys/class/net/" + devBridge); err == nil {
		return // the host's own
	}
	t.Cleanup(func() {
		if _, err := os.Stat("/sys/class/net/" + devBridge); err != nil {
			return
		}
		if out, err := exec.Command("ip", "link", "del", devBridge).CombinedOutput(); err != nil {
			t.Errorf("removing the dev bridge %s: %v: %s", devBridge, err, out)
		}
	})
}

// confinedLine is the log line of an agent that confines its VMs, naming
// its cgroup.
var confinedLine = regexp.MustCompile(`msg="VMs run confined" .*cgroup=(\S+)`)

// removeAgentCgroup removes the cgroup of an agent (its VMs' parent in
// every hierarchy) that logged log and has ended, which it leaves for its
// VMs, as they outlive it: tests leave none behind. One with a VM's cgroup
// still in it is an error of the test's.
func removeAgentCgroup(t *testing.T, log string) {
	m := confinedLine.FindStringSubmatch(log)
	if m == nil {
		return
	}
	l, err := jail.DetectLayout()
	if err != nil {
		t.Errorf("finding the cgroup hierarchies: %v", err)
		return
	}
	c := l.Cgroup(m[1])
	if vms, _ := c.Children(); len(vms) > 0 {
		t.Errorf("the test left VM cgroups in its agent's cgroup %s: %v", m[1], vms)
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := c.Remove(ctx); err != nil {
		t.Errorf("removing the agent's cgroup %s: %v", m[1], err)
	}
}

func startServer(t *testing.T, dir string, args ...string) *server {
	t.Helper()
	s := &server{stdout: &lockedBuffer{}, stderr: &lockedBuffer{}, done: make(chan error, 1)}
	if slices.Contains(args, "--dev") {
		removeDevBridgeAfter(t)
	}
	// After the agent has ended (cleanups run last first): its cgroup.
	t.Cleanup(func() { removeAgentCgroup(t, s.stderr.String()) })
	s.cmd = exec.Command(binary(t), append([]string{"serve"}, args...)...)
	s.cmd.Dir = dir
	s.cmd.Stdout = s.stdout
	s.cmd.Stderr = s.stderr
	if err := s.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { s.done <- s.cmd.Wait() }()
	t.Cleanup(func() {
		if s.cmd.ProcessState == nil {
			s.cmd.Process.Kill()
			<-s.done
		}
	})
	deadline := time.After(30 * time.Second)
	for {
		if m := servingLine.FindStringSubmatch(s.stderr.String()); m != nil {
			s.addr = m[1]
			return s
		}
		select {
		case err := <-s.done:
			t.Fatalf("vmhost serve exited early (%v):\nstdout: %s\nstderr: %s", err, s.stdout, s.stderr)
		case <-deadline:
			t.Fatalf("vmhost serve did not start serving:\nstderr: %s", s.stderr)
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// stop sends sig and returns the exit code.
func (s *server) stop(t *testing.T, sig os.Signal) int {
	t.Helper()
	if err := s.cmd.Process.Signal(sig); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-s.done:
		s.exited = true
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			return ee.ExitCode()
		}
		if err != nil {
			t.Fatal(err)
		}
		return 0
	case <-time.After(30 * time.Second):
		t.Fatalf("vmhost serve did not exit after %v:\n%s", sig, s.stderr)
		return -1
	}
}

// waitReady waits until the agent has started: GET /healthz answers 200
// once the records are loaded and every VM reconciled (running VMs
// adopted, their consoles kept). "serving", which startServer waits for,
// is logged before that.
func (s *server) waitReady(t *testing.T) {
	t.Helper()
	waitFor(t, func() bool {
		code, _ := s.get(t, "/healthz", "")
		return code == http.StatusOK
	}, "the agent's start (GET /healthz 200)")
}

func (s *server) client() (*http.Client, string) {
	path, ok := strings.CutPrefix(s.addr, "unix:")
	if !ok {
		return &http.Client{Timeout: 10 * time.Second}, "http://" + s.addr
	}
	tr := &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", path)
	}}
	return &http.Client{Transport: tr, Timeout: 10 * time.Second}, "http://vmhost"
}

// get does GET path with the given Authorization header (none if empty) and
// returns the status and the decoded error envelope, if any.
func (s *server) get(t *testing.T, path, authz string) (int, map[string]string) {
	t.Helper()
	c, base := s.client()
	req, err := http.NewRequest("GET", base+path, nil)
	if err != nil {
		t.Fatal(err)
	}
	if authz != "" {
		req.Header.Set("Authorization", authz)
	}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	var env map[string]string
	json.Unmarshal(body, &env)
	return resp.StatusCode, env
}

func TestServeDev(t *testing.T) {
	cwd := t.TempDir()
	s := startServer(t, cwd, "--dev", "--listen", "127.0.0.1:0")

	token := devToken(t, s)
	if api := devExport(t, s, "VMHOST_API"); api != "http://"+s.addr {
		t.Errorf("serve --dev printed VMHOST_API=%s, want http://%s", api, s.addr)
	}
	for _, p := range []string{"vmhost-dev/config.json", "vmhost-dev/state/keys.json", "vmhost-dev/state/vms", "vmhost-dev/run"} {
		if _, err := os.Stat(filepath.Join(cwd, p)); err != nil {
			t.Errorf("serve --dev did not create %s: %v", p, err)
		}
	}

	if code, env := s.get(t, "/api/vms/x", ""); code != http.StatusUnauthorized || env["code"] != "UNAUTHORIZED" {
		t.Errorf("GET /api/vms/x without a key = %d %v, want 401 UNAUTHORIZED", code, env)
	}
	if code, env := s.get(t, "/api/vms/x", "Bearer "+token); code != http.StatusNotFound || env["code"] != "NOT_FOUND" {
		t.Errorf("GET /api/vms/x with the dev key = %d %v, want 404 NOT_FOUND", code, env)
	}

	// A key added while serving works after SIGHUP.
	out, _, code := vmhost(t, cwd, "key", "add", "--dev", "--name", "late", "--scope", "read")
	if code != 0 {
		t.Fatalf("key add --dev = %d", code)
	}
	late := "Bearer " + strings.TrimSpace(out)
	if code, _ := s.get(t, "/api/vms/x", late); code != http.StatusUnauthorized {
		t.Errorf("new key before SIGHUP = %d, want 401", code)
	}
	if err := s.cmd.Process.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	waitFor(t, func() bool { return strings.Contains(s.stderr.String(), "reloaded keys") }, "the keys reload after SIGHUP")
	if code, env := s.get(t, "/api/vms/x", late); code != http.StatusNotFound {
		t.Errorf("new key after SIGHUP = %d %v, want 404", code, env)
	}

	if code := s.stop(t, syscall.SIGTERM); code != 0 {
		t.Errorf("exit code after SIGTERM = %d, want 0; stderr:\n%s", code, s.stderr)
	}
	if os.Geteuid() == 0 {
		// As root: one bridge made, said once; classic VMs confined and
		// the process-mode guest's AppVMs not, said once.
		out := s.stderr.String()
		for msg, want := range map[string]int{`msg="dev bridge ready"`: 1, `msg="VMs run confined"`: 1, `msg="AppVMs run unconfined"`: 1} {
			if n := strings.Count(out, msg); n != want {
				t.Errorf("serve --dev as root said %s %d times, want %d:\n%s", msg, n, want, out)
			}
		}
	}

	// The second start prints no key and keeps the first one.
	s2 := startServer(t, cwd, "--dev", "--listen", "127.0.0.1:0")
	if api := devExport(t, s2, "VMHOST_API"); api != "http://"+s2.addr || strings.Contains(s2.stdout.String(), "vmh_") {
		t.Errorf("second dev start printed a key:\n%s", s2.stdout)
	}
	if code, _ := s2.get(t, "/api/vms/x", "Bearer "+token); code != http.StatusNotFound {
		t.Errorf("dev key after restart = %d, want 404", code)
	}
	if code := s2.stop(t, syscall.SIGINT); code != 0 {
		t.Errorf("exit code after SIGINT = %d, want 0", code)
	}
}

func TestServeUnixSocket(t *testing.T) {
	cwd := t.TempDir()
	sock := filepath.Join(cwd, "api.sock")
	s := startServer(t, cwd, "--dev", "--listen", "unix:"+sock)
	fi, err := os.Stat(sock)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o600 {
		t.Errorf("socket mode = %o, want 600", fi.Mode().Perm())
	}
	if code, _ := s.get(t, "/api/vms/x", ""); code != http.StatusUnauthorized {
		t.Errorf("GET over the unix socket = %d, want 401", code)
	}
	// A second server (on other directories) on the same socket refuses
	// rather than steal it.
	other := t.TempDir()
	_, errOut, code := vmhost(t, cwd, "serve", "--listen", "unix:"+sock, "--state-dir", other+"/state", "--run-dir", other+"/run", "--simulate", "ch,qsd")
	if code != 1 || !strings.Contains(errOut, "another server is answering") {
		t.Errorf("second serve on a live socket = %d, %s", code, errOut)
	}
	if code := s.stop(t, syscall.SIGTERM); code != 0 {
		t.Errorf("exit code = %d", code)
	}
	// A stale socket left behind (as after kill -9) is replaced.
	os.Remove(sock)
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	l.(*net.UnixListener).SetUnlinkOnClose(false)
	l.Close()
	s = startServer(t, cwd, "--dev", "--listen", "unix:"+sock)
	if code, _ := s.get(t, "/api/vms/x", ""); code != http.StatusUnauthorized {
		t.Errorf("GET after replacing a stale socket = %d, want 401", code)
	}
	s.stop(t, syscall.SIGTERM)
}

// TestServeOneAgentPerDirectory: a second agent on the state or the run
// directory of a running one exits 1 naming the first one's pid, before it
// touches anything (it would adopt or reap the first one's VMs).
func TestServeOneAgentPerDirectory(t *testing.T) {
	cwd, err := os.MkdirTemp("", "vh") // short: the run dir holds sockets
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(cwd) })
	s := startServer(t, cwd, "--listen", "127.0.0.1:0", "--state-dir", "state", "--run-dir", "run", "--simulate", "ch,qsd")
	want := fmt.Sprintf("(pid %d)", s.cmd.Process.Pid)
	for _, dirs := range [][]string{
		{"--state-dir", "state", "--run-dir", "run2"},
		{"--state-dir", "state2", "--run-dir", "run"},
	} {
		args := append([]string{"serve", "--listen", "127.0.0.1:0", "--simulate", "ch,qsd"}, dirs...)
		_, errOut, code := vmhost(t, cwd, args...)
		if code != 1 || !strings.Contains(errOut, "in use by another vmhost "+want) {
			t.Errorf("serve %v beside a running agent = %d, %s; want exit 1 naming %s", dirs, code, errOut, want)
		}
	}
	if code := s.stop(t, syscall.SIGTERM); code != 0 {
		t.Errorf("exit code = %d", code)
	}
	// Released with the agent: the next one starts.
	s = startServer(t, cwd, "--listen", "127.0.0.1:0", "--state-dir", "state", "--run-dir", "run", "--simulate", "ch,qsd")
	s.stop(t, syscall.SIGTERM)
}

func TestServeFlags(t *testing.T) {
	dir := t.TempDir()
	for _, tt := range []struct {
		args []string
		code int
		want string
	}{
		{[]string{"serve", "--state-dir", dir, "--run-dir", dir}, 2, "--listen is required"},
		{[]string{"serve", "--listen", "127.0.0.1:0", "--run-dir", dir}, 2, "--state-dir is required"},
		{[]string{"--listen", "127.0.0.1:0", "--state-dir", dir}, 2, "--run-dir is required"},
		{[]string{"serve", "extra"}, 2, "unexpected argument"},
		{[]string{"serve", "--listen", "127.0.0.1:0", "--state-dir", dir, "--run-dir", dir, "--config", filepath.Join(dir, "nope.json")}, 1, "no such file"},
	} {
		_, errOut, code := vmhost(t, dir, tt.args...)
		if code != tt.code || !strings.Contains(errOut, tt.want) {
			t.Errorf("vmhost %q = %d, %q; want %d and %q", tt.args, code, errOut, tt.code, tt.want)
		}
	}
	bad := filepath.Join(dir, "bad.json")
	os.WriteFile(bad, []byte(`{"boot_timeout_secs": 0, "bogus": 1}`), 0o600)
	_, errOut, code := vmhost(t, dir, "serve", "--listen", "127.0.0.1:0", "--state-dir", dir, "--run-dir", dir, "--config", bad)
	if code != 1 || !strings.Contains(errOut, `unknown field \"bogus\"`) {
		t.Errorf("serve with a bad config = %d, %q", code, errOut)
	}
}

func TestHelp(t *testing.T) {
	out, _, code := vmhost(t, "", "help")
	if code != 0 || !strings.Contains(out, "vmhost key add") || !strings.Contains(out, "vmhost serve") {
		t.Errorf("vmhost help = %d, %q", code, out)
	}
}

func waitFor(t *testing.T, cond func() bool, what string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestSimCHDispatch checks that sim-ch reaches the simulator's own argument
// parsing (which refuses an empty command line) rather than vmhost's.
func TestSimCHDispatch(t *testing.T) {
	_, errOut, code := vmhost(t, "", "sim-ch")
	if code != 1 || !strings.Contains(errOut, "no arguments") {
		t.Errorf("vmhost sim-ch = %d, %q; want the simulator's usage error", code, errOut)
	}
}

// TestSimQSDDispatch checks that sim-qsd reaches the simulator's own option
// parsing, which answers in qemu-storage-daemon's words.
func TestSimQSDDispatch(t *testing.T) {
	_, errOut, code := vmhost(t, "", "sim-qsd", "bogus")
	if code != 1 || !strings.Contains(errOut, "qemu-storage-daemon: Unexpected argument: bogus") {
		t.Errorf("vmhost sim-qsd bogus = %d, %q; want the simulator's error", code, errOut)
	}
}
