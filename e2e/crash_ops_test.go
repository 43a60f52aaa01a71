//go:build linux

package e2e

import (
	"encoding/json"
	"fmt"
	mrand "math/rand/v2"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"vmhost/appvm"
	"vmhost/config"
	"vmhost/internal/atomicfile"
	"vmhost/qcow2"
)

// The day-two operations of a running AppVM, each killed (SIGKILL) at
// random points: a hot attach, a hot detach, a spec edit with
// ?restart=true and a redeploy. After each kill the agent starts again
// and the test checks that the AppVM ends in the state the operation
// meant (attached, detached, running on its new spec, running on the new
// build if it was committed or else on the old one), that nothing is left
// half done (the record, CH's disks and the storage daemon's exports
// agree, no change or restart left pending), that the next attach and
// detach work, and that no file is left that the records do not know.
// Always on, each interrupts at least 5 operations; in CI, and with
// VMHOST_E2E_CRASH_LOOP=1, 50 (not with -short). With the real
// qemu-storage-daemon installed, attach and detach make their 50 against
// it, and the simulated daemon's runs keep 5.

// crashOp is one operation under test.
type crashOp struct {
	name string
	// setup readies the AppVM for round r (before the request).
	setup func(c *opCrash, r int)
	// request is the operation of round r.
	request func(c *opCrash, r int) (int, []byte)
	// answered is the status of an operation that completed.
	answered int
	// check asserts the outcome of round r after the restart; before is
	// the record as the killed agent left it.
	check func(c *opCrash, r int, before appRecord, answered bool)
}

// opCrash is the state of one operation's kill loop.
type opCrash struct {
	t   *testing.T
	s   *server
	cat appvm.Catalog
	id  string
	rng *mrand.Rand
	// killed is closed when the round's kill came: a request that waits
	// for the agent gives up then.
	killed chan struct{}
	// outcomes counts what the interrupted operations ended as.
	outcomes map[string]int
}

// appRecord is the part of an AppVM's record file these tests read.
type appRecord struct {
	State string `json:"state"`
	Jail  *struct {
		UID uint32 `json:"uid"`
	} `json:"jail"`
	Spec struct {
		Volumes []struct {
			ID         string `json:"id"`
			VolumeID   string `json:"volume_id"`
			Mountpoint string `json:"mountpoint"`
			Pending    string `json:"pending"`
		} `json:"volumes"`
	} `json:"spec"`
	AppVM struct {
		Env         []string `json:"env"`
		SpecPending bool     `json:"spec_pending"`
		SpecGen     uint64   `json:"spec_gen"`
		Redeploy    *struct {
			To struct {
				BuildDigest string `json:"build_digest"`
			} `json:"to"`
			Staged bool `json:"staged"`
		} `json:"redeploy"`
		RedeployError string          `json:"redeploy_error"`
		Restart       json.RawMessage `json:"restart"`
		Image         struct {
			BuildDigest string `json:"build_digest"`
		} `json:"image"`
	} `json:"appvm"`
}

func (c *opCrash) record() appRecord {
	c.t.Helper()
	r, err := c.readRecord()
	if err != nil {
		c.t.Fatal(err)
	}
	return r
}

// readRecord reads the AppVM's record file (safe off the test's
// goroutine).
func (c *opCrash) readRecord() (appRecord, error) {
	var r appRecord
	b, err := os.ReadFile(filepath.Join(c.s.stateDir, "vms", c.id+".json"))
	if err == nil {
		err = json.Unmarshal(b, &r)
	}
	return r, err
}

// volume returns the record's volume mounted at mp, if any.
func (r appRecord) volume(mp string) (id, volumeID, pending string, ok bool) {
	for _, v := range r.Spec.Volumes {
		if v.Mountpoint == mp {
			return v.ID, v.VolumeID, v.Pending, true
		}
	}
	return "", "", "", false
}

func (r appRecord) settled() bool {
	if r.AppVM.Redeploy != nil || len(r.AppVM.Restart) > 0 && string(r.AppVM.Restart) != "null" {
		return false
	}
	return !slices.ContainsFunc(r.Spec.Volumes, func(v struct {
		ID         string `json:"id"`
		VolumeID   string `json:"volume_id"`
		Mountpoint string `json:"mountpoint"`
		Pending    string `json:"pending"`
	}) bool {
		return v.Pending != ""
	})
}

// settle waits until the AppVM runs (booted: its guest agent connected)
// and its record holds nothing in progress, and returns the record.
func (c *opCrash) settle() appRecord {
	c.t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for {
		r := c.record()
		v := c.s.appvmGet(c.id)
		if r.settled() && v.State == "running" && v.DisplayState == "running" {
			return r
		}
		if time.Now().After(deadline) {
			c.t.Fatalf("AppVM %s did not settle: record %+v, view %s", c.id, r, v.raw)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func (c *opCrash) attach(mp, body string) {
	c.t.Helper()
	if st, b := c.s.do("POST", "/api/appvm/vms/"+c.id+"/volumes", body); st != http.StatusOK {
		c.t.Fatalf("attach at %s = %d %s", mp, st, b)
	}
}

// detach detaches the volume at mp and deletes the first-class volume a
// VM-owned one became, unless keep.
func (c *opCrash) detach(mp string, keep bool) {
	c.t.Helper()
	key, _, _, ok := c.record().volume(mp)
	if !ok {
		c.t.Fatalf("no volume at %s to detach", mp)
	}
	st, b := c.s.do("DELETE", "/api/appvm/vms/"+c.id+"/volumes/"+key, "")
	if st != http.StatusOK {
		c.t.Fatalf("detach of %s = %d %s", key, st, b)
	}
	var v struct {
		VolumeID string `json:"volume_id"`
	}
	json.Unmarshal(b, &v)
	if !keep {
		c.dropKept()
	}
}

// dropKept deletes every first-class volume but the test's own ("fc"):
// the VM-owned volumes detaches kept.
func (c *opCrash) dropKept() {
	c.t.Helper()
	st, b := c.s.do("GET", "/api/volumes", "")
	var list struct {
		Volumes []struct {
			ID         string          `json:"id"`
			AttachedTo json.RawMessage `json:"attached_to"`
		} `json:"volumes"`
	}
	if st != http.StatusOK || json.Unmarshal(b, &list) != nil {
		c.t.Fatalf("GET /api/volumes = %d %s", st, b)
	}
	for _, v := range list.Volumes {
		if v.ID == "fc" || len(v.AttachedTo) > 0 {
			continue
		}
		if st, b := c.s.do("DELETE", "/api/volumes/"+v.ID, ""); st != http.StatusNoContent {
			c.t.Fatalf("DELETE /api/volumes/%s = %d %s", v.ID, st, b)
		}
	}
}

// checkFiles asserts that the state directory holds no temp file, that
// the AppVM's directory holds only what its record names, and that the
// volumes directory holds exactly the first-class volumes the API lists.
func (c *opCrash) checkFiles() {
	c.t.Helper()
	// A temp file seen twice, a while apart, is a leftover; the running
	// agent's writes in flight make (and remove) their own meanwhile.
	temps := func() map[string]bool {
		out := map[string]bool{}
		filepath.WalkDir(c.s.stateDir, func(p string, e os.DirEntry, err error) error {
			if err == nil && atomicfile.IsTemp(e.Name()) {
				out[p] = true
			}
			return nil
		})
		return out
	}
	first := temps()
	if len(first) > 0 {
		time.Sleep(500 * time.Millisecond)
		for p := range temps() {
			if first[p] {
				c.t.Errorf("temp file %s left", p)
			}
		}
	}
	r := c.record()
	const logName = "workload.ndjson" // appvm.WorkloadLog, and its rotation (.1)
	want := []string{"root.qcow2", logName}
	for _, v := range r.Spec.Volumes {
		if v.VolumeID == "" {
			want = append(want, v.ID+".qcow2")
		}
	}
	if r.Jail != nil {
		// A confined VM reaches its first-class volumes through hard links
		// in volumes/, one per volume its record names, and owns them
		// while attached; a volume not attached is root's.
		want = append(want, "volumes")
		attached := map[string]bool{}
		for _, v := range r.Spec.Volumes {
			if v.VolumeID != "" {
				attached[v.VolumeID] = true
			}
		}
		links, _ := os.ReadDir(filepath.Join(c.s.stateDir, "vms", c.id, "volumes"))
		for _, e := range links {
			vid := strings.TrimSuffix(e.Name(), ".qcow2")
			li, lerr := os.Stat(filepath.Join(c.s.stateDir, "vms", c.id, "volumes", e.Name()))
			vi, verr := os.Stat(filepath.Join(c.s.stateDir, "volumes", vid+".qcow2"))
			if !attached[vid] || lerr != nil || verr != nil || !os.SameFile(li, vi) {
				c.t.Errorf("vms/%s/volumes/%s is not the link of a volume its record names (%v)", c.id, e.Name(), attached)
			}
		}
		vols, _ := filepath.Glob(filepath.Join(c.s.stateDir, "volumes", "*.qcow2"))
		for _, f := range vols {
			fi, err := os.Stat(f)
			if err != nil {
				continue
			}
			owner, want := fi.Sys().(*syscall.Stat_t).Uid, uint32(0)
			if attached[strings.TrimSuffix(filepath.Base(f), ".qcow2")] {
				want = r.Jail.UID
			}
			if owner != want {
				c.t.Errorf("%s is uid %d's, want %d's (attached: %v)", f, owner, want, attached)
			}
		}
	}
	ents, _ := os.ReadDir(filepath.Join(c.s.stateDir, "vms", c.id))
	for _, e := range ents {
		if !slices.Contains(want, e.Name()) && !strings.HasPrefix(e.Name(), logName) {
			c.t.Errorf("%s/vms/%s/%s is a file the record does not name (it names %v)", c.s.stateDir, c.id, e.Name(), want)
		}
	}
	st, b := c.s.do("GET", "/api/volumes", "")
	var list struct {
		Volumes []struct {
			ID string `json:"id"`
		} `json:"volumes"`
	}
	if st != http.StatusOK || json.Unmarshal(b, &list) != nil {
		c.t.Fatalf("GET /api/volumes = %d %s", st, b)
	}
	var files, listed []string
	for _, v := range list.Volumes {
		listed = append(listed, v.ID+".json", v.ID+".qcow2")
	}
	vents, _ := os.ReadDir(filepath.Join(c.s.stateDir, "volumes"))
	for _, e := range vents {
		files = append(files, e.Name())
	}
	slices.Sort(listed)
	if !slices.Equal(files, listed) {
		c.t.Errorf("volumes directory holds %v; the API lists %v", files, listed)
	}
}

// appvmOps are the operations TestCrashDuringAppVMOperations kills.
var appvmOps = []crashOp{
	{
		name: "attach",
		// A new VM-owned volume (made with mkfs.ext4), or the first-class
		// ext4 volume fc, by turns.
		request: func(c *opCrash, r int) (int, []byte) {
			body := `{"size_gib":1,"mountpoint":"/data"}`
			if r%2 == 1 {
				body = `{"volume_id":"fc","mountpoint":"/data"}`
			}
			return c.s.do("POST", "/api/appvm/vms/"+c.id+"/volumes", body)
		},
		answered: http.StatusOK,
		check: func(c *opCrash, r int, before appRecord, answered bool) {
			_, _, _, recorded := before.volume("/data")
			_, _, pending, attached := c.record().volume("/data")
			switch {
			case pending != "":
				c.t.Errorf("round %d: the attach is still pending", r)
			case recorded && !attached:
				c.t.Errorf("round %d: the attach was recorded before the kill, and is not finished", r)
			case !recorded && attached && !answered:
				c.t.Errorf("round %d: a volume attached that no record had", r)
			}
			c.outcomes[fmt.Sprintf("attached=%t", attached)]++
			// The next detach (or attach, then detach) works.
			if !attached {
				c.attach("/data", `{"size_gib":1,"mountpoint":"/data"}`)
				waitVolumesAgree(c.t, c.s, c.id)
			}
			c.detach("/data", false)
		},
	},
	{
		name: "detach",
		setup: func(c *opCrash, r int) {
			body := `{"size_gib":1,"mountpoint":"/data"}`
			if r%2 == 1 {
				body = `{"volume_id":"fc","mountpoint":"/data"}`
			}
			c.attach("/data", body)
		},
		request: func(c *opCrash, r int) (int, []byte) {
			key, _, _, _ := c.record().volume("/data")
			return c.s.do("DELETE", "/api/appvm/vms/"+c.id+"/volumes/"+key, "")
		},
		answered: http.StatusOK,
		check: func(c *opCrash, r int, before appRecord, answered bool) {
			_, _, was, recorded := before.volume("/data")
			_, _, pending, attached := c.record().volume("/data")
			switch {
			case pending != "":
				c.t.Errorf("round %d: the detach is still pending", r)
			case (was == "detach" || !recorded) && attached:
				c.t.Errorf("round %d: the detach was recorded before the kill, and is not finished", r)
			case recorded && was == "" && !attached && !answered:
				c.t.Errorf("round %d: a volume detached that no record said to detach", r)
			}
			c.outcomes[fmt.Sprintf("attached=%t", attached)]++
			// The next attach (or detach, then attach) works.
			if attached {
				c.detach("/data", false)
			}
			c.dropKept()
			c.attach("/data", `{"volume_id":"fc","mountpoint":"/data"}`)
			waitVolumesAgree(c.t, c.s, c.id)
			c.detach("/data", false)
		},
	},
	{
		name: "patch-restart",
		request: func(c *opCrash, r int) (int, []byte) {
			return c.s.do("PATCH", "/api/appvm/vms/"+c.id+"/spec?restart=true", fmt.Sprintf(`{"env":["ROUND=%d"]}`, r))
		},
		answered: http.StatusOK,
		check: func(c *opCrash, r int, before appRecord, answered bool) {
			after := c.record()
			edited := slices.Contains(before.AppVM.Env, fmt.Sprintf("ROUND=%d", r))
			now := slices.Contains(after.AppVM.Env, fmt.Sprintf("ROUND=%d", r))
			switch {
			case edited && !now:
				c.t.Errorf("round %d: the stored edit was lost: env %v", r, after.AppVM.Env)
			case after.AppVM.SpecPending:
				c.t.Errorf("round %d: the AppVM runs on its old spec (spec_pending), though the edit asked for a restart", r)
			}
			c.outcomes[fmt.Sprintf("edited=%t", now)]++
		},
	},
	{
		name: "redeploy",
		setup: func(c *opCrash, r int) {
			// A new build of the image for every round.
			im, err := c.cat.Get("svc")
			if err != nil {
				c.t.Fatal(err)
			}
			im.Workload.BuildDigest = fmt.Sprintf("sha256:%064x", r+1)
			if err := os.MkdirAll(filepath.Dir(c.cat.RootFS(im)), 0o700); err != nil {
				c.t.Fatal(err)
			}
			if err := qcow2.Create(c.cat.RootFS(im), 64<<20); err != nil {
				c.t.Fatal(err)
			}
			if err := c.cat.Put(im); err != nil {
				c.t.Fatal(err)
			}
		},
		request: func(c *opCrash, r int) (int, []byte) {
			st, b := c.s.do("POST", "/api/appvm/vms/"+c.id+"/redeploy", "")
			if st != http.StatusAccepted {
				return st, b
			}
			// The redeploy runs in the background: it is done when the
			// AppVM runs on the new build.
			want := fmt.Sprintf("sha256:%064x", r+1)
			for {
				rec, err := c.readRecord()
				vst, vb := c.s.do("GET", "/api/appvm/vms/"+c.id, "")
				if err == nil && vst == http.StatusOK && rec.AppVM.Redeploy == nil && rec.AppVM.Image.BuildDigest == want && strings.Contains(string(vb), `"display_state":"running"`) {
					return st, b
				}
				if err == nil && rec.AppVM.Redeploy == nil && rec.AppVM.RedeployError != "" {
					return -1, []byte("redeploy failed: " + rec.AppVM.RedeployError)
				}
				select {
				case <-c.killed:
					return 0, []byte("the agent was killed during the redeploy")
				case <-time.After(20 * time.Millisecond):
				}
			}
		},
		answered: http.StatusAccepted,
		check: func(c *opCrash, r int, before appRecord, answered bool) {
			after := c.record()
			want := fmt.Sprintf("sha256:%064x", r+1)
			committed := before.AppVM.Image.BuildDigest == want || before.AppVM.Redeploy != nil && before.AppVM.Redeploy.Staged
			switch {
			case committed && after.AppVM.Image.BuildDigest != want:
				c.t.Errorf("round %d: the new root disk was committed, and the AppVM runs build %s", r, after.AppVM.Image.BuildDigest)
			case !committed && after.AppVM.Image.BuildDigest == want:
				c.t.Errorf("round %d: the AppVM runs the new build, which was not committed", r)
			case !committed && before.AppVM.Redeploy != nil && after.AppVM.RedeployError == "":
				c.t.Errorf("round %d: a redeploy rolled back without redeploy_error", r)
			}
			c.outcomes[fmt.Sprintf("new_build=%t", after.AppVM.Image.BuildDigest == want)]++
		},
	},
}

func TestCrashDuringAppVMOperations(t *testing.T) {
	t.Parallel() // a long loop, mostly waiting: beside the others (doc.go)
	full := 5
	if (os.Getenv("CI") != "" || os.Getenv("VMHOST_E2E_CRASH_LOOP") != "") && !testing.Short() {
		full = 50 // the proof (about 5 minutes here)
	}
	// The volume changes run against the real qemu-storage-daemon too;
	// where it runs, it gets the full count and the simulator 5.
	type variant struct {
		name string
		opts serverOpts
		ops  []crashOp
		want int
	}
	volumeOps, restartOps := appvmOps[:2], appvmOps[2:]
	variants := []variant{{"qsdsim", serverOpts{}, volumeOps, full}, {"qsdsim", serverOpts{}, restartOps, full}}
	if qsd, err := exec.LookPath("qemu-storage-daemon"); err == nil {
		variants[0].want = min(full, 5)
		variants = append(variants, variant{"real-qsd", serverOpts{simulate: "ch", edit: func(c *config.Config) { c.Binaries.QemuStorageDaemon = qsd }}, volumeOps, full})
	} else if os.Getenv("CI") != "" {
		t.Fatal("qemu-storage-daemon not installed")
	}
	for _, v := range variants {
		for _, op := range v.ops {
			t.Run(v.name+"/"+op.name, func(t *testing.T) {
				t.Parallel()
				crashLoop(t, v.opts, op, v.want)
			})
		}
	}
}

// crashLoop kills the agent during op until want operations were cut
// short, checking each outcome.
func crashLoop(t *testing.T, o serverOpts, op crashOp, want int) {
	s := startAppVMServerWith(t, o, map[string]string{"svc": `trap 'exit 0' TERM; echo up; while :; do sleep 0.05; done`})
	c := &opCrash{t: t, s: s, cat: appvm.Catalog{Dir: filepath.Join(s.stateDir, "appvm-images")}, id: "app", outcomes: map[string]int{}}
	seed := time.Now().UnixNano()
	t.Logf("seed %d", seed)
	c.rng = mrand.New(mrand.NewPCG(uint64(seed), 0))
	if st, b := s.do("POST", "/api/appvm/vms", `{"vm_id":"app","image_id":"svc","vcpus":1,"memory_mb":128,"disk_gib":1,`+
		`"ip":"10.80.0.5","prefix":24,"gateway":"10.80.0.1"}`); st != http.StatusCreated {
		t.Fatalf("create = %d %s", st, b)
	}
	if st, b := s.do("POST", "/api/volumes", `{"volume_id":"fc","size_gib":1,"format":"ext4"}`); st != http.StatusCreated {
		t.Fatalf("POST /api/volumes = %d %s", st, b)
	}
	c.settle()
	// How long the operation takes here, uninterrupted: kills fall
	// at random points within about that span.
	if op.setup != nil {
		op.setup(c, 0)
	}
	t0 := time.Now()
	c.killed = make(chan struct{})
	if st, b := op.request(c, 0); st != op.answered {
		t.Fatalf("%s = %d %s", op.name, st, b)
	}
	took := []time.Duration{time.Since(t0)}
	c.settle()
	op.check(c, 0, c.record(), true)
	c.settle()
	t.Logf("%s takes %v uninterrupted", op.name, took[0])
	cut, rounds := 0, 0
	for r := 1; cut < want && r <= 10*want+10; r++ {
		rounds++
		if op.setup != nil {
			op.setup(c, r)
		}
		c.settle()
		type answer struct {
			st   int
			b    []byte
			took time.Duration
		}
		done := make(chan answer, 1)
		c.killed = make(chan struct{})
		go func() {
			t0 := time.Now()
			st, b := op.request(c, r)
			done <- answer{st, b, time.Since(t0)}
		}()
		// The kill falls at a random point of about the operation's
		// length (the median of the runs that finished so far).
		span := median(took)
		time.Sleep(time.Duration(c.rng.Int64N(int64(span + span/4))))
		s.kill()
		close(c.killed)
		a := <-done
		answered := a.st == op.answered
		switch {
		case answered:
			took = append(took, a.took)
		case a.st == 0 && (strings.Contains(string(a.b), "connection refused") || strings.Contains(string(a.b), "no such file")):
			// the agent was dead before the request reached it
		case a.st == 0:
			cut++
		default:
			t.Errorf("round %d: %s answered %d %s", r, op.name, a.st, a.b)
		}
		before := c.record()
		s.restart()
		c.settle()
		waitVolumesAgree(t, s, c.id)
		op.check(c, r, before, answered)
		c.settle()
		c.checkFiles()
		if t.Failed() {
			break
		}
	}
	t.Logf("%s: %d rounds, %d interrupted; outcomes %v", op.name, rounds, cut, c.outcomes)
	if cut < want {
		t.Errorf("interrupted %d %s operations, want at least %d", cut, op.name, want)
	}
}
