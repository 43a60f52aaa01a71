package chsim_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"vmhost/chclient"
)

// vhostListener stands in for a vhost-user backend: it accepts connections and counts them.
func vhostListener(t testing.TB, path string) *atomic.Int32 {
	t.Helper()
	l, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	var n atomic.Int32
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			n.Add(1)
			go func() {
				var b [1]byte
				c.Read(b[:]) // held until the peer closes
				c.Close()
			}()
		}
	}()
	return &n
}

// snapshotVMConfig is an AppVM-like VM of the simulator: a vhost-user root disk, a raw
// seed disk, the serial port on a socket, a hybrid vsock device, 256 MiB of shared memory.
func snapshotVMConfig(t testing.TB, dir string) string {
	t.Helper()
	kernel := filepath.Join(dir, "vmlinux")
	seed := filepath.Join(dir, "seed.img")
	for _, f := range []string{kernel, seed} {
		if err := os.WriteFile(f, []byte("x"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	cfg := map[string]any{
		"cpus":    map[string]any{"boot_vcpus": 2, "max_vcpus": 2},
		"memory":  map[string]any{"size": 256 << 20, "shared": true},
		"payload": map[string]any{"kernel": kernel, "cmdline": "console=ttyS0"},
		"disks": []any{
			map[string]any{"vhost_user": true, "vhost_socket": filepath.Join(dir, "root.vhost"), "num_queues": 2},
			map[string]any{"path": seed, "readonly": true, "image_type": "Raw"},
		},
		"serial":  map[string]any{"mode": "Socket", "socket": filepath.Join(dir, "console.sock")},
		"console": map[string]any{"mode": "Off"},
		"vsock":   map[string]any{"cid": 42, "socket": filepath.Join(dir, "vsock.sock")},
	}
	data, _ := json.Marshal(cfg)
	return string(data)
}

// vmInfo returns vm.info's config and device tree, as raw JSON for exact comparisons.
func (p *simProc) vmInfo() (config json.RawMessage, tree map[string]json.RawMessage) {
	p.t.Helper()
	var info struct {
		Config     json.RawMessage            `json:"config"`
		DeviceTree map[string]json.RawMessage `json:"device_tree"`
	}
	if err := json.Unmarshal(p.wantStatus("GET", "/api/v1/vm.info", "", 200), &info); err != nil {
		p.t.Fatal(err)
	}
	return info.Config, info.DeviceTree
}

func snapshotBody(dir string) string {
	return fmt.Sprintf(`{"destination_url":%q}`, "file://"+dir)
}

func chainOf(t testing.TB, p *simProc, method, path, body string, status int) []string {
	t.Helper()
	return errorChain(t, p.wantStatus(method, path, body, status))
}

// TestSnapshotRestore follows a VM through CH's snapshot and restore in two simulator
// processes: the snapshot needs a paused VM and writes config.json, state.json and
// memory-ranges; a fresh process restores it paused, with the same config, device ids and
// PCI addresses, its devices reopened (vhost-user, serial and vsock sockets), the guest's
// vsock listeners and the id counter kept; vm.resume runs it.
func TestSnapshotRestore(t *testing.T) {
	p := startSim(t, "--sim-activate-delay", "0s")
	vhost := vhostListener(t, filepath.Join(p.dir, "root.vhost"))
	p.wantStatus("PUT", "/api/v1/vm.create", snapshotVMConfig(t, p.dir), 204)
	p.wantStatus("PUT", "/api/v1/vm.boot", "", 204)
	// The seed and vsock announce their activation; the vhost-user root disk does not (CH v53).
	p.waitEvents("vm/booted", "virtio-device/activated map[id:_disk1]", "virtio-device/activated map[id:_vsock2]")
	p.wantStatus("PUT", "/sim/v1/vsock/listen", `{"port":6000}`, 204)
	extra := filepath.Join(p.dir, "extra.img")
	os.WriteFile(extra, nil, 0o600)
	p.wantStatus("PUT", "/api/v1/vm.add-disk", fmt.Sprintf(`{"path":%q}`, extra), 200)
	p.wantStatus("PUT", "/sim/v1/counters", `{"device":"_disk1","counters":{"read_bytes":4096}}`, 204)

	snap := filepath.Join(p.dir, "snap")
	if err := os.Mkdir(snap, 0o700); err != nil {
		t.Fatal(err)
	}
	chain := chainOf(t, p, "PUT", "/api/v1/vm.snapshot", snapshotBody(snap), 500)
	want := []string{"Error from API", "The VM could not be snapshotted", "Cannot snapshot VM",
		"Failed to snapshot migratable component", "Trying to snapshot while VM is running"}
	if !reflect.DeepEqual(chain, want) {
		t.Errorf("snapshot of a running VM = %q, want %q", chain, want)
	}
	if entries, _ := os.ReadDir(snap); len(entries) != 0 {
		t.Errorf("a refused snapshot wrote %v", entries)
	}
	p.wantStatus("PUT", "/api/v1/vm.pause", "", 204)
	config, tree := p.vmInfo()
	p.wantStatus("PUT", "/api/v1/vm.snapshot", snapshotBody(snap), 204)
	if st := p.state(); st != "Paused" {
		t.Errorf("state after the snapshot = %s, want Paused", st)
	}
	p.waitEvents("vm/snapshotting", "vm/pausing", "vm/paused", "vm/snapshotting", "vm/snapshotted")

	// config.json is the config vm.info echoes; state.json is CH's tree.
	saved, err := os.ReadFile(filepath.Join(snap, "config.json"))
	if err != nil {
		t.Fatal(err)
	}
	if !jsonEqual(t, saved, config) {
		t.Errorf("config.json = %s\nvm.info config = %s", saved, config)
	}
	var state struct {
		Snapshots    map[string]json.RawMessage `json:"snapshots"`
		SnapshotData *struct{ State string }    `json:"snapshot_data"`
	}
	data, _ := os.ReadFile(filepath.Join(snap, "state.json"))
	if err := json.Unmarshal(data, &state); err != nil || state.SnapshotData == nil {
		t.Fatalf("state.json = %.300s: %v", data, err)
	}
	var keys []string
	for k := range state.Snapshots {
		keys = append(keys, k)
	}
	if !sameSet(keys, []string{"cpu-manager", "memory-manager", "device-manager"}) {
		t.Errorf("state.json components = %v", keys)
	}
	var mm struct {
		SnapshotData struct{ State string } `json:"snapshot_data"`
	}
	json.Unmarshal(state.Snapshots["memory-manager"], &mm)
	if !strings.Contains(mm.SnapshotData.State, `"memory_ranges":{"data":[{"gpa":0,"length":268435456}]}`) {
		t.Errorf("memory-manager state = %s", mm.SnapshotData.State)
	}
	var st syscall.Stat_t
	if err := syscall.Stat(filepath.Join(snap, "memory-ranges"), &st); err != nil {
		t.Fatal(err)
	}
	if st.Size != 256<<20 || st.Blocks != 0 {
		t.Errorf("memory-ranges: %d bytes in %d blocks, want 256 MiB of holes", st.Size, st.Blocks)
	}
	// The files are created anew: a second snapshot into the same directory fails.
	chain = chainOf(t, p, "PUT", "/api/v1/vm.snapshot", snapshotBody(snap), 500)
	if n := len(chain); n < 2 || chain[n-2] != "Error creating VM config snapshot file" || chain[n-1] != "File exists (os error 17)" {
		t.Errorf("second snapshot into %s = %q", snap, chain)
	}

	p.wantStatus("PUT", "/api/v1/vmm.shutdown", "", 200)
	p.wait(t)
	for _, f := range []string{"console.sock", "vsock.sock"} {
		if _, err := os.Lstat(filepath.Join(p.dir, f)); err == nil {
			t.Fatalf("%s outlived the process", f)
		}
	}

	q := startSim(t, "--sim-activate-delay", "0s")
	conns := vhost.Load()
	q.wantStatus("PUT", "/api/v1/vm.restore", fmt.Sprintf(`{"source_url":%q}`, "file://"+snap), 204)
	if st := q.state(); st != "Paused" {
		t.Fatalf("state after the restore = %s, want Paused", st)
	}
	config2, tree2 := q.vmInfo()
	if !jsonEqual(t, config2, config) {
		t.Errorf("restored config = %s\nwant %s", config2, config)
	}
	if !reflect.DeepEqual(tree2, tree) {
		t.Errorf("restored device tree = %v\nwant %v", tree2, tree)
	}
	evs := q.waitEvents("vmm/starting", "virtio-device/activated map[id:_disk1]", "virtio-device/activated map[id:_vsock2]", "vm/restoring", "vm/restored")
	if hasEvent(evs, "vm/booting", "") || hasEvent(evs, "vm/resumed", "") || hasEvent(evs, "virtio-device/activated", "_disk0") {
		t.Errorf("restore events = %v", evs)
	}
	if vhost.Load() != conns+1 {
		t.Errorf("vhost-user connections %d → %d, want one more for the restored disk", conns, vhost.Load())
	}
	for _, f := range []string{"console.sock", "vsock.sock"} {
		if fi, err := os.Lstat(filepath.Join(p.dir, f)); err != nil || fi.Mode()&os.ModeSocket == 0 {
			t.Errorf("%s not bound again by the restore: %v", f, err)
		}
	}
	// The guest's listener (in its memory) answers; counters carried over.
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	c, err := chclient.DialVsock(ctx, filepath.Join(p.dir, "vsock.sock"), 6000)
	if err != nil {
		t.Errorf("CONNECT 6000 after the restore: %v", err)
	} else {
		c.Close()
	}
	var counters map[string]map[string]uint64
	json.Unmarshal(q.wantStatus("GET", "/api/v1/vm.counters", "", 200), &counters)
	if counters["_disk1"]["read_bytes"] != 4096 {
		t.Errorf("counters after the restore = %v", counters)
	}

	// A second restore, or a boot, on the restored VM is CH's "already created".
	if chain := chainOf(t, q, "PUT", "/api/v1/vm.restore", fmt.Sprintf(`{"source_url":%q}`, "file://"+snap), 500); lastOf(chain) != "VM is already created" {
		t.Errorf("second restore = %q", chain)
	}
	q.wantStatus("PUT", "/api/v1/vm.resume", "", 204)
	if st := q.state(); st != "Running" {
		t.Errorf("state after resume = %s", st)
	}
	q.waitEvents("vm/restored", "vm/resuming", "vm/resumed")
	// The generated-id counter continues where the snapshot left it.
	var added struct{ ID string }
	json.Unmarshal(q.wantStatus("PUT", "/api/v1/vm.add-disk", fmt.Sprintf(`{"path":%q}`, extra), 200), &added)
	if added.ID != "_disk4" {
		t.Errorf("disk added after the restore got id %s, want _disk4", added.ID)
	}
}

// TestRestoreResume: resume=true runs the restored VM (vm resuming, vm resumed), and a VM
// snapshotted before its drivers came up goes on booting after the restore.
func TestRestoreResume(t *testing.T) {
	p := startSim(t, "--sim-no-activate")
	p.wantStatus("PUT", "/api/v1/vm.create", minimalConfig(t, p.dir), 204)
	p.wantStatus("PUT", "/api/v1/vm.boot", "", 204)
	p.wantStatus("PUT", "/api/v1/vm.pause", "", 204)
	snap := filepath.Join(p.dir, "snap")
	os.Mkdir(snap, 0o700)
	p.wantStatus("PUT", "/api/v1/vm.snapshot", snapshotBody(snap), 204)
	p.wantStatus("PUT", "/api/v1/vm.delete", "", 204)

	// The same process can restore once its VM is gone.
	p.wantStatus("PUT", "/api/v1/vm.restore", fmt.Sprintf(`{"source_url":%q,"resume":true,"prefault":true}`, "file://"+snap), 204)
	if st := p.state(); st != "Running" {
		t.Fatalf("state after restore with resume = %s", st)
	}
	p.waitEvents("vm/deleted", "vm/restoring", "vm/restored", "vm/resuming", "vm/resumed")
	if evs := p.eventsSoFar(); hasEvent(evs, "virtio-device/activated", "") {
		t.Errorf("devices the guest never took were activated by the restore: %v", evs)
	}
	p.wantStatus("PUT", "/sim/v1/activate", "", 204)
	p.waitEvents("vm/resumed", "virtio-device/activated map[id:_disk0]")
}

// TestSnapshotErrors: the state rules and the destination's faults, with CH's chains.
func TestSnapshotErrors(t *testing.T) {
	p := startSim(t, "--sim-no-activate")
	snap := filepath.Join(p.dir, "snap")
	os.Mkdir(snap, 0o700)
	notRunning := []string{"Error from API", "The VM could not be snapshotted", "VM is not running"}
	if chain := chainOf(t, p, "PUT", "/api/v1/vm.snapshot", snapshotBody(snap), 500); !reflect.DeepEqual(chain, notRunning) {
		t.Errorf("snapshot without a VM = %q", chain)
	}
	p.wantStatus("PUT", "/api/v1/vm.create", minimalConfig(t, p.dir), 204)
	if chain := chainOf(t, p, "PUT", "/api/v1/vm.snapshot", snapshotBody(snap), 500); !reflect.DeepEqual(chain, notRunning) {
		t.Errorf("snapshot of a created VM = %q", chain)
	}
	if evs := p.eventsSoFar(); hasEvent(evs, "vm/snapshotting", "") {
		t.Errorf("snapshotting announced for a VM that never booted: %v", evs)
	}
	p.wantStatus("PUT", "/api/v1/vm.boot", "", 204)
	p.wantStatus("PUT", "/api/v1/vm.pause", "", 204)

	file := filepath.Join(p.dir, "plain")
	os.WriteFile(file, nil, 0o600)
	send := []string{"Error from API", "The VM could not be snapshotted", "Cannot send VM snapshot", "Failed to send migratable component snapshot"}
	for _, tc := range []struct{ url, last string }{
		{snap, "Could not extract path from URL: " + snap},
		{"file://" + filepath.Join(p.dir, "nothing"), fmt.Sprintf("Destination is not a directory: %q", filepath.Join(p.dir, "nothing"))},
		{"file://" + file, fmt.Sprintf("Destination is not a directory: %q", file)},
	} {
		chain := chainOf(t, p, "PUT", "/api/v1/vm.snapshot", fmt.Sprintf(`{"destination_url":%q}`, tc.url), 500)
		if want := append(send, tc.last); !reflect.DeepEqual(chain, want) {
			t.Errorf("snapshot to %s = %q, want %q", tc.url, chain, want)
		}
	}
	// A memory file already there: config.json and state.json are written first and stay.
	os.WriteFile(filepath.Join(snap, "memory-ranges"), nil, 0o600)
	chain := chainOf(t, p, "PUT", "/api/v1/vm.snapshot", snapshotBody(snap), 500)
	if want := append(send, fmt.Sprintf("Error creating memory snapshot file %q", filepath.Join(snap, "memory-ranges")),
		"File exists (os error 17)"); !reflect.DeepEqual(chain, want) {
		t.Errorf("snapshot over a memory file = %q, want %q", chain, want)
	}
	for _, f := range []string{"config.json", "state.json"} {
		if _, err := os.Stat(filepath.Join(snap, f)); err != nil {
			t.Errorf("%s: %v (CH leaves what it wrote before the failure)", f, err)
		}
	}
	// Bodies: the field is required; no body is CH's plain Bad Request.
	if chain := chainOf(t, p, "PUT", "/api/v1/vm.snapshot", `{}`, 400); len(chain) != 2 || chain[0] != "Failed to deserialize JSON" ||
		!strings.Contains(chain[1], "destination_url") {
		t.Errorf("snapshot body {} = %q", chain)
	}
	if chain := chainOf(t, p, "PUT", "/api/v1/vm.snapshot", "", 400); !reflect.DeepEqual(chain, []string{"Bad Request"}) {
		t.Errorf("snapshot without a body = %q", chain)
	}
	if st := p.state(); st != "Paused" {
		t.Errorf("state after failed snapshots = %s, want Paused", st)
	}
}

// TestRestoreErrors: a restore needs a fresh process and a complete, readable snapshot;
// each fault answers CH's chain, and a failure after the config was read drops it again
// (vm deleted), so the process can try again.
func TestRestoreErrors(t *testing.T) {
	src := startSim(t, "--sim-activate-delay", "0s")
	vhostListener(t, filepath.Join(src.dir, "root.vhost"))
	src.wantStatus("PUT", "/api/v1/vm.create", snapshotVMConfig(t, src.dir), 204)
	src.wantStatus("PUT", "/api/v1/vm.boot", "", 204)
	src.wantStatus("PUT", "/api/v1/vm.pause", "", 204)
	good := filepath.Join(src.dir, "good")
	os.Mkdir(good, 0o700)
	src.wantStatus("PUT", "/api/v1/vm.snapshot", snapshotBody(good), 204)
	src.wantStatus("PUT", "/api/v1/vmm.shutdown", "", 200)
	src.wait(t)

	// variant copies the good snapshot into a new directory and applies change to it.
	variant := func(name string, change func(dir string)) string {
		dir := filepath.Join(src.dir, name)
		os.Mkdir(dir, 0o700)
		for _, f := range []string{"config.json", "state.json", "memory-ranges"} {
			data, _ := os.ReadFile(filepath.Join(good, f))
			os.WriteFile(filepath.Join(dir, f), data, 0o600)
		}
		change(dir)
		return dir
	}
	p := startSim(t)
	restore := func(body string, status int) []string {
		t.Helper()
		return chainOf(t, p, "PUT", "/api/v1/vm.restore", body, status)
	}
	url := func(dir string) string { return fmt.Sprintf(`{"source_url":%q}`, "file://"+dir) }
	const (
		cannot  = "Cannot restore VM"
		receive = "Failed to receive migratable component snapshot"
	)
	noConfig := variant("noconfig", func(d string) { os.Remove(filepath.Join(d, "config.json")) })
	badConfig := variant("badconfig", func(d string) { os.WriteFile(filepath.Join(d, "config.json"), []byte(`{"cpus":`), 0o600) })
	noState := variant("nostate", func(d string) { os.Remove(filepath.Join(d, "state.json")) })
	badState := variant("badstate", func(d string) { os.WriteFile(filepath.Join(d, "state.json"), []byte(`[1]`), 0o600) })
	noMemory := variant("nomemory", func(d string) { os.Remove(filepath.Join(d, "memory-ranges")) })
	for _, tc := range []struct {
		name, body string
		want       []string // after "Error from API", "The VM could not be restored"
		deleted    bool     // CH held the config: vm deleted follows
	}{
		{"no file:// prefix", fmt.Sprintf(`{"source_url":%q}`, good), []string{cannot, "Failed to send migratable component snapshot", "Could not extract path from URL: " + good}, false},
		{"not a directory", url(filepath.Join(good, "config.json")), []string{cannot, "Failed to send migratable component snapshot",
			fmt.Sprintf("Destination is not a directory: %q", filepath.Join(good, "config.json"))}, false},
		{"config.json missing", url(noConfig), []string{cannot, receive,
			fmt.Sprintf("Error opening VM config snapshot file %q", filepath.Join(noConfig, "config.json")), "No such file or directory (os error 2)"}, false},
		{"config.json damaged", url(badConfig), []string{cannot, receive, "Error deserialising VM config snapshot"}, false},
		{"prefault with on-demand", fmt.Sprintf(`{"source_url":%q,"prefault":true,"memory_restore_mode":"OnDemand"}`, "file://"+good),
			[]string{"Failed to validate config", "'prefault' cannot be combined with 'memory_restore_mode=ondemand'"}, false},
		{"state.json missing", url(noState), []string{cannot, receive,
			fmt.Sprintf("Error opening VM state snapshot file %q", filepath.Join(noState, "state.json")), "No such file or directory (os error 2)"}, false},
		{"state.json damaged", url(badState), []string{cannot, receive, "Error deserialising VM state snapshot"}, false},
		{"memory-ranges missing", url(noMemory), []string{"Memory manager error", "Error opening snapshot file", "No such file or directory (os error 2)"}, true},
	} {
		before := len(p.eventsSoFar())
		chain := restore(tc.body, 500)
		head := []string{"Error from API", "The VM could not be restored"}
		if len(chain) < len(head)+len(tc.want) || !reflect.DeepEqual(chain[:len(head)+len(tc.want)], append(head, tc.want...)) {
			t.Errorf("%s: chain = %q, want it to start %q", tc.name, chain, append(head, tc.want...))
		}
		if r, _ := p.do("GET", "/api/v1/vm.info", ""); r.StatusCode != 404 {
			t.Errorf("%s: vm.info = %d after the failed restore, want 404 (no VM)", tc.name, r.StatusCode)
		}
		if got := hasEvent(p.eventsSoFar()[before:], "vm/deleted", ""); got != tc.deleted {
			t.Errorf("%s: vm deleted event %v, want %v", tc.name, got, tc.deleted)
		}
	}
	if chain := restore(`{"source_url":"file:///x","memory_restore_mode":"Lazy"}`, 400); chain[0] != "Failed to deserialize JSON" {
		t.Errorf("unknown memory_restore_mode = %q", chain)
	}
	if chain := restore(`{}`, 400); chain[0] != "Failed to deserialize JSON" || !strings.Contains(lastOf(chain), "source_url") {
		t.Errorf("restore body {} = %q", chain)
	}

	// A vsock socket left behind (the old process was killed) fails the restore, as a boot.
	stale, err := net.Listen("unix", filepath.Join(src.dir, "vsock.sock"))
	if err != nil {
		t.Fatal(err)
	}
	stale.(*net.UnixListener).SetUnlinkOnClose(false)
	stale.Close()
	chain := restore(url(good), 500)
	if !strings.Contains(strings.Join(chain, ": "), "vsock") || lastOf(chain) == "" {
		t.Errorf("restore over a stale vsock socket = %q", chain)
	}
	os.Remove(filepath.Join(src.dir, "vsock.sock"))
	// Nothing of the failed attempt is held: the next one succeeds.
	p.wantStatus("PUT", "/api/v1/vm.restore", url(good), 204)
	if st := p.state(); st != "Paused" {
		t.Errorf("state = %s", st)
	}
	if chain := chainOf(t, p, "PUT", "/api/v1/vm.boot", "", 500); lastOf(chain) != "VM is already created" {
		t.Errorf("boot of a restored VM = %q", chain)
	}
}

func jsonEqual(t testing.TB, a, b []byte) bool {
	t.Helper()
	var x, y any
	if err := json.Unmarshal(a, &x); err != nil {
		t.Fatalf("%s: %v", a, err)
	}
	if err := json.Unmarshal(b, &y); err != nil {
		t.Fatalf("%s: %v", b, err)
	}
	return reflect.DeepEqual(x, y)
}

func sameSet(a, b []string) bool {
	if len(a) != len(b) {
		return false
	}
	seen := map[string]bool{}
	for _, s := range a {
		seen[s] = true
	}
	for _, s := range b {
		if !seen[s] {
			return false
		}
	}
	return true
}
