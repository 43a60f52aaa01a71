package api

import (
	"archive/tar"
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"vmhost/appvm/guest"
	"vmhost/appvm/guest/proto"
)

// The guest operation tests run a real guest agent: this test binary in
// process mode (`guest --transport unix:… --root … --listen unix:…`), on
// the host end of a real session (Guests.Adopt) and with its operation
// connections reached through socketDialer, the engine's hybrid vsock
// dial's stand-in. Without --chroot the agent runs commands on the host
// and keeps files (and the secret files it writes) under its --root.

// opsBody creates AppVM "ops": a workload that runs until killed (and
// writes a file on SIGHUP, and marker.ready once it will), a secret env
// value and a secret file.
func opsBody(marker string) string {
	return `{"vm_id":"ops","image_id":"plain","vcpus":1,"memory_mb":64,"disk_gib":1,
	"command":["sh","-c","trap 'echo hup > ` + marker + `' HUP; : > ` + marker + `.ready; while :; do sleep 0.05; done"],
	"env":["MODE=test"],"secret_env":["TOKEN=` + plantedSecret + `"],
	"secret_files":[{"path":"/run/secrets/key","content":"` + plantedFile + `\n"}]}`
}

// guestAgent is a running process-mode guest agent.
type guestAgent struct {
	root string
	cmd  *exec.Cmd
}

// startGuest serves AppVM id's guest agent session on a fresh listener and
// starts a guest agent on it, then waits until an exec runs.
func (h *harness) startGuest(t *testing.T, id string) *guestAgent {
	t.Helper()
	// Unix socket paths must stay short: not under t.TempDir.
	sock, err := os.MkdirTemp("", "gops")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(sock) })
	ga := &guestAgent{root: t.TempDir()}
	l, err := net.Listen("unix", filepath.Join(sock, "v_1024"))
	if err != nil {
		t.Fatal(err)
	}
	rec := h.e.Records.Get(id)
	if err := h.guests.Adopt(context.Background(), rec, l); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.guests.End(id) })
	h.dialer.mu.Lock()
	h.dialer.prefix[id] = filepath.Join(sock, "g")
	h.dialer.mu.Unlock()
	args := guest.ProcessOptions{Socket: filepath.Join(sock, "v_1024"), Root: ga.root, Listen: filepath.Join(sock, "g"), Heartbeat: 200 * time.Millisecond}.Args()
	ga.cmd = exec.Command(os.Args[0], append([]string{"guest"}, args...)...)
	ga.cmd.Env = append(os.Environ(), "GORACE=atexit_sleep_ms=0")
	var logs lockedBuffer
	ga.cmd.Stdout, ga.cmd.Stderr = &logs, &logs
	if err := ga.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ga.cmd.Process.Signal(guest.HaltSignal)
		ga.cmd.Wait()
		// The agent's log joins the secret grep: it never holds a secret.
		seenMu.Lock()
		seenBodies = append(seenBodies, logs.String())
		seenMu.Unlock()
	})
	deadline := time.Now().Add(30 * time.Second)
	for {
		st, _, b := h.do(t, "POST", "/api/appvm/vms/"+id+"/exec", h.rw, `{"command":["true"]}`)
		if st == 200 {
			return ga
		}
		if st != 409 || time.Now().After(deadline) {
			t.Fatalf("the guest agent never took an exec: %d %s\nagent log:\n%s", st, b, logs.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func (h *harness) createOps(t *testing.T) (*guestAgent, string) {
	t.Helper()
	marker := filepath.Join(t.TempDir(), "hup")
	if st, _, b := h.do(t, "POST", "/api/appvm/vms", h.rw, opsBody(marker)); st != 201 {
		t.Fatalf("create: %d %s", st, b)
	}
	return h.startGuest(t, "ops"), marker
}

type execResult struct {
	ExitCode   int    `json:"exit_code"`
	Signal     int    `json:"signal"`
	Stdout     string `json:"stdout"`
	Stderr     string `json:"stderr"`
	Truncated  bool   `json:"truncated"`
	DurationMS int64  `json:"duration_ms"`
}

func (h *harness) exec(t *testing.T, body string) execResult {
	t.Helper()
	st, _, b := h.do(t, "POST", "/api/appvm/vms/ops/exec", h.rw, body)
	if st != 200 {
		t.Fatalf("exec %s: %d %s", body, st, b)
	}
	var r execResult
	if err := json.Unmarshal([]byte(b), &r); err != nil {
		t.Fatal(err)
	}
	return r
}

func jsonArgs(args ...string) string {
	b, _ := json.Marshal(args)
	return string(b)
}

// TestExecOneShot: the answer carries the exit status, both streams, the
// input given, the environment (secret values redacted), cuts at 1 MiB,
// and a timeout kills.
func TestExecOneShot(t *testing.T) {
	h := newHarness(t)
	ga, _ := h.createOps(t)
	r := h.exec(t, `{"command":["sh","-c","echo out; echo err >&2; exit 3"]}`)
	if r.ExitCode != 3 || r.Signal != 0 || r.Stdout != "out\n" || r.Stderr != "err\n" || r.Truncated || r.DurationMS < 0 {
		t.Errorf("exit 3: %+v", r)
	}
	if r := h.exec(t, `{"command":["cat"],"stdin":"to stdin\n"}`); r.Stdout != "to stdin\n" || r.ExitCode != 0 {
		t.Errorf("stdin: %+v", r)
	}
	// The exec'd process has the workload's environment, the secret
	// value included, but the answer shows it redacted.
	r = h.exec(t, `{"command":["env"],"env":["EXTRA=1"]}`)
	for _, want := range []string{"MODE=test\n", "EXTRA=1\n", "TOKEN=[redacted]\n"} {
		if !strings.Contains(r.Stdout, want) {
			t.Errorf("env lacks %q:\n%s", want, r.Stdout)
		}
	}
	if r := h.exec(t, `{"command":["sh","-c","test \"$TOKEN\" = `+plantedSecret+` && echo same"]}`); r.Stdout != "same\n" {
		t.Errorf("the process does not see the secret value: %+v", r)
	}
	// A secret file's content and its lines, a value cut across writes, a
	// secret in the argv.
	key := filepath.Join(ga.root, "run/secrets/key")
	for _, cmd := range []string{
		jsonArgs("cat", key),
		jsonArgs("sh", "-c", "printf %s "+plantedFile[:7]+"; sleep 0.2; printf '%s\\n' "+plantedFile[7:]),
		jsonArgs("echo", plantedSecret),
		jsonArgs("sh", "-c", "echo x"+plantedSecret+"y >&2"),
	} {
		r := h.exec(t, `{"command":`+cmd+`}`)
		if !strings.Contains(r.Stdout+r.Stderr, "[redacted]") {
			t.Errorf("%s: no [redacted] in %+v", cmd, r)
		}
	}
	r = h.exec(t, `{"command":["sh","-c","head -c 3000000 /dev/zero | tr '\\0' a; echo done >&2"]}`)
	if len(r.Stdout) != 1<<20 || !r.Truncated || r.Stderr != "done\n" || strings.Trim(r.Stdout, "a") != "" {
		t.Errorf("3 MB of output: %d bytes, truncated %v, stderr %q", len(r.Stdout), r.Truncated, r.Stderr)
	}
	start := time.Now()
	r = h.exec(t, `{"command":["sleep","30"],"timeout_secs":1}`)
	if r.Signal != 9 || r.ExitCode != 137 || time.Since(start) > 20*time.Second {
		t.Errorf("timeout: %+v after %v", r, time.Since(start))
	}
	if r := h.exec(t, `{"command":["sh","-c","kill -TERM $$"]}`); r.Signal != 15 || r.ExitCode != 143 {
		t.Errorf("killed by SIGTERM: %+v", r)
	}
}

// TestExecRefused: each rule answers 400 naming its field (or 422 for the
// body's shape) before anything runs; the guest's refusals are 400 too.
func TestExecRefused(t *testing.T) {
	h := newHarness(t)
	h.createOps(t)
	for _, c := range []struct {
		body   string
		status int
		want   string
	}{
		{`{}`, 422, "command: required field missing"},
		{`{"command":"ls"}`, 422, "command: expected array"},
		{`{"command":["ls"],"bogus":1}`, 422, `unknown field "bogus"`},
		{`{"command":["ls"],"timeout_secs":-1}`, 422, "timeout_secs"},
		{`{"command":[]}`, 400, "command:"},
		{`{"command":[""]}`, 400, "command[0]:"},
		{`{"command":["a\u0000b"]}`, 400, "command[0]: contains NUL"},
		{`{"command":["ls"],"timeout_secs":0}`, 400, "timeout_secs: must be 1..3600"},
		{`{"command":["ls"],"timeout_secs":3601}`, 400, "timeout_secs: must be 1..3600"},
		{`{"command":["ls"],"cols":80}`, 400, "cols:"},
		{`{"command":["ls"],"env":["1BAD=x"]}`, 400, "env[0]:"},
		{`{"command":["ls"],"workdir":"relative"}`, 400, "workdir:"},
		{`{"command":["ls"],"user":"a\nb"}`, 400, "user:"},
		{`{"command":["sh"],"interactive":true}`, 400, "interactive: an interactive exec"},
		{`{"command":["sh"],"tty":true}`, 400, "Upgrade: vmhost-exec"},
		{`{"command":["no-such-program-here"]}`, 400, "no-such-program-here"},
		{`{"command":["ls"],"user":"nobody-at-all"}`, 400, "user:"},
		{`{"command":["ls"],"workdir":"/no/such/dir"}`, 400, "workdir"},
	} {
		st, _, b := h.do(t, "POST", "/api/appvm/vms/ops/exec", h.rw, c.body)
		if st != c.status || !strings.Contains(b, c.want) {
			t.Errorf("%s: %d %s, want %d with %q", c.body, st, b, c.status, c.want)
		}
	}
	if st, _, b := h.do(t, "POST", "/api/appvm/vms/nope/exec", h.rw, `{"command":["ls"]}`); st != 404 || !strings.Contains(b, "NOT_FOUND") {
		t.Errorf("unknown AppVM: %d %s", st, b)
	}
	// The upgrade headers on a one-shot body.
	req := httptest.NewRequest("POST", "/api/appvm/vms/ops/exec", strings.NewReader(`{"command":["ls"]}`))
	req.Header.Set("Authorization", "Bearer "+h.rw)
	req.Header.Set("Connection", "Upgrade")
	req.Header.Set("Upgrade", "vmhost-exec")
	w := httptest.NewRecorder()
	h.srv.ServeHTTP(w, req)
	if w.Code != 400 || !strings.Contains(w.Body.String(), "set interactive or tty") {
		t.Errorf("upgrade without interactive: %d %s", w.Code, w.Body)
	}
}

// TestGuestOpsAuth: keys without the scope or the allowlist get 403, no
// key 401, before anything reaches the guest; every mutation is audited.
func TestGuestOpsAuth(t *testing.T) {
	h := newHarness(t)
	for _, c := range []struct{ method, path, body string }{
		{"POST", "/api/appvm/vms/ops/exec", `{"command":["true"]}`},
		{"PUT", "/api/appvm/vms/ops/files?path=/", "x"},
		{"POST", "/api/appvm/vms/ops/signal", `{"signal":"HUP"}`},
		{"GET", "/api/appvm/vms/ops/files?path=/", ""},
	} {
		if st, _, b := h.do(t, c.method, c.path, "", c.body); st != 401 {
			t.Errorf("%s %s without a key: %d %s", c.method, c.path, st, b)
		}
		if st, _, b := h.do(t, c.method, c.path, h.narrow, c.body); st != 403 {
			t.Errorf("%s %s with a narrow key: %d %s", c.method, c.path, st, b)
		}
		st, _, b := h.do(t, c.method, c.path, h.ro, c.body)
		if want := 403; c.method == "GET" {
			if st != 404 { // read scope suffices; no such AppVM
				t.Errorf("GET files with a read key: %d %s", st, b)
			}
		} else if st != want {
			t.Errorf("%s %s with a read key: %d %s", c.method, c.path, st, b)
		}
	}
	audit := h.auditLines(t)
	for _, route := range []string{"POST /api/appvm/vms/{id}/exec", "PUT /api/appvm/vms/{id}/files", "POST /api/appvm/vms/{id}/signal"} {
		n := 0
		for _, e := range audit {
			if e.Route == route && (e.Status == 401 || e.Status == 403) {
				n++
			}
		}
		if n != 3 {
			t.Errorf("%s: %d denied requests audited, want 3", route, n)
		}
	}
}

type auditLine struct {
	Route  string   `json:"route"`
	VMID   string   `json:"vm_id"`
	Status int      `json:"status"`
	Argv   []string `json:"argv"`
}

func (h *harness) auditLines(t *testing.T) []auditLine {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(h.e.StateDir, "audit.log"))
	if err != nil {
		t.Fatal(err)
	}
	var out []auditLine
	for _, l := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		var e auditLine
		if err := json.Unmarshal([]byte(l), &e); err != nil {
			t.Fatalf("audit line %q: %v", l, err)
		}
		out = append(out, e)
	}
	return out
}

// TestExecAudited: each exec's audit entry names its argv, with secret
// values redacted, and never its input or output.
func TestExecAudited(t *testing.T) {
	h := newHarness(t)
	h.createOps(t)
	h.exec(t, `{"command":["echo","visible-arg",`+strconv.Quote(plantedSecret)+`],"stdin":"input-not-logged"}`)
	b, _ := os.ReadFile(filepath.Join(h.e.StateDir, "audit.log"))
	if strings.Contains(string(b), "input-not-logged") || strings.Contains(string(b), "visible-arg\\n") {
		t.Errorf("the audit log holds an exec's input or output:\n%s", b)
	}
	found := false
	for _, e := range h.auditLines(t) {
		if e.Route == "POST /api/appvm/vms/{id}/exec" && e.Status == 200 && len(e.Argv) == 3 && e.Argv[1] == "visible-arg" {
			found = true
			if e.Argv[2] != "[redacted]" || e.VMID != "ops" {
				t.Errorf("audit entry %+v", e)
			}
		}
	}
	if !found {
		t.Errorf("no audit entry names the exec's argv:\n%s", b)
	}
}

// TestGuestOpsState: 409 INVALID_STATE saying what is missing: a stopped
// AppVM, a guest agent not connected, one too old, no workload running.
func TestGuestOpsState(t *testing.T) {
	h := newHarness(t)
	if st, _, b := h.do(t, "POST", "/api/appvm/vms", h.rw, `{"vm_id":"off","image_id":"plain","vcpus":1,"memory_mb":64,"disk_gib":1,"auto_boot":false}`); st != 201 {
		t.Fatalf("create: %d %s", st, b)
	}
	if st, _, b := h.do(t, "POST", "/api/appvm/vms", h.rw, `{"vm_id":"up","image_id":"plain","vcpus":1,"memory_mb":64,"disk_gib":1}`); st != 201 {
		t.Fatalf("create: %d %s", st, b)
	}
	for _, c := range []struct{ id, want string }{{"off", "is not running"}, {"up", "guest agent is not connected"}} {
		for _, r := range []struct{ method, path, body string }{
			{"POST", "/exec", `{"command":["true"]}`},
			{"GET", "/files?path=/etc", ""},
			{"PUT", "/files?path=/tmp", string(tarOf(t, tarEntry{name: "a", body: "x"}))},
			{"POST", "/signal", `{"signal":"HUP"}`},
		} {
			st, _, b := h.do(t, r.method, "/api/appvm/vms/"+c.id+r.path, h.rw, r.body)
			if st != 409 || !strings.Contains(b, "INVALID_STATE") || !strings.Contains(b, c.want) {
				t.Errorf("%s %s of %s: %d %s, want 409 saying %q", r.method, r.path, c.id, st, b, c.want)
			}
		}
	}
	// A guest agent of protocol version 2 (booted by an older vmhost).
	sock, err := os.MkdirTemp("", "gold")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(sock)
	l, err := net.Listen("unix", filepath.Join(sock, "v"))
	if err != nil {
		t.Fatal(err)
	}
	if err := h.guests.Adopt(context.Background(), h.e.Records.Get("up"), l); err != nil {
		t.Fatal(err)
	}
	defer h.guests.End("up")
	c, err := net.Dial("unix", filepath.Join(sock, "v"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if err := proto.NewConn(c).Send(&proto.Hello{V: 2, AgentVersion: "old", BootID: "b1", Resume: true}); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		st, _, b := h.do(t, "POST", "/api/appvm/vms/up/exec", h.rw, `{"command":["true"]}`)
		if st == 409 && strings.Contains(b, "protocol version 2") && strings.Contains(b, "stop and start the AppVM") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("a version 2 agent: %d %s", st, b)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestSignal: a name with or without SIG, any case, or a number reaches
// the workload; bad ones are 400 or 422; no workload is 409.
func TestSignal(t *testing.T) {
	h := newHarness(t)
	_, marker := h.createOps(t)
	// The guest takes an exec (createOps) once its root is set up, a
	// moment before the workload runs and sets its trap.
	waitFile(t, marker+".ready")
	for _, sig := range []string{`"SIGHUP"`, `"hup"`, `1`, `"1"`} {
		os.Remove(marker)
		if st, _, b := h.do(t, "POST", "/api/appvm/vms/ops/signal", h.rw, `{"signal":`+sig+`}`); st != 204 {
			t.Fatalf("signal %s: %d %s", sig, st, b)
		}
		waitFile(t, marker)
	}
	for _, c := range []struct {
		body   string
		status int
	}{
		{`{}`, 422}, {`{"signal":1.5}`, 422}, {`{"signal":true}`, 422}, {`{"signal":null}`, 422},
		{`{"signal":0}`, 400}, {`{"signal":65}`, 400}, {`{"signal":"NOPE"}`, 400}, {`{"signal":"RTMIN+31"}`, 400},
	} {
		if st, _, b := h.do(t, "POST", "/api/appvm/vms/ops/signal", h.rw, c.body); st != c.status {
			t.Errorf("%s: %d %s, want %d", c.body, st, b, c.status)
		}
	}
	// A keepalive AppVM's workload ends on SIGKILL; the AppVM keeps
	// running, and a signal now finds no workload.
	if st, _, b := h.do(t, "POST", "/api/appvm/vms", h.rw, `{"vm_id":"idle","image_id":"plain","vcpus":1,"memory_mb":64,"disk_gib":1,"keepalive":true}`); st != 201 {
		t.Fatalf("create: %d %s", st, b)
	}
	h.startGuest(t, "idle")
	if st, _, b := h.do(t, "POST", "/api/appvm/vms/idle/signal", h.rw, `{"signal":"KILL"}`); st != 204 {
		t.Fatalf("KILL: %d %s", st, b)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		st, _, b := h.do(t, "POST", "/api/appvm/vms/idle/signal", h.rw, `{"signal":"TERM"}`)
		if st == 409 && strings.Contains(b, "no workload runs") {
			break
		}
		if time.Now().After(deadline) || st != 204 {
			t.Fatalf("after the workload's end: %d %s", st, b)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func TestParseSignalNames(t *testing.T) {
	h := newHarness(t)
	for in, want := range map[string]int{"TERM": 15, "sigkill": 9, "SIGRTMIN": 34, "RTMIN+2": 36, "SIGRTMAX-1": 63, "RTMAX": 64, "64": 64, "WINCH": 28} {
		st, _, b := h.do(t, "POST", "/api/appvm/vms/nope/signal", h.rw, `{"signal":`+strconv.Quote(in)+`}`)
		// A valid name passes validation and meets the unknown id.
		if st != 404 {
			t.Errorf("signal %q (%d): %d %s", in, want, st, b)
		}
	}
}

func waitFile(t *testing.T, p string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		if _, err := os.Stat(p); err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s never appeared", p)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

type tarEntry struct {
	name, body, link string
	typ              byte
	mode             int64
}

func tarOf(t *testing.T, entries ...tarEntry) []byte {
	t.Helper()
	var b bytes.Buffer
	tw := tar.NewWriter(&b)
	for _, e := range entries {
		h := &tar.Header{Name: e.name, Typeflag: e.typ, Linkname: e.link, Mode: e.mode, Size: int64(len(e.body))}
		if h.Typeflag == 0 {
			h.Typeflag = tar.TypeReg
		}
		if h.Mode == 0 {
			h.Mode = 0o644
		}
		if h.Typeflag != tar.TypeReg {
			h.Size = 0
		}
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		if h.Typeflag == tar.TypeReg {
			io.WriteString(tw, e.body)
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	return b.Bytes()
}

// listTree lists what is under dir (names, kinds, sizes), for "nothing
// written" checks.
func listTree(t *testing.T, dir string) string {
	t.Helper()
	var b strings.Builder
	filepath.Walk(dir, func(p string, fi os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		fmt.Fprintf(&b, "%s %v %d\n", strings.TrimPrefix(p, dir), fi.Mode().Type(), fi.Size())
		return nil
	})
	return b.String()
}

// TestFilesPutSafety: every archive rule answers 400 and leaves the
// destination (and the host's spool) as it was; a good archive lands
// whole.
func TestFilesPutSafety(t *testing.T) {
	h := newHarness(t)
	ga, _ := h.createOps(t)
	h.e.Config.GuestFileMaxBytes = 64 << 10
	dest := filepath.Join(ga.root, "dest")
	if err := os.MkdirAll(dest, 0o755); err != nil {
		t.Fatal(err)
	}
	os.WriteFile(filepath.Join(dest, "kept"), []byte("old"), 0o644)
	before := listTree(t, ga.root)
	big := strings.Repeat("z", 40<<10)
	for _, c := range []struct {
		name    string
		entries []tarEntry
		want    string
	}{
		{"absolute name", []tarEntry{{name: "ok"}, {name: "/etc/evil", body: "x"}}, "absolute name"},
		{"dot dot", []tarEntry{{name: "ok"}, {name: "a/../../evil", body: "x"}}, ".. segment"},
		{"symlink out", []tarEntry{{name: "ok"}, {name: "l", typ: tar.TypeSymlink, link: "../../etc"}}, "leaves"},
		{"absolute symlink out", []tarEntry{{name: "l", typ: tar.TypeSymlink, link: "/etc/passwd"}}, "leaves"},
		{"below a symlink", []tarEntry{{name: "l", typ: tar.TypeSymlink, link: "sub"}, {name: "l/f", body: "x"}}, "below the link"},
		{"hard link out", []tarEntry{{name: "h", typ: tar.TypeLink, link: "../kept"}}, "hard link"},
		{"hard link to no member", []tarEntry{{name: "h", typ: tar.TypeLink, link: "kept"}}, "hard link"},
		{"char device", []tarEntry{{name: "ok"}, {name: "null", typ: tar.TypeChar}}, "device nodes"},
		{"block device", []tarEntry{{name: "sda", typ: tar.TypeBlock}}, "device nodes"},
		{"over the cap", []tarEntry{{name: "a", body: big}, {name: "b", body: big}}, "exceed"},
	} {
		body := tarOf(t, c.entries...)
		st, _, b := h.do(t, "PUT", "/api/appvm/vms/ops/files?path=/dest", h.rw, string(body))
		if st != 400 || !strings.Contains(b, c.want) {
			t.Errorf("%s: %d %s, want 400 saying %q", c.name, st, b, c.want)
		}
		if after := listTree(t, ga.root); after != before {
			t.Fatalf("%s: the guest's files changed:\n%s\nwant\n%s", c.name, after, before)
		}
	}
	for _, c := range []struct{ body, want string }{
		{"not a tar archive at all, but long enough to fill a header block" + strings.Repeat(".", 600), "not a valid tar archive"},
		{string(bytes.Repeat([]byte{0}, 70<<10)), "exceeds"}, // the archive's own bytes count
	} {
		if st, _, b := h.do(t, "PUT", "/api/appvm/vms/ops/files?path=/dest", h.rw, c.body); st != 400 || !strings.Contains(b, c.want) {
			t.Errorf("body %.20q: %d %s", c.body, st, b)
		}
	}
	for _, c := range []struct {
		path   string
		status int
	}{{"", 400}, {"dest", 400}, {"/dest/../etc", 400}, {"/no/such/dir", 404}, {"/dest/kept", 400}} {
		if st, _, b := h.do(t, "PUT", "/api/appvm/vms/ops/files?path="+c.path, h.rw, string(tarOf(t, tarEntry{name: "a", body: "x"}))); st != c.status {
			t.Errorf("path %q: %d %s, want %d", c.path, st, b, c.status)
		}
	}
	if after := listTree(t, ga.root); after != before {
		t.Fatalf("the guest's files changed:\n%s\nwant\n%s", after, before)
	}
	if ents, _ := os.ReadDir(filepath.Join(h.e.StateDir, "spool")); len(ents) != 0 {
		t.Errorf("spool holds %d files", len(ents))
	}
	good := tarOf(t, tarEntry{name: "dir/", typ: tar.TypeDir, mode: 0o755}, tarEntry{name: "dir/f.txt", body: "hello\n"},
		tarEntry{name: "dir/link", typ: tar.TypeSymlink, link: "f.txt"}, tarEntry{name: "dir/hard", typ: tar.TypeLink, link: "dir/f.txt"})
	if st, _, b := h.do(t, "PUT", "/api/appvm/vms/ops/files?path=/dest", h.rw, string(good)); st != 204 {
		t.Fatalf("good archive: %d %s", st, b)
	}
	if b, err := os.ReadFile(filepath.Join(dest, "dir/link")); err != nil || string(b) != "hello\n" {
		t.Errorf("dir/link reads %q, %v", b, err)
	}
	// What went in comes back out: GET answers the same members.
	st, hdr, body := h.do(t, "GET", "/api/appvm/vms/ops/files?path=/dest/dir", h.ro, "")
	if st != 200 || hdr.Get("Content-Type") != "application/x-tar" {
		t.Fatalf("GET: %d %s", st, hdr)
	}
	got := map[string]string{}
	tr := tar.NewReader(strings.NewReader(body))
	for {
		th, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		c, _ := io.ReadAll(tr)
		got[th.Name] = string(th.Typeflag) + ":" + th.Linkname + ":" + string(c)
	}
	if got["dir/f.txt"] != "0::hello\n" || got["dir/link"] != "2:f.txt:" || len(got) != 4 {
		t.Errorf("archive out: %q", got)
	}
}

// TestFilesGet: 404 for a missing path, 400 for a secret file's, and an
// archive of a directory leaves secret files out.
func TestFilesGet(t *testing.T) {
	h := newHarness(t)
	ga, _ := h.createOps(t)
	os.WriteFile(filepath.Join(ga.root, "run/secrets/plain"), []byte("not secret"), 0o644)
	for _, c := range []struct {
		path   string
		status int
		want   string
	}{
		{"/nope", 404, "does not exist"},
		{"/run/secrets/key", 400, "secret file"},
		{"", 400, "path:"},
		{"run", 400, "path:"},
		{"/run/../etc", 400, "path:"},
	} {
		st, _, b := h.do(t, "GET", "/api/appvm/vms/ops/files?path="+c.path, h.ro, "")
		if st != c.status || !strings.Contains(b, c.want) {
			t.Errorf("GET %q: %d %s, want %d %q", c.path, st, b, c.status, c.want)
		}
	}
	st, _, body := h.do(t, "GET", "/api/appvm/vms/ops/files?path=/run/secrets", h.ro, "")
	if st != 200 {
		t.Fatalf("GET /run/secrets: %d %s", st, body)
	}
	var names []string
	tr := tar.NewReader(strings.NewReader(body))
	for {
		th, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		names = append(names, th.Name)
	}
	if strings.Join(names, ",") != "secrets/,secrets/plain" {
		t.Errorf("members %q, want the directory and the plain file only", names)
	}
}

// execClient is the client end of an interactive exec over a real HTTP
// connection.
type execClient struct {
	c  net.Conn
	br *bufio.Reader
}

// dialExec sends an interactive exec request and reads the answer's
// status line; a 101 leaves the frames to the caller.
func dialExec(t *testing.T, srv *httptest.Server, token, body string) (*execClient, int, string) {
	t.Helper()
	c, err := net.Dial("tcp", srv.Listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	fmt.Fprintf(c, "POST /api/appvm/vms/ops/exec HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\nConnection: Upgrade\r\nUpgrade: vmhost-exec\r\n"+
		"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", token, len(body), body)
	br := bufio.NewReader(c)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != 101 {
		b, _ := io.ReadAll(resp.Body)
		return nil, resp.StatusCode, string(b)
	}
	if resp.Header.Get("Upgrade") != "vmhost-exec" || !strings.EqualFold(resp.Header.Get("Connection"), "upgrade") {
		t.Errorf("101 headers: %v", resp.Header)
	}
	return &execClient{c: c, br: br}, 101, ""
}

func (x *execClient) send(t *testing.T, typ byte, payload string) {
	t.Helper()
	hdr := make([]byte, 8)
	hdr[0] = typ
	binary.BigEndian.PutUint32(hdr[4:], uint32(len(payload)))
	if _, err := x.c.Write(append(hdr, payload...)); err != nil {
		t.Fatal(err)
	}
}

// read reads frames until the exit frame or the end of the connection;
// it returns the output of each stream and the exit frame's payload ("" when
// none came).
func (x *execClient) read(t *testing.T) (stdout, stderr, exit string) {
	t.Helper()
	x.c.SetReadDeadline(time.Now().Add(30 * time.Second))
	var out, errs bytes.Buffer
	for {
		var hdr [8]byte
		if _, err := io.ReadFull(x.br, hdr[:]); err != nil {
			return out.String(), errs.String(), ""
		}
		if hdr[1]|hdr[2]|hdr[3] != 0 {
			t.Fatalf("frame header %x", hdr)
		}
		p := make([]byte, binary.BigEndian.Uint32(hdr[4:]))
		if _, err := io.ReadFull(x.br, p); err != nil {
			t.Fatalf("cut frame: %v", err)
		}
		switch hdr[0] {
		case 1:
			out.Write(p)
		case 2:
			errs.Write(p)
		case 4:
			// The exit frame is the last: the connection ends after it.
			if _, err := x.br.ReadByte(); err != io.EOF {
				t.Errorf("after the exit frame: %v", err)
			}
			return out.String(), errs.String(), string(p)
		default:
			t.Fatalf("frame type %d from the agent", hdr[0])
		}
	}
}

// readUntil reads stdout frames until their text holds want.
func (x *execClient) readUntil(t *testing.T, want string) string {
	t.Helper()
	x.c.SetReadDeadline(time.Now().Add(30 * time.Second))
	var out bytes.Buffer
	for !strings.Contains(out.String(), want) {
		var hdr [8]byte
		if _, err := io.ReadFull(x.br, hdr[:]); err != nil {
			t.Fatalf("waiting for %q: %v; got %q", want, err, out.String())
		}
		p := make([]byte, binary.BigEndian.Uint32(hdr[4:]))
		if _, err := io.ReadFull(x.br, p); err != nil {
			t.Fatal(err)
		}
		if hdr[0] != 1 {
			t.Fatalf("frame type %d while waiting for %q", hdr[0], want)
		}
		out.Write(p)
	}
	return out.String()
}

// TestExecInteractive: a terminal session and a piped one over the
// upgraded connection: input, resize, both streams, the exit frame.
func TestExecInteractive(t *testing.T) {
	h := newHarness(t)
	h.createOps(t)
	srv := httptest.NewServer(h.srv)
	defer srv.Close()

	x, st, b := dialExec(t, srv, h.rw, `{"command":["sh"],"tty":true,"cols":100,"rows":30}`)
	if st != 101 {
		t.Fatalf("tty exec: %d %s", st, b)
	}
	x.send(t, 0, "stty size\n")
	first := x.readUntil(t, "30 100")
	x.send(t, 3, `{"cols":132,"rows":50}`)
	x.send(t, 0, "stty size; echo $TOKEN; exit 7\n")
	out, _, exit := x.read(t)
	if exit != `{"exit_code":7}` {
		t.Errorf("exit frame %q; output %q", exit, first+out)
	}
	if !strings.Contains(out, "50 132") || !strings.Contains(out, "[redacted]") || strings.Contains(first+out, plantedSecret) {
		t.Errorf("terminal output %q", first+out)
	}

	x, st, b = dialExec(t, srv, h.rw, `{"command":["sh","-c","cat; echo to-err >&2; exit 2"],"interactive":true}`)
	if st != 101 {
		t.Fatalf("piped exec: %d %s", st, b)
	}
	x.send(t, 0, "line one\n")
	// Above one frame's payload on the way back.
	x.send(t, 0, strings.Repeat("y", 40000))
	x.send(t, 0, strings.Repeat("y", 30000))
	x.send(t, 5, "")
	out, errOut, exit := x.read(t)
	if exit != `{"exit_code":2}` || out != "line one\n"+strings.Repeat("y", 70000) || errOut != "to-err\n" {
		t.Errorf("piped: exit %q, stdout %d bytes, stderr %q", exit, len(out), errOut)
	}

	// Refusals come before the upgrade, as ordinary answers.
	if _, st, b := dialExec(t, srv, h.rw, `{"command":["no-such-program-here"],"tty":true}`); st != 400 || !strings.Contains(b, "no-such-program-here") {
		t.Errorf("refused start: %d %s", st, b)
	}
	if _, st, _ := dialExec(t, srv, h.ro, `{"command":["sh"],"tty":true}`); st != 403 {
		t.Errorf("read key: %d", st)
	}
	found := false
	for _, e := range h.auditLines(t) {
		if e.Route == "POST /api/appvm/vms/{id}/exec" && e.Status == 101 && len(e.Argv) == 1 && e.Argv[0] == "sh" {
			found = true
		}
	}
	if !found {
		t.Error("no audit entry with status 101 for the terminal session")
	}
}

// pidGone waits until process pid has ended (and was reaped).
func pidGone(t *testing.T, pid int, what string) {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for syscall.Kill(pid, 0) == nil {
		if time.Now().After(deadline) {
			t.Fatalf("%s: process %d still runs", what, pid)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func readPID(t *testing.T, path string) int {
	t.Helper()
	waitFile(t, path)
	deadline := time.Now().Add(10 * time.Second)
	for {
		b, _ := os.ReadFile(path)
		if pid, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil && strings.HasSuffix(string(b), "\n") {
			return pid
		}
		if time.Now().After(deadline) {
			t.Fatalf("no pid in %s", path)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// openFDs counts this process's open file descriptors.
func openFDs(t *testing.T) int {
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(ents)
}

// settled waits for the goroutines and descriptors of the process to come
// back to at most the counts given, and fails naming what stayed.
func settled(t *testing.T, goroutines, fds int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for runtime.NumGoroutine() > goroutines || openFDs(t) > fds {
		if time.Now().After(deadline) {
			buf := make([]byte, 1<<20)
			t.Fatalf("leak: %d goroutines (was %d), %d fds (was %d)\n%s", runtime.NumGoroutine(), goroutines, openFDs(t), fds, buf[:runtime.Stack(buf, true)])
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestExecClientVanishes: a client that goes away mid-stream (or breaks
// the framing) gets its process (and its children) killed, and leaves no
// goroutine or descriptor of the agent's behind.
func TestExecClientVanishes(t *testing.T) {
	h := newHarness(t)
	h.createOps(t)
	srv := httptest.NewServer(h.srv)
	defer srv.Close()
	dir := t.TempDir()
	// Warm up: the first request starts the server's and the client's
	// long-lived goroutines.
	h.exec(t, `{"command":["true"]}`)
	http.DefaultClient.CloseIdleConnections()
	goroutines, fds := runtime.NumGoroutine(), openFDs(t)

	for i, end := range []struct {
		name string
		do   func(x *execClient)
	}{
		{"connection closed", func(x *execClient) { x.c.Close() }},
		{"malformed frame", func(x *execClient) { x.c.Write([]byte{0, 1, 0, 0, 0, 0, 0, 0}) }},
		{"frame type the client may not send", func(x *execClient) { x.c.Write([]byte{4, 0, 0, 0, 0, 0, 0, 2, '{', '}'}) }},
		{"frame too large", func(x *execClient) { x.c.Write([]byte{0, 0, 0, 0, 0x7f, 0, 0, 0}) }},
		{"bad resize", func(x *execClient) { x.c.Write([]byte{3, 0, 0, 0, 0, 0, 0, 1, '['}) }},
	} {
		pidFile := filepath.Join(dir, strconv.Itoa(i))
		x, st, b := dialExec(t, srv, h.rw, `{"command":["sh","-c","sleep 1000 & echo $! > `+pidFile+`; wait"],"interactive":true}`)
		if st != 101 {
			t.Fatalf("%s: %d %s", end.name, st, b)
		}
		child := readPID(t, pidFile)
		end.do(x)
		if end.name != "connection closed" {
			// No exit frame: the connection ends.
			if _, _, exit := x.read(t); exit != "" {
				t.Errorf("%s: exit frame %q", end.name, exit)
			}
			x.c.Close()
		}
		pidGone(t, child, end.name)
	}

	// A one-shot exec whose client cancels.
	pidFile := filepath.Join(dir, "oneshot")
	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, "POST", srv.URL+"/api/appvm/vms/ops/exec",
		strings.NewReader(`{"command":["sh","-c","sleep 1000 & echo $! > `+pidFile+`; wait"],"timeout_secs":600}`))
	req.Header.Set("Authorization", "Bearer "+h.rw)
	errc := make(chan error, 1)
	go func() {
		resp, err := http.DefaultClient.Do(req)
		if err == nil {
			resp.Body.Close()
		}
		errc <- err
	}()
	child := readPID(t, pidFile)
	cancel()
	if err := <-errc; !errors.Is(err, context.Canceled) {
		t.Errorf("one-shot: %v", err)
	}
	pidGone(t, child, "one-shot client gone")
	http.DefaultClient.CloseIdleConnections()
	srv.CloseClientConnections()
	settled(t, goroutines, fds)
}

// TestExecFrameFromClientRightBehindRequest: frames the client sends
// right behind its request (before it read the 101) are not lost.
func TestExecFrameFromClientRightBehindRequest(t *testing.T) {
	h := newHarness(t)
	h.createOps(t)
	srv := httptest.NewServer(h.srv)
	defer srv.Close()
	c, err := net.Dial("tcp", srv.Listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	body := `{"command":["cat"],"interactive":true}`
	frames := []byte{0, 0, 0, 0, 0, 0, 0, 3, 'a', 'b', '\n', 5, 0, 0, 0, 0, 0, 0, 0}
	fmt.Fprintf(c, "POST /api/appvm/vms/ops/exec HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\nConnection: Upgrade\r\nUpgrade: vmhost-exec\r\nContent-Length: %d\r\n\r\n%s%s",
		h.rw, len(body), body, frames)
	br := bufio.NewReader(c)
	resp, err := http.ReadResponse(br, nil)
	if err != nil || resp.StatusCode != 101 {
		t.Fatalf("%v %v", resp, err)
	}
	out, _, exit := (&execClient{c: c, br: br}).read(t)
	if out != "ab\n" || exit != `{"exit_code":0}` {
		t.Errorf("out %q exit %q", out, exit)
	}
}

// TestExecEndsAtShutdown: the agent's shutdown (CloseStreams) ends an
// interactive exec: its process is killed and the connection closes.
func TestExecEndsAtShutdown(t *testing.T) {
	h := newHarness(t)
	h.createOps(t)
	srv := httptest.NewServer(h.srv)
	defer srv.Close()
	pidFile := filepath.Join(t.TempDir(), "pid")
	x, st, b := dialExec(t, srv, h.rw, `{"command":["sh","-c","sleep 1000 & echo $! > `+pidFile+`; wait"],"interactive":true}`)
	if st != 101 {
		t.Fatalf("%d %s", st, b)
	}
	child := readPID(t, pidFile)
	h.srv.CloseStreams()
	if _, _, exit := x.read(t); exit != "" {
		t.Errorf("exit frame %q after the shutdown", exit)
	}
	pidGone(t, child, "shutdown")
}

// TestSpoolCap: a body announced above the cap is refused before it is
// read. (An archive an agent killed mid-put left spooled goes with the
// startup sweep: e2e TestStartupSweepsTemps.)
func TestSpoolCap(t *testing.T) {
	h := newHarness(t)
	if st, _, b := h.do(t, "POST", "/api/appvm/vms", h.rw, `{"vm_id":"off","image_id":"plain","vcpus":1,"memory_mb":64,"disk_gib":1,"auto_boot":false}`); st != 201 {
		t.Fatalf("create: %d %s", st, b)
	}
	h.e.Config.GuestFileMaxBytes = 1000
	req := httptest.NewRequest("PUT", "/api/appvm/vms/off/files?path=/tmp", &spyBody{r: strings.NewReader(strings.Repeat("x", 1001))})
	req.ContentLength = 1001
	req.Header.Set("Authorization", "Bearer "+h.rw)
	w := httptest.NewRecorder()
	h.srv.ServeHTTP(w, req)
	if w.Code != 400 || !strings.Contains(w.Body.String(), "exceeds 1000 bytes") || req.Body.(*spyBody).read {
		t.Errorf("an announced body over the cap: %d %s (read %v)", w.Code, w.Body, req.Body.(*spyBody).read)
	}
}
