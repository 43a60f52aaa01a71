package engine

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"vmhost/proc"
	"vmhost/store"
	"vmhost/vm/record"
	"vmhost/vm/records"
)

// gatedStore is the records' store with every write waiting for gate: a
// test holds gate to slow the writes down.
type gatedStore struct {
	records.Store
	gate *sync.Mutex
}

func (g gatedStore) Put(id string, data []byte) error {
	g.gate.Lock()
	defer g.gate.Unlock()
	return g.Store.Put(id, data)
}

// gatedService is simService with the record writes behind the returned
// gate.
func gatedService(t *testing.T) (*testService, *sync.Mutex) {
	t.Helper()
	gate := new(sync.Mutex)
	s := newTestServiceWith(t, testOpts{sims: true, store: func(st records.Store) records.Store { return gatedStore{st, gate} }})
	return s, gate
}

// TestEngineFailedCreateRollsBack: the storage daemon cannot start, after
// the disks were made. The create fails with a storage error and its
// rollback leaves nothing of the VM, while a neighbour's directory and the
// base image are untouched.
func TestEngineFailedCreateRollsBack(t *testing.T) {
	// A storage daemon that exits at once: preflight finds the program,
	// the provision's launch fails.
	s := simService(t, func(o *Options) { o.QSD = Program{Binary: falseProgram(t)} })
	l := s.lay
	neighbour := l.VMDir("other") + "/keep.qcow2"
	if err := os.MkdirAll(filepath.Dir(neighbour), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(neighbour, []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	sp := baseSpec(t, s.root, "doomed")
	_, err := s.create(context.Background(), sp)
	var he *record.HostError
	if !errors.As(err, &he) || he.Kind != record.HostStorage {
		t.Fatalf("create = %v, want a storage HostError", err)
	}
	for _, p := range []string{l.VMDir("doomed"), l.RunVMDir("doomed"), l.StateDir + "/vms/doomed.json"} {
		if _, err := os.Lstat(p); err == nil {
			t.Errorf("%s left behind", p)
		}
	}
	if s.recs.Get("doomed") != nil {
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
	if err := s.recs.Create(rec); err != nil {
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

// countingStore counts the record writes of each id.
type countingStore struct {
	records.Store
	mu   *sync.Mutex
	puts map[string]int
}

func (c countingStore) Put(id string, data []byte) error {
	c.mu.Lock()
	c.puts[id]++
	c.mu.Unlock()
	return c.Store.Put(id, data)
}

// TestEngineCreateRecordsResultOnce: a synchronous create with auto_boot
// (root disk, data volume, run directory, storage daemon, CH) stores its
// record twice, whatever the number of steps: the create's intent, and
// the boot, whose write holds the provision's result (staged into it); the
// engine itself writes once. The stored record then holds every step, the
// CID, both processes and the states.
func TestEngineCreateRecordsResultOnce(t *testing.T) {
	cs := countingStore{mu: new(sync.Mutex), puts: map[string]int{}}
	s := newTestServiceWith(t, testOpts{sims: true, store: func(st records.Store) records.Store { cs.Store = st; return cs }})
	sp := baseSpec(t, s.root, "once")
	sp.AutoBoot = true
	s.mustCreate(t, sp)
	cs.mu.Lock()
	n := cs.puts["once"]
	cs.mu.Unlock()
	if n != 2 {
		t.Errorf("the record was stored %d times, want 2 (the create's intent; the boot, with the provision's result)", n)
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
	s := simService(t, func(o *Options) { o.CH = Program{Binary: falseProgram(t)} })
	sp := baseSpec(t, s.root, "nobooted")
	sp.AutoBoot = true
	if _, err := s.create(context.Background(), sp); err == nil {
		t.Fatal("a create whose CH cannot start succeeded")
	}
	mem := s.recs.Get("nobooted")
	if mem == nil {
		t.Fatal("the VM was not kept")
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
func storedRecord(t *testing.T, s *testService, id string) *record.Record {
	t.Helper()
	st, err := store.Open(filepath.Join(s.state, "vms"))
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

// slowStore's writes take 50 ms longer.
type slowStore struct{ records.Store }

func (s slowStore) Put(id string, data []byte) error {
	time.Sleep(50 * time.Millisecond)
	return s.Store.Put(id, data)
}

// TestEngineConcurrentCreatesGetDistinctCIDs: record writes of different
// VMs run side by side, and concurrent creates still get distinct vsock
// CIDs.
func TestEngineConcurrentCreatesGetDistinctCIDs(t *testing.T) {
	// Each write lingers after its change is made, so the writes of the
	// concurrent creates overlap.
	s := newTestServiceWith(t, testOpts{sims: true, store: func(st records.Store) records.Store { return slowStore{st} }})
	const n = 8
	cids := make(chan uint32, n)
	var wg sync.WaitGroup
	for i := range n {
		sp := baseSpec(t, s.root, "cc"+strconv.Itoa(i))
		wg.Add(1)
		go func() {
			defer wg.Done()
			rec, err := s.create(context.Background(), sp)
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
	s := simService(t, nil)
	ctx := context.Background()
	var cids []uint32
	for _, id := range []string{"a", "b"} {
		sp := baseSpec(t, s.root, id)
		sp.AutoBoot = id == "a"
		rec, err := s.create(ctx, sp)
		if err != nil {
			t.Fatalf("create(%s) = %v", id, err)
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
	if err := s.remove(ctx, "a"); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(s.lay.VMDir("a")); err == nil {
		t.Error("VM directory left after delete")
	}
	// The freed CID is given again.
	rec, err := s.create(ctx, baseSpec(t, s.root, "c"))
	if err != nil {
		t.Fatal(err)
	}
	if rec.Runtime.VsockCID != cids[0] {
		t.Errorf("CID after delete = %d, want the freed %d", rec.Runtime.VsockCID, cids[0])
	}
}

// falseProgram is a program that exists and exits 1 at once.
func falseProgram(t *testing.T) string {
	t.Helper()
	p, err := exec.LookPath("false")
	if err != nil {
		t.Skip("no false(1) in PATH")
	}
	return p
}

// TestEngineWithoutTaps: an engine that cannot create taps (an agent
// without root) refuses a VM with interfaces in Preflight, before
// anything is stored, naming the reason (400: a host precondition).
func TestEngineWithoutTaps(t *testing.T) {
	s := simService(t, func(o *Options) { o.NoTapsReason = "creating taps needs root" })
	sp := baseSpec(t, s.root, "nic")
	sp.Nets = []record.NetSpec{{}}
	_, err := s.create(context.Background(), sp)
	var fe *record.FieldError
	if !errors.As(err, &fe) || fe.Field != "nets[0]" || !strings.Contains(err.Error(), "creating taps needs root") {
		t.Fatalf("create with a NIC = %v, want a FieldError on nets[0] with the reason", err)
	}
	if _, err := os.Stat(s.lay.VMDir("nic")); err == nil {
		t.Error("files were made before the refusal")
	}
	if s.recs.Get("nic") != nil {
		t.Error("a record was stored")
	}
}

// TestEngineFailedBootKillsHungVMM: a VMM that hangs as soon as its API
// socket exists and does not react to SIGTERM makes vm.create fail; the
// failed boot still ends it (SIGKILL) instead of leaving it running with
// its identity cleared from the record.
func TestEngineFailedBootKillsHungVMM(t *testing.T) {
	s := simService(t, func(o *Options) { o.StopGrace = 100 * time.Millisecond })
	ctx := context.Background()
	s.mustCreate(t, baseSpec(t, s.root, "hung"))
	sock := s.lay.APISocket("hung")
	s.o.CH.Env = append(simEnv("sim-ch"), freezeOnEnv+"="+sock)
	t.Cleanup(func() {
		for _, pid := range processesNaming(sock) {
			syscall.Kill(pid, syscall.SIGKILL)
		}
	})
	actx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	if _, err := s.act(actx, "hung", "start"); err == nil {
		t.Fatal("starting a VM whose VMM hangs succeeded")
	}
	if pids := processesNaming(sock); len(pids) > 0 {
		t.Errorf("the hung VMM (pids %v) still runs after the failed boot", pids)
	}
	if r := s.recs.Get("hung"); r.Runtime.CH != nil || r.State != record.StateCreated {
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
		action string
		ok     func(*record.Record) bool // the record keeps the failure
	}{
		{name: "stop after a CH crash", action: "stop",
			kill: func(r *record.Record) int { return r.Runtime.CH.Pid },
			ok: func(r *record.Record) bool {
				f := r.FailureReason
				return r.State == record.StateFailed && f != nil && f.Detail.Kind == record.KindProcessSignal && f.Cause == record.CauseCHCrash
			}},
		// vm.pause reaches CH, which still runs, while the storage failure
		// is being recorded.
		{name: "pause after a storage failure", action: "pause",
			kill: func(r *record.Record) int { return r.Runtime.QSD.Pid },
			ok: func(r *record.Record) bool {
				f := r.FailureReason
				return r.State == record.StateFailed && r.DisplayState == string(record.StateFailed) && f != nil && strings.Contains(f.Summary, "qemu-storage-daemon")
			}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, gate := gatedService(t)
			ctx := context.Background()
			sp := baseSpec(t, s.root, "v")
			sp.AutoBoot = true
			rec, err := s.create(ctx, sp)
			if err != nil || rec.State != record.StateRunning {
				t.Fatalf("create = %v, %v", rec, err)
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
				_, err := s.act(ctx, "v", tc.action)
				acted <- err
			}()
			time.Sleep(300 * time.Millisecond) // the action decides what to do
			gate.Unlock()
			held = false
			if err := <-acted; !errors.As(err, new(*record.StateError)) {
				t.Errorf("%s during the verdict = %v, want *StateError", tc.action, err)
			}
			if r := s.recs.Get("v"); !tc.ok(r) {
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
	s, gate := gatedService(t)
	ctx := context.Background()
	sp := baseSpec(t, s.root, "v")
	sp.AutoBoot = true
	rec, err := s.create(ctx, sp)
	if err != nil || rec.State != record.StateRunning {
		t.Fatalf("create = %v, %v", rec, err)
	}
	// A guest that reacts to the button has activated its devices (chsim
	// does so on its own shortly after boot).
	waitRecord(t, s, "v", 10*time.Second, "guest up", func(r *record.Record) bool { return r.DisplayState == string(record.StateRunning) })
	gate.Lock()
	held := true
	defer func() {
		if held {
			gate.Unlock()
		}
	}()
	done := make(chan error, 1)
	go func() {
		_, err := s.act(ctx, "v", "shutdown")
		done <- err
	}()
	time.Sleep(300 * time.Millisecond) // time for the guest to power off, were the button pressed
	gate.Unlock()
	held = false
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	r, _ := waitRecord(t, s, "v", 10*time.Second, "VM stopped", func(r *record.Record) bool { return r.State != record.StateRunning })
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
	s := simService(t, nil)
	ctx := context.Background()
	sp := baseSpec(t, s.root, "v")
	sp.AutoBoot = true
	s.mustCreate(t, sp)
	if _, err := s.act(ctx, "v", "stop"); err != nil {
		t.Fatal(err)
	}
	// The record as the stop left it between its two writes.
	if _, err := s.recs.Update("v", func(r *record.Record) {
		r.State, r.DisplayState, r.FailureReason = record.StateRunning, string(record.StateRunning), nil
	}); err != nil {
		t.Fatal(err)
	}
	b := s.restart(t)
	if r := b.recs.Get("v"); r.State != record.StateStopped || r.FailureReason == nil || r.FailureReason.Cause != record.CauseOperatorShutdown {
		t.Errorf("record after the restart: %s", describe(r))
	}
	if rep := b.Recovery(); !slices.Equal(rep.Ended, []string{"v"}) {
		t.Errorf("recovery = %+v, want v ended", rep)
	}
}

// TestEngineFailedStartStopsStorage: a stopped VM whose start fails (CH
// cannot be launched) is left running nothing: the storage daemon the
// start launched is stopped and forgotten.
func TestEngineFailedStartStopsStorage(t *testing.T) {
	s := simService(t, nil)
	ctx := context.Background()
	sp := baseSpec(t, s.root, "v")
	sp.AutoBoot = true
	s.mustCreate(t, sp)
	if _, err := s.act(ctx, "v", "stop"); err != nil {
		t.Fatal(err)
	}
	s.o.CH.Binary = "/nonexistent/cloud-hypervisor"
	if _, err := s.act(ctx, "v", "start"); err == nil {
		t.Fatal("start without a hypervisor binary succeeded")
	}
	if r := s.recs.Get("v"); r.State != record.StateStopped || r.Runtime.QSD != nil || r.Runtime.CH != nil {
		t.Errorf("record after the failed start: %s", describe(r))
	}
	if pids := processesNaming(s.lay.QMPSocket("v")); len(pids) > 0 {
		t.Errorf("qemu-storage-daemon (pids %v) still runs after the failed start", pids)
	}
}

// TestEngineGuestPowersOffAtBoot: a guest that powers off right after
// vm.boot answered (an init or workload that exits at once) took the VMM
// down before the engine's state check, yet it did boot: the create
// succeeds and the monitor records the guest's shutdown.
func TestEngineGuestPowersOffAtBoot(t *testing.T) {
	s := simService(t, func(o *Options) { o.CH.PreArgs = []string{"--sim-poweroff-at-boot"} })
	sp := baseSpec(t, s.root, "off")
	sp.AutoBoot = true
	if _, err := s.create(context.Background(), sp); err != nil {
		t.Fatalf("create = %v, want the boot to count", err)
	}
	waitRecord(t, s, "off", 5*time.Second, "stopped by the guest", func(r *record.Record) bool {
		return r.State == record.StateStopped && r.FailureReason != nil && r.FailureReason.Cause == record.CauseGuestShutdown
	})
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
	s := simService(t, nil)
	ctx := context.Background()
	for _, id := range []string{"del", "nodisk", "keep", "stopcut"} {
		sp := baseSpec(t, s.root, id)
		sp.AutoBoot = id == "del" || id == "stopcut"
		s.mustCreate(t, sp)
	}
	// stopcut: an operator stop cut short (processes ended, not recorded)
	// by a delete's teardown that removed its disk.
	if _, err := s.act(ctx, "stopcut", "stop"); err != nil {
		t.Fatal(err)
	}
	if _, err := s.recs.Update("stopcut", func(r *record.Record) {
		r.State, r.DisplayState, r.FailureReason = record.StateRunning, string(record.StateRunning), nil
	}); err != nil {
		t.Fatal(err)
	}
	l := s.lay
	del := s.recs.Get("del")
	ch, qsd := del.Runtime.CH, del.Runtime.QSD
	if _, err := s.recs.Update("del", func(r *record.Record) { r.Deleting = true }); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{l.RootDisk("del"), l.RootDisk("nodisk"), l.RootDisk("stopcut")} {
		if err := os.Remove(p); err != nil {
			t.Fatal(err)
		}
	}
	b := s.restart(t)
	rep := b.Recovery()
	if !slices.Equal(rep.Deleted, []string{"del"}) || !slices.Equal(rep.NoDisk, []string{"nodisk"}) {
		t.Errorf("recovery deleted %v, no disk %v; want [del], [nodisk]", rep.Deleted, rep.NoDisk)
	}
	if b.recs.Get("del") != nil {
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
		r := b.recs.Get(id)
		if f := r.FailureReason; r.State != record.StateFailed || f == nil || f.Detail.Kind != record.KindDiskMissing ||
			f.Cause != record.CauseDiskMissing || f.Detail.Path != l.RootDisk(id) {
			t.Errorf("VM without its root disk after the restart: %s", describe(r))
		}
	}
	if r := b.recs.Get("keep"); r == nil || r.State != record.StateCreated || r.FailureReason != nil {
		t.Errorf("intact VM after the restart: %s", describe(r))
	}
	if _, err := b.act(ctx, "keep", "start"); err != nil {
		t.Errorf("start of the intact VM: %v", err)
	}
	defer b.remove(ctx, "keep")
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
// (headers, then nothing) stays downloading; a delete cancels the
// download and removes the VM, its directories and the download's temp
// file, and the cancelled provision answers record.ErrDeleted and records
// nothing afterwards.
func TestEngineDeleteCancelsProvision(t *testing.T) {
	s := simService(t, nil)
	ctx := context.Background()
	sp := baseSpec(t, s.root, "stall")
	sp.Disk.BasePath = ""
	sp.Image = &record.ImageSpec{ImageID: "img", ContentSHA256: strings.Repeat("ab", 32), FetchURL: stalledImageServer(t)}
	rec := newRecord(sp)
	if err := s.recs.Create(rec); err != nil {
		t.Fatal(err)
	}
	provisioned := make(chan error, 1)
	go func() { provisioned <- s.Provision(ctx, rec) }() // in the background, as for a create answered 202
	l := s.lay
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
	if r := s.recs.Get("stall"); !r.Provisioning() {
		t.Fatalf("VM with a stalled download: %s, want provisioning", describe(r))
	}
	start := time.Now()
	if err := s.remove(ctx, "stall"); err != nil {
		t.Fatalf("delete while downloading: %v", err)
	}
	t.Logf("delete of a stalled download took %v", time.Since(start))
	if err := <-provisioned; !errors.Is(err, record.ErrDeleted) {
		t.Errorf("the cancelled provision returned %v, want record.ErrDeleted", err)
	}
	if s.recs.Get("stall") != nil {
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
// (vm.info shows the new size and the memory the guest has left); a VM
// booted later gets its balloon at the recorded target.
func TestEngineBalloon(t *testing.T) {
	s := simService(t, nil)
	ctx := context.Background()
	sp := baseSpec(t, s.root, "bal")
	sp.AutoBoot = true
	sp.MemoryMB = 512
	rec := s.mustCreate(t, sp)
	if rec.State != record.StateRunning {
		t.Fatalf("create = %+v", rec)
	}
	if err := s.Balloon(ctx, rec, 128); err != nil {
		t.Fatal(err)
	}
	c, err := s.client(s.recs.Get("bal"))
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
	// Stopped: the target is only recorded (vm's part); the next boot's
	// config carries it.
	if _, err := s.act(ctx, "bal", "stop"); err != nil {
		t.Fatal(err)
	}
	if _, err := s.recs.Update("bal", func(r *record.Record) { r.BalloonMB = 64 }); err != nil {
		t.Fatal(err)
	}
	if _, err := s.act(ctx, "bal", "start"); err != nil {
		t.Fatal(err)
	}
	c2, err := s.client(s.recs.Get("bal"))
	if err != nil {
		t.Fatal(err)
	}
	defer c2.Close()
	if info, err = c2.VMInfo(ctx); err != nil || info.Config.Balloon == nil || info.Config.Balloon.Size != 64<<20 {
		t.Errorf("booted after balloon 64 while stopped: %+v, %v", info, err)
	}
	s.remove(ctx, "bal")
}

// TestEngineCounters: the counters of a running VM are Cloud Hypervisor's
// vm.counters, per device; a stopped VM has none (a state error).
func TestEngineCounters(t *testing.T) {
	s := simService(t, nil)
	ctx := context.Background()
	sp := baseSpec(t, s.root, "cnt")
	sp.AutoBoot = true
	rec := s.mustCreate(t, sp)
	got, err := s.Counters(ctx, rec)
	if err != nil {
		t.Fatal(err)
	}
	if d, ok := got["_disk0"]; !ok || len(d) != 10 {
		t.Errorf("counters = %v, want _disk0 with CH's 10 block counters", got)
	}
	rec, err = s.act(ctx, "cnt", "stop")
	if err != nil {
		t.Fatal(err)
	}
	var se *record.StateError
	if _, err := s.Counters(ctx, rec); !errors.As(err, &se) {
		t.Errorf("counters of a stopped VM = %v, want a state error", err)
	}
	s.remove(ctx, "cnt")
}

// recordingGuest is a Guest that writes each call as a line and returns
// initrd from Boot; Stop fails with stopErr when set.
type recordingGuest struct {
	initrd  string
	mu      sync.Mutex
	calls   []string
	stopErr error
	ls      []net.Listener
}

func (g *recordingGuest) log(f string, args ...any) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.calls = append(g.calls, fmt.Sprintf(f, args...))
}

func (g *recordingGuest) transcript() string {
	g.mu.Lock()
	defer g.mu.Unlock()
	return strings.Join(g.calls, "\n")
}

func (g *recordingGuest) Port() uint32 { return 1024 }

func (g *recordingGuest) Boot(_ context.Context, rec *record.Record, kernel string, l net.Listener) (string, error) {
	g.log("boot %s kernel=%s listener=%s", rec.ID, filepath.Base(kernel), filepath.Base(l.Addr().String()))
	g.mu.Lock()
	g.ls = append(g.ls, l)
	g.mu.Unlock()
	return g.initrd, nil
}

func (g *recordingGuest) Adopt(_ context.Context, rec *record.Record, l net.Listener) error {
	g.log("adopt %s", rec.ID)
	return l.Close()
}

func (g *recordingGuest) Resume(_ context.Context, rec *record.Record, l net.Listener) error {
	g.log("resume %s listener=%s", rec.ID, filepath.Base(l.Addr().String()))
	g.mu.Lock()
	g.ls = append(g.ls, l)
	g.mu.Unlock()
	return nil
}

func (g *recordingGuest) End(id string) {
	g.log("end %s", id)
	g.mu.Lock()
	defer g.mu.Unlock()
	for _, l := range g.ls {
		l.Close()
	}
	g.ls = nil
}

func (g *recordingGuest) Stop(_ context.Context, rec *record.Record) error {
	g.log("stop %s", rec.ID)
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.stopErr
}

func (g *recordingGuest) Settle(id string) { g.log("settle %s", id) }

func (g *recordingGuest) Mount(_ context.Context, rec *record.Record, v record.VolumeSpec, bdf string) error {
	g.log("mount %s %s at %s", rec.ID, v.ID, v.Mountpoint)
	return nil
}

func (g *recordingGuest) Unmount(_ context.Context, rec *record.Record, v record.VolumeSpec) error {
	g.log("unmount %s %s at %s", rec.ID, v.ID, v.Mountpoint)
	return nil
}

// TestEngineAppVMGuestEdges: the engine drives an AppVM's guest end at the
// edges of its boots, and a classic VM's never. A boot hands the guest end
// a listener on the agent's port of the VM's hybrid vsock before CH starts
// and puts the initramfs it returns in CH's payload; a shutdown asks the
// guest end first (and presses the power button when that fails); a stop
// ends the guest end; a guest that powers off is settled before its end
// is recorded.
func TestEngineAppVMGuestEdges(t *testing.T) {
	g := &recordingGuest{}
	// No guest agent in the simulator: the test plays the guest end.
	s := newTestServiceWith(t, testOpts{sims: true, guest: g, edit: func(o *Options) { o.CH.PreArgs = []string{"--sim-no-guest-agent"} }})
	g.initrd = filepath.Join(s.root, "agent.cpio")
	if err := os.WriteFile(g.initrd, []byte("cpio"), 0o600); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	for _, mode := range []record.Mode{record.ModeVM, record.ModeAppVM} {
		sp := baseSpec(t, s.root, string(mode))
		sp.Volumes = nil
		rec := newRecord(sp)
		rec.Mode = mode
		if mode == record.ModeAppVM {
			rec.AppVM = &record.AppVMSpec{ImageID: "img", NetworkMode: "dhcp", RestartPolicy: "no"}
		}
		if err := s.recs.Create(rec); err != nil {
			t.Fatal(err)
		}
		if err := s.Provision(ctx, rec); err != nil {
			t.Fatal(err)
		}
		if _, err := s.act(ctx, rec.ID, "start"); err != nil {
			t.Fatal(err)
		}
		c, err := s.client(s.recs.Get(rec.ID))
		if err != nil {
			t.Fatal(err)
		}
		info, err := c.VMInfo(ctx)
		c.Close()
		if err != nil {
			t.Fatal(err)
		}
		if want := map[record.Mode]string{record.ModeAppVM: g.initrd}[mode]; info.Config.Payload.Initramfs != want {
			t.Errorf("%s booted with initramfs %q, want %q", mode, info.Config.Payload.Initramfs, want)
		}
		waitRecord(t, s, rec.ID, 10*time.Second, "guest up", func(r *record.Record) bool {
			return mode == record.ModeAppVM || r.DisplayState == string(record.StateRunning)
		})
		if _, err := s.act(ctx, rec.ID, "shutdown"); err != nil {
			t.Fatal(err)
		}
		if _, err := s.act(ctx, rec.ID, "stop"); err != nil {
			t.Fatal(err)
		}
	}
	// The guest end cannot stop the workload: the power button does; the
	// guest powers off, and what it sent is settled before its end.
	g.stopErr = errors.New("not connected")
	if _, err := s.act(ctx, "appvm", "start"); err != nil {
		t.Fatal(err)
	}
	// A guest that reacts to the button has activated its devices (chsim
	// does so on its own shortly after boot; an AppVM's display does not
	// show it).
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if b, _ := os.ReadFile(s.lay.Events("appvm")); strings.Contains(string(b), "activated") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the AppVM's devices were never activated")
		}
	}
	if _, err := s.act(ctx, "appvm", "shutdown"); err != nil {
		t.Fatal(err)
	}
	r, _ := waitRecord(t, s, "appvm", 10*time.Second, "powered off", func(r *record.Record) bool { return r.State == record.StateStopped })
	if f := r.FailureReason; f == nil || f.Cause != record.CauseOperatorShutdown {
		t.Errorf("record after the power button: %s", describe(r))
	}
	want := `end appvm
boot appvm kernel=vmlinux listener=vsock.sock_1024
stop appvm
end appvm
end appvm
boot appvm kernel=vmlinux listener=vsock.sock_1024
stop appvm
settle appvm`
	if got := g.transcript(); got != want {
		t.Errorf("guest end calls:\n%s\nwant\n%s", got, want)
	}
}

// TestEngineAppVMWithoutKernel: an AppVM on a host whose configuration
// names no appvm_kernel fails to boot before anything starts, saying so,
// and its guest end is not asked to boot.
func TestEngineAppVMWithoutKernel(t *testing.T) {
	g := &recordingGuest{}
	s := newTestServiceWith(t, testOpts{sims: true, guest: g})
	ctx := context.Background()
	sp := baseSpec(t, s.root, "nokernel")
	sp.KernelPath, sp.Volumes = nil, nil
	rec := newRecord(sp)
	rec.Mode = record.ModeAppVM
	rec.AppVM = &record.AppVMSpec{ImageID: "img", NetworkMode: "dhcp", RestartPolicy: "no"}
	if err := s.recs.Create(rec); err != nil {
		t.Fatal(err)
	}
	if err := s.Provision(ctx, rec); err != nil {
		t.Fatal(err)
	}
	_, err := s.act(ctx, "nokernel", "start")
	var he *record.HostError
	want := "preparing the boot of AppVM nokernel: booting AppVM nokernel: " + ErrNoAppVMKernel.Error()
	if !errors.As(err, &he) || he.Kind != record.HostInternal || err.Error() != want || !errors.Is(err, ErrNoAppVMKernel) {
		t.Fatalf("boot without an AppVM kernel = %v, want %q", err, want)
	}
	if r := s.recs.Get("nokernel"); r.State != record.StateCreated || r.Runtime.CH != nil {
		t.Errorf("record after the refused boot: %s", describe(r))
	}
	if got := g.transcript(); strings.Contains(got, "boot") {
		t.Errorf("the guest end was asked to boot: %s", got)
	}
}
