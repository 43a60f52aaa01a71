package engine

import (
	"context"
	"errors"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"vmhost/config"
	"vmhost/proc"
	"vmhost/qcow2"
	"vmhost/store"
	"vmhost/vm"
	"vmhost/vm/record"
	"vmhost/vm/records"
)

// engineService is a vm.Service over an Engine whose CH and QSD are this
// test binary running chsim and qsdsim (TestMain in monitor_test.go).
func engineService(t *testing.T, edit func(*Options)) (*vm.Service, *Engine, string) {
	t.Helper()
	s, e, root, _ := gatedEngineService(t, edit)
	return s, e, root
}

// gatedRecords are the records as the engine sees them, each of its
// writes waiting for gate: a test holds gate to slow the writes down.
type gatedRecords struct {
	*records.Registry
	gate *sync.Mutex
}

func (g gatedRecords) Update(id string, f func(*record.Record)) (*record.Record, error) {
	g.gate.Lock()
	defer g.gate.Unlock()
	return g.Registry.Update(id, f)
}

// gatedEngineService is engineService with the engine's record writes
// behind the returned gate.
func gatedEngineService(t *testing.T, edit func(*Options)) (*vm.Service, *Engine, string, *sync.Mutex) {
	t.Helper()
	gate := new(sync.Mutex)
	s, e, root := wrappedEngineService(t, edit, func(r *records.Registry) Records { return gatedRecords{Registry: r, gate: gate} })
	return s, e, root, gate
}

// wrappedEngineService is engineService with the records as the engine
// sees them wrapped by wrap.
func wrappedEngineService(t *testing.T, edit func(*Options), wrap func(*records.Registry) Records) (*vm.Service, *Engine, string) {
	t.Helper()
	root, err := os.MkdirTemp("", "vme")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(root) })
	state, run := root+"/s", root+"/r"
	cfg := config.Default()
	cfg.HostPathRoots = []string{root} // the test's kernel and base image
	eo := Options{Config: cfg, StateDir: state, RunDir: run,
		CH:  Program{Binary: os.Args[0], Env: simEnv("sim-ch")},
		QSD: Program{Binary: os.Args[0], Env: simEnv("sim-qsd")}}
	if edit != nil {
		edit(&eo)
	}
	e, err := New(eo)
	if err != nil {
		t.Fatal(err)
	}
	s := startEngineService(t, e, wrap)
	t.Cleanup(func() {
		for _, r := range s.List(record.ModeVM) {
			s.Delete(context.Background(), record.ModeVM, r.ID, true)
		}
		e.Close()
	})
	return s, e, root
}

// startEngineService opens the records of e's state directory in a
// vm.Service with e as its host and starts e on them (through wrap, when
// given), as the agent does.
func startEngineService(t *testing.T, e *Engine, wrap func(*records.Registry) Records) *vm.Service {
	t.Helper()
	st, err := store.Open(filepath.Join(e.o.StateDir, "vms"))
	if err != nil {
		t.Fatal(err)
	}
	reg, err := records.Open(st, records.Options{})
	if err != nil {
		t.Fatal(err)
	}
	s, err := vm.New(vm.Options{StateDir: e.o.StateDir, RunDir: e.o.RunDir, Config: e.o.Config, Records: reg, Host: e, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	var recs Records = reg
	if wrap != nil {
		recs = wrap(reg)
	}
	e.Start(recs, nil)
	return s
}

// baseSpec is a VM without interfaces on a fresh base image.
func baseSpec(t *testing.T, root, id string) *record.Spec {
	t.Helper()
	kernel, base := root+"/vmlinux", root+"/base.qcow2"
	if err := os.WriteFile(kernel, []byte("k"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(base); err != nil {
		if err := qcow2.Create(base, 1<<30); err != nil {
			t.Fatal(err)
		}
	}
	size := uint32(2)
	return &record.Spec{VMID: id, Vcpus: 1, MemoryMB: 128, KernelPath: &kernel,
		Disk: &record.DiskSpec{BasePath: base, SizeGiB: &size}, Volumes: []record.VolumeSpec{{ID: "data0", SizeGiB: 1}}}
}

// TestEngineFailedCreateRollsBack: the storage daemon cannot start, after
// the disks were made. The create fails with a storage error and nothing
// of the VM is left, while a neighbour's directory and the base image are
// untouched.
func TestEngineFailedCreateRollsBack(t *testing.T) {
	s, _, root := engineService(t, func(o *Options) { o.QSD = Program{Binary: "/nonexistent/qemu-storage-daemon"} })
	l := s.Layout()
	neighbour := l.VMDir("other") + "/keep.qcow2"
	if err := os.MkdirAll(filepath.Dir(neighbour), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(neighbour, []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	sp := baseSpec(t, root, "doomed")
	_, _, err := s.CreateVM(context.Background(), sp)
	var he *record.HostError
	if !errors.As(err, &he) || he.Kind != record.HostStorage {
		t.Fatalf("CreateVM = %v, want a storage HostError", err)
	}
	for _, p := range []string{l.VMDir("doomed"), l.RunVMDir("doomed"), l.StateDir + "/vms/doomed.json"} {
		if _, err := os.Lstat(p); err == nil {
			t.Errorf("%s left behind", p)
		}
	}
	if _, err := s.Get(record.ModeVM, "doomed"); err == nil {
		t.Error("record left behind")
	}
	for _, p := range []string{neighbour, sp.Disk.BasePath} {
		if _, err := os.Stat(p); err != nil {
			t.Errorf("%s was touched: %v", p, err)
		}
	}
}

// TestEngineRollbackRemovesOnlyRecorded: Rollback removes the files whose
// steps are recorded and leaves others (here a data volume whose creation
// was never recorded) and so the directory too.
func TestEngineRollbackRemovesOnlyRecorded(t *testing.T) {
	s := newTestService(t)
	e, l := s.Engine, s.lay
	rec := &record.Record{ID: "half", Mode: record.ModeVM, State: record.StateCreated, Spec: *baseSpec(t, t.TempDir(), "half"),
		Runtime: &record.Runtime{Steps: []string{record.StepRootDisk, record.StepRunDir}}}
	if err := s.recs.put(rec); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{l.RootDisk("half"), l.DataVolume("half", "data0")} {
		if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, nil, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.MkdirAll(l.RunVMDir("half"), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := e.Rollback(context.Background(), rec); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(l.RootDisk("half")); err == nil {
		t.Error("the recorded root disk was kept")
	}
	if _, err := os.Stat(l.DataVolume("half", "data0")); err != nil {
		t.Errorf("the unrecorded data volume was removed: %v", err)
	}
	if _, err := os.Stat(l.RunVMDir("half")); err == nil {
		t.Error("the run directory was kept")
	}
}

// countingRecords counts the engine's record writes.
type countingRecords struct {
	*records.Registry
	n *atomic.Int32
}

func (c countingRecords) Update(id string, f func(*record.Record)) (*record.Record, error) {
	c.n.Add(1)
	return c.Registry.Update(id, f)
}

// TestEngineCreateRecordsResultOnce: a synchronous create with auto_boot
// (root disk, data volume, run directory, storage daemon, CH) has the
// engine store the record once, with the boot, whatever the number of
// steps: the provision's result is staged into that write. The stored
// record then holds every step, the CID, both processes and the states.
func TestEngineCreateRecordsResultOnce(t *testing.T) {
	var writes atomic.Int32
	s, _, root := wrappedEngineService(t, nil, func(r *records.Registry) Records { return countingRecords{Registry: r, n: &writes} })
	sp := baseSpec(t, root, "once")
	sp.AutoBoot = true
	if _, _, err := s.CreateVM(context.Background(), sp); err != nil {
		t.Fatal(err)
	}
	if n := writes.Load(); n != 1 {
		t.Errorf("the engine wrote the record %d times, want 1 (the boot, with the provision's result)", n)
	}
	rec := storedRecord(t, s, "once")
	rt := rec.Runtime
	for _, st := range []string{record.StepRootDisk, record.StepData(0), record.StepRunDir} {
		if !rt.Done(st) {
			t.Errorf("step %s not stored: %v", st, rt.Steps)
		}
	}
	if rt.VsockCID < 3 || rt.QSD == nil || rt.CH == nil || rec.State != record.StateRunning || rec.DisplayState != record.DisplayBooting {
		t.Errorf("stored record after the create = %+v, runtime %+v", rec, rt)
	}
}

// TestEngineCreateWhoseBootFailsStoresTheResult: a create with auto_boot
// whose boot fails keeps the VM, created, and its stored record holds the
// provision's result (steps, CID, storage daemon), which the boot was to
// store: an agent started again finds it provisioned.
func TestEngineCreateWhoseBootFailsStoresTheResult(t *testing.T) {
	s, _, root := engineService(t, func(o *Options) { o.CH.Binary = "/nonexistent/cloud-hypervisor" })
	sp := baseSpec(t, root, "nobooted")
	sp.AutoBoot = true
	if _, _, err := s.CreateVM(context.Background(), sp); err == nil {
		t.Fatal("a create whose CH cannot start succeeded")
	}
	mem, err := s.Get(record.ModeVM, "nobooted")
	if err != nil {
		t.Fatalf("the VM was not kept: %v", err)
	}
	rec := storedRecord(t, s, "nobooted")
	if rec.State != record.StateCreated || rec.DisplayState != string(record.StateCreated) {
		t.Errorf("stored state %s/%s, want created/created", rec.State, rec.DisplayState)
	}
	rt := rec.Runtime
	if rt == nil || !rt.Done(record.StepRootDisk) || !rt.Done(record.StepData(0)) || !rt.Done(record.StepRunDir) || rt.VsockCID != mem.Runtime.VsockCID || rt.QSD == nil || rt.CH != nil {
		t.Errorf("stored runtime %+v, want the provision's result (in memory: %+v)", rt, mem.Runtime)
	}
}

// storedRecord reads the record of id from s's state directory, as an
// agent started again would.
func storedRecord(t *testing.T, s *vm.Service, id string) *record.Record {
	t.Helper()
	st, err := store.Open(filepath.Join(s.Layout().StateDir, "vms"))
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	data, err := st.Get(id)
	if err != nil {
		t.Fatal(err)
	}
	rec, err := record.Decode(data)
	if err != nil {
		t.Fatal(err)
	}
	return rec
}

// slowRecords' writes take 50 ms longer once the change is made.
type slowRecords struct{ *records.Registry }

func (r slowRecords) Update(id string, f func(*record.Record)) (*record.Record, error) {
	return r.Registry.Update(id, func(rec *record.Record) { f(rec); time.Sleep(50 * time.Millisecond) })
}

// TestEngineConcurrentCreatesGetDistinctCIDs: record writes of different
// VMs run side by side, and concurrent creates still get distinct vsock
// CIDs.
func TestEngineConcurrentCreatesGetDistinctCIDs(t *testing.T) {
	// Each write lingers after its change is made, so the writes of the
	// concurrent creates overlap.
	s, _, root := wrappedEngineService(t, nil, func(r *records.Registry) Records { return slowRecords{r} })
	const n = 8
	cids := make(chan uint32, n)
	var wg sync.WaitGroup
	for i := range n {
		sp := baseSpec(t, root, "cc"+strconv.Itoa(i))
		wg.Add(1)
		go func() {
			defer wg.Done()
			rec, _, err := s.CreateVM(context.Background(), sp)
			if err != nil {
				t.Error(err)
				return
			}
			cids <- rec.Runtime.VsockCID
		}()
	}
	wg.Wait()
	close(cids)
	seen := map[uint32]bool{}
	for c := range cids {
		if c < 3 || seen[c] {
			t.Errorf("CID %d given twice or below 3", c)
		}
		seen[c] = true
	}
}

// TestEngineCreateBootDelete runs the whole path in-process: provision
// (steps recorded, CID allocated), boot, first sign of life, delete.
func TestEngineCreateBootDelete(t *testing.T) {
	s, _, root := engineService(t, nil)
	ctx := context.Background()
	var cids []uint32
	for _, id := range []string{"a", "b"} {
		sp := baseSpec(t, root, id)
		sp.AutoBoot = id == "a"
		rec, async, err := s.CreateVM(ctx, sp)
		if err != nil || async {
			t.Fatalf("CreateVM(%s) = %v, async %t", id, err, async)
		}
		rt := rec.Runtime
		if rt == nil || rt.QSD == nil || !rt.Done(record.StepRootDisk) || !rt.Done(record.StepData(0)) || !rt.Done(record.StepRunDir) || rt.Done(record.StepSeed) {
			t.Fatalf("runtime of %s = %+v", id, rt)
		}
		cids = append(cids, rt.VsockCID)
		if id == "a" && (rec.State != record.StateRunning || rt.CH == nil || rec.PID != rt.CH.Pid) {
			t.Errorf("booted record = %+v", rec)
		}
	}
	if cids[0] < 3 || cids[0] == cids[1] {
		t.Errorf("vsock CIDs = %v, want distinct and ≥ 3", cids)
	}
	if err := s.Delete(ctx, record.ModeVM, "a", false); err == nil {
		t.Error("deleting a running VM without force succeeded")
	}
	if err := s.Delete(ctx, record.ModeVM, "a", true); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(s.Layout().VMDir("a")); err == nil {
		t.Error("VM directory left after delete")
	}
	// The freed CID is given again.
	sp := baseSpec(t, root, "c")
	rec, _, err := s.CreateVM(ctx, sp)
	if err != nil {
		t.Fatal(err)
	}
	if rec.Runtime.VsockCID != cids[0] {
		t.Errorf("CID after delete = %d, want the freed %d", rec.Runtime.VsockCID, cids[0])
	}
}

// TestEngineWithoutTaps: an engine that cannot create taps (an agent
// without root) refuses a VM with interfaces before anything is stored,
// naming the reason.
func TestEngineWithoutTaps(t *testing.T) {
	s, _, root := engineService(t, func(o *Options) { o.NoTapsReason = "creating taps needs root" })
	sp := baseSpec(t, root, "nic")
	sp.Nets = []record.NetSpec{{}}
	_, _, err := s.CreateVM(context.Background(), sp)
	var he *record.HostError
	if !errors.As(err, &he) || he.Kind != record.HostNetwork || !strings.Contains(err.Error(), "creating taps needs root") {
		t.Fatalf("CreateVM with a NIC = %v, want a network HostError with the reason", err)
	}
	if _, err := os.Stat(s.Layout().VMDir("nic")); err == nil {
		t.Error("files were made before the refusal")
	}
	if _, err := s.Get(record.ModeVM, "nic"); err == nil {
		t.Error("a record was stored")
	}
}

// TestEngineFailedBootKillsHungVMM: a VMM that hangs as soon as its API
// socket exists and does not react to SIGTERM makes vm.create fail; the
// failed boot still ends it (SIGKILL) instead of leaving it running with
// its identity cleared from the record.
func TestEngineFailedBootKillsHungVMM(t *testing.T) {
	s, e, root := engineService(t, func(o *Options) { o.StopGrace = 100 * time.Millisecond })
	ctx := context.Background()
	if _, _, err := s.CreateVM(ctx, baseSpec(t, root, "hung")); err != nil {
		t.Fatal(err)
	}
	sock := s.Layout().APISocket("hung")
	e.o.CH.Env = append(simEnv("sim-ch"), freezeOnEnv+"="+sock)
	t.Cleanup(func() {
		for _, pid := range processesNaming(sock) {
			syscall.Kill(pid, syscall.SIGKILL)
		}
	})
	actx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	if _, err := s.Act(actx, record.ModeVM, "hung", vm.ActionStart); err == nil {
		t.Fatal("starting a VM whose VMM hangs succeeded")
	}
	if pids := processesNaming(sock); len(pids) > 0 {
		t.Errorf("the hung VMM (pids %v) still runs after the failed boot", pids)
	}
	if r, _ := s.Get(record.ModeVM, "hung"); r.Runtime.CH != nil || r.State != record.StateCreated {
		t.Errorf("record after the failed boot: state %s, CH %+v", r.State, r.Runtime.CH)
	}
}

// processesNaming returns the pids whose command line holds s.
func processesNaming(s string) []int {
	ents, _ := os.ReadDir("/proc")
	var pids []int
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if b, err := os.ReadFile("/proc/" + e.Name() + "/cmdline"); err == nil && strings.Contains(string(b), s) {
			pids = append(pids, pid)
		}
	}
	return pids
}

// TestEngineActionDuringVerdict: a process of a running VM dies and an
// operator action arrives while the monitor is recording its verdict
// (record writes are held back here to widen that moment). The action sees
// the verdict: it answers *StateError and the VM stays failed, instead of
// being recorded stopped or paused over the failure.
func TestEngineActionDuringVerdict(t *testing.T) {
	for _, tc := range []struct {
		name   string
		kill   func(*record.Record) int // the pid to SIGKILL
		action vm.Action
		ok     func(*record.Record) bool // the record keeps the failure
	}{
		{name: "stop after a CH crash", action: vm.ActionStop,
			kill: func(r *record.Record) int { return r.Runtime.CH.Pid },
			ok: func(r *record.Record) bool {
				f := r.FailureReason
				return r.State == record.StateFailed && f != nil && f.Detail.Kind == record.KindProcessSignal && f.Cause == record.CauseCHCrash
			}},
		// vm.pause reaches CH, which still runs, while the storage failure
		// is being recorded.
		{name: "pause after a storage failure", action: vm.ActionPause,
			kill: func(r *record.Record) int { return r.Runtime.QSD.Pid },
			ok: func(r *record.Record) bool {
				f := r.FailureReason
				return r.State == record.StateFailed && r.DisplayState == string(record.StateFailed) && f != nil && strings.Contains(f.Summary, "qemu-storage-daemon")
			}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, _, root, gate := gatedEngineService(t, nil)
			ctx := context.Background()
			sp := baseSpec(t, root, "v")
			sp.AutoBoot = true
			rec, _, err := s.CreateVM(ctx, sp)
			if err != nil || rec.State != record.StateRunning {
				t.Fatalf("CreateVM = %v, %v", rec, err)
			}
			gate.Lock()
			held := true
			defer func() {
				if held {
					gate.Unlock()
				}
			}()
			if err := syscall.Kill(tc.kill(rec), syscall.SIGKILL); err != nil {
				t.Fatal(err)
			}
			time.Sleep(300 * time.Millisecond) // the monitor sees the exit at once and waits to record it
			acted := make(chan error, 1)
			go func() {
				_, err := s.Act(ctx, record.ModeVM, "v", tc.action)
				acted <- err
			}()
			time.Sleep(300 * time.Millisecond) // the action decides what to do
			gate.Unlock()
			held = false
			if err := <-acted; !errors.As(err, new(*record.StateError)) {
				t.Errorf("%s during the verdict = %v, want *StateError", tc.action, err)
			}
			r, err := s.Get(record.ModeVM, "v")
			if err != nil {
				t.Fatal(err)
			}
			if !tc.ok(r) {
				t.Errorf("record after the failure and the %s: %s", tc.action, describe(r))
			}
		})
	}
}

// TestEngineShutdownRecordedBeforeThePress: a guest that powers off at
// once after the ACPI power button (chsim: 50 ms) while record writes are
// slow (held back here) still ends as an operator shutdown, not as a
// guest shutdown: shutting_down is stored before the button is pressed.
func TestEngineShutdownRecordedBeforeThePress(t *testing.T) {
	s, _, root, gate := gatedEngineService(t, nil)
	ctx := context.Background()
	sp := baseSpec(t, root, "v")
	sp.AutoBoot = true
	rec, _, err := s.CreateVM(ctx, sp)
	if err != nil || rec.State != record.StateRunning {
		t.Fatalf("CreateVM = %v, %v", rec, err)
	}
	// A guest that reacts to the button has activated its devices (chsim
	// does so on its own shortly after boot).
	waitRecord(t, s.Records(), "v", 10*time.Second, "guest up", func(r *record.Record) bool { return r.DisplayState == string(record.StateRunning) })
	gate.Lock()
	held := true
	defer func() {
		if held {
			gate.Unlock()
		}
	}()
	done := make(chan error, 1)
	go func() {
		_, err := s.Act(ctx, record.ModeVM, "v", vm.ActionShutdown)
		done <- err
	}()
	time.Sleep(300 * time.Millisecond) // time for the guest to power off, were the button pressed
	gate.Unlock()
	held = false
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	r, _ := waitRecord(t, s.Records(), "v", 10*time.Second, "VM stopped", func(r *record.Record) bool { return r.State != record.StateRunning })
	if f := r.FailureReason; r.State != record.StateStopped || f == nil || f.Cause != record.CauseOperatorShutdown || r.ShuttingDown {
		t.Errorf("record after an ACPI shutdown: %s", describe(r))
	}
}

// TestEngineRecoverFinishesInterruptedStop: the agent died during an
// operator stop after the processes were ended and their identity cleared,
// before the stop was recorded (the record says running, with no process).
// The next agent finishes the stop instead of showing a VM that runs
// nothing as running.
func TestEngineRecoverFinishesInterruptedStop(t *testing.T) {
	s, e, root := engineService(t, nil)
	ctx := context.Background()
	sp := baseSpec(t, root, "v")
	sp.AutoBoot = true
	if _, _, err := s.CreateVM(ctx, sp); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Act(ctx, record.ModeVM, "v", vm.ActionStop); err != nil {
		t.Fatal(err)
	}
	// The record as the stop left it between its two writes.
	if _, err := s.Records().Update("v", func(r *record.Record) {
		r.State, r.DisplayState, r.FailureReason = record.StateRunning, string(record.StateRunning), nil
	}); err != nil {
		t.Fatal(err)
	}
	e.Close()
	e2, err := New(e.o)
	if err != nil {
		t.Fatal(err)
	}
	b := startEngineService(t, e2, nil)
	defer e2.Close()
	r, err := b.Get(record.ModeVM, "v")
	if err != nil {
		t.Fatal(err)
	}
	if f := r.FailureReason; r.State != record.StateStopped || f == nil || f.Cause != record.CauseOperatorShutdown {
		t.Errorf("record after the restart: %s", describe(r))
	}
	if rep := e2.Recovery(); !slices.Equal(rep.Ended, []string{"v"}) {
		t.Errorf("recovery = %+v, want v ended", rep)
	}
}

// TestEngineFailedStartStopsStorage: a stopped VM whose start fails (CH
// cannot be launched) is left running nothing: the storage daemon the
// start launched is stopped and forgotten.
func TestEngineFailedStartStopsStorage(t *testing.T) {
	s, e, root := engineService(t, nil)
	ctx := context.Background()
	sp := baseSpec(t, root, "v")
	sp.AutoBoot = true
	if _, _, err := s.CreateVM(ctx, sp); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Act(ctx, record.ModeVM, "v", vm.ActionStop); err != nil {
		t.Fatal(err)
	}
	e.o.CH.Binary = "/nonexistent/cloud-hypervisor"
	if _, err := s.Act(ctx, record.ModeVM, "v", vm.ActionStart); err == nil {
		t.Fatal("start without a hypervisor binary succeeded")
	}
	r, err := s.Get(record.ModeVM, "v")
	if err != nil {
		t.Fatal(err)
	}
	if r.State != record.StateStopped || r.Runtime.QSD != nil || r.Runtime.CH != nil {
		t.Errorf("record after the failed start: %s", describe(r))
	}
	if pids := processesNaming(s.Layout().QMPSocket("v")); len(pids) > 0 {
		t.Errorf("qemu-storage-daemon (pids %v) still runs after the failed start", pids)
	}
}

// TestEngineGuestPowersOffAtBoot: a guest that powers off right after
// vm.boot answered (an init or workload that exits at once) took the VMM
// down before the engine's state check, yet it did boot: the create
// succeeds and the monitor records the guest's shutdown.
func TestEngineGuestPowersOffAtBoot(t *testing.T) {
	s, _, root := engineService(t, func(o *Options) { o.CH.PreArgs = []string{"--sim-poweroff-at-boot"} })
	sp := baseSpec(t, root, "off")
	sp.AutoBoot = true
	if _, _, err := s.CreateVM(context.Background(), sp); err != nil {
		t.Fatalf("CreateVM = %v, want the boot to count", err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		r, err := s.Get(record.ModeVM, "off")
		if err != nil {
			t.Fatal(err)
		}
		if r.State == record.StateStopped && r.FailureReason != nil && r.FailureReason.Cause == record.CauseGuestShutdown {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("record %+v (failure %+v), want stopped by the guest", r, r.FailureReason)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestEngineRecoverFinishesInterruptedDelete: the agent died during a
// delete, after the intent was recorded and part of the VM torn down (its
// root disk gone, its processes still running). The next agent finishes
// the delete: processes, directories and record gone. A VM that is not
// running and whose root disk is gone (what an unrecorded interrupted
// delete used to leave) is failed with disk_missing rather than shown
// healthy, and so is one whose end recovery records (here an interrupted
// stop); an intact neighbour is untouched.
func TestEngineRecoverFinishesInterruptedDelete(t *testing.T) {
	s, e, root := engineService(t, nil)
	ctx := context.Background()
	for _, id := range []string{"del", "nodisk", "keep", "stopcut"} {
		sp := baseSpec(t, root, id)
		sp.AutoBoot = id == "del" || id == "stopcut"
		if _, _, err := s.CreateVM(ctx, sp); err != nil {
			t.Fatal(err)
		}
	}
	// stopcut: an operator stop cut short (processes ended, not recorded)
	// by a delete's teardown that removed its disk.
	if _, err := s.Act(ctx, record.ModeVM, "stopcut", vm.ActionStop); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Records().Update("stopcut", func(r *record.Record) {
		r.State, r.DisplayState, r.FailureReason = record.StateRunning, string(record.StateRunning), nil
	}); err != nil {
		t.Fatal(err)
	}
	l := s.Layout()
	del, _ := s.Get(record.ModeVM, "del")
	ch, qsd := del.Runtime.CH, del.Runtime.QSD
	if _, err := s.Records().Update("del", func(r *record.Record) { r.Deleting = true }); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{l.RootDisk("del"), l.RootDisk("nodisk"), l.RootDisk("stopcut")} {
		if err := os.Remove(p); err != nil {
			t.Fatal(err)
		}
	}
	e.Close()
	e2, err := New(e.o)
	if err != nil {
		t.Fatal(err)
	}
	b := startEngineService(t, e2, nil)
	defer e2.Close()
	rep := e2.Recovery()
	if !slices.Equal(rep.Deleted, []string{"del"}) || !slices.Equal(rep.NoDisk, []string{"nodisk"}) {
		t.Errorf("recovery deleted %v, no disk %v; want [del], [nodisk]", rep.Deleted, rep.NoDisk)
	}
	if _, err := b.Get(record.ModeVM, "del"); err == nil {
		t.Error("the interrupted delete's record is still there")
	}
	for _, p := range []string{l.VMDir("del"), l.RunVMDir("del"), l.StateDir + "/vms/del.json"} {
		if _, err := os.Lstat(p); err == nil {
			t.Errorf("%s left behind", p)
		}
	}
	if proc.Alive(ch.Pid, ch.StartTime) || proc.Alive(qsd.Pid, qsd.StartTime) {
		t.Error("the interrupted delete's processes still run")
	}
	for _, id := range []string{"nodisk", "stopcut"} {
		r, err := b.Get(record.ModeVM, id)
		if err != nil {
			t.Fatal(err)
		}
		if f := r.FailureReason; r.State != record.StateFailed || f == nil || f.Detail.Kind != record.KindDiskMissing ||
			f.Cause != record.CauseDiskMissing || f.Detail.Path != l.RootDisk(id) {
			t.Errorf("VM without its root disk after the restart: %s", describe(r))
		}
	}
	if r, _ := b.Get(record.ModeVM, "keep"); r == nil || r.State != record.StateCreated || r.FailureReason != nil {
		t.Errorf("intact VM after the restart: %s", describe(r))
	}
	if _, err := b.Act(ctx, record.ModeVM, "keep", vm.ActionStart); err != nil {
		t.Errorf("start of the intact VM: %v", err)
	}
	// Through b: the first service's cleanup does not know this boot.
	defer b.Delete(ctx, record.ModeVM, "keep", true)
}

// stalledImageServer answers every request with headers and then nothing,
// until the test ends.
func stalledImageServer(t *testing.T) string {
	t.Helper()
	stop := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", "1048576")
		w.WriteHeader(http.StatusOK)
		w.(http.Flusher).Flush()
		select {
		case <-stop:
		case <-r.Context().Done():
		}
	}))
	t.Cleanup(func() { close(stop); srv.Close() })
	return srv.URL + "/image.qcow2"
}

// TestEngineDeleteCancelsProvision: a VM whose image download stalls
// (headers, then nothing) stays downloading; a delete without force is
// refused, a forced delete cancels the download and removes the VM, its
// directories and the download's temp file, and the cancelled background
// provision records nothing afterwards.
func TestEngineDeleteCancelsProvision(t *testing.T) {
	s, _, root := engineService(t, nil)
	ctx := context.Background()
	sp := baseSpec(t, root, "stall")
	sp.Disk.BasePath = ""
	sp.Image = &record.ImageSpec{ImageID: "img", ContentSHA256: strings.Repeat("ab", 32), FetchURL: stalledImageServer(t)}
	if _, async, err := s.CreateVM(ctx, sp); err != nil || !async {
		t.Fatalf("CreateVM = %v, async %v", err, async)
	}
	l := s.Layout()
	// Wait until the download has begun (its temp file exists).
	deadline := time.Now().Add(10 * time.Second)
	for {
		ents, _ := os.ReadDir(l.StateDir + "/images")
		if len(ents) > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the download never began")
		}
		time.Sleep(10 * time.Millisecond)
	}
	var se *record.StateError
	if err := s.Delete(ctx, record.ModeVM, "stall", false); !errors.As(err, &se) {
		t.Fatalf("delete without force while downloading = %v, want a StateError", err)
	}
	start := time.Now()
	if err := s.Delete(ctx, record.ModeVM, "stall", true); err != nil {
		t.Fatalf("forced delete while downloading: %v", err)
	}
	t.Logf("forced delete of a stalled download took %v", time.Since(start))
	s.Wait() // the background provision has returned
	if _, err := s.Get(record.ModeVM, "stall"); err == nil {
		t.Error("the record survived the delete")
	}
	for _, p := range []string{l.VMDir("stall"), l.RunVMDir("stall"), l.StateDir + "/vms/stall.json"} {
		if _, err := os.Lstat(p); err == nil {
			t.Errorf("%s left behind", p)
		}
	}
	if ents, _ := os.ReadDir(l.StateDir + "/images"); len(ents) != 0 {
		t.Errorf("image cache holds %v after the cancelled download", ents)
	}
}

// TestEngineBalloon: a running VM's balloon changes through CH vm.resize
// (vm.info shows the new size and the memory the guest has left); the
// target is recorded, and a VM booted later gets its balloon at that size.
func TestEngineBalloon(t *testing.T) {
	s, e, root := engineService(t, nil)
	ctx := context.Background()
	sp := baseSpec(t, root, "bal")
	sp.AutoBoot = true
	sp.MemoryMB = 512
	rec, _, err := s.CreateVM(ctx, sp)
	if err != nil || rec.State != record.StateRunning {
		t.Fatalf("CreateVM = %+v, %v", rec, err)
	}
	if _, err := s.SetBalloon(ctx, record.ModeVM, "bal", 128); err != nil {
		t.Fatal(err)
	}
	c, err := e.client(s.Records().Get("bal"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	info, err := c.VMInfo(ctx)
	if err != nil {
		t.Fatal(err)
	}
	mem := sp.MemoryMB << 20
	if info.Config.Balloon == nil || info.Config.Balloon.Size != 128<<20 || !info.Config.Balloon.DeflateOnOom || info.MemoryActualSize != mem-128<<20 {
		t.Errorf("after balloon 128: balloon %+v, memory_actual_size %d (memory %d)", info.Config.Balloon, info.MemoryActualSize, mem)
	}
	if got, _ := s.Get(record.ModeVM, "bal"); got.BalloonMB != 128 {
		t.Errorf("recorded balloon_mb = %d", got.BalloonMB)
	}
	// Stopped: recorded only; the next boot's config carries it.
	if _, err := s.Act(ctx, record.ModeVM, "bal", "stop"); err != nil {
		t.Fatal(err)
	}
	if _, err := s.SetBalloon(ctx, record.ModeVM, "bal", 64); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Act(ctx, record.ModeVM, "bal", "start"); err != nil {
		t.Fatal(err)
	}
	c2, err := e.client(s.Records().Get("bal"))
	if err != nil {
		t.Fatal(err)
	}
	defer c2.Close()
	if info, err = c2.VMInfo(ctx); err != nil || info.Config.Balloon == nil || info.Config.Balloon.Size != 64<<20 {
		t.Errorf("booted after balloon 64 while stopped: %+v, %v", info, err)
	}
	s.Delete(ctx, record.ModeVM, "bal", true)
}

// TestEngineCounters: the counters of a running VM are Cloud Hypervisor's
// vm.counters, per device; a stopped VM has none (a state error).
func TestEngineCounters(t *testing.T) {
	s, _, root := engineService(t, nil)
	ctx := context.Background()
	sp := baseSpec(t, root, "cnt")
	sp.AutoBoot = true
	rec, _, err := s.CreateVM(ctx, sp)
	if err != nil {
		t.Fatal(err)
	}
	got, err := s.Counters(ctx, rec)
	if err != nil {
		t.Fatal(err)
	}
	if d, ok := got["_disk0"]; !ok || len(d) != 10 {
		t.Errorf("counters = %v, want _disk0 with CH's 10 block counters", got)
	}
	rec, err = s.Act(ctx, record.ModeVM, "cnt", "stop")
	if err != nil {
		t.Fatal(err)
	}
	var se *record.StateError
	if _, err := s.Counters(ctx, rec); !errors.As(err, &se) {
		t.Errorf("counters of a stopped VM = %v, want a state error", err)
	}
	s.Delete(ctx, record.ModeVM, "cnt", true)
}
