//go:build linux

package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"vmhost/agentid"
	"vmhost/api"
	"vmhost/auth"
	"vmhost/config"
	"vmhost/disk"
	"vmhost/internal/netnstest"
	"vmhost/openapi"
	"vmhost/qcow2"
	"vmhost/tap"
)

// vmhostBin is the binary TestMain builds, with buildFlags. simBin runs
// the simulators: vmhostBin, except under -race, where the agent is built
// with the race detector and the simulators are not (a race-built chsim
// exits too slowly for the monitor's socket checks).
var (
	vmhostBin  string
	simBin     string
	buildFlags []string
	raceBuild  bool
)

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "vmhost-e2e-bin")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	vmhostBin = filepath.Join(dir, "vmhost")
	simBin = vmhostBin
	builds := [][]string{append(append([]string{"build"}, buildFlags...), "-o", vmhostBin, "vmhost")}
	if raceBuild {
		simBin = filepath.Join(dir, "vmhost-sim")
		builds = append(builds, []string{"build", "-o", simBin, "vmhost"})
		// A race-built program sleeps a second before it exits (the race
		// detector's atexit_sleep_ms), and the agent's start waits for
		// one (the jail's self-check): a second per agent start, stop
		// and CLI command, half the package's time. The agents report
		// races as they happen; checkRaces reads them.
		if _, set := os.LookupEnv("GORACE"); !set {
			os.Setenv("GORACE", "atexit_sleep_ms=0")
		}
	}
	for _, args := range builds {
		build := exec.Command("go", args...)
		build.Stdout, build.Stderr = os.Stderr, os.Stderr
		if err := build.Run(); err != nil {
			fmt.Fprintln(os.Stderr, "building vmhost:", err)
			os.RemoveAll(dir)
			os.Exit(1)
		}
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// syncBuffer is a bytes.Buffer a test may read while the process writes.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}

// serverOpts configure one vmhost serve process.
type serverOpts struct {
	// netns runs the server in a network namespace of its own (needs root)
	// and creates the bridge of the default network there.
	netns bool
	// noBridge leaves the default network's bridge out (netns only).
	noBridge bool
	// shareNetNS runs the server in that server's network namespace
	// (which has the bridge): two agents on one host.
	shareNetNS *server
	// simulate is --simulate; empty means "ch,qsd".
	simulate string
	// simCHArgs is --sim-ch-args: more flags for the CH simulator.
	simCHArgs string
	// uid, when not 0, runs the server as that uid and gid (a test as
	// root running an agent that is not), owning its directory.
	uid int
	// confine sets jail.enabled true: with the process-mode simulator (the
	// harness's default), the agent confines classic VMs but not AppVMs
	// unless told to.
	confine bool
	// edit changes the config before it is written.
	edit func(*config.Config)
}

// server is one running `vmhost serve`.
type server struct {
	t        testing.TB
	dir      string // short temp dir: state, run, config, api socket
	stateDir string
	runDir   string
	sock     string
	token    string
	cmd      *exec.Cmd
	exited   chan struct{} // closed once cmd has been waited for
	stderr   *syncBuffer   // the agent's output; read while it runs
	hc       *http.Client
	nsFD     int         // the server's network namespace, when netns
	taps     *tap.Handle // works in the server's namespace, as the agent (its agent id)
	bridge   string
	agentID  string // <state>/agent_id
}

// shortTemp is where servers and benchmarks make their directories:
// $VMHOST_E2E_TMP, or /tmp. Unix socket paths are limited to 107 bytes,
// so it must be short; the variable lets a benchmark run on another file
// system (or another part of one) than the busy /tmp.
func shortTemp() string {
	if d := os.Getenv("VMHOST_E2E_TMP"); d != "" {
		return d
	}
	return "/tmp"
}

// startServer writes a config and a readwrite key, starts vmhost serve
// and waits until it answers.
func startServer(t testing.TB, o serverOpts) *server {
	t.Helper()
	if o.netns || o.shareNetNS != nil {
		netnstest.RequireRoot(t)
	}
	dir, err := os.MkdirTemp(shortTemp(), "vhe")
	if err != nil {
		t.Fatal(err)
	}
	s := &server{t: t, dir: dir, stateDir: dir + "/state", runDir: dir + "/run", sock: dir + "/api.sock", stderr: new(syncBuffer)}
	cfg := config.Default()
	cfg.BootTimeoutSecs = 30
	cfg.HostPathRoots = []string{os.TempDir()} // the fixtures' kernels and base images
	cfg.Networks = []config.Network{{ID: "default", Bridge: "vhe0", SpoofGuard: true, Isolated: true}}
	s.bridge = "vhe0"
	sim := o.simulate
	if sim == "" {
		sim = "ch,qsd"
	}
	if o.confine {
		cfg.Jail.Enabled = new(true)
	}
	if o.edit != nil {
		o.edit(cfg)
	}
	data, err := cfg.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(dir+"/config.json", data, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(s.stateDir, 0o700); err != nil {
		t.Fatal(err)
	}
	if s.token, err = auth.Add(s.stateDir+"/keys.json", "e2e", auth.ScopeReadWrite, nil); err != nil {
		t.Fatal(err)
	}
	// Under -race the agent runs with the race detector and the
	// simulators without (--simulator).
	s.cmd = exec.Command(vmhostBin, "serve", "--listen", "unix:"+s.sock, "--state-dir", s.stateDir,
		"--run-dir", s.runDir, "--config", dir+"/config.json", "--simulate", sim, "--simulator", simBin, "--sim-ch-args", o.simCHArgs)
	s.cmd.Stderr = s.stderr
	s.cmd.Stdout = s.stderr
	s.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if o.netns {
		s.cmd.SysProcAttr.Cloneflags = syscall.CLONE_NEWNET
	}
	if o.uid != 0 {
		err := filepath.Walk(dir, func(p string, _ os.FileInfo, err error) error {
			if err != nil {
				return err
			}
			return os.Lchown(p, o.uid, o.uid)
		})
		if err != nil {
			t.Fatal(err)
		}
		s.cmd.SysProcAttr.Credential = &syscall.Credential{Uid: uint32(o.uid), Gid: uint32(o.uid)}
	}
	if peer := o.shareNetNS; peer != nil {
		// A process starts in the namespace of the thread that forks it.
		if s.nsFD, err = syscall.Dup(peer.nsFD); err == nil {
			syscall.CloseOnExec(s.nsFD)
			err = netnstest.RunIn(s.nsFD, s.cmd.Start)
		}
	} else {
		err = s.cmd.Start()
	}
	if err != nil {
		t.Fatal(err)
	}
	s.waitExit()
	t.Cleanup(s.stop)
	if o.netns {
		fd, err := syscall.Open(fmt.Sprintf("/proc/%d/ns/net", s.cmd.Process.Pid), syscall.O_RDONLY|syscall.O_CLOEXEC, 0)
		if err != nil {
			t.Fatal(err)
		}
		s.nsFD = fd
		if !o.noBridge {
			if err := tap.New(&tap.Config{NetNS: fd}).CreateBridge(context.Background(), s.bridge); err != nil {
				t.Fatalf("creating bridge in the server's namespace: %v", err)
			}
		}
	}
	s.hc = &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", s.sock)
	}}, Timeout: 30 * time.Second}
	deadline := time.Now().Add(20 * time.Second)
	for {
		if st, _ := s.do("GET", "/api/vms", ""); st == http.StatusOK {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("vmhost serve did not answer within 20s; output:\n%s", s.stderr)
		}
		time.Sleep(20 * time.Millisecond)
	}
	if s.agentID, err = agentid.Load(s.stateDir); err != nil {
		t.Fatalf("the agent's id: %v", err)
	}
	if s.nsFD > 0 {
		s.taps = tap.New(&tap.Config{NetNS: s.nsFD, AgentID: s.agentID})
	}
	return s
}

// stop ends the server (SIGTERM), then every process it left (VMs outlive
// the agent by design), and removes the temp dir.
// waitExit waits for s.cmd, just started, in the background: s.exited
// closes when it has ended.
func (s *server) waitExit() {
	cmd, exited := s.cmd, make(chan struct{})
	s.exited = exited
	go func() { cmd.Wait(); close(exited) }()
}

func (s *server) stop() {
	if s.cmd.Process != nil {
		s.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-s.exited:
		case <-time.After(10 * time.Second):
			s.cmd.Process.Kill()
			<-s.exited
		}
		s.checkRaces()
	}
	for _, pid := range s.children() {
		syscall.Kill(pid, syscall.SIGKILL)
	}
	s.removeCgroups()
	if s.nsFD > 0 {
		syscall.Close(s.nsFD)
	}
	if s.t.Failed() {
		s.t.Logf("vmhost serve output:\n%s", s.stderr)
		logs, _ := filepath.Glob(s.runDir + "/vms/*/*.log*")
		for _, l := range logs {
			if b, err := os.ReadFile(l); err == nil && len(b) > 0 {
				if len(b) > 4000 {
					b = b[len(b)-4000:]
				}
				s.t.Logf("%s:\n%s", l, b)
			}
		}
	}
	disk.RemoveAll(s.dir) // the catalog's builds are sealed (immutable, as root)
}

// checkRaces fails the test when the agent, built with the race detector
// under -race, reported a data race in its output.
func (s *server) checkRaces() {
	if out := s.stderr.String(); strings.Contains(out, "WARNING: DATA RACE") {
		s.t.Errorf("the agent reported a data race:\n%s", out)
	}
}

// children lists the pids of processes whose command line names this
// server's run directory: the CH and QSD processes of its VMs.
func (s *server) children() []int {
	var pids []int
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		var pid int
		if _, err := fmt.Sscanf(e.Name(), "%d", &pid); err != nil || pid == os.Getpid() {
			continue
		}
		cmd, err := os.ReadFile("/proc/" + e.Name() + "/cmdline")
		if err != nil || !bytes.Contains(cmd, []byte(s.runDir+"/")) {
			continue
		}
		if st, err := os.ReadFile("/proc/" + e.Name() + "/stat"); err == nil {
			if f := strings.Fields(string(st[bytes.LastIndexByte(st, ')')+1:])); len(f) > 0 && f[0] == "Z" {
				continue // exited, awaiting its parent's wait
			}
		}
		pids = append(pids, pid)
	}
	return pids
}

// do sends one request and returns the status and body.
func (s *server) do(method, path, body string) (int, []byte) {
	var r io.Reader
	if body != "" {
		r = strings.NewReader(body)
	}
	req, err := http.NewRequest(method, "http://vmhost"+path, r)
	if err != nil {
		s.t.Fatal(err)
	}
	req.Header.Set("Authorization", "Bearer "+s.token)
	resp, err := s.hc.Do(req)
	if err != nil {
		return 0, []byte(err.Error())
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	validateResponse(s.t, method, req.URL.Path, resp, b)
	return resp.StatusCode, b
}

// validateResponse checks an answer of the real agent against the OpenAPI
// document (api.OpenAPI): the route's status, content type and every field
// of a JSON body. A request that matches no documented route is left
// alone (the API's own tests check those answers).
func validateResponse(t testing.TB, method, path string, resp *http.Response, body []byte) {
	t.Helper()
	docOnce.Do(func() {
		data, err := api.OpenAPI()
		if err == nil {
			doc, err = openapi.Parse(data)
		}
		if err != nil {
			panic(err)
		}
	})
	pattern, ok := doc.Match(method, path)
	if !ok {
		return
	}
	if err := doc.ValidateResponse(pattern, resp.StatusCode, resp.Header.Get("Content-Type"), body); err != nil {
		t.Errorf("OpenAPI: %v\nbody: %.2000s", err, body)
	}
}

var (
	docOnce sync.Once
	doc     *openapi.Doc
)

// view is the part of a VM view the tests read.
type view struct {
	ID                string `json:"id"`
	State             string `json:"state"`
	DisplayState      string `json:"display_state"`
	DiskPath          string `json:"disk_path"`
	ConsoleSocketPath string `json:"console_socket_path"`
	PID               int    `json:"pid"`
	ShuttingDown      bool   `json:"shutting_down"`
	FailureReason     *struct {
		Summary string `json:"summary"`
		Cause   string `json:"cause"`
		Detail  struct {
			Kind    string `json:"kind"`
			Code    *int   `json:"code"`
			Seconds *int   `json:"seconds"`
		} `json:"detail"`
	} `json:"failure_reason"`
	Nets []struct {
		TapName string `json:"tap_name"`
		Bridge  string `json:"bridge"`
	} `json:"nets"`
	Disk *struct {
		VirtualSizeBytes uint64 `json:"virtual_size_bytes"`
		QSDPid           int    `json:"qsd_pid"`
	} `json:"disk"`
}

// create posts body and checks the status.
func (s *server) create(body string, want int) view {
	s.t.Helper()
	st, b := s.do("POST", "/api/vms", body)
	if st != want {
		s.t.Fatalf("POST /api/vms = %d %s, want %d", st, b, want)
	}
	var v view
	if err := json.Unmarshal(b, &v); err != nil {
		s.t.Fatalf("decoding view %s: %v", b, err)
	}
	return v
}

// get reads the view of id; ok is false on 404.
func (s *server) get(id string) (view, bool) {
	s.t.Helper()
	st, b := s.do("GET", "/api/vms/"+id, "")
	if st == http.StatusNotFound {
		return view{}, false
	}
	if st != http.StatusOK {
		s.t.Fatalf("GET /api/vms/%s = %d %s", id, st, b)
	}
	var v view
	if err := json.Unmarshal(b, &v); err != nil {
		s.t.Fatal(err)
	}
	return v, true
}

// waitFor polls the view of id until cond holds or 10 s pass.
func (s *server) waitFor(id, what string, cond func(view) bool) view {
	s.t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		v, ok := s.get(id)
		if ok && cond(v) {
			return v
		}
		if time.Now().After(deadline) {
			s.t.Fatalf("VM %s: %s did not happen within 10s; last view %+v", id, what, v)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// waitDisplay waits for a state and display state.
func (s *server) waitDisplay(id, state, display string) view {
	s.t.Helper()
	return s.waitFor(id, state+"/"+display, func(v view) bool { return v.State == state && v.DisplayState == display })
}

// act posts a lifecycle action and returns the status.
func (s *server) act(id, action string) int {
	st, _ := s.do("POST", "/api/vms/"+id+"/"+action, "")
	return st
}

// sim sends a /sim/v1/ control request to the VM's chsim.
func (s *server) sim(id, action, body string) {
	s.t.Helper()
	c := &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", s.runDir+"/vms/"+id+"/ch.sock")
	}}}
	req, _ := http.NewRequest("PUT", "http://localhost/sim/v1/"+action, strings.NewReader(body))
	resp, err := c.Do(req)
	if err != nil {
		s.t.Fatalf("chsim %s: %v", action, err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusNoContent {
		s.t.Fatalf("chsim %s = %d %s", action, resp.StatusCode, b)
	}
}

// fixture is a kernel file and a qcow2 base image.
type fixture struct {
	kernel, base string
}

func newFixture(t testing.TB) fixture {
	t.Helper()
	dir := t.TempDir()
	f := fixture{kernel: dir + "/vmlinux", base: dir + "/base.qcow2"}
	if err := os.WriteFile(f.kernel, []byte("not really a kernel"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := qcow2.Create(f.base, 1<<30); err != nil {
		t.Fatal(err)
	}
	return f
}

// body is a create request for a VM of id without interfaces.
func (f fixture) body(id string, autoBoot bool, extra string) string {
	return fmt.Sprintf(`{"vm_id":%q,"vcpus":1,"memory_mb":128,"kernel_path":%q,"disk":{"base_path":%q,"size_gib":2},"volumes":[{"size_gib":1}],"auto_boot":%t%s}`,
		id, f.kernel, f.base, autoBoot, extra)
}

// exists reports whether path exists.
func exists(path string) bool {
	_, err := os.Lstat(path)
	return err == nil
}
