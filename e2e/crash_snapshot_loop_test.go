//go:build linux

package e2e

import (
	"bytes"
	"fmt"
	mrand "math/rand/v2"
	"net/http"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"vmhost/config"
)

// TestCrashSaveLoop kills the agent with SIGKILL at random points of
// suspends, starts from a saved state, snapshots, restores, creates from a
// snapshot and snapshot deletes running side by side, restarts it, and
// checks after every kill that each VM is in one consistent state
// (checkSaved), that a restored VM's disks are all the old ones or all the
// snapshot's (with its saved state exactly when restored), that the
// snapshots are whole or absent (checkSnapshots), and that nothing is left
// that no VM owns. It goes on until every operation was cut short at least
// 5 times, 50 with VMHOST_E2E_CRASH_LOOP=1 (not with -short; .ci/run sets
// it): a request counts when it reached the agent and got no answer.
func TestCrashSaveLoop(t *testing.T) {
	t.Parallel() // a long loop, mostly waiting: beside the others (doc.go)
	want := 5
	if os.Getenv("VMHOST_E2E_CRASH_LOOP") != "" && !testing.Short() {
		want = 50
	}
	root := os.Geteuid() == 0
	s := startServer(t, serverOpts{netns: root, confine: true, edit: func(c *config.Config) { c.HostCPUs = 64; c.HostMemoryMB = 64 << 10 }})
	f := newFixture(t)
	seed := time.Now().UnixNano()
	t.Logf("seed %d", seed)
	rng := mrand.New(mrand.NewPCG(uint64(seed), 0))
	const per = 4 // requests of each operation per round
	nets := crashNetworking(root)
	mustDo := func(method, path, body string, status int) {
		t.Helper()
		if st, b := s.do(method, path, body); st != status {
			t.Fatalf("%s %s = %d %s, want %d", method, path, st, b, status)
		}
	}
	// The pool: VMs that suspend (su), resume (re), snapshot (sn) and
	// restore (rs) round after round; base, whose snapshot new VMs come
	// from and whose snapshots are deleted.
	var pool []string
	for _, kind := range []string{"su", "re", "sn", "rs"} {
		for i := range per {
			pool = append(pool, fmt.Sprintf("%s%d", kind, i))
		}
	}
	for _, id := range append(slices.Clone(pool), "base") {
		s.create(f.body(id, true, nets), http.StatusCreated)
	}
	for _, id := range append(slices.Clone(pool), "base") {
		s.waitDisplay(id, "running", "running")
	}
	mustDo("POST", "/api/vms/base/stop", "", http.StatusNoContent)
	mustDo("POST", "/api/vms/base/snapshots", `{"snapshot_id":"base-s"}`, http.StatusCreated)
	for i := range per {
		id := fmt.Sprintf("rs%d", i)
		mustDo("POST", "/api/vms/"+id+"/pause", "", http.StatusNoContent)
		mustDo("POST", "/api/vms/"+id+"/snapshots", `{"snapshot_id":"`+id+`-s","memory":true}`, http.StatusCreated)
		mustDo("POST", "/api/vms/"+id+"/stop", "", http.StatusNoContent)
	}
	disks := []string{"root", "data0"}
	var n struct{ rounds int }
	cut := map[string]int{}
	took := map[string][]time.Duration{}
	span := func(op string) time.Duration { // how long before the kill its requests start
		if d := median(took[op]); d > 0 {
			return max(2*d, 20*time.Millisecond)
		}
		return 300 * time.Millisecond
	}
	enough := func() bool {
		for _, op := range []string{"suspend", "resume", "snapshot", "restore", "create", "delete"} {
			if cut[op] < want {
				return false
			}
		}
		return true
	}
	for round := 0; !enough() && round < 8*want; round++ {
		n.rounds++
		// Preconditions: su and sn run, re is suspended, rs is stopped
		// with its disks changed since its snapshot; base has snapshots to
		// delete.
		for i := range per {
			if v := checkSaved(t, s, fmt.Sprintf("su%d", i)); v.State != "running" {
				mustDo("POST", "/api/vms/"+v.ID+"/start", "", http.StatusNoContent)
			}
			if v := checkSaved(t, s, fmt.Sprintf("re%d", i)); v.SuspendedAt == nil {
				if v.State != "running" {
					mustDo("POST", "/api/vms/"+v.ID+"/start", "", http.StatusNoContent)
				}
				mustDo("POST", "/api/vms/"+v.ID+"/suspend", "", http.StatusNoContent)
			}
			mustDo("POST", fmt.Sprintf("/api/vms/base/snapshots"), fmt.Sprintf(`{"snapshot_id":"r%d-de%d"}`, round, i), http.StatusCreated)
		}
		before, snapped := map[string]string{}, map[string]string{}
		for i := range per {
			id := fmt.Sprintf("rs%d", i)
			if v := checkSaved(t, s, id); v.SuspendedAt != nil {
				// The last round's restore: its saved state goes, so that
				// this round's shows whether this restore happened.
				mustDo("POST", "/api/vms/"+id+"/start?cold=true", "", http.StatusNoContent)
				mustDo("POST", "/api/vms/"+id+"/stop", "", http.StatusNoContent)
			}
			for _, d := range disks {
				p := s.stateDir + "/vms/" + id + "/" + d + ".qcow2"
				fh, err := os.OpenFile(p, os.O_WRONLY|os.O_APPEND, 0)
				if err != nil {
					t.Fatal(err)
				}
				fh.Write(bytes.Repeat([]byte{byte(round)}, 512)) // past the image's end: a change the restore undoes
				fh.Close()
				before[id+d] = fileSum(t, p)
				snapped[id+d] = fileSum(t, s.stateDir+"/snapshots/"+id+"-s/disks/"+d+".qcow2")
			}
		}
		type outcome struct {
			op, id, err string
			st          int
			took        time.Duration
		}
		var reqs []func(time.Time, time.Time, chan<- outcome)
		add := func(op, id, method, path, body string) {
			reqs = append(reqs, func(begin, killAt time.Time, out chan<- outcome) {
				start := killAt.Add(-time.Duration(rng.Int64N(int64(span(op)))))
				go func() {
					time.Sleep(time.Until(start))
					t0 := time.Now()
					st, b := s.do(method, path, body)
					out <- outcome{op: op, id: id, st: st, err: string(b), took: time.Since(t0)}
				}()
			})
		}
		var creates []string
		for i := range per {
			add("suspend", fmt.Sprintf("su%d", i), "POST", fmt.Sprintf("/api/vms/su%d/suspend", i), "")
			add("resume", fmt.Sprintf("re%d", i), "POST", fmt.Sprintf("/api/vms/re%d/start", i), "")
			add("snapshot", fmt.Sprintf("sn%d", i), "POST", fmt.Sprintf("/api/vms/sn%d/snapshots", i), fmt.Sprintf(`{"snapshot_id":"r%d-sn%d","memory":true}`, round, i))
			add("restore", fmt.Sprintf("rs%d", i), "POST", fmt.Sprintf("/api/vms/rs%d/restore", i), fmt.Sprintf(`{"snapshot_id":"rs%d-s"}`, i))
			cr := fmt.Sprintf("r%d-cr%d", round, i)
			creates = append(creates, cr)
			add("create", cr, "POST", "/api/vms", fmt.Sprintf(`{"vm_id":%q,"vcpus":1,"memory_mb":128,"kernel_path":%q,"from_snapshot":"base-s","auto_boot":true%s}`, cr, f.kernel, nets))
			add("delete", fmt.Sprintf("r%d-de%d", round, i), "DELETE", fmt.Sprintf("/api/snapshots/r%d-de%d", round, i), "")
		}
		out := make(chan outcome, len(reqs))
		begin := time.Now()
		killAt := begin.Add(400*time.Millisecond + time.Duration(rng.Int64N(int64(100*time.Millisecond))))
		for _, r := range reqs {
			r(begin, killAt, out)
		}
		time.Sleep(time.Until(killAt))
		s.kill()
		for range reqs {
			o := <-out
			switch {
			case o.st == 0 && !strings.Contains(o.err, "connection refused") && !strings.Contains(o.err, "no such file"):
				cut[o.op]++
			case o.st >= 200 && o.st < 300:
				took[o.op] = append(took[o.op], o.took)
			case o.st == 0:
			default:
				t.Errorf("round %d: %s %s answered %d %s", round, o.op, o.id, o.st, o.err)
			}
		}
		s.restart()
		present := map[string]view{}
		for _, id := range append(append(slices.Clone(pool), "base"), creates...) {
			if _, ok := s.settled(id); !ok {
				continue
			}
			v := checkSaved(t, s, id)
			present[id] = v.view
			if !strings.HasPrefix(id, "rs") {
				continue
			}
			restored := fileSum(t, s.stateDir+"/vms/"+id+"/root.qcow2") == snapped[id+"root"]
			for _, d := range disks {
				if got, want := fileSum(t, s.stateDir+"/vms/"+id+"/"+d+".qcow2"), map[bool]map[string]string{true: snapped, false: before}[restored][id+d]; got != want {
					t.Errorf("round %d: %s's %s is not the %s one its root disk is (a mix)", round, id, d, map[bool]string{true: "restored", false: "old"}[restored])
				}
			}
			if (v.SuspendedAt != nil) != restored {
				t.Errorf("round %d: %s restored %v with suspended_at %v", round, id, restored, v.SuspendedAt)
			}
		}
		checkSnapshots(t, s)
		checkNothingElse(t, s, present, root)
		if t.Failed() {
			break
		}
		// What the round made goes: its new VMs and snapshots.
		for _, id := range creates {
			if _, ok := present[id]; ok {
				mustDo("DELETE", "/api/vms/"+id+"?force=true", "", http.StatusNoContent)
			}
		}
		for _, id := range checkSnapshots(t, s) {
			if strings.HasPrefix(id, fmt.Sprintf("r%d-", round)) {
				mustDo("DELETE", "/api/snapshots/"+id, "", http.StatusNoContent)
			}
		}
	}
	t.Logf("%d rounds; requests cut short: %v; median answered before the kill: suspend %v, resume %v, snapshot %v, restore %v, create %v, delete %v",
		n.rounds, cut, median(took["suspend"]), median(took["resume"]), median(took["snapshot"]), median(took["restore"]), median(took["create"]), median(took["delete"]))
	if !enough() {
		t.Errorf("cut short %v, want at least %d of each operation", cut, want)
	}
}
