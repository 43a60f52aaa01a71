package engine

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"vmhost/chclient"
	"vmhost/chclient/chsim"
	"vmhost/config"
	"vmhost/qcow2"
	"vmhost/qmp"
	"vmhost/qmp/qsdsim"
	"vmhost/store"
	"vmhost/vm/record"
	"vmhost/vm/records"
)

// testExecEnv makes the test binary run as a simulator instead of the
// tests: "sim-ch" runs chsim, "sim-qsd" runs qsdsim. Tests of this package
// that need real CH and QSD processes launch os.Args[0] with it set
// (simEnv gives the environment).
const testExecEnv = "VMHOST_VM_TEST_EXEC"

// exitOnEnv names a file whose appearance makes the simulated CH exit 3.
const exitOnEnv = "VMHOST_VM_TEST_EXIT_ON"

// freezeOnEnv names an API socket whose appearance makes the simulated CH
// stop itself (SIGSTOP).
const freezeOnEnv = "VMHOST_VM_TEST_FREEZE_ON"

func TestMain(m *testing.M) {
	switch os.Getenv(testExecEnv) {
	case "sim-ch":
		if p := os.Getenv(exitOnEnv); p != "" {
			// A VMM that dies with code 3 once the file p exists.
			go func() {
				for !fileExists(p) {
					time.Sleep(5 * time.Millisecond)
				}
				os.Exit(3)
			}()
		}
		if p := os.Getenv(freezeOnEnv); p != "" {
			// A VMM that hangs, deaf to SIGTERM, once its API socket p
			// exists: connections are accepted by the kernel and never
			// answered, and only SIGKILL ends it.
			go func() {
				for !fileExists(p) {
					time.Sleep(time.Millisecond)
				}
				syscall.Kill(os.Getpid(), syscall.SIGSTOP)
			}()
		}
		os.Exit(chsim.Main(os.Args[1:]))
	case "sim-qsd":
		os.Exit(qsdsim.Main(os.Args[1:]))
	}
	os.Exit(m.Run())
}

// simEnv is the environment of a simulator child: which one, and no
// one-second sleep at exit of a race-enabled binary.
func simEnv(which string) []string {
	return append(os.Environ(), testExecEnv+"="+which,
		"GORACE="+strings.TrimSpace(os.Getenv("GORACE")+" atexit_sleep_ms=0"))
}

// testService is an Engine over short temp dirs (socket paths must fit
// 107 bytes) and the records of the state directory (a real
// records.Registry over its store), with ping knobs of one second. Unless
// testOpts.sims is set, its CH and QSD are the configured defaults: tests
// launch the simulators themselves (launchVM) and hand them to the engine.
type testService struct {
	*Engine
	recs       *records.Registry
	root       string // the temp dir holding state and run (and a test's kernel and base image)
	state, run string
	logs       *syncBuffer
	opts       testOpts // what newTestServiceWith was given
}

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

// testOpts vary a testService.
type testOpts struct {
	// sims makes CH and QSD this test binary running chsim and qsdsim
	// (TestMain), with the default configuration's ping knobs.
	sims bool
	// edit changes the engine's options before New.
	edit func(*Options)
	// guest is the engine's Options.Guest.
	guest Guest
	// store wraps the records' store (to count or slow down writes).
	store func(records.Store) records.Store
}

// newTestService starts an engine on fresh directories, or on dirs
// (state, run) as an agent restart does.
func newTestService(t testing.TB, dirs ...string) *testService {
	t.Helper()
	return newTestServiceWith(t, testOpts{}, dirs...)
}

func newTestServiceWith(t testing.TB, o testOpts, dirs ...string) *testService {
	t.Helper()
	var root, state, run string
	if len(dirs) == 2 {
		state, run = dirs[0], dirs[1]
		root = filepath.Dir(state)
	} else {
		var err error
		if root, err = os.MkdirTemp("", "vmm"); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { os.RemoveAll(root) })
		// After the engine's Close (cleanups run last first): the
		// simulators of VMs a test left running, which outlive it
		// otherwise (their sessions are their own).
		t.Cleanup(func() { killProcessesUnder(t, root) })
		state, run = filepath.Join(root, "s"), filepath.Join(root, "r")
	}
	st, err := store.Open(filepath.Join(state, "vms"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	var rst records.Store = st
	if o.store != nil {
		rst = o.store(st)
	}
	recs, err := records.Open(rst, records.Options{})
	if err != nil {
		t.Fatal(err)
	}
	cfg := config.Default()
	cfg.PingIntervalSecs, cfg.PingTimeoutSecs = 1, 1
	logs := new(syncBuffer)
	log := slog.New(slog.NewTextHandler(logs, nil))
	eo := Options{Config: cfg, Records: recs, Guest: o.guest, StateDir: state, RunDir: run, Logger: log}
	if o.sims {
		eo.Config = config.Default()
		eo.CH = Program{Binary: os.Args[0], Env: simEnv("sim-ch")}
		eo.QSD = Program{Binary: os.Args[0], Env: simEnv("sim-qsd")}
	}
	if o.edit != nil {
		o.edit(&eo)
	}
	e, err := New(eo)
	if err != nil {
		t.Fatal(err)
	}
	e.Recover()
	t.Cleanup(func() { e.Close() })
	return &testService{Engine: e, recs: recs, root: root, state: state, run: run, logs: logs, opts: o}
}

// restart closes s and starts an engine again on its directories and
// options, as an agent restart does.
func (s *testService) restart(t testing.TB) *testService {
	t.Helper()
	s.Close()
	return newTestServiceWith(t, s.opts, s.state, s.run)
}

// running is a VM started by startVM: its processes and paths.
type running struct {
	id        string
	ch        *chclient.Process
	qsd       *qmp.QSD
	apiSocket string
	events    string
	rootDisk  string
}

// startVM launches qsdsim serving a fresh root disk and chsim booted on
// it, the way the engine does, stores a running record (display booting)
// with their identity, and returns without watching it. The processes are
// killed at the end of the test.
func startVM(t testing.TB, s *testService, id string, chArgs ...string) *running {
	t.Helper()
	return startVMWith(t, s, id, vmOpts{chArgs: chArgs})
}

// vmOpts are startVM's extras.
type vmOpts struct {
	chArgs []string
	chEnv  []string     // added to chsim's environment
	nics   []record.NIC // interfaces (taps must exist where chsim runs)
	mode   record.Mode  // the record's family; empty means ModeVM
	// launch runs CH's launch, e.g. on a thread inside a network
	// namespace; nil runs it directly.
	launch func(f func() error) error
}

func startVMWith(t testing.TB, s *testService, id string, o vmOpts) *running {
	t.Helper()
	r, stop, err := launchVM(s, id, o)
	if stop != nil {
		t.Cleanup(stop)
	}
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// launchVM is startVM for any goroutine: it returns an error, and a
// function that kills what it started (nil when nothing was).
func launchVM(s *testService, id string, o vmOpts) (_ *running, stop func(), err error) {
	chArgs := o.chArgs
	l := s.lay
	if err := os.MkdirAll(l.VMDir(id), 0o700); err != nil {
		return nil, nil, err
	}
	if err := os.MkdirAll(l.RunVMDir(id), 0o700); err != nil {
		return nil, nil, err
	}
	root := l.RootDisk(id)
	if err := qcow2.Create(root, 1<<30); err != nil {
		return nil, nil, err
	}
	kernel := filepath.Join(l.VMDir(id), "vmlinux")
	if err := os.WriteFile(kernel, []byte("kernel"), 0o600); err != nil {
		return nil, nil, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	self, _ := os.Executable()
	qsd, err := qmp.LaunchQSD(ctx, qmp.QSDConfig{
		Binary: self, Env: simEnv("sim-qsd"),
		Root:      qmp.RootDisk{Path: root, Socket: l.RootSocket(id)},
		QMPSocket: l.QMPSocket(id), PidFile: l.QSDPidFile(id), LogFile: l.QSDLog(id),
	})
	if err != nil {
		return nil, nil, err
	}
	var ch *chclient.Process
	launch := func() (err error) {
		ch, err = chclient.Launch(ctx, chclient.LaunchConfig{
			Binary: self, Env: append(simEnv("sim-ch"), o.chEnv...),
			APISocket: l.APISocket(id), EventMonitor: l.Events(id), LogFile: l.CHLog(id),
			SerialSocket: l.ConsoleSocket(id), ExtraArgs: append([]string{"-v"}, chArgs...),
		})
		return err
	}
	if o.launch != nil {
		err = o.launch(launch)
	} else {
		err = launch()
	}
	if err != nil {
		qsd.Quit(ctx)
		return nil, nil, err
	}
	stop = func() {
		ch.Signal(syscall.SIGKILL)
		<-ch.Done()
		select {
		case <-qsd.Done():
		default:
			qsd.Quit(context.Background())
		}
	}
	cfg := &chclient.VmConfig{
		Cpus:    &chclient.CpusConfig{BootVcpus: 1, MaxVcpus: 1},
		Memory:  &chclient.MemoryConfig{Size: 256 << 20, Shared: true},
		Payload: &chclient.PayloadConfig{Kernel: kernel, Cmdline: "console=ttyS0"},
		Disks:   []chclient.DiskConfig{{VhostUser: true, VhostSocket: l.RootSocket(id), NumQueues: 1, QueueSize: 128}},
		Serial:  &chclient.ConsoleConfig{Mode: chclient.ConsoleSocket, Socket: l.ConsoleSocket(id)},
		Console: &chclient.ConsoleConfig{Mode: chclient.ConsoleOff},
		Pvpanic: true,
	}
	var nets []record.NetSpec
	for _, n := range o.nics {
		cfg.Net = append(cfg.Net, chclient.NetConfig{Tap: n.Tap, Mac: n.MAC, Mtu: 1500})
		nets = append(nets, record.NetSpec{Bridge: "br-test"})
	}
	if err := ch.Client().CreateVM(ctx, cfg); err != nil {
		return nil, stop, err
	}
	if err := ch.Client().BootVM(ctx); err != nil {
		return nil, stop, err
	}
	mode := o.mode
	if mode == "" {
		mode = record.ModeVM
	}
	var app *record.AppVMSpec
	if mode == record.ModeAppVM {
		app = &record.AppVMSpec{ImageID: "img", NetworkMode: "dhcp", RestartPolicy: "no"}
	}
	rec := &record.Record{ID: id, Mode: mode, AppVM: app, State: record.StateRunning, DisplayState: record.DisplayBooting,
		CreatedAt: time.Now().UTC().Truncate(time.Second), PID: ch.Pid,
		Spec: record.Spec{VMID: id, Vcpus: 1, MemoryMB: 256, Nets: nets}, NICs: o.nics,
		Runtime: &record.Runtime{
			CH: &record.CHRuntime{Pid: ch.Pid, StartTime: ch.StartTime, APISocket: l.APISocket(id), EventsPath: l.Events(id),
				SerialSocket: l.ConsoleSocket(id), LogFile: l.CHLog(id)},
			QSD: &record.QSDRuntime{Pid: qsd.Pid, StartTime: qsd.StartTime, QMPSocket: l.QMPSocket(id), RootSocket: l.RootSocket(id),
				PidFile: l.QSDPidFile(id), LogFile: l.QSDLog(id)},
		}}
	if err := s.recs.Create(rec); err != nil {
		return nil, stop, err
	}
	return &running{id: id, ch: ch, qsd: qsd, apiSocket: l.APISocket(id), events: l.Events(id), rootDisk: root}, stop, nil
}

// sim calls a /sim/v1/ action on chsim and fails the test unless it
// answers 204.
func (r *running) sim(t testing.TB, action, body string) {
	t.Helper()
	simAction(t, r.apiSocket, action, body)
}

// simAction calls a /sim/v1/ action on the chsim whose API socket is
// apiSocket and fails the test unless it answers 204.
func simAction(t testing.TB, apiSocket, action, body string) {
	t.Helper()
	c := &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", apiSocket)
	}}}
	defer c.CloseIdleConnections()
	req, _ := http.NewRequest("PUT", "http://x/sim/v1/"+action, strings.NewReader(body))
	resp, err := c.Do(req)
	if err != nil {
		t.Fatalf("sim %s: %v", action, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 204 {
		data, _ := io.ReadAll(resp.Body)
		t.Fatalf("sim %s = %d %s", action, resp.StatusCode, data)
	}
}

// waitRecord polls the record of id until cond holds, failing after
// within. It returns the record and how long it took.
// recordGetter is testService or *records.Registry.
type recordGetter interface {
	Get(id string) *record.Record
}

// Get returns the record of id, or nil.
func (s *testService) Get(id string) *record.Record { return s.recs.Get(id) }

func logsOf(g recordGetter) string {
	if s, ok := g.(*testService); ok {
		return s.logs.String()
	}
	return ""
}

func waitRecord(t testing.TB, s recordGetter, id string, within time.Duration, what string, cond func(*record.Record) bool) (*record.Record, time.Duration) {
	t.Helper()
	start := time.Now()
	for {
		r := s.Get(id)
		if r != nil && cond(r) {
			return r, time.Since(start)
		}
		if time.Since(start) > within {
			t.Fatalf("after %v: %s not reached; record: %s\nlogs:\n%s", within, what, describe(r), logsOf(s))
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func describe(r *record.Record) string {
	if r == nil {
		return "<none>"
	}
	fr := "<nil>"
	if f := r.FailureReason; f != nil {
		fr = fmt.Sprintf("%+v %q %s", f.Detail, f.Summary, f.Cause)
	}
	return fmt.Sprintf("state=%s display=%s failure=%s runtime=%+v", r.State, r.DisplayState, fr, r.Runtime)
}

func gone(t testing.TB, what string, done <-chan struct{}) {
	t.Helper()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Errorf("%s still running after the VM ended", what)
	}
}

func intp(p *int) string {
	if p == nil {
		return "nil"
	}
	return fmt.Sprint(*p)
}

// TestMonitorFailures injects every failure the monitor knows, one VM per
// case, and checks the state, failure_reason and detection time (2 s; a
// hang within ping_timeout_secs + ping_interval_secs + 1 s), and that
// nothing of the VM keeps running.
func TestMonitorFailures(t *testing.T) {
	cases := []struct {
		name       string
		inject     func(t *testing.T, r *running)
		within     time.Duration
		state      record.State
		kind       string
		cause      string
		code       string // detail.code, "nil" when absent
		signum     string
		path       bool // detail.path is the root disk
		inSummary  string
		alsoBefore func(t *testing.T, s *testService, r *running)
	}{
		{name: "crash by signal", inject: func(t *testing.T, r *running) { r.sim(t, "crash", `{"signal":11}`) },
			within: 2 * time.Second, state: record.StateFailed, kind: record.KindProcessSignal, cause: record.CauseCHCrash, code: "nil", signum: "11", inSummary: "signal 11"},
		{name: "killed", inject: func(t *testing.T, r *running) { r.ch.Signal(syscall.SIGKILL) },
			within: 2 * time.Second, state: record.StateFailed, kind: record.KindProcessSignal, cause: record.CauseCHCrash, code: "nil", signum: "9"},
		{name: "exit code", inject: func(t *testing.T, r *running) {
			os.WriteFile(filepath.Join(filepath.Dir(r.apiSocket), "exit-now"), nil, 0o600)
		}, within: 2 * time.Second, state: record.StateFailed, kind: record.KindProcessExit, cause: record.CauseCHCrash, code: "3", signum: "nil", inSummary: "code 3"},
		{name: "guest poweroff", inject: func(t *testing.T, r *running) { r.sim(t, "poweroff", "") },
			within: 2 * time.Second, state: record.StateStopped, kind: record.KindProcessExit, cause: record.CauseGuestShutdown, code: "0", signum: "nil"},
		{name: "acpi shutdown pending", inject: func(t *testing.T, r *running) { r.sim(t, "poweroff", "") },
			alsoBefore: func(t *testing.T, s *testService, r *running) {
				if _, err := s.recs.Update(r.id, func(rec *record.Record) { rec.ShuttingDown = true }); err != nil {
					t.Fatal(err)
				}
			},
			within: 2 * time.Second, state: record.StateStopped, kind: record.KindProcessExit, cause: record.CauseOperatorShutdown, code: "0", signum: "nil"},
		{name: "socket removed", inject: func(t *testing.T, r *running) {
			if err := os.Remove(r.apiSocket); err != nil {
				t.Fatal(err)
			}
		}, within: 2 * time.Second, state: record.StateFailed, kind: record.KindSocketGone, cause: record.CauseCHCrash, code: "nil", signum: "nil", inSummary: "is gone"},
		{name: "socket refuses", inject: func(t *testing.T, r *running) {
			// A socket file nobody listens on takes the API socket's place.
			if err := os.Remove(r.apiSocket); err != nil {
				t.Fatal(err)
			}
			ln, err := net.Listen("unix", r.apiSocket)
			if err != nil {
				t.Fatal(err)
			}
			ln.(*net.UnixListener).SetUnlinkOnClose(false)
			ln.Close()
		}, within: 2 * time.Second, state: record.StateFailed, kind: record.KindSocketDead, cause: record.CauseCHCrash, code: "nil", signum: "nil", inSummary: "refuses"},
		{name: "hang", inject: func(t *testing.T, r *running) { r.sim(t, "hang", "") },
			within: 3 * time.Second, state: record.StateFailed, kind: record.KindPingTimeout, cause: record.CauseVMMHang, code: "nil", signum: "nil", inSummary: "vmm.ping"},
		{name: "root disk deleted", inject: func(t *testing.T, r *running) {
			if err := os.Remove(r.rootDisk); err != nil {
				t.Fatal(err)
			}
		}, within: 2 * time.Second, state: record.StateFailed, kind: record.KindDiskMissing, cause: record.CauseDiskMissing, code: "nil", signum: "nil", path: true},
		{name: "qsd killed", inject: func(t *testing.T, r *running) { syscall.Kill(r.qsd.Pid, syscall.SIGKILL) },
			within: 2 * time.Second, state: record.StateFailed, kind: record.KindMissingPID, cause: record.CauseUnknown, code: "nil", signum: "nil", inSummary: "qemu-storage-daemon"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			s := newTestService(t)
			r := startVMWith(t, s, "vm1", vmOpts{chEnv: []string{exitOnEnv + "=" + s.lay.RunVMDir("vm1") + "/exit-now"}})
			if tc.alsoBefore != nil {
				tc.alsoBefore(t, s, r)
			}
			s.watch(r.id, r.ch, r.qsd)
			// Let the monitor see the VM healthy first.
			waitRecord(t, s, r.id, 5*time.Second, "display running", func(r *record.Record) bool { return r.DisplayState == "running" })
			tc.inject(t, r)
			rec, took := waitRecord(t, s, r.id, 10*time.Second, "VM ended", func(r *record.Record) bool { return r.State != record.StateRunning })
			t.Logf("%s detected in %v: %s", tc.name, took, rec.FailureReason.Summary)
			if took > tc.within {
				t.Errorf("detected after %v, want within %v", took, tc.within)
			}
			f := rec.FailureReason
			if rec.State != tc.state || rec.DisplayState != string(tc.state) || f == nil || f.Detail.Kind != tc.kind || f.Cause != tc.cause ||
				intp(f.Detail.Code) != tc.code || intp(f.Detail.Signum) != tc.signum {
				t.Fatalf("record: %s; want state %s kind %s cause %s code %s signum %s", describe(rec), tc.state, tc.kind, tc.cause, tc.code, tc.signum)
			}
			if tc.path != (f.Detail.Path == r.rootDisk) {
				t.Errorf("detail.path = %q", f.Detail.Path)
			}
			if err := f.Detail.Check(); err != nil {
				t.Errorf("docs/api.md (The VM view): %v", err)
			}
			if !strings.Contains(f.Summary, tc.inSummary) {
				t.Errorf("summary %q lacks %q", f.Summary, tc.inSummary)
			}
			if rec.PID != 0 || rec.ShuttingDown {
				t.Errorf("pid %d, shutting_down %v after the end", rec.PID, rec.ShuttingDown)
			}
			gone(t, "cloud-hypervisor", r.ch.Done())
			gone(t, "qemu-storage-daemon", r.qsd.Done())
			rec, _ = waitRecord(t, s, r.id, 10*time.Second, "runtime cleared", func(r *record.Record) bool {
				return r.Runtime == nil || (r.Runtime.CH == nil && r.Runtime.QSD == nil)
			})
			if s.watched(r.id) {
				t.Error("VM still watched")
			}
		})
	}
}

// TestMonitorAppVMDiskActivation: an AppVM's root disk activating is no
// sign of life (its guest agent's heartbeat is), so it stays booting.
func TestMonitorAppVMDiskActivation(t *testing.T) {
	s := newTestService(t)
	r := startVMWith(t, s, "app1", vmOpts{chArgs: []string{"--sim-no-activate"}, mode: record.ModeAppVM})
	s.watch(r.id, r.ch, r.qsd)
	r.sim(t, "activate", "")
	// The panic event follows the activation in the same stream, so once
	// it is recorded the activation has been read too.
	r.sim(t, "panic", `{"event":"panic"}`)
	got, _ := waitRecord(t, s, r.id, 2*time.Second, "guest_panicked_at", func(r *record.Record) bool { return r.GuestPanickedAt != nil })
	if got.DisplayState != record.DisplayBooting {
		t.Errorf("AppVM display %s after its root disk activated, want booting until a heartbeat", got.DisplayState)
	}
}

func TestMonitorGuestEvents(t *testing.T) {
	s := newTestService(t)
	r := startVM(t, s, "vm1", "--sim-no-activate")
	s.watch(r.id, r.ch, r.qsd)
	time.Sleep(300 * time.Millisecond)
	if got := s.recs.Get(r.id); got.DisplayState != record.DisplayBooting {
		t.Fatalf("display %s before the guest activated its disk, want booting", got.DisplayState)
	}
	r.sim(t, "activate", "")
	waitRecord(t, s, r.id, 2*time.Second, "display running", func(r *record.Record) bool { return r.DisplayState == "running" })

	before := time.Now().Add(-2 * time.Second) // btime has whole seconds
	r.sim(t, "panic", `{"event":"panic"}`)
	rec, _ := waitRecord(t, s, r.id, 2*time.Second, "guest_panicked_at", func(r *record.Record) bool { return r.GuestPanickedAt != nil })
	if at := *rec.GuestPanickedAt; at.Before(before) || at.After(time.Now().Add(2*time.Second)) {
		t.Errorf("guest_panicked_at %v is not about now", at)
	}
	if rec.State != record.StateRunning || rec.FailureReason != nil {
		t.Errorf("after a panic: %s, want running without failure", describe(rec))
	}
	// A planned stop takes the processes back; the monitor records nothing.
	ch, qsd := s.unwatch(r.id)
	if ch != r.ch || qsd != r.qsd {
		t.Fatal("unwatch did not return the VM's processes")
	}
	if err := ch.Stop(context.Background(), time.Second); err != nil {
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond)
	if got := s.recs.Get(r.id); got.State != record.StateRunning || got.FailureReason != nil {
		t.Errorf("after unwatch and stop: %s, want the record untouched", describe(got))
	}
}

// TestMonitorIdleNoWakeups: an idle running VM's monitor does not check its
// files on a clock (only its ping wakes, once per ping interval), yet a
// deleted root disk is seen at once through inotify.
func TestMonitorIdleNoWakeups(t *testing.T) {
	s := newTestService(t)
	r := startVM(t, s, "vm1")
	s.watch(r.id, r.ch, r.qsd)
	waitRecord(t, s, r.id, 2*time.Second, "display running", func(r *record.Record) bool { return r.DisplayState == "running" })
	s.mon.mu.Lock()
	m := s.mon.m[r.id]
	s.mon.mu.Unlock()
	if m == nil || m.polling {
		t.Fatalf("monitor %+v: not watching with inotify", m)
	}
	time.Sleep(300 * time.Millisecond)
	before := m.checks.Load()
	time.Sleep(2 * time.Second)
	if n := m.checks.Load() - before; n != 0 {
		t.Errorf("an idle VM's monitor checked its files %d times in 2 s", n)
	}
	if err := os.Remove(r.rootDisk); err != nil {
		t.Fatal(err)
	}
	_, took := waitRecord(t, s, r.id, 2*time.Second, "disk_missing", func(r *record.Record) bool { return r.State == record.StateFailed })
	t.Logf("root disk deletion recorded in %v", took)
}

// TestMonitorPollsWithoutInotify: an engine without inotify (the limits
// reached, say) still sees a deleted root disk, by polling.
func TestMonitorPollsWithoutInotify(t *testing.T) {
	s := newTestService(t)
	s.fw.close()
	s.fw = nil
	r := startVM(t, s, "vm1")
	s.watch(r.id, r.ch, r.qsd)
	if err := os.Remove(r.rootDisk); err != nil {
		t.Fatal(err)
	}
	waitRecord(t, s, r.id, 2*time.Second, "disk_missing", func(r *record.Record) bool {
		return r.FailureReason != nil && r.FailureReason.Detail.Kind == record.KindDiskMissing
	})
}

// killProcessesUnder kills every process whose command line names a path
// under dir (a test's VMs' simulators: their sockets, disks and logs are
// there) and waits until none is left.
func killProcessesUnder(t testing.TB, dir string) {
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		var left []int
		ents, _ := os.ReadDir("/proc")
		for _, ent := range ents {
			pid, err := strconv.Atoi(ent.Name())
			if err != nil || pid == os.Getpid() {
				continue
			}
			cmdline, err := os.ReadFile("/proc/" + ent.Name() + "/cmdline")
			if err != nil || !bytes.Contains(cmdline, []byte(dir+"/")) {
				continue // gone, or a zombie (no command line), or not the test's
			}
			left = append(left, pid)
			syscall.Kill(pid, syscall.SIGKILL)
		}
		if len(left) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Errorf("processes of the test still there after SIGKILL: %v", left)
			return
		}
	}
}
