//go:build linux

package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"vmhost/chclient"
)

// savedView is the part of a VM view the saved-state crash tests read.
type savedView struct {
	view
	SuspendedAt *time.Time `json:"suspended_at"`
}

func (s *server) getSaved(id string) (savedView, bool) {
	s.t.Helper()
	st, b := s.do("GET", "/api/vms/"+id, "")
	if st == http.StatusNotFound {
		return savedView{}, false
	}
	var v savedView
	if st != http.StatusOK || json.Unmarshal(b, &v) != nil {
		s.t.Fatalf("GET /api/vms/%s = %d %s", id, st, b)
	}
	return v, true
}

// chState is what VM id's Cloud Hypervisor says of its VM ("" when it
// does not answer).
func (s *server) chState(id string) string {
	c := chclient.New(s.runDir + "/vms/" + id + "/ch.sock")
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	info, err := c.VMInfo(ctx)
	if err != nil {
		return ""
	}
	return info.State
}

// savedStateFiles are the files Cloud Hypervisor writes of a saved state.
var savedStateFiles = []string{"config.json", "memory-ranges", "state.json"}

// checkSaved asserts that VM id is in one consistent state after a
// restart, and returns its view: running or paused with its processes and
// its Cloud Hypervisor saying the same (never left paused by a cut-short
// operation); or stopped with a whole saved state (suspended_at) and no
// process; or stopped without one. Nothing of an operation in progress is
// left: no save directory, no staged state or copy.
func checkSaved(t *testing.T, s *server, id string) savedView {
	t.Helper()
	v, ok := s.getSaved(id)
	if !ok {
		t.Fatalf("VM %s is gone", id)
	}
	dir := s.stateDir + "/vms/" + id
	suspend := dir + "/suspend"
	switch v.State {
	case "running", "paused":
		want := map[string]string{"running": chclient.StateRunning, "paused": chclient.StatePaused}[v.State]
		if v.PID == 0 || syscall.Kill(v.PID, 0) != nil || v.Disk == nil || syscall.Kill(v.Disk.QSDPid, 0) != nil {
			t.Errorf("%s is %s without its processes: %+v", id, v.State, v)
		} else if got := s.chState(id); got != want {
			t.Errorf("%s is recorded %s, its CH says %q", id, v.State, got)
		}
		if v.SuspendedAt != nil || exists(suspend) {
			t.Errorf("%s runs with a saved state (suspended_at %v, directory %v)", id, v.SuspendedAt, exists(suspend))
		}
	case "stopped", "created", "failed":
		if v.PID != 0 {
			t.Errorf("%s is %s with pid %d", id, v.State, v.PID)
		}
		if v.SuspendedAt != nil {
			ents, _ := os.ReadDir(suspend)
			var got []string
			for _, e := range ents {
				got = append(got, e.Name())
			}
			if !slices.Equal(got, savedStateFiles) {
				t.Errorf("%s is suspended with a saved state of %v", id, got)
			}
		} else if exists(suspend) {
			t.Errorf("%s has a saved state directory no record names", id)
		}
	default:
		t.Errorf("%s is %s/%s", id, v.State, v.DisplayState)
	}
	for _, p := range []string{dir + "/suspend.next", dir + "/root.qcow2.restore", dir + "/data0.qcow2.restore"} {
		if exists(p) {
			t.Errorf("%s: %s is left over", id, p)
		}
	}
	if ents, _ := os.ReadDir(dir + "/save"); len(ents) > 0 {
		t.Errorf("%s: its save directory holds %v", id, ents)
	}
	return v
}

// checkSnapshots asserts that the snapshot directory holds only whole
// snapshots (each listed, with its metadata and files) and that the API
// lists exactly them; it returns their ids.
func checkSnapshots(t *testing.T, s *server) []string {
	t.Helper()
	var list struct {
		Snapshots []struct {
			ID     string `json:"id"`
			Memory bool   `json:"memory"`
			Disks  []struct {
				Path string `json:"path"`
			} `json:"disks"`
		} `json:"snapshots"`
	}
	st, b := s.do("GET", "/api/snapshots", "")
	if st != http.StatusOK || json.Unmarshal(b, &list) != nil {
		t.Fatalf("GET /api/snapshots = %d %s", st, b)
	}
	var listed []string
	for _, sn := range list.Snapshots {
		listed = append(listed, sn.ID)
		for _, d := range sn.Disks {
			if !exists(d.Path) {
				t.Errorf("snapshot %s lacks its disk %s", sn.ID, d.Path)
			}
		}
		mem := s.stateDir + "/snapshots/" + sn.ID + "/memory/state.json"
		if exists(mem) != sn.Memory {
			t.Errorf("snapshot %s: memory %v, state file there %v", sn.ID, sn.Memory, exists(mem))
		}
	}
	ents, _ := os.ReadDir(s.stateDir + "/snapshots")
	var onDisk []string
	for _, e := range ents {
		onDisk = append(onDisk, e.Name())
	}
	if !slices.Equal(onDisk, listed) {
		t.Errorf("the snapshot directory holds %v, the API lists %v", onDisk, listed)
	}
	return listed
}

// cutShort runs req against a server that stops dead at step (the
// VMHOST_TEST_STOP_AT_STEP hook), kills it there and restarts it.
func cutShort(t *testing.T, s *server, marker, step string, req func() (int, []byte)) {
	t.Helper()
	done := make(chan int, 1)
	go func() { st, _ := req(); done <- st }()
	deadline := time.Now().Add(30 * time.Second)
	for !exists(marker) {
		if time.Now().After(deadline) {
			t.Fatalf("the agent never reached step %s; output:\n%s", step, s.stderr)
		}
		time.Sleep(10 * time.Millisecond)
	}
	s.kill()
	if st := <-done; st >= 200 && st < 300 {
		t.Fatalf("the request answered %d although the agent was killed at %s", st, step)
	}
	s.restart()
}

// fileSum is a file's contents, for comparing disks.
func fileSum(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// TestCrashAtEachSaveStep kills the agent (SIGKILL) at every step of a
// suspend, a start from a saved state, a snapshot, a restore, a create
// from a snapshot and a snapshot's delete (the engine, the rules or the
// store stop dead there through the VMHOST_TEST_STOP_AT_STEP hook),
// restarts it, and checks that it finds one consistent state: the saved
// state whole or absent, the VM running (never left paused) or stopped,
// the snapshot whole or absent, the VM's disks the old ones or the
// restored ones and never a mix; and that the VM then works (a start, a
// suspend, a start) and nothing is left that no record owns.
func TestCrashAtEachSaveStep(t *testing.T) {
	t.Parallel() // a long loop, mostly waiting: beside the others (doc.go)
	root := os.Geteuid() == 0
	f := newFixture(t)
	type tc struct {
		step string
		// setup brings VM "c" to where the operation starts; run is the
		// operation.
		setup func(t *testing.T, s *server)
		run   func(s *server) (int, []byte)
		// check looks at what the restart made of it.
		check func(t *testing.T, s *server, v savedView)
	}
	boot := func(t *testing.T, s *server) {
		s.create(f.body("c", true, crashNetworking(root)), http.StatusCreated)
		s.waitDisplay("c", "running", "running")
	}
	suspended := func(t *testing.T, s *server) {
		boot(t, s)
		if st, b := s.do("POST", "/api/vms/c/suspend", ""); st != http.StatusNoContent {
			t.Fatalf("suspend = %d %s", st, b)
		}
	}
	post := func(path, body string) func(s *server) (int, []byte) {
		return func(s *server) (int, []byte) { return s.do("POST", path, body) }
	}
	isRunning := func(t *testing.T, s *server, v savedView) {
		if v.State != "running" {
			t.Errorf("want running, got %s/%s suspended_at %v", v.State, v.DisplayState, v.SuspendedAt)
		}
	}
	isSuspended := func(t *testing.T, s *server, v savedView) {
		if v.State != "stopped" || v.SuspendedAt == nil {
			t.Errorf("want suspended, got %s/%s suspended_at %v", v.State, v.DisplayState, v.SuspendedAt)
		}
	}
	noSnapshot := func(t *testing.T, s *server, v savedView) {
		isRunning(t, s, v)
		if got := checkSnapshots(t, s); len(got) != 0 {
			t.Errorf("snapshots %v after a snapshot cut short before its commit", got)
		}
	}
	// The restore cases: a stopped VM with a snapshot s1 (with memory),
	// whose disks changed since; after the restart its disks are all the
	// snapshot's (and it is suspended from it) or all its own.
	var before, snapped map[string]string
	disks := []string{"root.qcow2", "data0.qcow2"}
	restoreSetup := func(t *testing.T, s *server) {
		boot(t, s)
		if st, b := s.do("POST", "/api/vms/c/pause", ""); st != http.StatusNoContent {
			t.Fatalf("pause = %d %s", st, b)
		}
		if st, b := s.do("POST", "/api/vms/c/snapshots", `{"snapshot_id":"s1","memory":true}`); st != http.StatusCreated {
			t.Fatalf("snapshot = %d %s", st, b)
		}
		if st, b := s.do("POST", "/api/vms/c/stop", ""); st != http.StatusNoContent {
			t.Fatalf("stop = %d %s", st, b)
		}
		before, snapped = map[string]string{}, map[string]string{}
		for _, d := range disks {
			p := s.stateDir + "/vms/c/" + d
			fh, err := os.OpenFile(p, os.O_WRONLY|os.O_APPEND, 0)
			if err != nil {
				t.Fatal(err)
			}
			fh.Write(bytes.Repeat([]byte{0xab}, 4096)) // past the image's end: a change a restore must undo
			fh.Close()
			before[d] = fileSum(t, p)
			snapped[d] = fileSum(t, s.stateDir+"/snapshots/s1/disks/"+strings.TrimSuffix(d, ".qcow2")+".qcow2")
		}
	}
	restoreCheck := func(restored bool) func(t *testing.T, s *server, v savedView) {
		return func(t *testing.T, s *server, v savedView) {
			want := before
			if restored {
				want = snapped
			}
			for _, d := range disks {
				got := fileSum(t, s.stateDir+"/vms/c/"+d)
				switch {
				case got == want[d]:
				case got == before[d] || got == snapped[d]:
					t.Errorf("%s is the %s one, want every disk restored=%v (a mix)", d, map[bool]string{true: "old", false: "restored"}[got == before[d]], restored)
				default:
					t.Errorf("%s is neither the old disk nor the snapshot's", d)
				}
			}
			if (v.SuspendedAt != nil) != restored || v.State != "stopped" {
				t.Errorf("after the restore cut short: %s, suspended_at %v; want restored=%v", v.State, v.SuspendedAt, restored)
			}
		}
	}
	fromSnapshot := func(t *testing.T, s *server) {
		boot(t, s)
		if st, b := s.do("POST", "/api/vms/c/snapshots", `{"snapshot_id":"s1"}`); st != http.StatusCreated {
			t.Fatalf("snapshot = %d %s", st, b)
		}
	}
	newFrom := fmt.Sprintf(`{"vm_id":"n","vcpus":1,"memory_mb":128,"kernel_path":%q,"from_snapshot":"s1","auto_boot":true%s}`, f.kernel, crashNetworking(root))
	cases := []tc{
		{"suspend:start", boot, post("/api/vms/c/suspend", ""), isRunning},
		{"suspend:paused", boot, post("/api/vms/c/suspend", ""), isRunning},
		{"suspend:saved", boot, post("/api/vms/c/suspend", ""), isRunning},
		{"suspend:placed", boot, post("/api/vms/c/suspend", ""), isSuspended},
		{"suspend:stopped", boot, post("/api/vms/c/suspend", ""), isSuspended},
		{"resume:ch", suspended, post("/api/vms/c/start", ""), isSuspended},
		{"resume:restored", suspended, post("/api/vms/c/start", ""), isSuspended},
		{"resume:recorded", suspended, post("/api/vms/c/start", ""), isRunning},
		{"resume:resumed", suspended, post("/api/vms/c/start", ""), isRunning},
		{"snapshot:start", boot, post("/api/vms/c/snapshots", `{"snapshot_id":"s1","memory":true}`), noSnapshot},
		{"snapshot:paused", boot, post("/api/vms/c/snapshots", `{"snapshot_id":"s1","memory":true}`), noSnapshot},
		{"snapshot:memory", boot, post("/api/vms/c/snapshots", `{"snapshot_id":"s1","memory":true}`), noSnapshot},
		{"snapshot:disks", boot, post("/api/vms/c/snapshots", `{"snapshot_id":"s1","memory":true}`), noSnapshot},
		{"snapshot:resume", boot, post("/api/vms/c/snapshots", `{"snapshot_id":"s1","memory":true}`), noSnapshot},
		{"snapshot:committed", boot, post("/api/vms/c/snapshots", `{"snapshot_id":"s1","memory":true}`), func(t *testing.T, s *server, v savedView) {
			isRunning(t, s, v)
			if got := checkSnapshots(t, s); !slices.Equal(got, []string{"s1"}) {
				t.Errorf("snapshots %v after a snapshot cut short once committed, want s1", got)
			}
		}},
		{"restore:start", restoreSetup, post("/api/vms/c/restore", `{"snapshot_id":"s1"}`), restoreCheck(false)},
		{"restore:staged", restoreSetup, post("/api/vms/c/restore", `{"snapshot_id":"s1"}`), restoreCheck(false)},
		{"restore:commit", restoreSetup, post("/api/vms/c/restore", `{"snapshot_id":"s1"}`), restoreCheck(true)},
		{"restore:swapped", restoreSetup, post("/api/vms/c/restore", `{"snapshot_id":"s1"}`), restoreCheck(true)},
		{"snapshot-delete:renamed", fromSnapshot, func(s *server) (int, []byte) { return s.do("DELETE", "/api/snapshots/s1", "") }, func(t *testing.T, s *server, v savedView) {
			isRunning(t, s, v)
			if got := checkSnapshots(t, s); len(got) != 0 {
				t.Errorf("snapshots %v after a delete cut short once renamed", got)
			}
		}},
	}
	for _, step := range crashSteps(root, "root_disk", "data0", "seed", "tap0", "qsd", "provisioned", "ch", "running") {
		cases = append(cases, tc{step, fromSnapshot, post("/api/vms", newFrom), func(t *testing.T, s *server, v savedView) {
			s.settled("n") // the rollback of a create cut short runs in the background
			n, ok := s.getSaved("n")
			switch {
			case !ok:
				t.Error("the VM made from a snapshot is gone: its record says why it failed, or it runs")
			case step == "running":
				if n.State != "running" {
					t.Errorf("a create from a snapshot cut short once booted: %s/%s", n.State, n.DisplayState)
				}
			case n.State != "failed" || n.DisplayState != "provision_failed":
				t.Errorf("a create from a snapshot cut short at %s: %s/%s, want rolled back", step, n.State, n.DisplayState)
			}
			checkSnapshots(t, s)
			if ok && n.State == "failed" && exists(s.stateDir+"/vms/n") {
				t.Errorf("a rolled back create left %s", s.stateDir+"/vms/n")
			}
		}})
	}
	for _, c := range cases {
		t.Run(strings.ReplaceAll(c.step, ":", "-"), func(t *testing.T) {
			// The setup runs without the hook (a create from a snapshot
			// shares its steps with the create of the VM it comes from);
			// the agent is restarted with it for the operation.
			marker := t.TempDir() + "/stopped"
			s := startServer(t, serverOpts{netns: root, confine: true})
			c.setup(t, s)
			s.kill()
			s.restart("VMHOST_TEST_STOP_AT_STEP="+c.step, "VMHOST_TEST_STOP_MARKER="+marker)
			cutShort(t, s, marker, c.step, func() (int, []byte) { return c.run(s) })
			v := checkSaved(t, s, "c")
			c.check(t, s, v)
			// It works on from here: a start (resuming it if suspended),
			// a suspend and a start, and nothing else is left.
			if v.State != "running" {
				if st, b := s.do("POST", "/api/vms/c/start", ""); st != http.StatusNoContent {
					t.Fatalf("start after the restart = %d %s", st, b)
				}
			}
			for _, a := range []string{"suspend", "start"} {
				if st, b := s.do("POST", "/api/vms/c/"+a, ""); st != http.StatusNoContent {
					t.Fatalf("%s after the restart = %d %s", a, st, b)
				}
			}
			checkSaved(t, s, "c")
			present := map[string]view{}
			for _, id := range []string{"c", "n"} {
				if v, ok := s.getSaved(id); ok {
					present[id] = v.view
				}
			}
			checkNothingElse(t, s, present, root)
		})
	}
}
