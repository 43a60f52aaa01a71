package chsim_test

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"vmhost/chclient"
	"vmhost/internal/netnstest"
)

// tickRE matches the counter guest's lines.
var tickRE = regexp.MustCompile(`tinyguest: tick (\d+) up ([0-9.]+) net (\w+) disk (\w+)`)

type tick struct {
	n      int
	uptime float64
	net    string
	disk   string // the first bytes of vda
}

// ticks parses the counter guest's complete lines in out.
func ticks(out string) []tick {
	var ts []tick
	for _, m := range tickRE.FindAllStringSubmatch(out, -1) {
		n, _ := strconv.Atoi(m[1])
		up, _ := strconv.ParseFloat(m[2], 64)
		ts = append(ts, tick{n, up, m[3], m[4]})
	}
	return ts
}

// waitTick waits until the guest has printed a tick numbered at least n, and returns it.
func (r *serialReader) waitTick(t testing.TB, n int, timeout time.Duration) tick {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		ts := ticks(r.String())
		if len(ts) > 0 && ts[len(ts)-1].n >= n {
			return ts[len(ts)-1]
		}
		if time.Now().After(deadline) {
			out := r.String()
			t.Fatalf("no tick %d in %v; serial:\n%s", n, timeout, out[max(0, len(out)-2000):])
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// tapInNamespace makes a persistent tap in ns with the host end's address, up.
func tapInNamespace(t testing.TB, ns *netnstest.NS, name, addr string) {
	t.Helper()
	netnstest.RequireTun(t)
	if err := ns.Run(func() error {
		if err := createPersistentTap(name); err != nil {
			return err
		}
		for _, args := range [][]string{{"addr", "add", addr, "dev", name}, {"link", "set", name, "up"}} {
			if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
				return fmt.Errorf("ip %v: %v: %s", args, err, out)
			}
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
}

// TestQemuBackendSnapshotRestore suspends and resumes a real guest through CH's API: a
// guest whose workload keeps a counter only in memory, on a qemu-storage-daemon vhost-user
// root disk and a tap. vm.snapshot of the running guest is CH's error; paused, it writes
// config.json, state.json and qemu's stream. A snapshot of a running VM resumes in place;
// a suspend ends the process (qemu with it) and the storage daemon, and a new process,
// with a new storage daemon on the same socket, restores the guest, paused until
// vm.resume: the counter continues, the uptime did not go back, the guest did not boot
// again, it reads its disk through the new daemon, and its network answers.
func TestQemuBackendSnapshotRestore(t *testing.T) {
	t.Parallel()
	laneKernel(t)
	needQemu(t)
	ns := netnstest.New(t)
	const tap = "vmhsnap0"
	tapInNamespace(t, ns, tap, "10.99.0.1/24")
	g := bootTinyGuest(t, tinyGuestOpts{mode: "counter", vhostDisk0: true, tap: tap, start: ns.Run,
		cmdline: "tinyguest.ip=10.99.0.2/24,10.99.0.1"})
	p := g.p
	p.timeout = 2 * time.Minute // a loaded machine slows qemu's save and load
	image, vhostSocket := filepath.Join(p.dir, "disk0.img"), filepath.Join(p.dir, "disk0.vhost")
	mark := func(m string) {
		t.Helper()
		f, err := os.OpenFile(image, os.O_WRONLY, 0)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		if _, err := f.WriteAt([]byte(m), 0); err != nil {
			t.Fatal(err)
		}
	}
	mark("BEFORE01")
	first := g.serial.waitTick(t, 5, 90*time.Second)
	if first.net != "ok" {
		// The first pings may go before the tap's neighbour is known: wait for one more.
		deadline := time.Now().Add(20 * time.Second)
		for ts := ticks(g.serial.String()); ts[len(ts)-1].net != "ok"; ts = ticks(g.serial.String()) {
			if time.Now().After(deadline) {
				t.Fatalf("the guest's network does not answer: %v", ts[len(ts)-1])
			}
			time.Sleep(100 * time.Millisecond)
		}
	}

	dir := func(name string) string {
		d := filepath.Join(p.dir, name)
		if err := os.Mkdir(d, 0o700); err != nil {
			t.Fatal(err)
		}
		return d
	}
	snap := dir("snap")
	if chain := errorChain(t, p.wantStatus("PUT", "/api/v1/vm.snapshot", snapshotBody(snap), 500)); lastOf(chain) != "Trying to snapshot while VM is running" {
		t.Errorf("snapshot of the running guest = %q", chain)
	}

	// A snapshot of a running VM: paused for the copy, then it goes on.
	p.wantStatus("PUT", "/api/v1/vm.pause", "", 204)
	start := time.Now()
	p.wantStatus("PUT", "/api/v1/vm.snapshot", snapshotBody(snap), 204)
	t.Logf("vm.snapshot of the paused guest took %v", time.Since(start))
	names := func(d string) []string {
		var out []string
		entries, _ := os.ReadDir(d)
		for _, e := range entries {
			out = append(out, e.Name())
		}
		return out
	}
	if got := names(snap); !reflect.DeepEqual(got, []string{"config.json", "qemu-migration", "state.json"}) {
		t.Errorf("snapshot files = %v", got)
	}
	fi, _ := os.Stat(filepath.Join(snap, "qemu-migration"))
	t.Logf("qemu's stream: %d bytes for %d MiB of guest RAM", fi.Size(), 256)
	p.waitEvents("vm/snapshotting", "vm/snapshotted")
	paused := ticks(g.serial.String())
	p.wantStatus("PUT", "/api/v1/vm.resume", "", 204)
	g.serial.waitTick(t, paused[len(paused)-1].n+3, 30*time.Second)

	// The suspend: pause, snapshot, the process and qemu gone.
	p.wantStatus("PUT", "/api/v1/vm.pause", "", 204)
	time.Sleep(500 * time.Millisecond) // a line in flight reaches the socket
	before := ticks(g.serial.String())
	last := before[len(before)-1]
	suspend := dir("suspend")
	p.wantStatus("PUT", "/api/v1/vm.snapshot", snapshotBody(suspend), 204)
	// CH can snapshot a paused VM again; qemu 7.2 cannot until the guest has run.
	twice := dir("twice")
	chain := errorChain(t, p.wantStatus("PUT", "/api/v1/vm.snapshot", snapshotBody(twice), 500))
	if !strings.Contains(lastOf(chain), "Can't migrate the vm that was paused due to previous migration") {
		t.Errorf("second snapshot of the paused guest = %q", chain)
	}
	if got := names(twice); len(got) != 0 {
		t.Errorf("the refused snapshot wrote %v", got)
	}
	p.wantStatus("PUT", "/api/v1/vmm.shutdown", "", 200)
	if st := p.wait(t); !st.Success() {
		t.Fatalf("exit after vmm.shutdown = %v", st)
	}
	if !processGone(g.qemu) {
		t.Fatalf("qemu %d outlived the suspend", g.qemu)
	}
	if last.disk != "BEFORE01" {
		t.Errorf("the guest read %q from its disk, want BEFORE01", last.disk)
	}
	// The storage daemon goes too (killed: its socket stays); a new one serves the disk,
	// whose content changed meanwhile.
	g.qsd.Process.Kill()
	g.qsd.Wait()
	os.Remove(vhostSocket)
	mark("AFTER002")
	startQSD(t, image, vhostSocket)

	var q *simProc
	if err := ns.Run(func() error { q = startSimNoFatal(t, "--sim-backend", "qemu"); return nil }); err != nil || q == nil {
		t.Fatalf("starting the simulator for the restore: %v", err)
	}
	q.timeout = p.timeout
	start = time.Now()
	q.wantStatus("PUT", "/api/v1/vm.restore", fmt.Sprintf(`{"source_url":%q}`, "file://"+suspend), 204)
	t.Logf("vm.restore took %v", time.Since(start))
	if st := q.state(); st != "Paused" {
		t.Fatalf("state after the restore = %s, want Paused", st)
	}
	restored := &qemuGuest{p: q, serial: readSerial(t, filepath.Join(p.dir, "console.sock"))}
	restored.findChildren(t, false)
	time.Sleep(time.Second)
	if ts := ticks(restored.serial.String()); len(ts) > 0 && ts[len(ts)-1].n > last.n+1 {
		t.Fatalf("the restored guest ran while paused: %v after tick %d", ts, last.n)
	}
	// A restored guest, not yet run, can be saved again.
	q.wantStatus("PUT", "/api/v1/vm.snapshot", snapshotBody(dir("again")), 204)
	q.wantStatus("PUT", "/api/v1/vm.resume", "", 204)
	now := restored.serial.waitTick(t, last.n+5, 30*time.Second)
	out := restored.serial.String()
	after := ticks(out)
	if after[0].n < last.n || after[0].n > last.n+1 {
		t.Errorf("the counter went on at %d after %d, want %d", after[0].n, last.n, last.n+1)
	}
	if after[0].uptime < last.uptime {
		t.Errorf("uptime went back from %.2f to %.2f: the guest booted again", last.uptime, after[0].uptime)
	}
	if strings.Contains(out, "tinyguest: loading") || strings.Contains(out, "Linux version") {
		t.Errorf("the guest booted again after the restore:\n%s", out)
	}
	deadline := time.Now().Add(20 * time.Second)
	for now.net != "ok" && time.Now().Before(deadline) {
		time.Sleep(200 * time.Millisecond)
		ts := ticks(restored.serial.String())
		now = ts[len(ts)-1]
	}
	if now.net != "ok" {
		t.Errorf("the restored guest's network does not answer: %v", now)
	}
	if now.disk != "AFTER002" {
		t.Errorf("the restored guest read %q from its disk, want AFTER002 through the new storage daemon", now.disk)
	}
	evs := q.eventsSoFar()
	if !containsSeq(evs, []string{"vmm/starting", "vm/restoring", "vm/restored", "vm/resuming", "vm/resumed"}) || hasEvent(evs, "vm/booting", "") {
		t.Errorf("restore events = %v", evs)
	}
	t.Logf("tick %d (up %.2f s) before the suspend, %d (up %.2f s) after", last.n, last.uptime, after[0].n, after[0].uptime)

	// A damaged stream: qemu refuses it and the restore fails with its reason.
	q.wantStatus("PUT", "/api/v1/vmm.shutdown", "", 200)
	q.wait(t)
	damaged := dir("damaged")
	for _, f := range []string{"config.json", "state.json", "qemu-migration"} {
		data, _ := os.ReadFile(filepath.Join(suspend, f))
		if f == "qemu-migration" {
			data = data[:len(data)/2]
		}
		os.WriteFile(filepath.Join(damaged, f), data, 0o600)
	}
	var r *simProc
	if err := ns.Run(func() error { r = startSimNoFatal(t, "--sim-backend", "qemu"); return nil }); err != nil || r == nil {
		t.Fatalf("starting the simulator: %v", err)
	}
	r.timeout = p.timeout
	chain = errorChain(t, r.wantStatus("PUT", "/api/v1/vm.restore", fmt.Sprintf(`{"source_url":%q}`, "file://"+damaged), 500))
	t.Logf("restore of a damaged stream: %q", chain)
	if chain[1] != "The VM could not be restored" || !strings.Contains(lastOf(chain), "qemu") {
		t.Errorf("restore of a damaged stream = %q", chain)
	}
	if kids := children(r.cmd.Process.Pid); len(kids) != 0 {
		t.Errorf("children left after the failed restore: %v", kids)
	}
	if resp, _ := r.do("GET", "/api/v1/vm.info", ""); resp.StatusCode != 404 {
		t.Errorf("vm.info after the failed restore = %d, want 404", resp.StatusCode)
	}
}

// TestQemuBackendSnapshotRestoreVsock saves and restores a real guest with CH's hybrid
// vsock (an AppVM's device set), which qemu cannot migrate as it stands: vm.snapshot of
// the paused guest unplugs the vsock device (the guest ejects it) and ends
// vhost-device-vsock, then writes the stream; vm.resume plugs a new device with a new
// vhost-device-vsock, which the guest's driver takes up. A suspend's restore starts
// qemu without the device and without vhost-device-vsock; vm.resume plugs them, and the
// workload's counter goes on without a boot.
func TestQemuBackendSnapshotRestoreVsock(t *testing.T) {
	t.Parallel()
	laneKernel(t)
	needQemu(t)
	backend := vsockBackend(t)
	g := bootTinyGuest(t, tinyGuestOpts{mode: "counter", vhostDisk0: true, vsock: true}, "--sim-vsock-backend", backend)
	p := g.p
	p.timeout = 2 * time.Minute
	g.serial.waitTick(t, 2, 90*time.Second)
	vsockID := "_vsock2" // CH's generated id in tinyGuestConfig
	activations := func(evs []chclient.Event) int {
		n := 0
		for _, e := range evs {
			if e.Source+"/"+e.Event == "virtio-device/activated" && e.Properties["id"] == vsockID {
				n++
			}
		}
		return n
	}
	waitActivations := func(p *simProc, n int) {
		t.Helper()
		deadline := time.Now().Add(time.Minute)
		for activations(p.eventsSoFar()) < n {
			if time.Now().After(deadline) {
				t.Fatalf("the guest's driver did not take up vsock device %s (%d activations, want %d): %v", vsockID, activations(p.eventsSoFar()), n, p.eventsSoFar())
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	waitActivations(p, 1)
	firstBackend := g.vsockBackend

	// A snapshot of the running guest: the device goes for the save and comes back.
	dir := func(name string) string {
		d := filepath.Join(p.dir, name)
		if err := os.Mkdir(d, 0o700); err != nil {
			t.Fatal(err)
		}
		return d
	}
	p.wantStatus("PUT", "/api/v1/vm.pause", "", 204)
	snap := dir("snap")
	p.wantStatus("PUT", "/api/v1/vm.snapshot", snapshotBody(snap), 204)
	if _, err := os.Stat(filepath.Join(snap, "qemu-migration")); err != nil {
		t.Fatal(err)
	}
	if st := p.state(); st != "Paused" {
		t.Errorf("state after the snapshot = %s", st)
	}
	g.findChildren(t, false) // vhost-device-vsock ended with the device
	before := ticks(g.serial.String())
	p.wantStatus("PUT", "/api/v1/vm.resume", "", 204)
	g.serial.waitTick(t, before[len(before)-1].n+2, 30*time.Second)
	waitActivations(p, 2)
	g.findChildren(t, true)
	if g.vsockBackend == firstBackend {
		t.Errorf("vhost-device-vsock %d served the device before and after the snapshot", firstBackend)
	}

	// The suspend: a new process restores the guest, paused, with neither the device nor
	// its backend until vm.resume.
	p.wantStatus("PUT", "/api/v1/vm.pause", "", 204)
	time.Sleep(500 * time.Millisecond) // a line in flight reaches the socket
	paused := ticks(g.serial.String())
	last := paused[len(paused)-1]
	suspend := dir("suspend")
	p.wantStatus("PUT", "/api/v1/vm.snapshot", snapshotBody(suspend), 204)
	p.wantStatus("PUT", "/api/v1/vmm.shutdown", "", 200)
	if st := p.wait(t); !st.Success() {
		t.Fatalf("exit after vmm.shutdown = %v", st)
	}
	if _, err := os.Stat(filepath.Join(p.dir, "vsock.sock")); err == nil {
		t.Error("the vsock socket outlived the process")
	}
	q := startSim(t, "--sim-backend", "qemu", "--sim-vsock-backend", backend)
	q.timeout = p.timeout
	q.wantStatus("PUT", "/api/v1/vm.restore", fmt.Sprintf(`{"source_url":%q}`, "file://"+suspend), 204)
	restored := &qemuGuest{p: q, serial: readSerial(t, filepath.Join(p.dir, "console.sock"))}
	restored.findChildren(t, false)
	q.wantStatus("PUT", "/api/v1/vm.resume", "", 204)
	restored.serial.waitTick(t, last.n+3, 30*time.Second)
	waitActivations(q, 1)
	restored.findChildren(t, true)
	out := restored.serial.String()
	after := ticks(out)
	if after[0].n < last.n || after[0].n > last.n+2 {
		t.Errorf("the counter went on at %d after %d", after[0].n, last.n)
	}
	if after[0].uptime < last.uptime {
		t.Errorf("uptime went back from %.2f to %.2f: the guest booted again", last.uptime, after[0].uptime)
	}
	if strings.Contains(out, "tinyguest: loading") || strings.Contains(out, "Linux version") {
		t.Errorf("the guest booted again after the restore:\n%s", out)
	}
	if fi, err := os.Stat(filepath.Join(p.dir, "vsock.sock")); err != nil || fi.Mode()&os.ModeSocket == 0 {
		t.Errorf("no vsock socket after the resume: %v", err)
	}
	t.Logf("tick %d (up %.2f s) before the suspend, %d (up %.2f s) after", last.n, last.uptime, after[0].n, after[0].uptime)
}
