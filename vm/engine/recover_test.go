package engine

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"vmhost/chclient"
	"vmhost/proc"
	"vmhost/tap"
	"vmhost/vm/record"
)

// startVMs launches n VMs in parallel (a few at a time) and watches them.
func startVMs(t *testing.T, s *testService, n int) []*running {
	t.Helper()
	rs := make([]*running, n)
	errs := make([]error, n)
	sem := make(chan struct{}, 6)
	var wg sync.WaitGroup
	var mu sync.Mutex
	for i := range n {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			r, stop, err := launchVM(s, fmt.Sprintf("vm%02d", i), vmOpts{})
			if stop != nil {
				mu.Lock()
				t.Cleanup(stop)
				mu.Unlock()
			}
			rs[i], errs[i] = r, err
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	for _, r := range rs {
		s.watch(r.id, r.ch, r.qsd)
	}
	return rs
}

// recordJSON is the record of id as its file holds it: every field a view
// shows derives from it (and the fixed layout and config).
func recordJSON(t testing.TB, s *testService, id string) string {
	t.Helper()
	b, err := record.Encode(s.recs.Get(id))
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// TestRecoverAdoptsRunningVMs restarts the agent (Close, then New on the
// same directories) with 50 running VMs: every one is adopted, none is
// restarted, every record (so every view) is byte-identical, and the adopted processes are
// watched again (a crash and a poweroff after the restart are noticed).
func TestRecoverAdoptsRunningVMs(t *testing.T) {
	n := 50
	if testing.Short() {
		n = 5
	}
	a := newTestService(t)
	rs := startVMs(t, a, n)
	for _, r := range rs {
		waitRecord(t, a, r.id, 10*time.Second, "display running", func(r *record.Record) bool { return r.DisplayState == "running" })
	}
	// A guest panic is replayed from the event stream after the restart:
	// its time must come out the same.
	rs[3].sim(t, "panic", `{"event":"panic"}`)
	waitRecord(t, a, rs[3].id, 2*time.Second, "guest_panicked_at", func(r *record.Record) bool { return r.GuestPanickedAt != nil })
	before := map[string]string{}
	for _, r := range rs {
		before[r.id] = recordJSON(t, a, r.id)
	}
	a.Close()

	start := time.Now()
	b := newTestService(t, a.state, a.run)
	took := time.Since(start)
	rep := b.Recovery()
	t.Logf("agent restart with %d running VMs: New took %v (reconciliation %v)", n, took, rep.Duration)
	if len(rep.Adopted) != n || len(rep.Ended)+len(rep.Killed)+len(rep.Dirs)+len(rep.Resumed) != 0 {
		t.Fatalf("recovery = %+v, want all %d adopted and nothing else", rep, n)
	}
	for _, r := range rs {
		if !b.watched(r.id) {
			t.Errorf("%s is not watched after the restart", r.id)
		}
		if !proc.Alive(r.ch.Pid, r.ch.StartTime) || !proc.Alive(r.qsd.Pid, r.qsd.StartTime) {
			t.Errorf("%s: processes restarted or gone", r.id)
		}
		if got := recordJSON(t, b, r.id); got != before[r.id] {
			t.Errorf("%s record changed across the restart:\nbefore %s\nafter  %s", r.id, before[r.id], got)
		}
	}
	// Let replayed events and a ping round pass: still nothing written.
	// The agent's CPU time meanwhile is what watching n VMs costs.
	var ru0, ru1 syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &ru0)
	time.Sleep(1500 * time.Millisecond)
	syscall.Getrusage(syscall.RUSAGE_SELF, &ru1)
	cpu := time.Duration(ru1.Utime.Nano()+ru1.Stime.Nano()-ru0.Utime.Nano()-ru0.Stime.Nano()) * time.Nanosecond
	t.Logf("watching %d VMs cost %v of CPU per second (test process, race detector %v)", n, cpu*2/3, raceEnabled)
	for _, r := range rs {
		if got := recordJSON(t, b, r.id); got != before[r.id] {
			t.Errorf("%s record changed after the restart settled:\nbefore %s\nafter  %s", r.id, before[r.id], got)
		}
	}

	// Adopted processes are watched: a crash has no readable status; a
	// poweroff is told apart by the event stream.
	rs[1].ch.Signal(syscall.SIGKILL)
	rec, took1 := waitRecord(t, b, rs[1].id, 2*time.Second, "adopted crash noticed", func(r *record.Record) bool { return r.State != record.StateRunning })
	if f := rec.FailureReason; rec.State != record.StateFailed || f.Detail.Kind != record.KindMissingPID || f.Detail.Check() != nil || f.Cause != record.CauseCHCrash {
		t.Errorf("adopted CH killed: %s", describe(rec))
	}
	rs[2].sim(t, "poweroff", "")
	rec, took2 := waitRecord(t, b, rs[2].id, 2*time.Second, "adopted poweroff noticed", func(r *record.Record) bool { return r.State != record.StateRunning })
	if f := rec.FailureReason; rec.State != record.StateStopped || f.Cause != record.CauseGuestShutdown || intp(f.Detail.Code) != "0" {
		t.Errorf("adopted guest poweroff: %s", describe(rec))
	}
	t.Logf("after the restart: crash noticed in %v, poweroff in %v", took1, took2)
	gone(t, "qemu-storage-daemon of the crashed VM", rs[1].qsd.Done())
}

// TestRecoverEndsWhatDiedWhileDown covers VMs whose processes changed
// while the agent was down: CH killed (missing_pid), a guest poweroff
// (stopped, guest_shutdown), QSD killed (storage failure, CH stopped).
func TestRecoverEndsWhatDiedWhileDown(t *testing.T) {
	a := newTestService(t)
	rs := startVMs(t, a, 3)
	for _, r := range rs {
		waitRecord(t, a, r.id, 10*time.Second, "display running", func(r *record.Record) bool { return r.DisplayState == "running" })
	}
	a.Close()
	crashed, poweredOff, noStorage := rs[0], rs[1], rs[2]
	crashed.ch.Signal(syscall.SIGKILL)
	poweredOff.sim(t, "poweroff", "")
	syscall.Kill(noStorage.qsd.Pid, syscall.SIGKILL)
	for _, d := range []<-chan struct{}{crashed.ch.Done(), poweredOff.ch.Done(), noStorage.qsd.Done()} {
		<-d
	}

	b := newTestService(t, a.state, a.run)
	rep := b.Recovery()
	slices.Sort(rep.Ended)
	if !slices.Equal(rep.Ended, []string{"vm00", "vm01", "vm02"}) || len(rep.Adopted) != 0 {
		t.Errorf("recovery = %+v, want vm00-vm02 ended", rep)
	}
	check := func(r *running, state record.State, kind, cause string) {
		t.Helper()
		rec := b.recs.Get(r.id)
		f := rec.FailureReason
		if rec.State != state || rec.DisplayState != string(state) || f == nil || f.Detail.Kind != kind || f.Cause != cause || f.Detail.Check() != nil {
			t.Errorf("%s: %s; want %s %s %s", r.id, describe(rec), state, kind, cause)
		}
		if rec.PID != 0 || (rec.Runtime != nil && (rec.Runtime.CH != nil || rec.Runtime.QSD != nil)) {
			t.Errorf("%s: process identity kept: %s", r.id, describe(rec))
		}
		if b.watched(r.id) {
			t.Errorf("%s is watched", r.id)
		}
	}
	check(crashed, record.StateFailed, record.KindMissingPID, record.CauseCHCrash)
	check(poweredOff, record.StateStopped, record.KindProcessExit, record.CauseGuestShutdown)
	check(noStorage, record.StateFailed, record.KindMissingPID, record.CauseUnknown)
	gone(t, "qemu-storage-daemon of the crashed VM", crashed.qsd.Done())
	gone(t, "cloud-hypervisor of the VM without storage", noStorage.ch.Done())
}

// TestRecoverReapsOrphans leaves behind what an agent killed mid-way
// could: a CH and a QSD whose VM has no record, a CH in a run directory
// without a record, run and VM directories without a record, and
// an interrupted provision with a partial copy and a temp file. Only
// those are reaped; an unrelated process and a damaged record's directory
// stay.
func TestRecoverReapsOrphans(t *testing.T) {
	a := newTestService(t)
	ghost := startVM(t, a, "ghost") // its record is removed below
	kept := startVM(t, a, "kept")   // a running VM whose record stays
	a.watch(kept.id, kept.ch, kept.qsd)
	waitRecord(t, a, kept.id, 10*time.Second, "display running", func(r *record.Record) bool { return r.DisplayState == "running" })
	a.Close()
	if err := a.recs.Remove(ghost.id); err != nil {
		t.Fatal(err)
	}
	l := a.lay
	// A CH whose run directory has no record (an agent killed between
	// launching it and storing the record).
	os.MkdirAll(l.RunVMDir("strayvm"), 0o700)
	stray, err := chclient.Launch(context.Background(), chclient.LaunchConfig{
		Binary: os.Args[0], Env: simEnv("sim-ch"),
		APISocket: l.APISocket("strayvm"), EventMonitor: l.Events("strayvm"), LogFile: l.CHLog("strayvm"),
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { stray.Signal(syscall.SIGKILL) })
	unrelated := exec.Command("sleep", "60")
	if err := unrelated.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unrelated.Process.Kill(); unrelated.Wait() })
	for _, d := range []string{l.VMDir("orphan"), l.RunVMDir("orphan"), l.VMDir("damaged")} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(l.StateDir, "vms", "damaged.json.damaged"), []byte("{"), 0o600); err != nil {
		t.Fatal(err)
	}
	// An interrupted provision: the root disk copy was not recorded done.
	prov := &record.Record{ID: "prov", Mode: record.ModeVM, State: record.StateCreated, DisplayState: record.DisplayCreating,
		Spec: record.Spec{VMID: "prov", Vcpus: 1, MemoryMB: 256}, Runtime: &record.Runtime{Steps: []string{record.StepRunDir}}}
	if err := a.recs.Create(prov); err != nil {
		t.Fatal(err)
	}
	os.MkdirAll(l.VMDir("prov"), 0o700)
	copyTemp := l.VMDir("prov") + "/.root.qcow2.tmp-0123"
	for _, f := range []string{l.RootDisk("prov"), copyTemp} {
		if err := os.WriteFile(f, []byte("partial"), 0o600); err != nil {
			t.Fatal(err)
		}
	}

	// A temp of an interrupted write in the run directory (an AppVM
	// initramfs being written when the agent was killed) and the file
	// such a write publishes, which stays.
	initrdTemp := filepath.Join(l.RunDir, ".appvm-initramfs-0123.cpio.tmp-89ab")
	initrd := filepath.Join(l.RunDir, "appvm-initramfs-0123.cpio")
	// And an AppVM files put's archive, spooled when the agent was killed.
	spoolTemp := filepath.Join(l.SpoolDir(), ".put.tar.tmp-4567")
	os.MkdirAll(l.SpoolDir(), 0o700)
	for _, f := range []string{initrdTemp, initrd, spoolTemp} {
		if err := os.WriteFile(f, []byte("cpio"), 0o600); err != nil {
			t.Fatal(err)
		}
	}

	b := newTestService(t, a.state, a.run)
	b.Wait() // the interrupted synchronous create is rolled back and failed
	rep := b.Recovery()
	slices.Sort(rep.Temps)
	want := []string{initrdTemp, spoolTemp, copyTemp}
	slices.Sort(want)
	if _, err := os.Stat(initrdTemp); !errors.Is(err, fs.ErrNotExist) || !slices.Equal(rep.Temps, want) {
		t.Errorf("temp %s of an interrupted write: %v; reaped temps %v", initrdTemp, err, rep.Temps)
	}
	if _, err := os.Stat(initrd); err != nil {
		t.Errorf("a finished initramfs was removed: %v", err)
	}
	t.Logf("recovery: %+v", rep)
	if !slices.Equal(rep.Adopted, []string{"kept"}) || !slices.Equal(rep.Resumed, []string{"prov"}) {
		t.Errorf("adopted %v, resumed %v; want [kept], [prov]", rep.Adopted, rep.Resumed)
	}
	if len(rep.Killed) != 3 {
		t.Errorf("killed %v, want ghost's CH and QSD and strayvm's CH", rep.Killed)
	}
	for what, done := range map[string]<-chan struct{}{"ghost CH": ghost.ch.Done(), "ghost QSD": ghost.qsd.Done(), "stray CH": stray.Done()} {
		gone(t, what, done)
	}
	if !proc.Alive(kept.ch.Pid, kept.ch.StartTime) || !proc.Alive(kept.qsd.Pid, kept.qsd.StartTime) {
		t.Error("kept's processes were killed")
	}
	if unrelated.ProcessState != nil || unrelated.Process.Signal(syscall.Signal(0)) != nil {
		t.Error("an unrelated process was killed")
	}
	for _, d := range []string{l.VMDir("ghost"), l.RunVMDir("ghost"), l.VMDir("orphan"), l.RunVMDir("orphan"), l.RunVMDir("strayvm")} {
		if _, err := os.Stat(d); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("%s survived: %v", d, err)
		}
		if !slices.Contains(rep.Dirs, d) {
			t.Errorf("reaped dirs %v lack %s", rep.Dirs, d)
		}
	}
	for _, d := range []string{l.VMDir("damaged"), l.VMDir("kept"), l.RunVMDir("kept")} {
		if _, err := os.Stat(d); err != nil {
			t.Errorf("%s was removed: %v", d, err)
		}
	}
	for _, f := range []string{l.RootDisk("prov"), copyTemp} {
		if _, err := os.Stat(f); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("file of an unfinished step %s survived: %v", f, err)
		}
	}
	if r := b.recs.Get("prov"); r.State != record.StateFailed || r.DisplayState != record.DisplayProvisionFailed {
		t.Errorf("resumed provision on a host that cannot provision: %s, want failed/provision_failed", describe(r))
	}
}

// TestIntegrationRecoverReapsTaps: at agent start, of the vmhost taps in
// the namespace, the agent deletes those marked with its own id that no
// record names (a VM or an interface index no record has, or not the
// recorded name), adopts the unmarked ones its records name (re-marked,
// and guarded again: the anti-spoof chain moves from the unmarked table to
// the agent's), and leaves alone another agent's and unmarked strangers.
func TestIntegrationRecoverReapsTaps(t *testing.T) {
	fd, inNS := testNetNS(t)
	const me, other = "aaaa0000aaaa0000", "bbbb0000bbbb0000"
	h := tap.New(&tap.Config{NetNS: fd, AgentID: me})
	theirs := tap.New(&tap.Config{NetNS: fd, AgentID: other})
	unmarked := tap.New(&tap.Config{NetNS: fd})
	ctx := context.Background()
	a := newTestService(t)
	a.o.Config.Networks[0].SpoofGuard = true
	mine, old := record.AgentTapName(me, "vm1", 0), record.TapName("vm2", 0)
	for _, r := range []struct{ id, tap string }{{"vm1", mine}, {"vm2", old}} {
		rec := &record.Record{ID: r.id, Mode: record.ModeVM, State: record.StateStopped, DisplayState: "stopped",
			Spec: record.Spec{VMID: r.id, Vcpus: 1, MemoryMB: 256}, NICs: []record.NIC{{MAC: "02:00:00:00:00:01", Tap: r.tap, DHCPSnoopedIPv4: "192.0.2.7"}}}
		if err := a.recs.Create(rec); err != nil {
			t.Fatal(err)
		}
	}
	taps := []struct {
		h *tap.Handle
		c tap.TapConfig
	}{
		{h, tap.TapConfig{Name: mine, VMID: "vm1", Index: 0}},                                        // named: kept
		{h, tap.TapConfig{Name: record.AgentTapName(me, "vm1", 1), VMID: "vm1", Index: 1}},           // index beyond the record's NICs
		{h, tap.TapConfig{Name: record.AgentTapName(me, "gone", 0), VMID: "gone", Index: 0}},         // no record
		{h, tap.TapConfig{Name: "vmhother0", VMID: "vm1", Index: 0}},                                 // not the recorded name
		{unmarked, tap.TapConfig{Name: old, VMID: "vm2", Index: 0}},                                  // named, unmarked: adopted
		{unmarked, tap.TapConfig{Name: record.TapName("gone", 0), VMID: "gone", Index: 0}},           // unmarked stranger
		{theirs, tap.TapConfig{Name: record.AgentTapName(other, "gone", 0), VMID: "gone", Index: 0}}, // another agent's
		{theirs, tap.TapConfig{Name: record.AgentTapName(other, "vm1", 0), VMID: "vm1", Index: 0}},   // another agent's, same VM id
	}
	for _, c := range taps {
		if err := c.h.Create(ctx, c.c); err != nil {
			t.Fatal(err)
		}
	}
	mac, _ := net.ParseMAC("02:00:00:00:00:01")
	if err := unmarked.Guard(ctx, tap.GuardRule{Tap: old, MAC: mac}); err != nil {
		t.Fatal(err)
	}
	a.Close()
	b := newTestServiceWith(t, testOpts{edit: func(o *Options) { o.Taps = h; o.Config.Networks[0].SpoofGuard = true }}, a.state, a.run)
	marked, err := h.ListMarked(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, o := range marked {
		got = append(got, o.Name+" "+o.Whose.String())
	}
	slices.Sort(got)
	want := []string{
		mine + " mine", old + " mine",
		record.TapName("gone", 0) + " unmarked",
		record.AgentTapName(other, "gone", 0) + " other agent's", record.AgentTapName(other, "vm1", 0) + " other agent's",
	}
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Errorf("taps after recovery:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
	rep := b.Recovery()
	slices.Sort(rep.Taps)
	reaped := []string{record.AgentTapName(me, "gone", 0), record.AgentTapName(me, "vm1", 1), "vmhother0"}
	slices.Sort(reaped)
	if !slices.Equal(rep.Taps, reaped) {
		t.Errorf("reaped taps %v, want %v", rep.Taps, reaped)
	}
	// The adopted tap's chain moved, keeping the snooped address pinned.
	nft := func(table string) string {
		var out []byte
		inNS(func() error {
			out, _ = exec.Command("nft", "list", "table", "bridge", table).CombinedOutput()
			return nil
		})
		return string(out)
	}
	if mt, ut := nft(tap.GuardTableOf(me)), nft(tap.GuardTable); !strings.Contains(mt, "guard-"+old) || !strings.Contains(mt, "192.0.2.7") || strings.Contains(ut, "guard-"+old) {
		t.Errorf("after adoption, table %s:\n%s\ntable %s:\n%s\nwant the chain guard-%s (pinning 192.0.2.7) only in the agent's", tap.GuardTableOf(me), mt, tap.GuardTable, ut, old)
	}
}

func TestVMProcessOf(t *testing.T) {
	prefix := []byte("path=/run/vmhost/vms/")
	for _, tc := range []struct {
		name, cmdline, id string
	}{
		{"ch", "cloud-hypervisor\x00--api-socket\x00path=/run/vmhost/vms/vm-1/ch.sock\x00--event-monitor\x00path=/run/vmhost/vms/vm-1/events\x00", "vm-1"},
		{"sim ch", "/usr/bin/vmhost\x00sim-ch\x00--api-socket\x00path=/run/vmhost/vms/a.b/ch.sock\x00", "a.b"},
		{"qsd", "qemu-storage-daemon\x00--chardev\x00socket,id=qmp,path=/run/vmhost/vms/vm2/qsd.qmp,server=on,wait=off\x00", "vm2"},
		{"another run dir", "cloud-hypervisor\x00--api-socket\x00path=/run/other/vms/vm-1/ch.sock\x00", ""},
		{"other file", "cloud-hypervisor\x00--api-socket\x00path=/run/vmhost/vms/vm-1/other.sock\x00", ""},
		{"guest agent", "vmhost\x00guest\x00--transport\x00unix:/run/vmhost/vms/vm-1/vsock.sock_1024\x00", ""},
		{"invalid id", "x\x00path=/run/vmhost/vms/../ch.sock\x00", ""},
		{"nested", "x\x00path=/run/vmhost/vms/a/b/ch.sock\x00", ""},
		{"empty", "", ""},
	} {
		id, ok := vmProcessOf([]byte(tc.cmdline), prefix)
		if id != tc.id || ok != (tc.id != "") {
			t.Errorf("%s: vmProcessOf = %q, %v; want %q", tc.name, id, ok, tc.id)
		}
	}
}

func TestHasRecordFile(t *testing.T) {
	dir := t.TempDir()
	for _, f := range []string{"a.json", "b.json.damaged", "c[1].json"} {
		os.WriteFile(filepath.Join(dir, f), nil, 0o600)
	}
	for id, want := range map[string]bool{"a": true, "b": true, "c[1]": true, "c1": false, "d": false, "*": false} {
		if got := hasRecordFile(dir, id); got != want {
			t.Errorf("hasRecordFile(%q) = %v, want %v", id, got, want)
		}
	}
}

// BenchmarkRecoverAdopt50 is an agent restart with 50 running VMs: New
// adopting every CH and QSD (pidfd, start time, QMP handshake) and
// starting their monitors, then Close. The contract's target is 2 s.
func BenchmarkRecoverAdopt50(b *testing.B) {
	s := newTestService(b)
	rs := make([]*running, 50)
	for i := range rs {
		r, stop, err := launchVM(s, fmt.Sprintf("vm%02d", i), vmOpts{})
		if stop != nil {
			b.Cleanup(stop)
		}
		if err != nil {
			b.Fatal(err)
		}
		rs[i] = r
	}
	for _, r := range rs {
		r.qsd.Close() // QSD's monitor serves one client: let New attach
		r.ch.Close()
	}
	s.Close()
	for b.Loop() {
		n := newTestService(b, s.state, s.run)
		if got := len(n.Recovery().Adopted); got != 50 {
			b.Fatalf("adopted %d: %+v\n%s", got, n.Recovery(), s.logs)
		}
		n.Close()
	}
}

// TestRecoverBusyQMP restarts the agent while another client holds the
// storage daemon's QMP monitor (which serves one at a time): the VM is
// adopted with its daemon watched by pid, so its death is still noticed,
// and nothing is left running after the VM fails.
func TestRecoverBusyQMP(t *testing.T) {
	a := newTestService(t)
	r := startVM(t, a, "busy") // not watched: the launch's QMP connection stays open
	b := newTestService(t, a.state, a.run)
	if rep := b.Recovery(); !slices.Equal(rep.Adopted, []string{"busy"}) {
		t.Fatalf("recovery = %+v, want busy adopted; logs:\n%s", rep, b.logs)
	}
	if rec := b.recs.Get("busy"); rec.State != record.StateRunning || rec.Runtime.QSD == nil || rec.Runtime.QSD.Pid != r.qsd.Pid {
		t.Fatalf("after adoption: %s", describe(rec))
	}
	syscall.Kill(r.qsd.Pid, syscall.SIGKILL)
	rec, took := waitRecord(t, b, "busy", 2*time.Second, "storage failure", func(r *record.Record) bool { return r.State == record.StateFailed })
	t.Logf("death of a pid-watched QSD noticed in %v: %s", took, rec.FailureReason.Summary)
	gone(t, "cloud-hypervisor", r.ch.Done())
	waitRecord(t, b, "busy", 5*time.Second, "runtime cleared", func(r *record.Record) bool { return r.Runtime.CH == nil && r.Runtime.QSD == nil })
}

// TestRecoverRearmsBootTimeout: a VM still booting when the agent
// restarts gets the rest of its boot timeout, counted from its CH's start.
func TestRecoverRearmsBootTimeout(t *testing.T) {
	a := newTestService(t)
	r := startVM(t, a, "slow", "--sim-no-activate")
	r.qsd.Close() // let the next agent attach
	a.Close()
	b := newTestServiceWith(t, testOpts{edit: func(o *Options) {
		cfg := *o.Config
		cfg.BootTimeoutSecs = 2
		o.Config = &cfg
	}}, a.state, a.run)
	if rep := b.Recovery(); !slices.Equal(rep.Adopted, []string{"slow"}) {
		t.Fatalf("recovery = %+v", rep)
	}
	rec, took := waitRecord(t, b, "slow", 5*time.Second, "boot timeout", func(r *record.Record) bool { return r.State == record.StateFailed })
	if f := rec.FailureReason; f.Detail.Kind != record.KindBootTimeout || f.Cause != record.CauseBootTimeout {
		t.Errorf("after the re-armed boot timeout: %s", describe(rec))
	}
	t.Logf("boot timeout fired %v after the restart", took)
	gone(t, "cloud-hypervisor", r.ch.Done())
}

// adoptingGuest is a Guest that records Adopt calls and the listener each
// got.
type adoptingGuest struct {
	Guest   // nil: only Port and Adopt are called here
	adopted chan net.Listener
}

func (adoptingGuest) Port() uint32 { return 1024 }

func (g adoptingGuest) Adopt(_ context.Context, rec *record.Record, l net.Listener) error {
	if rec.ID == "app" {
		g.adopted <- l
	}
	return nil
}

// TestRecoverAdoptsAppVMGuestSession: an adopted AppVM is handed to the
// guest end (Options.Guest) with a listener on its agent's port of the
// VM's hybrid vsock, so its guest agent's reconnection is accepted.
func TestRecoverAdoptsAppVMGuestSession(t *testing.T) {
	a := newTestService(t)
	r := startVM(t, a, "app")
	if _, err := a.recs.Update("app", func(rec *record.Record) {
		rec.Mode = record.ModeAppVM
		rec.AppVM = &record.AppVMSpec{ImageID: "img", NetworkMode: "dhcp", RestartPolicy: "no"}
	}); err != nil {
		t.Fatal(err)
	}
	r.qsd.Close()
	a.Close()
	g := adoptingGuest{adopted: make(chan net.Listener, 1)}
	b := newTestServiceWith(t, testOpts{guest: g}, a.state, a.run)
	select {
	case l := <-g.adopted:
		defer l.Close()
		if want := chclient.VsockListenPath(b.lay.VsockSocket("app"), 1024); l.Addr().String() != want {
			t.Errorf("adopted with a listener on %s, want %s", l.Addr(), want)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the guest end was not asked to adopt the running AppVM")
	}
	if !b.watched("app") {
		t.Error("the AppVM is not watched")
	}
}
