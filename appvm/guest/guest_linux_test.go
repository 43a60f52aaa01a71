package guest

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"vmhost/appvm/guest/proto"
)

// agentEnv makes the test binary run the agent (process mode) instead of
// the tests, so the agent is a real process with a real pid and signals.
const agentEnv = "VMHOST_GUEST_TEST_AGENT"

func TestMain(m *testing.M) {
	if os.Getenv(agentEnv) == "1" {
		os.Exit(Main(os.Args[1:]))
	}
	os.Exit(m.Run())
}

// lockedBuffer collects the agent's stderr.
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

// fakeHost is the host side of one agent run: a unix listener standing in
// for the hybrid vsock socket, speaking proto.
type fakeHost struct {
	t      testing.TB
	ln     net.Listener
	root   string
	cmd    *exec.Cmd
	nc     net.Conn
	conn   *proto.Conn
	hello  *proto.Hello
	stderr *lockedBuffer
	// opsSock is where the agent takes operation connections.
	opsSock string
	msgs    chan proto.Message
	exited  chan struct{}
	// exitCode and waitStatus are the agent's, valid once exited is closed.
	exitCode   int
	waitStatus syscall.WaitStatus

	mu  sync.Mutex
	all []proto.Message
}

type agentOpts struct {
	root string
	args []string
	// wrap prefixes the agent's command line (e.g. unshare), which must
	// exec the agent in place so its pid stays the agent's.
	wrap []string
	// exe replaces the test binary's path (an agent in a chroot); sock and
	// agentSock are the listener's path here and as the agent sees it.
	exe, sock, agentSock string
	// noAck keeps the host from acknowledging Exit and Fatal, as a host
	// does at once.
	noAck bool
	// listen and opsSock replace the operation socket: the agent's
	// --listen prefix and the socket's path here (an agent in a chroot).
	listen, opsSock string
}

// startAgent starts the agent, accepts its connection, checks the Hello
// and sends spec.
func startAgent(t testing.TB, spec *proto.Spec, o agentOpts) *fakeHost {
	t.Helper()
	dir := t.TempDir()
	if o.root == "" {
		o.root = filepath.Join(dir, "root")
		if err := os.Mkdir(o.root, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	sock := filepath.Join(dir, "vsock.sock_"+strconv.Itoa(proto.Port))
	agentSock := sock
	if o.sock != "" {
		sock, agentSock = o.sock, o.agentSock
	}
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	listen, opsSock := filepath.Join(dir, "g"), filepath.Join(dir, "g_"+strconv.Itoa(proto.OpPort))
	if o.listen != "" {
		listen, opsSock = o.listen, o.opsSock
	}
	args := append(ProcessOptions{Socket: agentSock, Root: o.root, Heartbeat: 100 * time.Millisecond, Listen: listen}.Args(), o.args...)
	h := &fakeHost{t: t, ln: ln, root: o.root, stderr: &lockedBuffer{}, msgs: make(chan proto.Message, 4096), exited: make(chan struct{}), opsSock: opsSock}
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	if o.exe != "" {
		exe = o.exe
	}
	argv := append(append(append([]string{}, o.wrap...), exe), args...)
	h.cmd = exec.Command(argv[0], argv[1:]...)
	h.cmd.Env = append(os.Environ(), agentEnv+"=1")
	h.cmd.Stderr = h.stderr
	if err := h.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		h.cmd.Wait()
		h.exitCode = h.cmd.ProcessState.ExitCode()
		h.waitStatus = h.cmd.ProcessState.Sys().(syscall.WaitStatus)
		close(h.exited)
	}()
	t.Cleanup(func() {
		h.cmd.Process.Kill()
		<-h.exited
		if t.Failed() {
			t.Logf("agent stderr:\n%s", h.stderr.String())
		}
	})
	accepted := make(chan net.Conn, 1)
	go func() {
		c, err := ln.Accept()
		if err == nil {
			accepted <- c
		}
	}()
	var c net.Conn
	select {
	case c = <-accepted:
	case <-h.exited:
		t.Fatalf("agent exited (%d) before dialing:\n%s", h.exitCode, h.stderr.String())
	case <-time.After(10 * time.Second):
		t.Fatal("agent did not dial")
	}
	t.Cleanup(func() { c.Close() })
	h.nc, h.conn = c, proto.NewConn(c)
	m, err := h.conn.Recv()
	if err != nil {
		t.Fatalf("receiving hello: %v", err)
	}
	hello, ok := m.(*proto.Hello)
	if !ok || hello.V != proto.Version || hello.BootID == "" {
		t.Fatalf("first message = %#v, want a v%d Hello with a boot id", m, proto.Version)
	}
	h.hello = hello
	if spec.V == 0 {
		spec.V = proto.Version
	}
	if spec.Network.Mode == "" {
		spec.Network.Mode = proto.NetworkNone
	}
	if err := h.conn.Send(spec); err != nil {
		t.Fatal(err)
	}
	go func() {
		for {
			m, err := h.conn.Recv()
			if err != nil {
				close(h.msgs)
				return
			}
			h.mu.Lock()
			h.all = append(h.all, m)
			h.mu.Unlock()
			switch m.(type) {
			case *proto.Exit, *proto.Fatal:
				if !o.noAck {
					h.conn.Send(&proto.ExitAck{})
				}
			}
			h.msgs <- m
		}
	}()
	return h
}

// next returns the next message that is not a heartbeat.
func (h *fakeHost) next() proto.Message {
	h.t.Helper()
	for {
		select {
		case m, ok := <-h.msgs:
			if !ok {
				h.t.Fatalf("connection closed while waiting for a message; agent stderr:\n%s", h.stderr.String())
			}
			if _, hb := m.(*proto.Heartbeat); hb {
				continue
			}
			return m
		case <-time.After(10 * time.Second):
			h.t.Fatal("no message within 15s")
		}
	}
}

// waitExit skips to the Exit message, collecting the logs on the way.
func (h *fakeHost) waitExit() (*proto.Exit, string, string) {
	h.t.Helper()
	var stdout, stderr bytes.Buffer
	var lastSeq uint64
	for {
		switch m := h.next().(type) {
		case *proto.Exit:
			return m, stdout.String(), stderr.String()
		case *proto.Log:
			if m.Seq != lastSeq+1 {
				h.t.Errorf("log seq %d after %d", m.Seq, lastSeq)
			}
			lastSeq = m.Seq
			if m.Stream == proto.Stdout {
				stdout.Write(m.Data)
			} else {
				stderr.Write(m.Data)
			}
		case *proto.Fatal:
			h.t.Fatalf("fatal: %s", m.Message)
		}
	}
}

// waitAgent waits for the agent process to end and returns its status.
func (h *fakeHost) waitAgent() int {
	h.t.Helper()
	select {
	case <-h.exited:
		return h.exitCode
	case <-time.After(10 * time.Second):
		h.t.Fatal("agent still running after 15s")
	}
	return -1
}

// messages returns everything received so far.
func (h *fakeHost) messages() []proto.Message {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]proto.Message(nil), h.all...)
}

func sh(script string) []string { return []string{"/bin/sh", "-c", script} }

func TestWorkloadExit(t *testing.T) {
	tests := []struct {
		name     string
		script   string
		code     int
		signal   int
		wantOut  string
		wantErr  string
		wantNote string
	}{
		{name: "exit 0", script: "echo hello", code: 0, wantOut: "hello\n"},
		{name: "exit 3", script: "echo out; echo err >&2; exit 3", code: 3, wantOut: "out\n", wantErr: "err\n"},
		{name: "killed", script: "echo bye; kill -KILL $$", signal: 9, wantOut: "bye\n"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := startAgent(t, &proto.Spec{Command: sh(tt.script)}, agentOpts{})
			st, ok := h.next().(*proto.Started)
			if !ok || st.PID <= 0 {
				t.Fatalf("first message after spec = %#v, want Started", st)
			}
			exit, out, errOut := h.waitExit()
			switch {
			case tt.signal != 0 && exit.Signal != tt.signal:
				t.Errorf("exit = %+v, want signal %d", exit, tt.signal)
			case tt.signal == 0 && (exit.Code == nil || *exit.Code != tt.code):
				t.Errorf("exit = %+v, want code %d", exit, tt.code)
			}
			if out != tt.wantOut || errOut != tt.wantErr {
				t.Errorf("stdout, stderr = %q, %q; want %q, %q", out, errOut, tt.wantOut, tt.wantErr)
			}
			if code := h.waitAgent(); code != ExitPoweroff {
				t.Errorf("agent exit status = %d, want %d (poweroff)", code, ExitPoweroff)
			}
		})
	}
}

func TestFatalCommandNotFound(t *testing.T) {
	h := startAgent(t, &proto.Spec{Command: []string{"no-such-command-xyz"}}, agentOpts{})
	f, ok := h.next().(*proto.Fatal)
	if !ok || !strings.Contains(f.Message, "no-such-command-xyz") || !strings.Contains(f.Message, "not found") {
		t.Fatalf("message = %#v, want a Fatal naming the command", f)
	}
	if code := h.waitAgent(); code != ExitPoweroff {
		t.Errorf("agent exit status = %d, want %d", code, ExitPoweroff)
	}
}

func TestFatalUnknownUser(t *testing.T) {
	h := startAgent(t, &proto.Spec{Command: sh("true"), User: "ghost"}, agentOpts{})
	f, ok := h.next().(*proto.Fatal)
	if !ok || !strings.Contains(f.Message, `"ghost" not found`) {
		t.Fatalf("message = %#v, want a Fatal about the user", f)
	}
}

func TestLargeOutputChunks(t *testing.T) {
	const n = 300000
	h := startAgent(t, &proto.Spec{Command: sh(fmt.Sprintf("head -c %d /dev/zero | tr '\\0' a", n))}, agentOpts{})
	exit, out, _ := h.waitExit()
	if exit.Code == nil || *exit.Code != 0 {
		t.Fatalf("exit = %+v", exit)
	}
	if out != strings.Repeat("a", n) {
		t.Errorf("stdout: %d bytes, want %d a's", len(out), n)
	}
	chunks := 0
	for _, m := range h.messages() {
		if l, ok := m.(*proto.Log); ok {
			chunks++
			if len(l.Data) > proto.MaxLogChunk {
				t.Errorf("log chunk of %d bytes", len(l.Data))
			}
		}
	}
	if chunks < n/proto.MaxLogChunk {
		t.Errorf("%d chunks for %d bytes", chunks, n)
	}
}

func TestKeepaliveHeartbeatsAndStop(t *testing.T) {
	h := startAgent(t, &proto.Spec{Command: sh("exit 0"), Keepalive: true}, agentOpts{})
	if exit, _, _ := h.waitExit(); exit.Code == nil || *exit.Code != 0 {
		t.Fatalf("exit = %+v", exit)
	}
	// Still up: heartbeats keep coming, with growing sequence numbers.
	var last uint64
	for beats := 0; beats < 3; {
		select {
		case m := <-h.msgs:
			if hb, ok := m.(*proto.Heartbeat); ok {
				if hb.Seq <= last || hb.At.IsZero() {
					t.Fatalf("heartbeat %+v after seq %d", hb, last)
				}
				last = hb.Seq
				beats++
			}
		case <-h.exited:
			t.Fatal("agent exited despite keepalive")
		case <-time.After(5 * time.Second):
			t.Fatal("no heartbeats after the workload exit")
		}
	}
	if err := h.conn.Send(&proto.Stop{}); err != nil {
		t.Fatal(err)
	}
	if code := h.waitAgent(); code != ExitPoweroff {
		t.Errorf("agent exit status = %d, want %d", code, ExitPoweroff)
	}
}

// waitLog skips messages until a Log containing s.
func (h *fakeHost) waitLog(s string) {
	h.t.Helper()
	var seen strings.Builder
	for {
		m := h.next()
		if l, ok := m.(*proto.Log); ok {
			seen.Write(l.Data)
			if strings.Contains(seen.String(), s) {
				return
			}
		}
		if _, ok := m.(*proto.Exit); ok {
			h.t.Fatalf("workload exited before printing %q", s)
		}
	}
}

func TestStopGraceThenKill(t *testing.T) {
	// The workload ignores SIGTERM, so Stop must end in SIGKILL after the grace.
	h := startAgent(t, &proto.Spec{Command: sh(`trap "" TERM; echo ready; while :; do sleep 0.05; done`), Keepalive: true}, agentOpts{})
	h.waitLog("ready")
	start := time.Now()
	if err := h.conn.Send(&proto.Stop{GraceSecs: 1}); err != nil {
		t.Fatal(err)
	}
	exit, _, _ := h.waitExit()
	if exit.Signal != int(syscall.SIGKILL) {
		t.Errorf("exit = %+v, want SIGKILL", exit)
	}
	if d := time.Since(start); d < time.Second {
		t.Errorf("killed after %v, before the 1s grace", d)
	}
	if code := h.waitAgent(); code != ExitPoweroff {
		t.Errorf("agent exit status = %d, want %d despite keepalive", code, ExitPoweroff)
	}
}

func TestStopTerm(t *testing.T) {
	h := startAgent(t, &proto.Spec{Command: sh(`trap "exit 5" TERM; echo ready; while :; do sleep 0.05; done`), StopGraceSecs: 30}, agentOpts{})
	h.waitLog("ready")
	if err := h.conn.Send(&proto.Stop{}); err != nil {
		t.Fatal(err)
	}
	if exit, _, _ := h.waitExit(); exit.Code == nil || *exit.Code != 5 {
		t.Errorf("exit = %+v, want code 5", exit)
	}
}

func TestSignalForwarding(t *testing.T) {
	for _, sig := range []syscall.Signal{syscall.SIGTERM, syscall.SIGHUP, syscall.SIGUSR1} {
		t.Run(sig.String(), func(t *testing.T) {
			name := strings.TrimPrefix(strings.ToUpper(sigName(sig)), "SIG")
			h := startAgent(t, &proto.Spec{Command: sh(`trap "exit 7" ` + name + `; echo ready; while :; do sleep 0.05; done`)}, agentOpts{})
			h.waitLog("ready")
			if err := h.cmd.Process.Signal(sig); err != nil {
				t.Fatal(err)
			}
			if exit, _, _ := h.waitExit(); exit.Code == nil || *exit.Code != 7 {
				t.Errorf("exit = %+v, want code 7 from the trap", exit)
			}
		})
	}
}

func sigName(s syscall.Signal) string {
	switch s {
	case syscall.SIGTERM:
		return "TERM"
	case syscall.SIGHUP:
		return "HUP"
	case syscall.SIGUSR1:
		return "USR1"
	}
	return s.String()
}

// procStat returns the state and parent pid of pid.
func procStat(pid int) (state byte, ppid int, err error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, 0, err
	}
	i := bytes.LastIndexByte(b, ')')
	f := strings.Fields(string(b[i+1:]))
	ppid, err = strconv.Atoi(f[1])
	return f[0][0], ppid, err
}

// zombiesOf lists zombie children of pid.
func zombiesOf(t *testing.T, pid int) []int {
	var z []int
	for _, c := range childrenOf(pid) {
		if st, _, err := procStat(c); err == nil && st == 'Z' {
			z = append(z, c)
		}
	}
	return z
}

func TestReapsOrphans(t *testing.T) {
	dir := t.TempDir()
	pidFile := filepath.Join(dir, "orphan.pid")
	gate := filepath.Join(dir, "gate")
	// The subshells exit at once, so their background children are orphaned
	// and reparented to the agent (subreaper here, PID 1 in a VM); the first
	// orphan lives until the test opens the gate, after the workload ended.
	script := fmt.Sprintf(`(while ! test -f %s; do sleep 0.02; done & echo $! > %s); (sleep 0.05 &); exec sleep 0.2`, gate, pidFile)
	h := startAgent(t, &proto.Spec{Command: sh(script), Keepalive: true}, agentOpts{})
	if exit, _, _ := h.waitExit(); exit.Code == nil || *exit.Code != 0 {
		t.Fatalf("exit = %+v", exit)
	}
	b, err := os.ReadFile(pidFile)
	if err != nil {
		t.Fatal(err)
	}
	orphan, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		t.Fatal(err)
	}
	agentPID := h.cmd.Process.Pid
	if _, ppid, err := procStat(orphan); err != nil || ppid != agentPID {
		t.Fatalf("orphan %d: parent %d, %v; want the agent %d", orphan, ppid, err, agentPID)
	}
	// Once the orphan exits, the agent must reap it: no zombie may remain.
	if err := os.WriteFile(gate, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		_, _, err := procStat(orphan)
		if errors.Is(err, os.ErrNotExist) && len(zombiesOf(t, agentPID)) == 0 {
			break
		}
		if time.Now().After(deadline) {
			st, _, _ := procStat(orphan)
			t.Fatalf("orphan %d still present (state %c) after 5s; zombies of the agent: %v", orphan, st, zombiesOf(t, agentPID))
		}
		time.Sleep(50 * time.Millisecond)
	}
	h.conn.Send(&proto.Stop{})
	h.waitAgent()
}

func TestFilesAndEtc(t *testing.T) {
	spec := &proto.Spec{
		Command:     sh("true"),
		Hostname:    "web-1.example",
		Network:     proto.Network{Mode: proto.NetworkNone, DNS: []string{"10.0.0.53"}},
		ExtraHosts:  []proto.HostEntry{{Host: "db", IP: "10.0.0.9"}},
		ConfigFiles: []proto.ConfigFile{{Path: "/etc/app/app.conf", Mode: 0o640, Content: "a=b\n"}},
		TmpfsMounts: []proto.TmpfsMount{{Path: "/scratch/tmp"}},
		DataMounts:  []proto.DataMount{{Device: "/dev/vdb", Mountpoint: "/data"}},
		Workdir:     "/srv/app",
	}
	root := t.TempDir()
	// An absolute symlink in the image must resolve inside the root.
	if err := os.Symlink("/srv", filepath.Join(root, "link")); err != nil {
		t.Fatal(err)
	}
	spec.ConfigFiles = append(spec.ConfigFiles, proto.ConfigFile{Path: "/link/via.conf", Mode: 0o600, Content: "x"})
	h := startAgent(t, spec, agentOpts{root: root})
	h.waitExit()
	want := map[string]struct {
		content string
		mode    os.FileMode
	}{
		"etc/app/app.conf": {"a=b\n", 0o640},
		"srv/via.conf":     {"x", 0o600},
		"etc/hostname":     {"web-1.example\n", 0o644},
		"etc/hosts":        {"127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n127.0.1.1\tweb-1.example web-1\n10.0.0.9\tdb\n", 0o644},
		"etc/resolv.conf":  {"nameserver 10.0.0.53\n", 0o644},
	}
	for p, w := range want {
		b, err := os.ReadFile(filepath.Join(root, p))
		if err != nil {
			t.Errorf("reading %s: %v", p, err)
			continue
		}
		fi, _ := os.Stat(filepath.Join(root, p))
		if string(b) != w.content || fi.Mode().Perm() != w.mode {
			t.Errorf("%s = %q mode %v, want %q mode %v", p, b, fi.Mode().Perm(), w.content, w.mode)
		}
	}
	for _, d := range []string{"scratch/tmp", "data", "srv/app"} {
		if fi, err := os.Stat(filepath.Join(root, d)); err != nil || !fi.IsDir() {
			t.Errorf("directory %s: %v", d, err)
		}
	}
}

func sha(s string) string {
	h := sha256.Sum256([]byte(s))
	return hex.EncodeToString(h[:])
}

// TestSecrets checks that a secret env value and a secret file reach the
// workload, and that neither appears in any message or the agent's stderr.
func TestSecrets(t *testing.T) {
	const envSecret = "env-secret-Zq8w3"
	const fileSecret = "file-secret-Kp2v9"
	root := t.TempDir()
	spec := &proto.Spec{
		Command: sh(fmt.Sprintf(`printf %%s "$API_TOKEN" | sha256sum; sha256sum < %s/run/secrets/key; `+
			`printf %%s "$PLAIN"; echo; no-such-tool-for-the-log`, root)),
		Env:         []string{"PLAIN=visible", "API_TOKEN=overridden"},
		SecretEnv:   []proto.SecretEnv{{Key: "API_TOKEN", Value: proto.NewSecret(envSecret)}},
		SecretFiles: []proto.SecretFile{{Path: "/run/secrets/key", Mode: 0o400, Content: proto.NewSecret(fileSecret)}},
		Healthcheck: &proto.Healthcheck{Type: proto.CheckExec, Command: sh(`test "$API_TOKEN" = ` + envSecret), IntervalSecs: 1},
		Keepalive:   true,
	}
	h := startAgent(t, spec, agentOpts{root: root})
	exit, out, _ := h.waitExit()
	if exit.Code == nil {
		t.Fatalf("exit = %+v", exit)
	}
	wantOut := sha(envSecret) + "  -\n" + sha(fileSecret) + "  -\nvisible\n"
	if out != wantOut {
		t.Errorf("workload stdout = %q, want %q (hashes of the secrets)", out, wantOut)
	}
	b, err := os.ReadFile(filepath.Join(root, "run/secrets/key"))
	if err != nil || string(b) != fileSecret {
		t.Errorf("secret file = %q, %v", b, err)
	}
	if fi, err := os.Stat(filepath.Join(root, "run/secrets/key")); err != nil || fi.Mode().Perm() != 0o400 {
		t.Errorf("secret file mode: %v, %v", fi.Mode(), err)
	}
	h.conn.Send(&proto.Stop{})
	h.waitAgent()
	for _, m := range h.messages() {
		text := fmt.Sprintf("%#v", m)
		if l, ok := m.(*proto.Log); ok {
			text += string(l.Data)
		}
		for _, s := range []string{envSecret, fileSecret} {
			if strings.Contains(text, s) {
				t.Errorf("message %s leaks a secret: %s", m.Type(), text)
			}
		}
	}
	stderr := h.stderr.String()
	for _, s := range []string{envSecret, fileSecret} {
		if strings.Contains(stderr, s) {
			t.Errorf("agent stderr leaks a secret:\n%s", stderr)
		}
	}
}

// healthSeq collects Health messages until want of them arrived.
func (h *fakeHost) healthSeq(want int) []proto.Health {
	h.t.Helper()
	var got []proto.Health
	for len(got) < want {
		if m, ok := h.next().(*proto.Health); ok {
			got = append(got, *m)
		}
	}
	return got
}

func TestHealthExecTurnsUnhealthyThenHealthy(t *testing.T) {
	root := t.TempDir()
	marker := filepath.Join(root, "healthy")
	h := startAgent(t, &proto.Spec{
		Command:     sh("sleep 30"),
		Healthcheck: &proto.Healthcheck{Type: proto.CheckExec, Command: sh("echo probe; test -f " + marker), IntervalSecs: 1, Retries: 2},
	}, agentOpts{root: root})
	got := h.healthSeq(3)
	want := []proto.Health{
		{Status: proto.HealthStarting},
		{Status: proto.HealthStarting, Streak: 1, Output: "probe\n"},
		{Status: proto.HealthUnhealthy, Streak: 2, Output: "probe\n"},
	}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("health = %+v\nwant %+v", got, want)
	}
	if err := os.WriteFile(marker, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if got := h.healthSeq(1)[0]; got.Status != proto.HealthHealthy || got.Streak != 0 {
		t.Errorf("after the fix: %+v, want healthy with streak 0", got)
	}
}

func TestHealthHTTPAndTCP(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/down" {
			http.Error(w, "down", http.StatusServiceUnavailable)
		}
	}))
	defer srv.Close()
	port := srv.Listener.Addr().(*net.TCPAddr).Port
	closed, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	closedPort := closed.Addr().(*net.TCPAddr).Port
	closed.Close()
	tests := []struct {
		name string
		hc   proto.Healthcheck
		want string
	}{
		{"http ok", proto.Healthcheck{Type: proto.CheckHTTP, URL: srv.URL + "/"}, proto.HealthHealthy},
		{"http 503", proto.Healthcheck{Type: proto.CheckHTTP, URL: srv.URL + "/down", Retries: 1}, proto.HealthUnhealthy},
		{"tcp ok", proto.Healthcheck{Type: proto.CheckTCP, Port: port}, proto.HealthHealthy},
		{"tcp refused", proto.Healthcheck{Type: proto.CheckTCP, Port: closedPort, Retries: 1}, proto.HealthUnhealthy},
		{"exec timeout", proto.Healthcheck{Type: proto.CheckExec, Command: sh("exec sleep 10"), TimeoutSecs: 1, Retries: 1}, proto.HealthUnhealthy},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tt.hc.IntervalSecs = 1
			h := startAgent(t, &proto.Spec{Command: sh("sleep 30"), Healthcheck: &tt.hc}, agentOpts{})
			got := h.healthSeq(2)
			if got[0].Status != proto.HealthStarting || got[1].Status != tt.want {
				t.Errorf("health = %+v, want starting then %s", got, tt.want)
			}
			if tt.hc.Type == proto.CheckExec && got[1].Output != "timed out after 1s" {
				t.Errorf("output = %q, want the timeout", got[1].Output)
			}
		})
	}
}

func TestHealthRecord(t *testing.T) {
	type step struct {
		ok         bool
		since      time.Duration
		wantStatus string
		wantStreak int
		wantMsg    bool
	}
	tests := []struct {
		name  string
		hc    proto.Healthcheck
		steps []step
	}{
		{"start period hides failures", proto.Healthcheck{Retries: 2, StartPeriodSecs: 10}, []step{
			{false, time.Second, "starting", 0, false},
			{false, 5 * time.Second, "starting", 0, false},
			{false, 11 * time.Second, "starting", 1, true},
			{false, 12 * time.Second, "unhealthy", 2, true},
			{false, 13 * time.Second, "unhealthy", 3, true},
			{true, 14 * time.Second, "healthy", 0, true},
			{true, 15 * time.Second, "healthy", 0, false},
		}},
		{"success in start period", proto.Healthcheck{Retries: 1, StartPeriodSecs: 10}, []step{
			{true, time.Second, "healthy", 0, true},
			// Once healthy, the start period no longer hides failures.
			{false, 2 * time.Second, "unhealthy", 1, true},
		}},
		{"default retries", proto.Healthcheck{}, []step{
			{false, 0, "starting", 1, true},
			{false, 0, "starting", 2, true},
			{false, 0, "unhealthy", 3, true},
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := newHealthChecker(nil, &tt.hc, &workload{}, "")
			for i, s := range tt.steps {
				msg := h.record(s.ok, "out", s.since)
				if h.status != s.wantStatus || h.streak != s.wantStreak || (msg != nil) != s.wantMsg {
					t.Errorf("step %d: status %s streak %d msg %v; want %s %d %v", i, h.status, h.streak, msg, s.wantStatus, s.wantStreak, s.wantMsg)
				}
			}
		})
	}
}

func TestUserAndOwnership(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to run the workload as another user (run the tests as root)")
	}
	root, err := os.MkdirTemp("", "guest-user-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(root) })
	os.Chmod(root, 0o755)
	os.MkdirAll(filepath.Join(root, "etc"), 0o755)
	os.WriteFile(filepath.Join(root, "etc/passwd"), []byte("root:x:0:0::/root:/bin/sh\napp:x:4242:4243::/home/app:/bin/sh\n"), 0o644)
	os.WriteFile(filepath.Join(root, "etc/group"), []byte("app:x:4243:\nextra:x:4300:app\n"), 0o644)
	h := startAgent(t, &proto.Spec{
		Command:     sh(fmt.Sprintf(`id -u; id -g; id -G; echo $HOME; pwd; cat %s/run/s`, root)),
		User:        "app",
		Workdir:     "/work",
		SecretFiles: []proto.SecretFile{{Path: "/run/s", Mode: 0o400, Content: proto.NewSecret("readable")}},
	}, agentOpts{root: root})
	exit, out, errOut := h.waitExit()
	want := fmt.Sprintf("4242\n4243\n4243 4300\n/home/app\n%s/work\nreadable", root)
	if exit.Code == nil || *exit.Code != 0 || out != want {
		t.Errorf("exit %+v, stdout %q (stderr %q), want %q", exit, out, errOut, want)
	}
}

// TestReconnect cuts the host connection while the workload runs, and the
// host stays away while the workload exits: the agent keeps the VM up,
// redials once the host listens again, says Hello with Resume and the same
// boot id, replays Started and the Exit, and powers off only when the host
// acknowledges the exit.
func TestReconnect(t *testing.T) {
	root := t.TempDir()
	gate := filepath.Join(root, "go")
	h := startAgent(t, &proto.Spec{Command: sh("while ! test -f " + gate + "; do sleep 0.05; done; exit 4")}, agentOpts{root: root})
	st, ok := h.next().(*proto.Started)
	if !ok {
		t.Fatalf("want Started, got %#v", st)
	}
	sock := h.ln.Addr().String()
	h.ln.Close() // the host agent is down
	h.nc.Close()
	if err := os.WriteFile(gate, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	select {
	case <-h.exited:
		t.Fatalf("the agent powered off with its exit unacknowledged:\n%s", h.stderr.String())
	case <-time.After(700 * time.Millisecond):
	}
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		if c, err := ln.Accept(); err == nil {
			accepted <- c
		}
	}()
	var c net.Conn
	select {
	case c = <-accepted:
	case <-time.After(10 * time.Second):
		t.Fatal("agent did not redial")
	}
	defer c.Close()
	conn := proto.NewConn(c)
	m, err := conn.Recv()
	if hello, ok := m.(*proto.Hello); err != nil || !ok || !hello.Resume || hello.BootID != h.hello.BootID {
		t.Fatalf("after redial: %#v, %v; want Hello with Resume and boot id %q", m, err, h.hello.BootID)
	}
	if m, err := conn.Recv(); err != nil || !reflect.DeepEqual(m, st) {
		t.Fatalf("replay: %#v, %v; want %#v", m, err, st)
	}
	for {
		m, err := conn.Recv()
		if err != nil {
			t.Fatalf("waiting for the exit: %v", err)
		}
		if e, ok := m.(*proto.Exit); ok {
			if e.Code == nil || *e.Code != 4 {
				t.Errorf("exit = %+v, want code 4", e)
			}
			break
		}
	}
	select {
	case <-h.exited:
		t.Fatal("the agent powered off before the host acknowledged the exit")
	case <-time.After(300 * time.Millisecond):
	}
	if err := conn.Send(&proto.ExitAck{}); err != nil {
		t.Fatal(err)
	}
	if code := h.waitAgent(); code != ExitPoweroff {
		t.Errorf("agent exit status = %d", code)
	}
}

// TestExitAckVersions: a version 1 host never acknowledges, so the agent
// powers off at once after the exit; a version 2 host that has not
// acknowledged can still stop the guest.
func TestExitAckVersions(t *testing.T) {
	h := startAgent(t, &proto.Spec{V: 1, Command: sh("exit 0")}, agentOpts{noAck: true})
	h.waitExit()
	if code := h.waitAgent(); code != ExitPoweroff {
		t.Errorf("v1: agent exit status = %d", code)
	}

	h = startAgent(t, &proto.Spec{Command: sh("exit 0")}, agentOpts{noAck: true})
	h.waitExit()
	select {
	case <-h.exited:
		t.Fatal("v2: the agent powered off without an acknowledgement")
	case <-time.After(300 * time.Millisecond):
	}
	h.send(&proto.Stop{})
	if code := h.waitAgent(); code != ExitPoweroff {
		t.Errorf("v2 after Stop: agent exit status = %d", code)
	}
}

// TestPowerButtonStops: the simulator's power button (SIGPWR to the agent)
// stops the workload with SIGTERM, reports its exit and powers off.
func TestPowerButtonStops(t *testing.T) {
	h := startAgent(t, &proto.Spec{Command: sh("trap 'echo got-term; exit 9' TERM; echo ready; while :; do sleep 0.05; done")}, agentOpts{})
	h.eventually("the workload's trap", func(all []proto.Message) bool {
		return slices.ContainsFunc(all, func(m proto.Message) bool {
			l, ok := m.(*proto.Log)
			return ok && strings.Contains(string(l.Data), "ready")
		})
	})
	h.cmd.Process.Signal(syscall.SIGPWR)
	exit, out, _ := h.waitExit()
	if exit.Code == nil || *exit.Code != 9 || !strings.Contains(out, "got-term") {
		t.Errorf("exit %+v, output %q; want the workload's TERM trap", exit, out)
	}
	if code := h.waitAgent(); code != ExitPoweroff {
		t.Errorf("agent exit status = %d", code)
	}
}

// TestPowerButtonEvents reads input events the way the agent reads a VM's
// "Power Button" device: only a key-down of KEY_POWER on a device of that
// name counts.
func TestPowerButtonEvents(t *testing.T) {
	dir := t.TempDir()
	sysfs, dev := filepath.Join(dir, "sys"), filepath.Join(dir, "dev")
	for name, devName := range map[string]string{"event0": "AT Translated Set 2 keyboard", "event1": "Power Button"} {
		d := filepath.Join(sysfs, "class/input", name, "device")
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(d, "name"), []byte(devName+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.MkdirAll(filepath.Join(dev, "input"), 0o755); err != nil {
		t.Fatal(err)
	}
	event := func(typ, code uint16, value int32) []byte {
		b := make([]byte, inputEventSize)
		binary.NativeEndian.PutUint16(b[16:], typ)
		binary.NativeEndian.PutUint16(b[18:], code)
		binary.NativeEndian.PutUint32(b[20:], uint32(value))
		return b
	}
	var stream []byte
	stream = append(stream, event(evKey, keyPower, 1)...) // press
	stream = append(stream, event(0, 0, 0)...)            // EV_SYN
	stream = append(stream, event(evKey, keyPower, 0)...) // release
	stream = append(stream, event(evKey, 30, 1)...)       // KEY_A
	stream = append(stream, event(evKey, keyPower, 1)...) // press again
	for _, name := range []string{"event0", "event1"} {
		if err := os.WriteFile(filepath.Join(dev, "input", name), stream, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	presses := make(chan struct{}, 10)
	if n := watchPowerButtons(sysfs, dev, func() { presses <- struct{}{} }); n != 1 {
		t.Fatalf("watching %d devices, want 1 (the one named Power Button)", n)
	}
	for i := range 2 {
		select {
		case <-presses:
		case <-time.After(5 * time.Second):
			t.Fatalf("%d presses seen, want 2", i)
		}
	}
	select {
	case <-presses:
		t.Error("a third press: a release or another key was taken for one")
	case <-time.After(100 * time.Millisecond):
	}
}

func TestProcessOptionsArgs(t *testing.T) {
	got := ProcessOptions{Socket: "/run/v.sock_1024", Root: "/r", Chroot: true, Network: true, Heartbeat: 1500 * time.Millisecond, Listen: "/run/v.sock.guest"}.Args()
	want := []string{"--transport", "unix:/run/v.sock_1024", "--root", "/r", "--chroot", "--network", "--listen", "unix:/run/v.sock.guest", "--heartbeat", "1500ms"}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("Args() = %q, want %q", got, want)
	}
}

// TestWorkloadDiesWithAgent kills the agent outright, as the simulator may:
// the workload must not survive it.
func TestWorkloadDiesWithAgent(t *testing.T) {
	h := startAgent(t, &proto.Spec{Command: sh("echo ready; exec sleep 60")}, agentOpts{})
	st, ok := h.next().(*proto.Started)
	if !ok {
		t.Fatalf("want Started, got %#v", st)
	}
	h.waitLog("ready")
	h.cmd.Process.Kill()
	h.waitAgent()
	deadline := time.Now().Add(5 * time.Second)
	for {
		state, _, err := procStat(st.PID)
		if errors.Is(err, os.ErrNotExist) || state == 'Z' {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("workload %d still running (state %c) after the agent died", st.PID, state)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestWriteInRootReplacesImageFile checks that an injected file replaces
// what the image has at its path instead of writing through it: a hard link
// elsewhere in the image keeps its old content.
func TestWriteInRootReplacesImageFile(t *testing.T) {
	root := t.TempDir()
	if err := os.MkdirAll(filepath.Join(root, "run/secrets"), 0o755); err != nil {
		t.Fatal(err)
	}
	target := filepath.Join(root, "run/secrets/key")
	if err := os.WriteFile(target, []byte("image content"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Link(target, filepath.Join(root, "public")); err != nil {
		t.Fatal(err)
	}
	if err := writeInRoot(root, "/run/secrets/key", 0o400, []byte("the-secret"), -1, -1); err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(filepath.Join(root, "public")); err != nil || string(b) != "image content" {
		t.Errorf("hard link to the image file now reads %q, %v; want the image content", b, err)
	}
	fi, err := os.Stat(target)
	if err != nil || fi.Mode().Perm() != 0o400 {
		t.Fatalf("injected file: %v, %v", fi, err)
	}
	if b, _ := os.ReadFile(target); string(b) != "the-secret" {
		t.Errorf("injected file = %q", b)
	}
}

// TestPoweroffKillsOrphanTrees checks that a process-mode poweroff leaves
// nothing behind: an orphan parked on the agent is killed, and so is the
// child it still had, which the kill reparents to the agent in turn.
func TestPoweroffKillsOrphanTrees(t *testing.T) {
	dir := t.TempDir()
	gcFile := filepath.Join(dir, "grandchild.pid")
	script := fmt.Sprintf(`(sh -c 'sleep 60 & echo $! > %[1]s.tmp; mv %[1]s.tmp %[1]s; wait' &); `+
		`while ! test -f %[1]s; do sleep 0.02; done`, gcFile)
	h := startAgent(t, &proto.Spec{Command: sh(script)}, agentOpts{})
	if exit, _, _ := h.waitExit(); exit.Code == nil || *exit.Code != 0 {
		t.Fatalf("exit = %+v", exit)
	}
	h.waitAgent()
	b, err := os.ReadFile(gcFile)
	if err != nil {
		t.Fatal(err)
	}
	gc, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		t.Fatal(err)
	}
	defer syscall.Kill(gc, syscall.SIGKILL)
	deadline := time.Now().Add(5 * time.Second)
	for {
		state, _, err := procStat(gc)
		if errors.Is(err, os.ErrNotExist) || state == 'Z' {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("grandchild %d still running (state %c) after the agent powered off", gc, state)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// relisten brings the host back at the agent's socket and returns the
// resumed connection after its Hello.
func (h *fakeHost) relisten(sock string) (*proto.Conn, *proto.Hello) {
	h.t.Helper()
	ln, err := net.Listen("unix", sock)
	if err != nil {
		h.t.Fatal(err)
	}
	h.t.Cleanup(func() { ln.Close() })
	ln.(*net.UnixListener).SetDeadline(time.Now().Add(10 * time.Second))
	c, err := ln.Accept()
	if err != nil {
		h.t.Fatalf("the agent did not redial: %v", err)
	}
	h.t.Cleanup(func() { c.Close() })
	conn := proto.NewConn(c)
	m, err := conn.Recv()
	hello, ok := m.(*proto.Hello)
	if err != nil || !ok || !hello.Resume || hello.BootID != h.hello.BootID {
		h.t.Fatalf("after redial: %#v, %v; want Hello with Resume and boot id %q", m, err, h.hello.BootID)
	}
	return conn, hello
}

// outage runs a workload that prints "before", waits for the host to go
// away, prints on both streams and exits 4; it returns the resumed
// connection's Hello and what it replays up to the Exit.
func logOutage(t *testing.T, v int, ack bool) (first *proto.Log, resumed *proto.Hello, replay []proto.Message) {
	root := t.TempDir()
	gate := filepath.Join(root, "go")
	h := startAgent(t, &proto.Spec{V: v, Command: sh(`echo before; while ! test -f ` + gate + `; do sleep 0.05; done; echo during-1; echo during-2 >&2; exit 4`)}, agentOpts{root: root})
	if _, ok := h.next().(*proto.Started); !ok {
		t.Fatal("want Started")
	}
	first, ok := h.next().(*proto.Log)
	if !ok || string(first.Data) != "before\n" {
		t.Fatalf("want the first log, got %#v", first)
	}
	if ack {
		h.send(&proto.LogAck{Seq: first.Seq})
		// The agent takes its host's messages in order: once it answers
		// this Unmount (of nothing: done), it has taken the ack, which the
		// closing below could otherwise overtake.
		h.send(&proto.Unmount{Seq: 1, Mountpoint: "/barrier"})
		if r, ok := h.next().(*proto.MountResult); !ok || r.Seq != 1 || r.Error != "" {
			t.Fatalf("want the Unmount's result, got %#v", r)
		}
	}
	sock := h.ln.Addr().String()
	h.ln.Close()
	h.nc.Close()
	if err := os.WriteFile(gate, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond) // the workload ends while the host is away
	conn, resumed := h.relisten(sock)
	for {
		m, err := conn.Recv()
		if err != nil {
			t.Fatalf("waiting for the replayed exit: %v", err)
		}
		if _, hb := m.(*proto.Heartbeat); hb {
			continue
		}
		replay = append(replay, m)
		if _, ok := m.(*proto.Exit); ok {
			conn.Send(&proto.ExitAck{})
			h.waitAgent()
			return first, resumed, replay
		}
	}
}

// TestLogReplay: a guest sends a host of version 3 on again, after a
// resume, the output the host did not acknowledge (what it printed while
// the host was away included), with the same Seq and At, before the Exit;
// to a host of version 4 on, its resuming Hello says the Seq of the last
// Log it numbered (a version 3 host, strict, would refuse the field).
func TestLogReplay(t *testing.T) {
	for _, tc := range []struct {
		v   int
		ack bool
	}{{proto.Version, false}, {proto.Version, true}, {proto.Version3, false}} {
		t.Run(fmt.Sprintf("v%d ack %v", tc.v, tc.ack), func(t *testing.T) {
			ack := tc.ack
			first, resumed, replay := logOutage(t, tc.v, ack)
			if first.At.IsZero() || time.Since(first.At) > time.Minute {
				t.Errorf("log at %v, want the time it was read", first.At)
			}
			var types []string
			logs := map[string]uint64{}
			for _, m := range replay {
				types = append(types, m.Type())
				if l, ok := m.(*proto.Log); ok {
					if l.At.IsZero() {
						t.Errorf("replayed log %d without its time", l.Seq)
					}
					logs[string(l.Data)] = l.Seq
				}
			}
			want := map[string]uint64{"during-1\n": 0, "during-2\n": 0}
			if !ack {
				want["before\n"] = first.Seq
			}
			if strings.Join(types, " ") != "started"+strings.Repeat(" log", len(want))+" exit" {
				t.Errorf("replay %v, want started, %d logs, exit", types, len(want))
			}
			seqs := map[uint64]bool{}
			var last uint64
			for data := range want {
				seq, ok := logs[data]
				if !ok || seq <= first.Seq && data != "before\n" || seqs[seq] {
					t.Errorf("replayed logs %v: %q missing or misnumbered", logs, data)
				}
				seqs[seq] = true
				last = max(last, seq)
			}
			switch {
			case tc.v < proto.Version4 && resumed.LogSeq != nil:
				t.Errorf("the resume to a version %d host says log_seq %d", tc.v, *resumed.LogSeq)
			case tc.v >= proto.Version4 && (resumed.LogSeq == nil || *resumed.LogSeq != last):
				t.Errorf("the resume says log_seq %v, want %d (the last Log numbered)", resumed.LogSeq, last)
			}
		})
	}
}

// TestLogsForAVersion2Host: a host of version 2 gets logs without At and no
// replay of logs (it would store them twice).
func TestLogsForAVersion2Host(t *testing.T) {
	first, resumed, replay := logOutage(t, proto.Version2, false)
	if resumed.LogSeq != nil {
		t.Errorf("the resume to a version 2 host says log_seq %d", *resumed.LogSeq)
	}
	if !first.At.IsZero() {
		t.Errorf("a version 2 host got a log with at %v", first.At)
	}
	var types []string
	for _, m := range replay {
		types = append(types, m.Type())
	}
	if strings.Join(types, " ") != "started exit" {
		t.Errorf("replay to a version 2 host: %v, want started, exit", types)
	}
}

// TestHaltKillsTheGuest: HaltSignal (the simulator's VM stop, and the
// agent's parent-death signal) ends the agent with every process below it:
// the workload, its children, an orphan parked on the agent and one that
// left its session.
func TestHaltKillsTheGuest(t *testing.T) {
	dir := t.TempDir()
	script := fmt.Sprintf(`sleep 300 & echo $! > %[1]s/child; `+
		`(sleep 300 & echo $! > %[1]s/orphan); `+
		`setsid sh -c 'echo $$ > %[1]s/session; exec sleep 300' & `+
		`while ! test -s %[1]s/session; do sleep 0.02; done; echo ready; exec sleep 300`, dir)
	h := startAgent(t, &proto.Spec{Command: sh(script)}, agentOpts{})
	st, ok := h.next().(*proto.Started)
	if !ok {
		t.Fatal("want Started")
	}
	h.waitLog("ready")
	pids := []int{st.PID}
	for _, f := range []string{"child", "orphan", "session"} {
		b, err := os.ReadFile(filepath.Join(dir, f))
		if err != nil {
			t.Fatal(err)
		}
		p, _ := strconv.Atoi(strings.TrimSpace(string(b)))
		pids = append(pids, p)
		defer syscall.Kill(p, syscall.SIGKILL)
	}
	if err := h.cmd.Process.Signal(HaltSignal); err != nil {
		t.Fatal(err)
	}
	if code := h.waitAgent(); code != ExitHalted {
		t.Errorf("agent status %d, want %d", code, ExitHalted)
	}
	// The agent reaped them before it exited: they are gone already.
	for _, p := range pids {
		if !gone(p) {
			t.Errorf("process %d outlived the halt", p)
		}
	}
}
