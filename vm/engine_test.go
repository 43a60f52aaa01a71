package vm

import (
	"context"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"vmhost/config"
	"vmhost/qcow2"
	"vmhost/store"
)

// engineService is a Service over an Engine whose CH and QSD are this test
// binary running chsim and qsdsim (TestMain in monitor_test.go).
func engineService(t *testing.T, edit func(*EngineOptions)) (*Service, *Engine, string) {
	t.Helper()
	root, err := os.MkdirTemp("", "vme")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(root) })
	state, run := root+"/s", root+"/r"
	st, err := store.Open(filepath.Join(state, "vms"))
	if err != nil {
		t.Fatal(err)
	}
	cfg := config.Default()
	eo := EngineOptions{Config: cfg,
		CH:  Program{Binary: os.Args[0], Env: simEnv("sim-ch")},
		QSD: Program{Binary: os.Args[0], Env: simEnv("sim-qsd")}}
	if edit != nil {
		edit(&eo)
	}
	e, err := NewEngine(eo)
	if err != nil {
		t.Fatal(err)
	}
	s, err := New(Options{StateDir: state, RunDir: run, Config: cfg, Store: st, Host: e, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		for _, r := range s.List(ModeVM) {
			s.Delete(context.Background(), ModeVM, r.ID, true)
		}
		s.Close()
	})
	return s, e, root
}

// baseSpec is a VM without interfaces on a fresh base image.
func baseSpec(t *testing.T, root, id string) *Spec {
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
	return &Spec{VMID: id, Vcpus: 1, MemoryMB: 128, KernelPath: &kernel,
		Disk: &DiskSpec{BasePath: base, SizeGiB: &size}, Volumes: []VolumeSpec{{SizeGiB: 1}}}
}

// TestEngineFailedCreateRollsBack: the storage daemon cannot start, after
// the disks were made. The create fails with a storage error and nothing
// of the VM is left, while a neighbour's directory and the base image are
// untouched.
func TestEngineFailedCreateRollsBack(t *testing.T) {
	s, _, root := engineService(t, func(o *EngineOptions) { o.QSD = Program{Binary: "/nonexistent/qemu-storage-daemon"} })
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
	var he *HostError
	if !errors.As(err, &he) || he.Kind != HostStorage {
		t.Fatalf("CreateVM = %v, want a storage HostError", err)
	}
	for _, p := range []string{l.VMDir("doomed"), l.RunVMDir("doomed"), l.StateDir + "/vms/doomed.json"} {
		if _, err := os.Lstat(p); err == nil {
			t.Errorf("%s left behind", p)
		}
	}
	if _, err := s.Get(ModeVM, "doomed"); err == nil {
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
	s, e, root := engineService(t, nil)
	l := s.Layout()
	rec := &Record{ID: "half", Mode: ModeVM, State: StateCreated, Spec: *baseSpec(t, root, "half"),
		Runtime: &Runtime{Steps: []string{StepRootDisk, StepRunDir}}}
	if err := s.reg.put(rec); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{l.RootDisk("half"), l.DataVolume("half", 0)} {
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
	if _, err := os.Stat(l.DataVolume("half", 0)); err != nil {
		t.Errorf("the unrecorded data volume was removed: %v", err)
	}
	if _, err := os.Stat(l.RunVMDir("half")); err == nil {
		t.Error("the run directory was kept")
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
		if rt == nil || rt.QSD == nil || !rt.Done(StepRootDisk) || !rt.Done(StepData(0)) || !rt.Done(StepRunDir) || rt.Done(StepSeed) {
			t.Fatalf("runtime of %s = %+v", id, rt)
		}
		cids = append(cids, rt.VsockCID)
		if id == "a" && (rec.State != StateRunning || rt.CH == nil || rec.PID != rt.CH.Pid) {
			t.Errorf("booted record = %+v", rec)
		}
	}
	if cids[0] < 3 || cids[0] == cids[1] {
		t.Errorf("vsock CIDs = %v, want distinct and ≥ 3", cids)
	}
	if err := s.Delete(ctx, ModeVM, "a", false); err == nil {
		t.Error("deleting a running VM without force succeeded")
	}
	if err := s.Delete(ctx, ModeVM, "a", true); err != nil {
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
	s, _, root := engineService(t, func(o *EngineOptions) { o.NoTapsReason = "creating taps needs root" })
	sp := baseSpec(t, root, "nic")
	sp.Nets = []NetSpec{{}}
	_, _, err := s.CreateVM(context.Background(), sp)
	var he *HostError
	if !errors.As(err, &he) || he.Kind != HostNetwork || !strings.Contains(err.Error(), "creating taps needs root") {
		t.Fatalf("CreateVM with a NIC = %v, want a network HostError with the reason", err)
	}
	if _, err := os.Stat(s.Layout().VMDir("nic")); err == nil {
		t.Error("files were made before the refusal")
	}
	if _, err := s.Get(ModeVM, "nic"); err == nil {
		t.Error("a record was stored")
	}
}

// TestEngineFailedBootKillsHungVMM: a VMM that hangs as soon as its API
// socket exists and does not react to SIGTERM makes vm.create fail; the
// failed boot still ends it (SIGKILL) instead of leaving it running with
// its identity cleared from the record.
func TestEngineFailedBootKillsHungVMM(t *testing.T) {
	s, e, root := engineService(t, func(o *EngineOptions) { o.StopGrace = 100 * time.Millisecond })
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
	if _, err := s.Act(actx, ModeVM, "hung", ActionStart); err == nil {
		t.Fatal("starting a VM whose VMM hangs succeeded")
	}
	if pids := processesNaming(sock); len(pids) > 0 {
		t.Errorf("the hung VMM (pids %v) still runs after the failed boot", pids)
	}
	if r, _ := s.Get(ModeVM, "hung"); r.Runtime.CH != nil || r.State != StateCreated {
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
		kill   func(*Record) int // the pid to SIGKILL
		action Action
		ok     func(*Record) bool // the record keeps the failure
	}{
		{name: "stop after a CH crash", action: ActionStop,
			kill: func(r *Record) int { return r.Runtime.CH.Pid },
			ok: func(r *Record) bool {
				f := r.FailureReason
				return r.State == StateFailed && f != nil && f.Detail.Kind == KindProcessSignal && f.Cause == CauseCHCrash
			}},
		// vm.pause reaches CH, which still runs, while the storage failure
		// is being recorded.
		{name: "pause after a storage failure", action: ActionPause,
			kill: func(r *Record) int { return r.Runtime.QSD.Pid },
			ok: func(r *Record) bool {
				f := r.FailureReason
				return r.State == StateFailed && r.DisplayState == string(StateFailed) && f != nil && strings.Contains(f.Summary, "qemu-storage-daemon")
			}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, _, root := engineService(t, nil)
			ctx := context.Background()
			sp := baseSpec(t, root, "v")
			sp.AutoBoot = true
			rec, _, err := s.CreateVM(ctx, sp)
			if err != nil || rec.State != StateRunning {
				t.Fatalf("CreateVM = %v, %v", rec, err)
			}
			s.reg.wmu.Lock()
			held := true
			defer func() {
				if held {
					s.reg.wmu.Unlock()
				}
			}()
			if err := syscall.Kill(tc.kill(rec), syscall.SIGKILL); err != nil {
				t.Fatal(err)
			}
			time.Sleep(300 * time.Millisecond) // the monitor sees the exit at once and waits to record it
			acted := make(chan error, 1)
			go func() {
				_, err := s.Act(ctx, ModeVM, "v", tc.action)
				acted <- err
			}()
			time.Sleep(300 * time.Millisecond) // the action decides what to do
			s.reg.wmu.Unlock()
			held = false
			if err := <-acted; !errors.As(err, new(*StateError)) {
				t.Errorf("%s during the verdict = %v, want *StateError", tc.action, err)
			}
			r, err := s.Get(ModeVM, "v")
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
	s, _, root := engineService(t, nil)
	ctx := context.Background()
	sp := baseSpec(t, root, "v")
	sp.AutoBoot = true
	rec, _, err := s.CreateVM(ctx, sp)
	if err != nil || rec.State != StateRunning {
		t.Fatalf("CreateVM = %v, %v", rec, err)
	}
	(&running{apiSocket: rec.Runtime.CH.APISocket}).sim(t, "activate", "") // a guest that reacts to the button
	s.reg.wmu.Lock()
	held := true
	defer func() {
		if held {
			s.reg.wmu.Unlock()
		}
	}()
	done := make(chan error, 1)
	go func() {
		_, err := s.Act(ctx, ModeVM, "v", ActionShutdown)
		done <- err
	}()
	time.Sleep(300 * time.Millisecond) // time for the guest to power off, were the button pressed
	s.reg.wmu.Unlock()
	held = false
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	var ts testService
	ts.Service = s
	r, _ := waitRecord(t, &ts, "v", 10*time.Second, "VM stopped", func(r *Record) bool { return r.State != StateRunning })
	if f := r.FailureReason; r.State != StateStopped || f == nil || f.Cause != CauseOperatorShutdown || r.ShuttingDown {
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
	if _, err := s.Act(ctx, ModeVM, "v", ActionStop); err != nil {
		t.Fatal(err)
	}
	// The record as the stop left it between its two writes.
	if _, err := s.reg.update("v", func(r *Record) {
		r.State, r.DisplayState, r.FailureReason = StateRunning, string(StateRunning), nil
	}); err != nil {
		t.Fatal(err)
	}
	s.Close()
	e2, err := NewEngine(e.o)
	if err != nil {
		t.Fatal(err)
	}
	b, err := New(Options{StateDir: root + "/s", RunDir: root + "/r", Config: s.o.Config, Store: s.o.Store, Host: e2,
		Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	r, err := b.Get(ModeVM, "v")
	if err != nil {
		t.Fatal(err)
	}
	if f := r.FailureReason; r.State != StateStopped || f == nil || f.Cause != CauseOperatorShutdown {
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
	s, e, root := engineService(t, nil)
	ctx := context.Background()
	sp := baseSpec(t, root, "v")
	sp.AutoBoot = true
	if _, _, err := s.CreateVM(ctx, sp); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Act(ctx, ModeVM, "v", ActionStop); err != nil {
		t.Fatal(err)
	}
	e.o.CH.Binary = "/nonexistent/cloud-hypervisor"
	if _, err := s.Act(ctx, ModeVM, "v", ActionStart); err == nil {
		t.Fatal("start without a hypervisor binary succeeded")
	}
	r, err := s.Get(ModeVM, "v")
	if err != nil {
		t.Fatal(err)
	}
	if r.State != StateStopped || r.Runtime.QSD != nil || r.Runtime.CH != nil {
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
	s, _, root := engineService(t, func(o *EngineOptions) { o.CH.PreArgs = []string{"--sim-poweroff-at-boot"} })
	sp := baseSpec(t, root, "off")
	sp.AutoBoot = true
	if _, _, err := s.CreateVM(context.Background(), sp); err != nil {
		t.Fatalf("CreateVM = %v, want the boot to count", err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		r, err := s.Get(ModeVM, "off")
		if err != nil {
			t.Fatal(err)
		}
		if r.State == StateStopped && r.FailureReason != nil && r.FailureReason.Cause == CauseGuestShutdown {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("record %+v (failure %+v), want stopped by the guest", r, r.FailureReason)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
