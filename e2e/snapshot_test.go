//go:build linux

package e2e

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"
)

// The process-mode guest of an AppVM, through the real binary: its
// workload keeps a counter in memory and prints it; the counts and the pid
// it prints once at its start are what these tests read of the guest.
const counterWorkload = `echo pid $$; i=0; while :; do i=$((i+1)); echo count $i; sleep 0.1; done`

var (
	pidLine   = regexp.MustCompile(`(?m)^pid (\d+)$`)
	countLine = regexp.MustCompile(`(?m)^count (\d+)$`)
)

// workloadLog is what AppVM id's workload printed so far, both streams in
// the order its log (workload.ndjson, rotated to .1) holds them.
func (s *server) workloadLog(id string) string {
	path := filepath.Join(s.stateDir, "vms", id, "workload.ndjson")
	var out strings.Builder
	for _, p := range []string{path + ".1", path} {
		b, _ := os.ReadFile(p)
		chunks, _ := decodeChunks(b) // a line being written is left for the next read
		for _, c := range chunks {
			out.WriteString(c.Data)
		}
	}
	return out.String()
}

// counts are the counts the workload printed, in order.
func counts(log string) []int {
	var out []int
	for _, m := range countLine.FindAllStringSubmatch(log, -1) {
		n, _ := strconv.Atoi(m[1])
		out = append(out, n)
	}
	return out
}

// waitLog waits until AppVM id's workload log satisfies cond.
func (s *server) waitLog(id, what string, cond func(string) bool) string {
	s.t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		log := s.workloadLog(id)
		if cond(log) {
			return log
		}
		if time.Now().After(deadline) {
			s.t.Fatalf("AppVM %s: %s did not happen within 30s; workload log:\n%s", id, what, log)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// lastCount is the last count in log (0 when none).
func lastCount(log string) int {
	c := counts(log)
	if len(c) == 0 {
		return 0
	}
	return c[len(c)-1]
}

// procStateOf is the state letter of /proc/pid/stat ("" when gone).
func procStateOf(pid int) string {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return ""
	}
	i := bytes.LastIndexByte(b, ')')
	if f := strings.Fields(string(b[i+1:])); len(f) > 0 {
		return f[0]
	}
	return ""
}

// TestAppVMSuspendKeepsTheWorkload: an AppVM whose workload keeps a counter
// only in memory is suspended (204: stopped, suspended_at, no VMM or
// storage daemon left, the workload frozen) and started again: the same
// workload process goes on counting, without a boot in between (its start
// line printed once), the guest agent resumed on its session, heartbeats
// come and none went stale. A cold start instead boots it afresh, and a
// delete leaves no process behind.
func TestAppVMSuspendKeepsTheWorkload(t *testing.T) {
	s := startAppVMServer(t, map[string]string{"counter": counterWorkload})
	if st, b := s.do("POST", "/api/appvm/vms", `{"vm_id":"ctr","image_id":"counter","vcpus":1,"memory_mb":128,"disk_gib":1,`+
		`"ip":"10.80.0.9","prefix":24,"gateway":"10.80.0.1"}`); st != http.StatusCreated {
		t.Fatalf("create = %d %s", st, b)
	}
	s.appvmWait("ctr", "display running", 30*time.Second, func(v appvmView) bool { return v.DisplayState == "running" })
	log := s.waitLog("ctr", "three counts", func(l string) bool { return lastCount(l) >= 3 })
	pid, _ := strconv.Atoi(pidLine.FindStringSubmatch(log)[1])

	if st, b := s.do("POST", "/api/appvm/vms/ctr/suspend", ""); st != http.StatusNoContent {
		t.Fatalf("suspend = %d %s", st, b)
	}
	v := s.appvmGet("ctr")
	var sv struct {
		SuspendedAt *time.Time `json:"suspended_at"`
		PID         int        `json:"pid"`
	}
	json.Unmarshal(v.raw, &sv)
	if v.State != "stopped" || sv.SuspendedAt == nil || sv.PID != 0 {
		t.Fatalf("after the suspend: %s", v.raw)
	}
	if st := procStateOf(pid); st != "T" {
		t.Fatalf("the workload (pid %d) after the suspend: state %q, want frozen", pid, st)
	}
	for _, p := range s.children() {
		cmd, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", p))
		if bytes.Contains(cmd, []byte("sim-ch\x00--api-socket")) || bytes.Contains(cmd, []byte("qsd.qmp")) {
			t.Errorf("pid %d (%q) runs after the suspend", p, cmd)
		}
	}
	frozen := lastCount(s.workloadLog("ctr"))
	time.Sleep(500 * time.Millisecond)
	if got := lastCount(s.workloadLog("ctr")); got != frozen {
		t.Errorf("the suspended workload counted on: %d, then %d", frozen, got)
	}

	if st, b := s.do("POST", "/api/appvm/vms/ctr/start", ""); st != http.StatusNoContent {
		t.Fatalf("start = %d %s", st, b)
	}
	v = s.appvmGet("ctr")
	if v.State != "running" || v.DisplayState != "running" || bytes.Contains(v.raw, []byte("suspended_at")) {
		t.Errorf("right after the start: %s", v.raw)
	}
	log = s.waitLog("ctr", "counting on", func(l string) bool { return lastCount(l) >= frozen+5 })
	// The guest agent replays the output the host has not acknowledged when
	// it reconnects, so the log may hold the start again: the same process,
	// and from its last "count 1" on one unbroken run past the suspend.
	for _, m := range pidLine.FindAllStringSubmatch(log, -1) {
		if m[1] != strconv.Itoa(pid) {
			t.Errorf("a workload pid %s after the suspend, want only %d (no boot):\n%s", m[1], pid, log)
		}
	}
	c := counts(log)
	last := len(c) - 1
	for last > 0 && c[last] != 1 {
		last--
	}
	run := c[last:]
	for i := 1; i < len(run); i++ {
		if run[i] != run[i-1]+1 {
			t.Errorf("the counter did not go on across the suspend: %v", c)
			break
		}
	}
	if st := procStateOf(pid); st == "" || st == "T" {
		t.Errorf("the workload (pid %d) after the start: state %q, want it running", pid, st)
	}
	before := s.appvmGet("ctr").AppVM.LastHeartbeatAt
	v = s.appvmWait("ctr", "a heartbeat after the resume", 15*time.Second, func(v appvmView) bool {
		return v.AppVM.LastHeartbeatAt != nil && (before == nil || v.AppVM.LastHeartbeatAt.After(*before))
	})
	if bytes.Contains(v.raw, []byte("heartbeat_stale")) || bytes.Contains(v.raw, []byte("log_stream_detached")) {
		t.Errorf("after the resume: %s", v.raw)
	}

	// Suspended again, then started cold: a fresh boot, the frozen guest gone.
	if st, b := s.do("POST", "/api/appvm/vms/ctr/suspend", ""); st != http.StatusNoContent {
		t.Fatalf("second suspend = %d %s", st, b)
	}
	if st, b := s.do("POST", "/api/appvm/vms/ctr/start?cold=true", ""); st != http.StatusNoContent {
		t.Fatalf("cold start = %d %s", st, b)
	}
	log = s.waitLog("ctr", "a second workload start", func(l string) bool { return len(pidLine.FindAllString(l, -1)) == 2 })
	deadline := time.Now().Add(10 * time.Second)
	for procStateOf(pid) != "" {
		if time.Now().After(deadline) {
			t.Fatalf("the workload of the discarded state (pid %d) lives on: %q", pid, procStateOf(pid))
		}
		time.Sleep(50 * time.Millisecond)
	}
	if st, b := s.do("DELETE", "/api/appvm/vms/ctr?force=true", ""); st != http.StatusNoContent {
		t.Fatalf("delete = %d %s", st, b)
	}
	waitNoChildren(t, s)
}

// waitNoChildren waits until no process of s's run directory is left.
func waitNoChildren(t *testing.T, s *server) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for len(s.children()) > 0 {
		if time.Now().After(deadline) {
			t.Fatalf("processes left: %v", s.children())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TestAppVMSnapshotRestore: a snapshot with memory of a running AppVM,
// then changes, then a stop, a restore and a start: the workload sees the
// state of the snapshot (a count it keeps in a file of its guest; in the
// simulator the guest's processes cannot be copied, so the restored guest
// starts its workload again over the guest as saved). A suspended AppVM is
// deleted with the snapshot it was restored from, leaving nothing.
func TestAppVMSnapshotRestore(t *testing.T) {
	s := startAppVMServer(t, map[string]string{"filectr": `n=$(cat n 2>/dev/null || echo 0); while :; do n=$((n+1)); echo $n > n; echo count $n; sleep 0.1; done`})
	if st, b := s.do("POST", "/api/appvm/vms", `{"vm_id":"fc","image_id":"filectr","vcpus":1,"memory_mb":128,"disk_gib":1,`+
		`"ip":"10.80.0.10","prefix":24,"gateway":"10.80.0.1"}`); st != http.StatusCreated {
		t.Fatalf("create = %d %s", st, b)
	}
	s.waitLog("fc", "three counts", func(l string) bool { return lastCount(l) >= 3 })
	// Paused, the count on disk is the snapshot's.
	if st, b := s.do("POST", "/api/appvm/vms/fc/pause", ""); st != http.StatusNoContent {
		t.Fatalf("pause = %d %s", st, b)
	}
	nfile := filepath.Join(s.runDir, "vms", "fc", "vsock.sock.root", "n")
	data, _ := os.ReadFile(nfile)
	saved, err := strconv.Atoi(strings.TrimSpace(string(data)))
	if err != nil {
		t.Fatalf("the workload's count file: %q", data)
	}
	st, b := s.do("POST", "/api/appvm/vms/fc/snapshots", `{"snapshot_id":"fc-1","memory":true}`)
	var sn struct {
		ID     string `json:"id"`
		Mode   string `json:"mode"`
		Memory bool   `json:"memory"`
		Disks  []struct {
			ID string `json:"id"`
		} `json:"disks"`
		SizeBytes uint64 `json:"size_bytes"`
	}
	if st != http.StatusCreated || json.Unmarshal(b, &sn) != nil || !sn.Memory || sn.Mode != "appvm" || len(sn.Disks) != 1 || sn.SizeBytes == 0 {
		t.Fatalf("snapshot = %d %s", st, b)
	}
	if v := s.appvmGet("fc"); v.State != "paused" {
		t.Errorf("a paused AppVM after its snapshot: %s", v.raw)
	}
	if st, b := s.do("POST", "/api/appvm/vms/fc/resume", ""); st != http.StatusNoContent {
		t.Fatalf("resume = %d %s", st, b)
	}
	s.waitLog("fc", "counting past the snapshot", func(l string) bool { return lastCount(l) >= saved+5 })
	if st, b := s.do("POST", "/api/appvm/vms/fc/restore", `{"snapshot_id":"fc-1"}`); st != http.StatusConflict {
		t.Errorf("restore onto a running AppVM = %d %s, want 409", st, b)
	}
	if st, b := s.do("POST", "/api/appvm/vms/fc/stop", ""); st != http.StatusNoContent {
		t.Fatalf("stop = %d %s", st, b)
	}
	s.appvmWait("fc", "stopped", 30*time.Second, func(v appvmView) bool { return v.State == "stopped" })
	mark := len(s.workloadLog("fc"))
	st, b = s.do("POST", "/api/appvm/vms/fc/restore", `{"snapshot_id":"fc-1"}`)
	if st != http.StatusOK || !bytes.Contains(b, []byte(`"suspended_at"`)) {
		t.Fatalf("restore = %d %s", st, b)
	}
	if st, b := s.do("POST", "/api/appvm/vms/fc/start", ""); st != http.StatusNoContent {
		t.Fatalf("start = %d %s", st, b)
	}
	log := s.waitLog("fc", "counts after the restore", func(l string) bool { return len(counts(l[mark:])) >= 2 })
	if c := counts(log[mark:]); c[0] != saved+1 {
		t.Errorf("after the restore the workload counts %v, want it to go on from the snapshot's %d", c, saved)
	}
	// The snapshot is listed with its VM, and goes with its delete.
	var list struct {
		Snapshots []struct {
			ID string `json:"id"`
		} `json:"snapshots"`
	}
	_, b = s.do("GET", "/api/snapshots?vm_id=fc", "")
	if json.Unmarshal(b, &list) != nil || len(list.Snapshots) != 1 || list.Snapshots[0].ID != "fc-1" {
		t.Errorf("GET /api/snapshots?vm_id=fc = %s", b)
	}
	if st, b := s.do("POST", "/api/appvm/vms/fc/suspend", ""); st != http.StatusNoContent {
		t.Fatalf("suspend = %d %s", st, b)
	}
	for _, req := range [][2]string{{"DELETE", "/api/appvm/vms/fc"}, {"DELETE", "/api/snapshots/fc-1"}} {
		if st, b := s.do(req[0], req[1], ""); st != http.StatusNoContent {
			t.Fatalf("%s %s = %d %s", req[0], req[1], st, b)
		}
	}
	waitNoChildren(t, s)
	if ents, _ := os.ReadDir(filepath.Join(s.stateDir, "snapshots")); len(ents) != 0 {
		t.Errorf("snapshots left: %v", ents)
	}
}

// TestAppVMFromSnapshotKeepsTheBuild, through the real binary and the
// real storage daemon: a snapshot of an AppVM whose root disk is an
// overlay of its image's build keeps the build after the AppVM's delete
// (the image's delete is 409 naming the snapshot); an AppVM made from it
// is an overlay of that build (disk mode overlay, base_path the build),
// boots on the chain and runs its workload; with the AppVM and the
// snapshot gone the image can be deleted, leaving nothing.
func TestAppVMFromSnapshotKeepsTheBuild(t *testing.T) {
	s := startAppVMServer(t, map[string]string{"ctr": counterWorkload})
	if st, b := s.do("POST", "/api/appvm/vms", `{"vm_id":"src","image_id":"ctr","vcpus":1,"memory_mb":128,"disk_gib":1,"auto_boot":false}`); st != http.StatusCreated {
		t.Fatalf("create = %d %s", st, b)
	}
	var view struct {
		Disk struct {
			Mode     string `json:"mode"`
			BasePath string `json:"base_path"`
		} `json:"disk"`
	}
	diskOf := func(id string) (string, string) {
		if err := json.Unmarshal(s.appvmGet(id).raw, &view); err != nil {
			t.Fatal(err)
		}
		return view.Disk.Mode, view.Disk.BasePath
	}
	mode, build := diskOf("src")
	if mode != "overlay" || build == "" {
		t.Fatalf("the source's root disk: mode %q, base %q; want an overlay of the build", mode, build)
	}
	if st, b := s.do("POST", "/api/appvm/vms/src/snapshots", `{"snapshot_id":"src-1"}`); st != http.StatusCreated {
		t.Fatalf("snapshot = %d %s", st, b)
	}
	if st, b := s.do("DELETE", "/api/appvm/vms/src", ""); st != http.StatusNoContent {
		t.Fatalf("delete = %d %s", st, b)
	}
	if st, b := s.do("DELETE", "/api/appvm/images/ctr", ""); st != http.StatusConflict || !bytes.Contains(b, []byte("snapshots src-1")) {
		t.Errorf("image delete while a snapshot uses its build = %d %s, want 409 naming src-1", st, b)
	}
	if _, err := os.Stat(build); err != nil {
		t.Fatalf("the build the snapshot reads through to: %v", err)
	}
	if st, b := s.do("POST", "/api/appvm/vms", `{"vm_id":"new","from_snapshot":"src-1","vcpus":1,"memory_mb":128,"disk_gib":1,`+
		`"ip":"10.80.0.11","prefix":24,"gateway":"10.80.0.1"}`); st != http.StatusCreated {
		t.Fatalf("create from the snapshot = %d %s", st, b)
	}
	if mode, base := diskOf("new"); mode != "overlay" || base != build {
		t.Errorf("the AppVM from the snapshot: disk mode %q, base %q; want an overlay of %s", mode, base, build)
	}
	s.waitLog("new", "two counts", func(l string) bool { return len(counts(l)) >= 2 })
	for _, req := range [][2]string{{"DELETE", "/api/appvm/vms/new?force=true"}, {"DELETE", "/api/snapshots/src-1"}, {"DELETE", "/api/appvm/images/ctr"}} {
		if st, b := s.do(req[0], req[1], ""); st != http.StatusNoContent {
			t.Fatalf("%s %s = %d %s", req[0], req[1], st, b)
		}
	}
	waitNoChildren(t, s)
	if _, err := os.Stat(build); !os.IsNotExist(err) {
		t.Errorf("the build after the image's delete: %v", err)
	}
}

// TestAppVMRestartPolicyAfterResume: an AppVM started from its saved state
// is still under its restart policy: its workload (the same process, no
// boot in between) fails after the resume, the failure is seen and the
// AppVM boots again (restart_count 1), while the suspend and the start
// themselves counted as no restart.
func TestAppVMRestartPolicyAfterResume(t *testing.T) {
	const failOnHUP = `echo pid $$; trap 'echo failing; exit 3' HUP; i=0; while :; do i=$((i+1)); echo count $i; sleep 0.1; done`
	s := startAppVMServer(t, map[string]string{"fail": failOnHUP})
	if st, b := s.do("POST", "/api/appvm/vms", `{"vm_id":"rp","image_id":"fail","vcpus":1,"memory_mb":128,"disk_gib":1,`+
		`"ip":"10.80.0.11","prefix":24,"gateway":"10.80.0.1","restart_policy":"on-failure"}`); st != http.StatusCreated {
		t.Fatalf("create = %d %s", st, b)
	}
	s.appvmWait("rp", "display running", 30*time.Second, func(v appvmView) bool { return v.DisplayState == "running" })
	log := s.waitLog("rp", "three counts", func(l string) bool { return lastCount(l) >= 3 })
	pid := pidLine.FindStringSubmatch(log)[1]
	if st, b := s.do("POST", "/api/appvm/vms/rp/suspend", ""); st != http.StatusNoContent {
		t.Fatalf("suspend = %d %s", st, b)
	}
	if st, b := s.do("POST", "/api/appvm/vms/rp/start", ""); st != http.StatusNoContent {
		t.Fatalf("start = %d %s", st, b)
	}
	frozen := lastCount(s.workloadLog("rp"))
	s.waitLog("rp", "counting on after the resume", func(l string) bool { return lastCount(l) >= frozen+3 })
	if v := s.appvmGet("rp"); v.AppVM.RestartCount != 0 {
		t.Fatalf("the suspend and start counted as a restart: %s", v.raw)
	}
	// The guest session is back once a signal reaches the workload.
	deadline := time.Now().Add(15 * time.Second)
	for {
		st, b := s.do("POST", "/api/appvm/vms/rp/signal", `{"signal":"HUP"}`)
		if st == http.StatusNoContent {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("signal after the resume = %d %s", st, b)
		}
		time.Sleep(100 * time.Millisecond)
	}
	v := s.appvmWait("rp", "a restart after the resumed workload failed", 30*time.Second, func(v appvmView) bool {
		return v.AppVM.RestartCount == 1 && v.DisplayState == "running"
	})
	if v.AppVM.LastRestartAt == nil {
		t.Errorf("no last_restart_at after the restart: %s", v.raw)
	}
	log = s.waitLog("rp", "the next boot's workload", func(l string) bool { return len(pidLine.FindAllString(l, -1)) >= 2 })
	if pids := pidLine.FindAllStringSubmatch(log, -1); pids[0][1] != pid || !strings.Contains(log, "failing\n") {
		t.Errorf("want the resumed workload (pid %s) to fail, then a new one:\n%s", pid, log)
	}
}
