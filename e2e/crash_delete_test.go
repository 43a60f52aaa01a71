//go:build linux

package e2e

import (
	"fmt"
	mrand "math/rand/v2"
	"net/http"
	"net/http/httptest"
	"os"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"vmhost/config"
)

// stalledImageServer answers with headers and then nothing, until the test
// ends: a download that never progresses.
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

// TestDeleteStalledDownload: a VM whose image download stalls stays
// downloading; DELETE without force is 409, DELETE ?force=true cancels the
// download and answers 204 with nothing left (image cache temp included).
// After an agent restart the provision resumes and stalls again, and the
// forced delete still works.
func TestDeleteStalledDownload(t *testing.T) {
	s := startServer(t, serverOpts{confine: true})
	f := newFixture(t)
	url := stalledImageServer(t)
	body := func(id string) string {
		return `{"vm_id":"` + id + `","vcpus":1,"memory_mb":128,"kernel_path":"` + f.kernel + `","disk":{"size_gib":3},` +
			`"image":{"image_id":"img","content_sha256":"` + strings.Repeat("cd", 32) + `","fetch_url":"` + url + `"},"auto_boot":true}`
	}
	downloading := func() {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for {
			if ents, _ := os.ReadDir(s.stateDir + "/images"); len(ents) > 0 {
				return
			}
			if time.Now().After(deadline) {
				t.Fatal("the download never began")
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	deleted := func(id string) {
		t.Helper()
		if st, b := s.do("DELETE", "/api/vms/"+id, ""); st != http.StatusConflict {
			t.Errorf("DELETE without force while downloading = %d %s, want 409", st, b)
		}
		start := time.Now()
		if st, b := s.do("DELETE", "/api/vms/"+id+"?force=true", ""); st != http.StatusNoContent {
			t.Fatalf("DELETE ?force=true while downloading = %d %s, want 204", st, b)
		}
		t.Logf("forced delete of %s took %v", id, time.Since(start))
		checkGone(t, s, id)
		if ents, _ := os.ReadDir(s.stateDir + "/images"); len(ents) != 0 {
			t.Errorf("image cache holds %v after the cancelled download", ents)
		}
	}

	s.create(body("stall1"), http.StatusAccepted)
	downloading()
	deleted("stall1")

	s.create(body("stall2"), http.StatusAccepted)
	downloading()
	s.kill()
	s.restart()
	if v, ok := s.get("stall2"); !ok || v.DisplayState != "downloading" {
		t.Fatalf("after a restart: %+v, want the provision resumed (downloading)", v)
	}
	downloading()
	deleted("stall2")
}

// TestCrashDeleteCreateLoop kills the agent with SIGKILL at random points
// of concurrent forced deletes (of running VMs) and creates, restarts it,
// and checks that every VM is either fully there and consistent (its
// disks, run directory, taps and, when running, processes present; or
// failed, saying why) or fully gone, and that nothing is left that no VM
// owns. Always on, it interrupts at least 5 deletes and 5 creates;
// VMHOST_E2E_CRASH_LOOP=1 (without -short) makes it 50 and 50.
func TestCrashDeleteCreateLoop(t *testing.T) {
	t.Parallel() // a long loop, mostly waiting: beside the others (doc.go)
	want := 5
	if os.Getenv("VMHOST_E2E_CRASH_LOOP") != "" && !testing.Short() {
		want = 50
	}
	root := os.Geteuid() == 0
	nets := ""
	if root {
		nets = `,"nets":[{}]`
	} else {
		t.Log("not root: no network namespace, so the VMs have no interface")
	}
	s := startServer(t, serverOpts{netns: root, confine: true, edit: func(c *config.Config) { c.HostCPUs = 64 }})
	f := newFixture(t)
	seed := time.Now().UnixNano()
	t.Logf("seed %d", seed)
	rng := mrand.New(mrand.NewPCG(uint64(seed), 0))
	var n struct {
		rounds, deletesCut, midTeardown, deletesGone, deletesKept int
		createsCut, createsGone, createsFailed, createsUp         int
	}
	const perRound = 8
	var delTook, createTook []time.Duration // of requests answered before the kill
	for round := 0; (n.deletesCut < want || n.createsCut < want) && round < 4*want; round++ {
		n.rounds++
		var dels, crs []string
		for i := range perRound {
			id := fmt.Sprintf("d%d-%d", round, i)
			s.create(f.body(id, true, nets), http.StatusCreated)
			dels = append(dels, id)
			crs = append(crs, fmt.Sprintf("c%d-%d", round, i))
		}
		for _, id := range dels {
			s.waitDisplay(id, "running", "running")
		}
		type outcome struct {
			id, err string
			st      int
			del     bool
			took    time.Duration
		}
		out := make(chan outcome, 2*perRound)
		// The kill comes at a random time; each request starts up to about
		// twice its usual length before it, so the kill falls anywhere in
		// it or after it (here, 16 at once, a forced delete of a running VM
		// takes some 80 ms, a create with boot some 300 ms).
		killAt := 600*time.Millisecond + time.Duration(rng.Int64N(int64(100*time.Millisecond)))
		begin := time.Now()
		start := func(id string, del bool, span time.Duration) {
			delay := killAt - time.Duration(rng.Int64N(int64(span)))
			go func() {
				time.Sleep(time.Until(begin.Add(delay)))
				var st int
				var b []byte
				t0 := time.Now()
				if del {
					st, b = s.do("DELETE", "/api/vms/"+id+"?force=true", "")
				} else {
					st, b = s.do("POST", "/api/vms", f.body(id, true, nets))
				}
				out <- outcome{id: id, st: st, err: string(b), del: del, took: time.Since(t0)}
			}()
		}
		for i := range perRound {
			start(dels[i], true, 200*time.Millisecond)
			start(crs[i], false, 600*time.Millisecond)
		}
		time.Sleep(time.Until(begin.Add(killAt)))
		s.kill()
		// A request counts as interrupted when it reached the agent and got
		// no answer (not when the agent was already dead at connect).
		cut := map[string]bool{}
		for range 2 * perRound {
			o := <-out
			switch {
			case o.st == 0 && !strings.Contains(o.err, "connection refused") && !strings.Contains(o.err, "no such file"):
				cut[o.id] = true
			case o.del && o.st == http.StatusNoContent:
				delTook = append(delTook, o.took)
			case !o.del && o.st == http.StatusCreated:
				createTook = append(createTook, o.took)
			case o.st == 0:
			default:
				t.Errorf("round %d: %s answered %d %s", round, o.id, o.st, o.err)
			}
		}
		for _, id := range dels {
			// What the dead agent left: a record over a VM whose teardown
			// had begun is the case the recorded intent is for.
			if cut[id] && exists(s.stateDir+"/vms/"+id+".json") &&
				(!exists(s.stateDir+"/vms/"+id+"/root.qcow2") || !exists(s.runDir+"/vms/"+id)) {
				n.midTeardown++
			}
		}
		s.restart()
		present := map[string]view{}
		for _, id := range append(append([]string(nil), dels...), crs...) {
			v, ok := s.settled(id)
			if ok {
				present[id] = v
				checkConsistent(t, s, v, root)
			}
			switch {
			case !cut[id]:
			case strings.HasPrefix(id, "d"):
				n.deletesCut++
				if ok {
					n.deletesKept++
				} else {
					n.deletesGone++
				}
			case !ok:
				n.createsCut++
				n.createsGone++
			case v.State == "failed":
				n.createsCut++
				n.createsFailed++
			default:
				n.createsCut++
				n.createsUp++
			}
		}
		checkNothingElse(t, s, present, root)
		for id := range present {
			if st, b := s.do("DELETE", "/api/vms/"+id+"?force=true", ""); st != http.StatusNoContent {
				t.Fatalf("round %d: DELETE %s after the restart = %d %s", round, id, st, b)
			}
		}
		for id := range present {
			checkGone(t, s, id)
		}
		if t.Failed() {
			break
		}
	}
	t.Logf("%d rounds: %d interrupted deletes (%d cut mid-teardown, the record left over a VM partly gone): %d finished at restart, %d still there and consistent; "+
		"%d interrupted creates: %d gone, %d failed (rolled back), %d created or running",
		n.rounds, n.deletesCut, n.midTeardown, n.deletesGone, n.deletesKept, n.createsCut, n.createsGone, n.createsFailed, n.createsUp)
	t.Logf("answered before the kill: %d deletes, median %v; %d creates, median %v", len(delTook), median(delTook), len(createTook), median(createTook))
	if n.deletesCut < want || n.createsCut < want {
		t.Errorf("interrupted %d deletes and %d creates, want at least %d each", n.deletesCut, n.createsCut, want)
	}
}

func median(d []time.Duration) time.Duration {
	if len(d) == 0 {
		return 0
	}
	slices.Sort(d)
	return d[len(d)/2]
}

// settled waits until VM id is gone or no longer provisioning or booting
// (recovery resumes or rolls back in the background), and returns its view.
func (s *server) settled(id string) (view, bool) {
	s.t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for {
		v, ok := s.get(id)
		if !ok {
			return v, false
		}
		switch v.DisplayState {
		case "creating", "downloading", "booting":
		default:
			return v, true
		}
		if time.Now().After(deadline) {
			s.t.Fatalf("VM %s did not settle within 15s: %+v", id, v)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// checkConsistent asserts that a VM that is not failed has everything it
// owns: root disk and data volume, run directory, taps, and when running
// its processes. A failed VM must say why.
func checkConsistent(t *testing.T, s *server, v view, taps bool) {
	t.Helper()
	if v.State == "failed" {
		if v.FailureReason == nil {
			t.Errorf("%s: failed without a failure_reason", v.ID)
		}
		return
	}
	for _, p := range []string{s.stateDir + "/vms/" + v.ID + "/root.qcow2", s.stateDir + "/vms/" + v.ID + "/data0.qcow2", s.runDir + "/vms/" + v.ID} {
		if !exists(p) {
			t.Errorf("%s looks healthy (%s/%s) without %s", v.ID, v.State, v.DisplayState, p)
		}
	}
	if v.State == "running" || v.State == "paused" {
		if v.PID == 0 || syscall.Kill(v.PID, 0) != nil || v.Disk == nil || syscall.Kill(v.Disk.QSDPid, 0) != nil {
			t.Errorf("%s is %s without its processes: %+v", v.ID, v.State, v)
		}
	}
	if taps {
		have := map[string]bool{}
		for _, o := range s.ownedTaps(t) {
			have[o.Name] = true
		}
		for _, nic := range v.Nets {
			if !have[nic.TapName] {
				t.Errorf("%s (%s) names tap %s, which does not exist", v.ID, v.State, nic.TapName)
			}
		}
	}
}

// checkNothingElse asserts that no process, directory or tap is left that
// none of the present VMs owns.
func checkNothingElse(t *testing.T, s *server, present map[string]view, taps bool) {
	t.Helper()
	pids := map[int]bool{}
	tapNames := map[string]bool{}
	for _, v := range present {
		pids[v.PID] = true
		if v.Disk != nil {
			pids[v.Disk.QSDPid] = true
		}
		for _, nic := range v.Nets {
			tapNames[nic.TapName] = true
		}
	}
	for _, p := range s.children() {
		if !pids[p] {
			t.Errorf("process %d is left that no VM owns", p)
		}
	}
	for _, dir := range []string{s.stateDir + "/vms", s.runDir + "/vms"} {
		ents, _ := os.ReadDir(dir)
		for _, e := range ents {
			id := strings.TrimSuffix(e.Name(), ".json")
			if _, ok := present[id]; !ok {
				t.Errorf("%s/%s is left that no VM owns", dir, e.Name())
			}
		}
	}
	if taps {
		for _, o := range s.ownedTaps(t) {
			if !tapNames[o.Name] {
				t.Errorf("tap %s is left that no VM owns", o.Name)
			}
		}
	}
	checkJails(t, s, present)
}
