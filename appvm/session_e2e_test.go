package appvm_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"vmhost/api"
	"vmhost/appvm"
	"vmhost/auth"
	"vmhost/chclient/chsim"
	"vmhost/config"
	"vmhost/events"
	"vmhost/qcow2"
	"vmhost/store"
	"vmhost/tap"
	"vmhost/vm"
	"vmhost/vm/engine"
	"vmhost/vm/records"
)

// lockedLog collects the agent's log lines.
type lockedLog struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedLog) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedLog) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// host is a whole vmhost over the real engine: CH and QSD are this test
// binary running chsim and qsdsim, chsim runs the real guest agent (this
// binary again), the API is served over HTTP with a real key.
type host struct {
	t      *testing.T
	vms    *vm.Service
	recs   *records.Registry
	guests *appvm.Guests
	apps   *appvm.Service
	srv    *httptest.Server
	token  string
	state  string
	run    string
	logs   *lockedLog
	images appvm.Catalog
	events *events.Log
}

// output is the workload output of AppVM id its log keeps (the last
// appvm.MaxLogTail chunks), both streams, as read through Service.Logs.
func (h *host) output(id string) []byte {
	h.t.Helper()
	var buf bytes.Buffer
	if err := h.apps.Logs(context.Background(), id, appvm.LogQuery{Tail: appvm.MaxLogTail}, &buf, func() {}); err != nil {
		h.t.Fatalf("reading the workload log: %v", err)
	}
	var out []byte
	dec := json.NewDecoder(&buf)
	for dec.More() {
		var c appvm.LogChunk
		if err := dec.Decode(&c); err != nil {
			h.t.Fatal(err)
		}
		out = append(out, c.Data...)
	}
	return out
}

func newHost(t *testing.T) *host {
	t.Helper()
	inPrivateNetns(t)
	if _, err := os.Stat("/dev/net/tun"); err != nil {
		t.Skip("no /dev/net/tun")
	}
	root, err := os.MkdirTemp("", "apv")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(root) })
	h := &host{t: t, state: filepath.Join(root, "s"), run: filepath.Join(root, "r"), logs: new(lockedLog)}
	kernel := filepath.Join(root, "vmlinuz")
	if err := os.WriteFile(kernel, []byte("kernel"), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg := config.Default()
	cfg.AppVMKernel = kernel
	cfg.PingIntervalSecs, cfg.PingTimeoutSecs = 1, 2
	taps := tap.New(&tap.Config{})
	if err := taps.CreateBridge(context.Background(), cfg.Networks[0].Bridge); err != nil {
		t.Fatal(err)
	}
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	logger := slog.New(slog.NewTextHandler(h.logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	st, err := store.Open(filepath.Join(h.state, "vms"))
	if err != nil {
		t.Fatal(err)
	}
	h.events, err = events.Open(filepath.Join(h.state, "events"), events.Options{})
	if err != nil {
		t.Fatal(err)
	}
	recs, err := records.Open(st, records.Options{Logger: logger})
	if err != nil {
		t.Fatal(err)
	}
	recs.Watch(records.Publish(h.events))
	h.recs = recs
	h.guests = appvm.NewGuests(appvm.GuestOptions{Records: recs, Config: cfg, Layout: vm.Layout{StateDir: h.state, RunDir: h.run},
		HeartbeatSecs: 1, StaleAfter: 2, Logger: logger, Events: h.events})
	eng, err := engine.New(engine.Options{Config: cfg, Records: recs, Guest: h.guests, StateDir: h.state, RunDir: h.run, Taps: taps, Logger: logger, StopGrace: 2 * time.Second,
		CH:  engine.Program{Binary: self, PreArgs: []string{"sim-ch", "--sim-guest-heartbeat", "200ms"}},
		QSD: engine.Program{Binary: self, PreArgs: []string{"sim-qsd"}}})
	if err != nil {
		t.Fatal(err)
	}
	h.vms, err = vm.New(vm.Options{StateDir: h.state, RunDir: h.run, Config: cfg, Records: recs, Host: eng, Logger: logger})
	if err != nil {
		t.Fatal(err)
	}
	h.apps = appvm.New(appvm.Config{VMs: h.vms, Records: recs, Guests: h.guests, RootDisks: eng,
		Restart: appvm.RestartOptions{BaseDelay: 300 * time.Millisecond, MaxDelay: 1200 * time.Millisecond, StablePeriod: time.Minute}})
	eng.Recover()
	h.images = h.apps.Catalog()
	keys := filepath.Join(h.state, "keys.json")
	h.token, err = auth.Add(keys, "test", auth.ScopeReadWrite, nil)
	if err != nil {
		t.Fatal(err)
	}
	ring, err := auth.Open(keys)
	if err != nil {
		t.Fatal(err)
	}
	h.srv = httptest.NewServer(api.New(api.Config{Keys: ring, VMs: h.vms, AppVMs: h.apps, Logger: logger}))
	t.Cleanup(func() {
		h.apps.Wait() // background redeploys
		for _, r := range h.vms.List(vm.ModeAppVM) {
			h.vms.Delete(context.Background(), vm.ModeAppVM, r.ID, true)
		}
		h.srv.Close()
		eng.Close()
		h.events.Close()
		if t.Failed() {
			t.Logf("agent log:\n%s", h.logs.String())
		}
	})
	return h
}

// image adds a ready catalog image whose workload is cmd (run by /bin/sh
// -c on the host: the simulator's guest agent runs in process mode).
func (h *host) image(id, cmd string, hc *vm.Healthcheck) {
	h.t.Helper()
	im := &appvm.Image{ID: id, Status: appvm.StatusReady, CreatedAt: time.Now().UTC(), Workload: vm.Workload{
		BuildDigest: "sha256:0123456789ab", SizeBytes: 64 << 20, Cmd: []string{"/bin/sh", "-c", cmd},
		Env: []string{"PATH=/usr/local/bin:/usr/bin:/bin"}, Healthcheck: hc}}
	if err := h.images.Put(im); err != nil {
		h.t.Fatal(err)
	}
	if err := qcow2.Create(h.images.RootFS(im), 64<<20); err != nil {
		h.t.Fatal(err)
	}
}

// do sends an API request and returns status and body; every body is
// kept for the secret checks.
func (h *host) do(method, path string, body any) (int, []byte) {
	h.t.Helper()
	var rd io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			h.t.Fatal(err)
		}
		rd = bytes.NewReader(b)
	}
	req, err := http.NewRequest(method, h.srv.URL+path, rd)
	if err != nil {
		h.t.Fatal(err)
	}
	req.Header.Set("Authorization", "Bearer "+h.token)
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		h.t.Fatal(err)
	}
	defer resp.Body.Close()
	data, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, data
}

// create posts an AppVM create and checks the 201 CreateAppVmResponse.
func (h *host) create(req map[string]any) string {
	h.t.Helper()
	code, body := h.do("POST", "/api/appvm/vms", req)
	if code != http.StatusCreated {
		h.t.Fatalf("create = %d %s", code, body)
	}
	var resp appvm.CreateResponse
	if err := json.Unmarshal(body, &resp); err != nil {
		h.t.Fatal(err)
	}
	wantBooted := true
	if b, ok := req["auto_boot"].(bool); ok {
		wantBooted = b
	}
	if resp.Mode != "appvm" || resp.ImageID != req["image_id"] || resp.Booted != wantBooted || resp.ID == "" {
		h.t.Errorf("create response %s", body)
	}
	return resp.ID
}

// appView is the part of GET /api/appvm/vms/{id} the tests read.
type appView struct {
	State        string `json:"state"`
	DisplayState string `json:"display_state"`
	AppVM        struct {
		WorkloadExitCode   *int       `json:"workload_exit_code"`
		WorkloadExitSignal int        `json:"workload_exit_signal"`
		WorkloadFatal      string     `json:"workload_fatal"`
		Health             string     `json:"health"`
		HealthStreak       int        `json:"health_failing_streak"`
		LastHeartbeatAt    *time.Time `json:"last_heartbeat_at"`
		HeartbeatStale     bool       `json:"heartbeat_stale"`
		RestartPolicy      string     `json:"restart_policy"`
		RestartCount       int        `json:"restart_count"`
		LastRestartAt      *time.Time `json:"last_restart_at"`
		Args               []string   `json:"args"`
		Env                []struct {
			Key    string `json:"key"`
			Value  string `json:"value"`
			Secret bool   `json:"secret"`
		} `json:"env"`
	} `json:"appvm"`
	raw []byte
}

func (h *host) get(id string) appView {
	h.t.Helper()
	code, body := h.do("GET", "/api/appvm/vms/"+id, nil)
	if code != http.StatusOK {
		h.t.Fatalf("GET %s = %d %s", id, code, body)
	}
	var v appView
	if err := json.Unmarshal(body, &v); err != nil {
		h.t.Fatal(err)
	}
	v.raw = body
	return v
}

// waitFor polls the view until cond holds.
func (h *host) waitFor(id, what string, timeout time.Duration, cond func(v appView) bool) appView {
	h.t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		v := h.get(id)
		if cond(v) {
			return v
		}
		if time.Now().After(deadline) {
			h.t.Fatalf("%s: waited %v for %s; view: %s", id, timeout, what, v.raw)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

var nextIP atomic.Int32

// baseCreate is a create of the smallest AppVM. It is static (a fresh
// 10.79.0.x): chsim gives the guest agent a real NIC, and a DHCP guest
// without a DHCP server would wait for an offer.
func baseCreate(image string) map[string]any {
	ip := fmt.Sprintf("10.79.0.%d", 10+nextIP.Add(1))
	return map[string]any{"image_id": image, "vcpus": 1, "memory_mb": 128, "disk_gib": 1,
		"ip": ip, "prefix": 24, "gateway": "10.79.0.1"}
}

// TestIntegrationWorkloadExits: a workload that exits 0, exits 3 or is
// killed by a signal: the exit is reported, the guest powers off, the VM
// is stopped (guest_shutdown) and, with restart_policy no, stays so.
func TestIntegrationWorkloadExits(t *testing.T) {
	h := newHost(t)
	for _, tt := range []struct {
		name, cmd string
		code      *int
		signal    int
	}{
		{"exit 0", "echo bye; exit 0", new(int), 0},
		{"exit 3", "echo oops >&2; exit 3", func() *int { c := 3; return &c }(), 0},
		{"signal", "kill -KILL $$", nil, 9},
	} {
		t.Run(tt.name, func(t *testing.T) {
			img := "img-" + strings.ReplaceAll(tt.name, " ", "")
			h.image(img, tt.cmd, nil)
			id := h.create(baseCreate(img))
			v := h.waitFor(id, "stopped", 30*time.Second, func(v appView) bool { return v.State == "stopped" })
			a := v.AppVM
			if fmt.Sprint(ptrVal(a.WorkloadExitCode)) != fmt.Sprint(ptrVal(tt.code)) || a.WorkloadExitSignal != tt.signal {
				t.Errorf("exit code %v signal %d, want %v %d; view %s", ptrVal(a.WorkloadExitCode), a.WorkloadExitSignal, ptrVal(tt.code), tt.signal, v.raw)
			}
			if tt.code == nil && strings.Contains(string(v.raw), "workload_exit_code") {
				t.Errorf("workload_exit_code present for a signal death: %s", v.raw)
			}
			// The log says the code (or the signal), not where it is kept.
			want := fmt.Sprintf(`msg="workload exited" component=appvm-session id=%s signal=%d`+"\n", id, tt.signal)
			if tt.code != nil {
				want = fmt.Sprintf(`msg="workload exited" component=appvm-session id=%s code=%d`+"\n", id, *tt.code)
			}
			if logs := h.logs.String(); !strings.Contains(logs, want) {
				t.Errorf("agent log lacks %q:\n%s", want, logs)
			}
			if a.LastHeartbeatAt == nil || a.RestartPolicy != "no" || a.RestartCount != 0 || a.LastRestartAt != nil {
				t.Errorf("heartbeat %v policy %q restarts %d/%v", a.LastHeartbeatAt, a.RestartPolicy, a.RestartCount, a.LastRestartAt)
			}
			if !strings.Contains(string(v.raw), `"cause":"guest_shutdown"`) {
				t.Errorf("failure_reason is not a guest shutdown: %s", v.raw)
			}
			time.Sleep(700 * time.Millisecond) // longer than the first backoff
			if v := h.get(id); v.State != "stopped" || v.AppVM.RestartCount != 0 {
				t.Errorf("restart_policy no restarted the VM: %s", v.raw)
			}
		})
	}
	// The workload's output reached the capped log file.
	var ids []string
	for _, r := range h.vms.List(vm.ModeAppVM) {
		ids = append(ids, r.ID)
	}
	found := 0
	for _, id := range ids {
		b := h.output(id)
		if bytes.Contains(b, []byte("bye\n")) || bytes.Contains(b, []byte("oops\n")) {
			found++
		}
	}
	if found != 2 {
		t.Errorf("workload output found in %d logs, want 2", found)
	}
}

func ptrVal(p *int) any {
	if p == nil {
		return nil
	}
	return *p
}

// TestIntegrationKeepalive: keepalive replaces the workload with a shell
// that stays up: the AppVM runs, shows life (display running) and keeps
// heartbeating.
func TestIntegrationKeepalive(t *testing.T) {
	h := newHost(t)
	h.image("ka", "exit 7", nil)
	req := baseCreate("ka")
	req["keepalive"] = true
	id := h.create(req)
	v := h.waitFor(id, "display running", 30*time.Second, func(v appView) bool { return v.DisplayState == "running" })
	first := v.AppVM.LastHeartbeatAt
	if first == nil {
		t.Fatalf("running without a heartbeat: %s", v.raw)
	}
	if fmt.Sprint(v.AppVM.Args) != fmt.Sprint(appvm.KeepaliveArgs) {
		t.Errorf("args = %v", v.AppVM.Args)
	}
	v = h.waitFor(id, "a later heartbeat", 10*time.Second, func(v appView) bool {
		return v.AppVM.LastHeartbeatAt != nil && v.AppVM.LastHeartbeatAt.After(*first)
	})
	if v.State != "running" || v.AppVM.WorkloadExitCode != nil || v.AppVM.HeartbeatStale {
		t.Errorf("keepalive AppVM: %s", v.raw)
	}
}

// TestIntegrationRestartPolicies: on-failure restarts a failing workload
// with a growing backoff and counts consecutive restarts; always restarts
// even a clean exit; on-failure leaves a clean exit stopped.
func TestIntegrationRestartPolicies(t *testing.T) {
	h := newHost(t)
	h.image("fail", "exit 3", nil)
	h.image("ok", "exit 0", nil)

	req := baseCreate("fail")
	req["restart_policy"] = "on-failure"
	id := h.create(req)
	var restarts []time.Time
	seen := 0
	// A new boot clears the previous run's exit code, so it is looked for
	// between an exit and the next boot (the backoff), in any poll.
	exits := map[any]bool{}
	v := h.waitFor(id, "3 restarts", 60*time.Second, func(v appView) bool {
		if v.AppVM.RestartCount > seen && v.AppVM.LastRestartAt != nil {
			seen = v.AppVM.RestartCount
			restarts = append(restarts, *v.AppVM.LastRestartAt)
		}
		exits[ptrVal(v.AppVM.WorkloadExitCode)] = true
		return v.AppVM.RestartCount >= 3
	})
	if !exits[3] || exits[0] || v.AppVM.RestartPolicy != "on-failure" {
		t.Errorf("exit codes seen %v, want 3 (and never 0); view: %s", exits, v.raw)
	}
	// Backoff 300ms, 600ms, 1200ms. The gaps between restart times also
	// hold a boot, the run and the stop, whose length varies with the
	// machine's load, so the doubling is read from the decisions logged.
	for _, want := range []string{"restart=1 backoff=300ms", "restart=2 backoff=600ms", "restart=3 backoff=1.2s"} {
		if !strings.Contains(h.logs.String(), want) {
			t.Errorf("agent log lacks %q: want the backoff to double (300ms→600ms→1.2s)", want)
		}
	}
	if len(restarts) >= 2 && !restarts[1].After(restarts[0]) {
		t.Errorf("last_restart_at did not advance: %v", restarts)
	}

	req = baseCreate("ok")
	req["restart_policy"] = "always"
	id = h.create(req)
	exits = map[any]bool{}
	v = h.waitFor(id, "a restart after exit 0", 30*time.Second, func(v appView) bool {
		exits[ptrVal(v.AppVM.WorkloadExitCode)] = true
		return v.AppVM.RestartCount >= 1 && exits[0]
	})
	if exits[3] {
		t.Errorf("always: exit codes seen %v, want only 0; view: %s", exits, v.raw)
	}

	// A workload that ran past the stable period starts a new series:
	// every restart is restart 1 again.
	h.image("slow", "sleep 1.5; exit 4", nil)
	h.apps.SetRestartStablePeriod(time.Second)
	req = baseCreate("slow")
	req["restart_policy"] = "on-failure"
	id = h.create(req)
	var lastAt time.Time
	restartsSeen := 0
	h.waitFor(id, "three restarts after stable runs", 60*time.Second, func(v appView) bool {
		if a := v.AppVM.LastRestartAt; a != nil && !a.Equal(lastAt) {
			lastAt = *a
			restartsSeen++
			if v.AppVM.RestartCount != 1 {
				t.Errorf("restart after a stable run counted %d, want 1", v.AppVM.RestartCount)
			}
		}
		return restartsSeen >= 3
	})

	req = baseCreate("ok")
	req["restart_policy"] = "on-failure"
	id = h.create(req)
	h.waitFor(id, "stopped", 30*time.Second, func(v appView) bool { return v.State == "stopped" })
	time.Sleep(800 * time.Millisecond)
	if v := h.get(id); v.State != "stopped" || v.AppVM.RestartCount != 0 {
		t.Errorf("on-failure restarted a clean exit: %s", v.raw)
	}
}

// TestIntegrationHealthUnhealthy: a failing health check turns the
// workload unhealthy with the failing streak.
func TestIntegrationHealthUnhealthy(t *testing.T) {
	h := newHost(t)
	h.image("sick", "exec sleep 300", &vm.Healthcheck{Test: []string{"CMD", "false"}, IntervalSecs: 1, TimeoutSecs: 1, Retries: 2})
	id := h.create(baseCreate("sick"))
	v := h.waitFor(id, "unhealthy", 30*time.Second, func(v appView) bool { return v.AppVM.Health == "unhealthy" })
	if v.AppVM.HealthStreak < 2 {
		t.Errorf("unhealthy with streak %d, want ≥ 2: %s", v.AppVM.HealthStreak, v.raw)
	}
	n := v.AppVM.HealthStreak
	h.waitFor(id, "a longer streak", 10*time.Second, func(v appView) bool { return v.AppVM.HealthStreak > n })
}

// TestIntegrationHeartbeatStale: a stopped guest agent (SIGSTOP) stops
// heartbeating while CH runs: heartbeat_stale; it clears when the agent
// continues.
func TestIntegrationHeartbeatStale(t *testing.T) {
	h := newHost(t)
	h.image("idle", "exec sleep 300", nil)
	id := h.create(baseCreate("idle"))
	v := h.waitFor(id, "display running", 30*time.Second, func(v appView) bool { return v.DisplayState == "running" })
	if v.AppVM.HeartbeatStale {
		t.Fatalf("stale while heartbeating: %s", v.raw)
	}
	if n := h.eventCount(id, events.HeartbeatStale); n != 0 {
		t.Fatalf("%d heartbeat_stale events while heartbeating", n)
	}
	h.simAgentSignal(id, 19) // SIGSTOP
	v = h.waitFor(id, "heartbeat_stale", 15*time.Second, func(v appView) bool { return v.AppVM.HeartbeatStale })
	if v.State != "running" {
		t.Errorf("stale AppVM state %s, want running", v.State)
	}
	time.Sleep(3 * time.Second) // longer than the stale limit: still one event for one silence
	if n := h.eventCount(id, events.HeartbeatStale); n != 1 {
		t.Errorf("%d heartbeat_stale events for one silence, want 1", n)
	}
	h.simAgentSignal(id, 18) // SIGCONT
	h.waitFor(id, "heartbeat_stale cleared", 15*time.Second, func(v appView) bool { return !v.AppVM.HeartbeatStale })
}

// eventCount counts the synced events of type typ for VM id.
func (h *host) eventCount(id string, typ events.Type) int {
	h.t.Helper()
	deadline := time.Now().Add(2 * time.Second)
	for {
		entries, _, _ := h.events.After(0, 1<<20)
		n := 0
		for _, e := range entries {
			if e.VMID == id && strings.Contains(string(e.JSON), `"type":"`+string(typ)+`"`) {
				n++
			}
		}
		if n > 0 || time.Now().After(deadline) {
			return n
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// simAgentSignal signals the guest agent through chsim's control API.
func (h *host) simAgentSignal(id string, sig int) {
	h.t.Helper()
	sock := h.vms.Layout().APISocket(id)
	c := &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", sock)
	}}}
	defer c.CloseIdleConnections()
	req, _ := http.NewRequest("PUT", "http://localhost/sim/v1/guest-agent", strings.NewReader(fmt.Sprintf(`{"signal":%d}`, sig)))
	req.Header.Set("Content-Type", "application/json")
	resp, err := c.Do(req)
	if err != nil {
		h.t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusNoContent {
		h.t.Fatalf("signalling the guest agent: %s", resp.Status)
	}
}

// TestIntegrationSecretsStayInGuest: a secret env value reaches the
// workload (it writes it into its root) and appears in no API response,
// no log line and no file under the state dir except the 0600 record.
func TestIntegrationSecretsStayInGuest(t *testing.T) {
	h := newHost(t)
	const secret = "tops3cret-Value-42"
	h.image("sec", `printf %s "$API_TOKEN" > token.out; echo "started with $(printf %s "$API_TOKEN" | wc -c) secret bytes"; exec sleep 300`, nil)
	req := baseCreate("sec")
	req["secret_env"] = []string{"API_TOKEN=" + secret}
	req["env"] = []string{"PLAIN=visible"}
	var bodies [][]byte
	code, body := h.do("POST", "/api/appvm/vms", req)
	if code != http.StatusCreated {
		t.Fatalf("create = %d %s", code, body)
	}
	bodies = append(bodies, body)
	var resp appvm.CreateResponse
	json.Unmarshal(body, &resp)
	id := resp.ID
	v := h.waitFor(id, "display running", 30*time.Second, func(v appView) bool { return v.DisplayState == "running" })
	bodies = append(bodies, v.raw)
	sock := h.vms.Layout().VsockSocket(id)
	var got []byte
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		if got, _ = os.ReadFile(filepath.Join(chsim.GuestRoot(sock), "token.out")); len(got) > 0 {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	if string(got) != secret {
		t.Fatalf("the workload saw API_TOKEN=%q, want the secret", got)
	}
	var keyed bool
	for _, e := range v.AppVM.Env {
		if e.Key == "API_TOKEN" {
			keyed = e.Secret && e.Value == ""
		}
	}
	if !keyed {
		t.Errorf("env view lacks the redacted secret key: %s", v.raw)
	}
	for _, p := range []string{"/api/appvm/vms", "/api/appvm/vms/" + id} {
		_, b := h.do("GET", p, nil)
		bodies = append(bodies, b)
	}
	for i, b := range bodies {
		if bytes.Contains(b, []byte(secret)) {
			t.Errorf("response %d holds the secret: %s", i, b)
		}
	}
	// Wait for the workload's line, so the log file was written to.
	logPath := appvm.WorkloadLog(h.vms.Layout(), id)
	deadline = time.Now().Add(10 * time.Second)
	for {
		b := h.output(id)
		if bytes.Contains(b, []byte("started with 18 secret bytes")) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("workload log %s: %q", logPath, b)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if strings.Contains(h.logs.String(), secret) {
		t.Error("the agent's log holds the secret")
	}
	record := filepath.Join(h.state, "vms", id+".json")
	err := filepath.WalkDir(h.state, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		if p == record {
			fi, _ := d.Info()
			if !bytes.Contains(b, []byte(secret)) || fi.Mode().Perm() != 0o600 {
				t.Errorf("record %s: mode %v, holds secret %v", p, fi.Mode(), bytes.Contains(b, []byte(secret)))
			}
			return nil
		}
		if bytes.Contains(b, []byte(secret)) {
			t.Errorf("%s holds the secret", p)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	// The run dir holds CH's and the agent's logs: no secret there either.
	filepath.WalkDir(h.run, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() || d.Type()&fs.ModeSocket != 0 || strings.Contains(p, ".root/") || !d.Type().IsRegular() {
			return nil
		}
		if b, err := os.ReadFile(p); err == nil && bytes.Contains(b, []byte(secret)) && !strings.HasSuffix(p, ".cpio") {
			t.Errorf("%s holds the secret", p)
		}
		return nil
	})
}

// bridgeAddr puts cidr on the host bridge (the AppVM's gateway side).
func (h *host) bridgeAddr(cidr string) {
	h.t.Helper()
	for _, args := range [][]string{{"addr", "replace", cidr, "dev", config.DefaultBridge}, {"link", "set", config.DefaultBridge, "up"}} {
		if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
			h.t.Fatalf("ip %v: %v: %s", args, err, out)
		}
	}
}

const netPath = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

// TestIntegrationStaticNetwork: the guest agent configures the static
// address on the guest's NIC (chsim wires it to the VM's tap, which the
// engine attached to the bridge), and the host reaches the guest through
// the bridge.
func TestIntegrationStaticNetwork(t *testing.T) {
	h := newHost(t)
	h.bridgeAddr("10.77.0.1/24")
	h.image("stat", "ip -4 -o addr show > addr.out; exec sleep 300", nil)
	im, _ := h.images.Get("stat")
	im.Env = []string{netPath}
	h.images.Put(im)
	req := baseCreate("stat")
	req["ip"], req["prefix"], req["gateway"], req["dns"] = "10.77.0.5", 24, "10.77.0.1", []string{"10.77.0.53"}
	id := h.create(req)
	h.waitFor(id, "display running", 30*time.Second, func(v appView) bool { return v.DisplayState == "running" })
	root := chsim.GuestRoot(h.vms.Layout().VsockSocket(id))
	var addrs []byte
	deadline := time.Now().Add(10 * time.Second)
	for len(addrs) == 0 && time.Now().Before(deadline) {
		addrs, _ = os.ReadFile(filepath.Join(root, "addr.out"))
		time.Sleep(50 * time.Millisecond)
	}
	if !bytes.Contains(addrs, []byte("eth0    inet 10.77.0.5/24")) {
		t.Fatalf("guest addresses:\n%s", addrs)
	}
	if b, _ := os.ReadFile(filepath.Join(root, "etc/resolv.conf")); !bytes.Contains(b, []byte("nameserver 10.77.0.53")) {
		t.Errorf("guest resolv.conf: %q", b)
	}
	// A TCP connect to a closed port of the guest is refused by the
	// guest's kernel (a RST): packets crossed the bridge both ways.
	var err error
	for range 5 {
		var c net.Conn
		if c, err = net.DialTimeout("tcp", "10.77.0.5:9", time.Second); err == nil {
			c.Close()
		}
		if errors.Is(err, syscall.ECONNREFUSED) {
			break
		}
	}
	if !errors.Is(err, syscall.ECONNREFUSED) {
		t.Errorf("the host cannot reach the guest's static address: %v", err)
	}
}

// TestIntegrationDHCPNetwork: the guest agent leases an address from
// dnsmasq serving the bridge, and the view shows the lease it reported.
func TestIntegrationDHCPNetwork(t *testing.T) {
	h := newHost(t)
	if _, err := exec.LookPath("dnsmasq"); err != nil {
		t.Skip("dnsmasq not installed")
	}
	h.bridgeAddr("10.78.0.1/24")
	dir := t.TempDir()
	dns := exec.Command("dnsmasq", "--no-daemon", "--conf-file=/dev/null", "--user=root", "--port=0",
		"--interface="+config.DefaultBridge, "--bind-interfaces", "--dhcp-authoritative",
		"--dhcp-range=10.78.0.50,10.78.0.60,255.255.255.0,1h", "--dhcp-option=option:router,10.78.0.1",
		"--dhcp-option=option:dns-server,10.78.0.1", "--dhcp-leasefile="+filepath.Join(dir, "leases"),
		"--pid-file="+filepath.Join(dir, "pid"))
	var dnsLog lockedLog
	dns.Stdout, dns.Stderr = &dnsLog, &dnsLog
	if err := dns.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		dns.Process.Kill()
		dns.Wait()
		if t.Failed() {
			t.Logf("dnsmasq:\n%s", dnsLog.String())
		}
	})
	h.image("dyn", "exec sleep 300", nil)
	req := baseCreate("dyn")
	delete(req, "ip")
	delete(req, "prefix")
	delete(req, "gateway")
	id := h.create(req)
	var body []byte
	var v struct {
		AppVM struct {
			Lease *struct {
				IP         string    `json:"ip"`
				Prefix     int       `json:"prefix"`
				Gateway    string    `json:"gateway"`
				DNS        []string  `json:"dns"`
				LeaseSecs  int       `json:"lease_secs"`
				ReportedAt time.Time `json:"reported_at"`
			} `json:"lease"`
			NetworkMode string `json:"network_mode"`
		} `json:"appvm"`
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		_, body = h.do("GET", "/api/appvm/vms/"+id, nil)
		if err := json.Unmarshal(body, &v); err != nil {
			t.Fatal(err)
		}
		if v.AppVM.Lease != nil || time.Now().After(deadline) {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	l := v.AppVM.Lease
	if l == nil {
		t.Fatalf("no lease reported: %s", body)
	}
	if !strings.HasPrefix(l.IP, "10.78.0.") || l.Prefix != 24 || l.Gateway != "10.78.0.1" || fmt.Sprint(l.DNS) != "[10.78.0.1]" ||
		l.LeaseSecs != 3600 || l.ReportedAt.IsZero() || v.AppVM.NetworkMode != "dhcp" {
		t.Errorf("lease view: %s", body)
	}
	leases, _ := os.ReadFile(filepath.Join(dir, "leases"))
	if !bytes.Contains(leases, []byte(l.IP)) {
		t.Errorf("dnsmasq's leases %q lack %s", leases, l.IP)
	}
}

// TestIntegrationSpecEditRestart: an edit of a running AppVM is pending
// until ?restart=true stops it gracefully and boots it on the new spec:
// the workload then sees the new environment, the real guest agent wrote
// the new config file into the workload root (the simulator's guest root:
// the workload runs unchrooted there), and spec_pending is gone.
func TestIntegrationSpecEditRestart(t *testing.T) {
	h := newHost(t)
	h.image("edit", `echo "MODE=$MODE"; exec sleep 300`, nil)
	id := h.create(baseCreate("edit"))
	h.waitFor(id, "display running", 30*time.Second, func(v appView) bool { return v.DisplayState == "running" })
	code, body := h.do("PATCH", "/api/appvm/vms/"+id+"/spec", map[string]any{"env": []string{"MODE=edited"}})
	if code != http.StatusOK || !bytes.Contains(body, []byte(`"spec_pending":true`)) {
		t.Fatalf("edit of a running AppVM = %d %s, want spec_pending", code, body)
	}
	code, body = h.do("PATCH", "/api/appvm/vms/"+id+"/spec?restart=true", map[string]any{
		"config_files": []map[string]any{{"path": "/etc/edit.conf", "content": "from-the-edit\n"}}, "stop_grace_secs": 2})
	if code != http.StatusOK {
		t.Fatalf("edit with restart = %d %s", code, body)
	}
	h.waitFor(id, "running on the new spec", 30*time.Second, func(v appView) bool {
		return v.DisplayState == "running" && !bytes.Contains(v.raw, []byte(`"spec_pending":true`))
	})
	deadline := time.Now().Add(10 * time.Second)
	for {
		b := h.output(id)
		if bytes.Contains(b, []byte("MODE=edited\n")) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the restarted workload did not see the edit; log:\n%s", b)
		}
		time.Sleep(100 * time.Millisecond)
	}
	conf := filepath.Join(chsim.GuestRoot(h.vms.Layout().VsockSocket(id)), "etc", "edit.conf")
	if b, err := os.ReadFile(conf); err != nil || string(b) != "from-the-edit\n" {
		t.Errorf("the config file in the guest root: %q, %v", b, err)
	}
}

// TestIntegrationRestartBeforeHello: a restart of an AppVM whose guest
// agent has not yet said hello in its boot (a create's ?restart edit right
// away) stops it at once: no workload runs yet, and a guest still booting
// would not take the power button. The record is put back to how a boot
// looks before the hello, with the host end gone and the guest agent
// frozen, so that a graceful shutdown could not end it.
func TestIntegrationRestartBeforeHello(t *testing.T) {
	h := newHost(t)
	h.image("early", `exec sleep 300`, nil)
	id := h.create(baseCreate("early"))
	h.waitFor(id, "display running", 30*time.Second, func(v appView) bool { return v.DisplayState == "running" })
	old := h.recs.Get(id).AppVM.Guest.BootID
	h.simAgentSignal(id, int(syscall.SIGSTOP))
	h.guests.End(id)
	if _, err := h.recs.Update(id, func(r *vm.Record) { r.AppVM.Guest.BootID = "" }); err != nil {
		t.Fatal(err)
	}
	code, body := h.do("PATCH", "/api/appvm/vms/"+id+"/spec?restart=true", map[string]any{"env": []string{"MODE=edited"}, "stop_grace_secs": 30})
	if code != http.StatusOK {
		t.Fatalf("edit with restart before the hello = %d %s", code, body)
	}
	h.waitFor(id, "a new boot greeted by its guest agent", 30*time.Second, func(v appView) bool {
		b := h.recs.Get(id).AppVM.Guest.BootID
		return v.DisplayState == "running" && b != "" && b != old
	})
}

// TestIntegrationRedeploy: a running AppVM is redeployed on a new build of
// its image: it stops gracefully, gets a fresh root disk (a new file), and
// boots running the new build's command; update_available is gone.
func TestIntegrationRedeploy(t *testing.T) {
	h := newHost(t)
	h.image("rd", `echo build-one; exec sleep 300`, nil)
	id := h.create(baseCreate("rd"))
	h.waitFor(id, "display running", 30*time.Second, func(v appView) bool { return v.DisplayState == "running" })
	root := h.vms.Layout().RootDisk(id)
	before, err := os.Stat(root)
	if err != nil {
		t.Fatal(err)
	}
	im, err := h.images.Get("rd")
	if err != nil {
		t.Fatal(err)
	}
	im.BuildDigest = "sha256:ba5eba11"
	im.Cmd = []string{"/bin/sh", "-c", "echo build-two; exec sleep 300"}
	if err := h.images.Put(im); err != nil {
		t.Fatal(err)
	}
	if err := qcow2.Create(h.images.RootFS(im), 64<<20); err != nil { // the new build's own file
		t.Fatal(err)
	}
	code, body := h.do("POST", "/api/appvm/vms/"+id+"/redeploy", nil)
	if code != http.StatusAccepted || !bytes.Contains(body, []byte(`"redeploying":true`)) {
		t.Fatalf("redeploy = %d %s", code, body)
	}
	v := h.waitFor(id, "running the new build", 30*time.Second, func(v appView) bool {
		return v.DisplayState == "running" && !bytes.Contains(v.raw, []byte(`"redeploying"`)) && bytes.Contains(v.raw, []byte(`"build_digest":"sha256:ba5eba11"`))
	})
	if bytes.Contains(v.raw, []byte("update_available")) || bytes.Contains(v.raw, []byte("redeploy_error")) {
		t.Errorf("after the redeploy: %s", v.raw)
	}
	after, err := os.Stat(root)
	if err != nil {
		t.Fatal(err)
	}
	if os.SameFile(before, after) {
		t.Error("the root disk is the same file: no fresh root disk")
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		b := h.output(id)
		if bytes.Contains(b, []byte("build-two\n")) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the redeployed AppVM does not run the new build; log:\n%s", b)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// TestIntegrationHotVolume attaches a new volume to a running AppVM over
// the API: the simulated guest agent is asked to mount it (in process
// mode it makes the mountpoint in its root) before the answer, which
// lists it in data_mounts; the detach has it unmounted and drops it.
func TestIntegrationHotVolume(t *testing.T) {
	h := newHost(t)
	h.image("hot", "exec sleep 600", nil)
	id := h.create(baseCreate("hot"))
	h.waitFor(id, "a heartbeat", 30*time.Second, func(v appView) bool { return v.DisplayState == "running" && v.AppVM.LastHeartbeatAt != nil })
	root := chsim.GuestRoot(h.vms.Layout().VsockSocket(id))

	code, body := h.do("POST", "/api/appvm/vms/"+id+"/volumes", map[string]any{"size_gib": 1, "mountpoint": "/srv/hot"})
	if code != http.StatusOK {
		t.Fatalf("hot attach = %d %s", code, body)
	}
	var view struct {
		AppVM struct {
			DataMounts []appvm.DataMount `json:"data_mounts"`
		} `json:"appvm"`
		Volumes []struct {
			Device string `json:"device"`
		} `json:"volumes"`
	}
	if err := json.Unmarshal(body, &view); err != nil {
		t.Fatal(err)
	}
	if len(view.AppVM.DataMounts) != 1 || view.AppVM.DataMounts[0].Mountpoint != "/srv/hot" || view.AppVM.DataMounts[0].Device != "/dev/vdb" {
		t.Errorf("data_mounts after the hot attach: %+v", view.AppVM.DataMounts)
	}
	if fi, err := os.Stat(filepath.Join(root, "srv/hot")); err != nil || !fi.IsDir() {
		t.Errorf("the guest agent made no mountpoint: %v", err)
	}

	code, body = h.do("DELETE", "/api/appvm/vms/"+id+"/volumes/data0", nil)
	if code != http.StatusOK {
		t.Fatalf("hot detach = %d %s", code, body)
	}
	if strings.Contains(string(body), "/srv/hot") {
		t.Errorf("the detached volume is still in the view: %s", body)
	}
	if v := h.get(id); v.State != "running" {
		t.Errorf("state after the detach: %s", v.raw)
	}
}

// TestIntegrationShutdownByPowerButton: an AppVM whose guest agent is not
// connected is shut down through the ACPI power button, which the guest
// agent watches (the simulator's SIGPWR): the workload gets SIGTERM, the
// guest powers off, and the operator's shutdown is not restarted.
func TestIntegrationShutdownByPowerButton(t *testing.T) {
	h := newHost(t)
	dir := t.TempDir()
	termed, trapped := filepath.Join(dir, "got-term"), filepath.Join(dir, "trapped")
	// The workload says when its trap is set: a SIGTERM before that
	// would end the shell without the trap, on a slow machine.
	h.image("pb", "trap 'touch "+termed+"; exit 0' TERM; touch "+trapped+"; while :; do sleep 0.1; done", nil)
	req := baseCreate("pb")
	req["restart_policy"] = "always"
	id := h.create(req)
	h.waitFor(id, "a heartbeat", 30*time.Second, func(v appView) bool { return v.DisplayState == "running" && v.AppVM.LastHeartbeatAt != nil })
	h.waitFor(id, "the workload's trap", 30*time.Second, func(appView) bool { _, err := os.Stat(trapped); return err == nil })
	rec, err := h.vms.Get(vm.ModeAppVM, id)
	if err != nil {
		t.Fatal(err)
	}
	h.guests.End(rec.ID) // the host end goes away: no Stop can be sent
	if code, body := h.do("POST", "/api/appvm/vms/"+id+"/shutdown", nil); code != http.StatusNoContent {
		t.Fatalf("shutdown = %d %s", code, body)
	}
	h.waitFor(id, "stopped", 15*time.Second, func(v appView) bool { return v.State == "stopped" })
	time.Sleep(1500 * time.Millisecond) // longer than the first restart backoff
	if v := h.get(id); v.State != "stopped" || v.AppVM.RestartCount != 0 {
		t.Errorf("after the power button: %s", v.raw)
	}
	if _, err := os.Stat(termed); err != nil {
		t.Errorf("the workload got no SIGTERM from the guest agent: %v", err)
	}
	if !strings.Contains(h.logs.String(), "pressing the power button") {
		t.Errorf("the shutdown did not fall back to the power button")
	}
}
