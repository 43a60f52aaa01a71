//go:build linux

package e2e

import (
	"bytes"
	"encoding/json"
	"fmt"
	mrand "math/rand/v2"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"vmhost/appvm"
	"vmhost/config"
	"vmhost/internal/atomicfile"
	"vmhost/internal/netnstest"
	"vmhost/qcow2"
	"vmhost/vm"
)

// commitBuild adds a build of image id to the catalog as an import commits
// one (`vmhost image import` beside the agent): under the image's lock
// file, the build first, then image.json naming it.
func commitBuild(t *testing.T, cat appvm.Catalog, id, digest string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Join(cat.Dir, id), 0o700); err != nil {
		t.Fatal(err)
	}
	lock := filepath.Join(cat.Dir, id+".lock")
	for {
		f, err := os.OpenFile(lock, os.O_RDWR|os.O_CREATE, 0o600)
		if err != nil {
			t.Fatal(err)
		}
		if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX); err != nil {
			t.Fatal(err)
		}
		held, err1 := f.Stat()
		now, err2 := os.Stat(lock)
		if err1 != nil || err2 != nil || !os.SameFile(held, now) {
			f.Close() // a delete removed it meanwhile
			continue
		}
		defer f.Close()
		break
	}
	if err := qcow2.Create(cat.BuildFile(id, digest), 64<<20); err != nil {
		t.Fatal(err)
	}
	im := &appvm.Image{ID: id, Status: appvm.StatusReady, CreatedAt: time.Now().UTC(), Workload: vm.Workload{
		BuildDigest: digest, SizeBytes: 64 << 20, Cmd: []string{"/bin/sh", "-c", "exec sleep 300"},
		Env: []string{"PATH=/usr/local/bin:/usr/bin:/bin"}}}
	if err := cat.Put(im); err != nil {
		t.Fatal(err)
	}
}

// overlayView is the part of an AppVM view the overlay crash test reads.
type overlayView struct {
	ID            string `json:"id"`
	State         string `json:"state"`
	DisplayState  string `json:"display_state"`
	PID           int    `json:"pid"`
	FailureReason *struct {
		Summary string `json:"summary"`
	} `json:"failure_reason"`
	Disk *struct {
		Mode     string `json:"mode"`
		BasePath string `json:"base_path"`
		QSDPid   int    `json:"qsd_pid"`
	} `json:"disk"`
	AppVM struct {
		ImageID       string `json:"image_id"`
		Redeploying   bool   `json:"redeploying"`
		RedeployError string `json:"redeploy_error"`
	} `json:"appvm"`
	raw []byte
}

// appvmSettled waits until AppVM id is gone, or neither provisioning,
// booting nor redeploying, and returns its view.
func (s *server) appvmSettled(id string) (overlayView, bool) {
	s.t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		st, b := s.do("GET", "/api/appvm/vms/"+id, "")
		if st == http.StatusNotFound {
			return overlayView{}, false
		}
		if st != http.StatusOK {
			s.t.Fatalf("GET /api/appvm/vms/%s = %d %s", id, st, b)
		}
		var v overlayView
		if err := json.Unmarshal(b, &v); err != nil {
			s.t.Fatal(err)
		}
		v.raw = b
		switch v.DisplayState {
		case "creating", "downloading", "booting":
		default:
			if !v.AppVM.Redeploying {
				return v, true
			}
		}
		if time.Now().After(deadline) {
			s.t.Fatalf("AppVM %s did not settle within 30s: %s", id, b)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestCrashOverlayLoop kills the agent with SIGKILL at random points of
// concurrent AppVM creates (each root disk an overlay of its image's
// build), redeploys of running AppVMs onto a new build, and deletes of
// images (some that creates from them race, some unused), most rounds with
// the operations stopped dead at one of their steps by the crash hooks,
// restarts it, and checks that no
// root disk is left without the build it reads through to; that every
// AppVM is consistent (a view that is not failed has its root disk, its
// build and, running, its processes; the record and the overlay's header
// name the same build) or gone; that no AppVM names a deleted image; that
// the catalog holds no half-deleted image, no image without its current
// build and, once the agent's sweeps ran, no build nothing uses; and that
// no process or directory is left that no VM owns. Always on, it
// interrupts at least 5 of each operation; VMHOST_E2E_CRASH_LOOP=1
// (without -short) makes it 50.
func TestCrashOverlayLoop(t *testing.T) {
	t.Parallel()             // a long loop, mostly waiting: beside the others (doc.go)
	netnstest.RequireRoot(t) // an AppVM always has an interface
	want := 5
	if os.Getenv("VMHOST_E2E_CRASH_LOOP") != "" && !testing.Short() {
		want = 50
	}
	f := newFixture(t)
	s := startServer(t, serverOpts{netns: true, edit: func(c *config.Config) {
		c.AppVMKernel = f.kernel
		c.HostCPUs, c.HostMemoryMB = 1024, 1<<20
	}})
	cat := appvm.Catalog{Dir: s.stateDir + "/appvm-images"}
	seed := time.Now().UnixNano()
	t.Logf("seed %d", seed)
	rng := mrand.New(mrand.NewPCG(uint64(seed), 0))
	version := 0
	commit := func(id string) {
		version++
		commitBuild(t, cat, id, fmt.Sprintf("sha256:%064x", version))
	}
	commit("base")
	ip := 0
	body := func(id, img string) string {
		ip++
		return fmt.Sprintf(`{"vm_id":%q,"image_id":%q,"vcpus":1,"memory_mb":128,"disk_gib":1,"ip":"10.81.%d.%d","prefix":16,"gateway":"10.81.0.1"}`,
			id, img, ip/200, ip%200+2)
	}
	// The crash hooks (VMHOST_TEST_STOP_AT_STEP) in the steps of the three
	// operations: a create's overlay made but not recorded, its storage
	// daemon started, its guest booted; a redeploy's new root disk staged
	// and recorded, then swapped in; an image delete's directory renamed
	// out of the catalog; and "" (no stop: the kill alone decides).
	stopSteps := []string{"", appvm.HookImageDeleteRenamed, "root_disk", appvm.HookRedeployStaged, appvm.HookImageDeleteRenamed,
		"qsd", appvm.HookRedeploySwapped, appvm.HookImageDeleteRenamed, "booted"}
	var n struct {
		rounds, createsCut, redeploysCut, deletesCut                           int
		createsKept, redeploysDone, redeploysBack, deletesDone, deletesRenamed int
	}
	const perRound = 4
	for round := 0; (n.createsCut < want || n.redeploysCut < want || n.deletesCut < want) && round < 8*want; round++ {
		n.rounds++
		var olds, news, imgs, spares []string
		for i := range perRound {
			id := fmt.Sprintf("o%d-%d", round, i)
			if st, b := s.do("POST", "/api/appvm/vms", body(id, "base")); st != http.StatusCreated {
				t.Fatalf("round %d: create %s = %d %s", round, id, st, b)
			}
			olds = append(olds, id)
			news = append(news, fmt.Sprintf("n%d-%d", round, i))
			img := fmt.Sprintf("img%d-%d", round, i)
			commit(img)
			imgs = append(imgs, img)
		}
		// Images no create races: their deletes get past the users check.
		for i := range perRound {
			img := fmt.Sprintf("spare%d-%d", round, i)
			commit(img)
			spares = append(spares, img)
		}
		for _, id := range olds {
			s.appvmWait(id, "display running", 30*time.Second, func(v appvmView) bool { return v.DisplayState == "running" })
		}
		commit("base") // what the redeploys install
		// Most rounds the operations stop dead at one of their steps
		// (the crash hooks), so the kill finds each of them there.
		step := stopSteps[round%len(stopSteps)]
		if step != "" {
			s.kill()
			s.restart("VMHOST_TEST_STOP_AT_STEP=" + step)
		}

		type outcome struct {
			kind, id, err string
			st            int
		}
		out := make(chan outcome, 4*perRound)
		// The kill comes at a random time; each request starts up to
		// about twice its usual length before it (a create with its boot
		// some 300 ms here, a redeploy's answer at once but its work some
		// 200 ms, an image delete a few ms), so the kill falls anywhere in
		// it or after it.
		killAt := 600*time.Millisecond + time.Duration(rng.Int64N(int64(100*time.Millisecond)))
		begin := time.Now()
		start := func(kind, id, img string, span time.Duration) {
			delay := killAt - time.Duration(rng.Int64N(int64(span)))
			create := ""
			if kind == "create" {
				create = body(id, img) // here: body counts addresses
			}
			go func() {
				time.Sleep(time.Until(begin.Add(delay)))
				var st int
				var b []byte
				switch kind {
				case "create":
					st, b = s.do("POST", "/api/appvm/vms", create)
				case "redeploy":
					st, b = s.do("POST", "/api/appvm/vms/"+id+"/redeploy", "")
				case "delete":
					st, b = s.do("DELETE", "/api/appvm/images/"+id, "")
				}
				out <- outcome{kind: kind, id: id, st: st, err: string(b)}
			}()
		}
		for i := range perRound {
			start("redeploy", olds[i], "", 500*time.Millisecond)
			start("create", news[i], imgs[i], 600*time.Millisecond)
			start("delete", imgs[i], "", 300*time.Millisecond)
			start("delete", spares[i], "", 300*time.Millisecond)
		}
		time.Sleep(time.Until(begin.Add(killAt)))
		s.kill()
		cut := map[string]bool{}
		for range 4 * perRound {
			o := <-out
			switch {
			case o.st == 0 && !strings.Contains(o.err, "connection refused") && !strings.Contains(o.err, "no such file"):
				cut[o.kind+" "+o.id] = true
			case o.st == 0:
			case o.kind == "create" && (o.st == http.StatusCreated || o.st == http.StatusBadRequest):
				// 400: the image was deleted first.
			case o.kind == "redeploy" && (o.st == http.StatusAccepted || o.st == http.StatusConflict):
			case o.kind == "delete" && (o.st == http.StatusNoContent || o.st == http.StatusConflict):
			default:
				t.Errorf("round %d: %s %s answered %d %s", round, o.kind, o.id, o.st, o.err)
			}
		}
		// A redeploy is cut when the dead agent's stored record shows it
		// in progress; an image delete when its request got no answer or
		// its directory was renamed out of the catalog but not removed.
		for _, id := range olds {
			if b, err := os.ReadFile(s.stateDir + "/vms/" + id + ".json"); err == nil && bytes.Contains(b, []byte(`"redeploy": {`)) {
				cut["redeploy "+id] = true
			}
		}
		if half, _ := filepath.Glob(cat.Dir + "/.deleted-*"); len(half) > 0 {
			n.deletesRenamed += len(half)
			for _, h := range half {
				for _, img := range append(imgs, spares...) {
					if strings.HasPrefix(filepath.Base(h), ".deleted-"+img+"-") {
						cut["delete "+img] = true
					}
				}
			}
		}
		for k := range cut {
			switch strings.Fields(k)[0] {
			case "create":
				n.createsCut++
			case "redeploy":
				n.redeploysCut++
			case "delete":
				n.deletesCut++
			}
		}
		s.restart()

		present := map[string]bool{}
		var bases []string
		for _, id := range append(append([]string(nil), olds...), news...) {
			v, ok := s.appvmSettled(id)
			if !ok {
				continue
			}
			present[id] = true
			checkOverlayConsistent(t, s, cat, v)
			if v.Disk != nil {
				bases = append(bases, v.Disk.BasePath)
			}
			switch {
			case cut["create "+id]:
				n.createsKept++
			case cut["redeploy "+id] && v.AppVM.RedeployError == "":
				n.redeploysDone++
			case cut["redeploy "+id]:
				n.redeploysBack++
			}
		}
		for _, img := range append(imgs, spares...) {
			if cut["delete "+img] && !exists(filepath.Join(cat.Dir, img)) {
				n.deletesDone++
			}
		}
		checkCatalog(t, s, cat, bases)
		checkNoStrays(t, s, present)
		for id := range present {
			if st, b := s.do("DELETE", "/api/appvm/vms/"+id+"?force=true", ""); st != http.StatusNoContent {
				t.Fatalf("round %d: DELETE %s after the restart = %d %s", round, id, st, b)
			}
		}
		for _, img := range append(imgs, spares...) {
			if st, b := s.do("DELETE", "/api/appvm/images/"+img, ""); st != http.StatusNoContent && st != http.StatusNotFound {
				t.Fatalf("round %d: DELETE image %s with no AppVM left = %d %s", round, img, st, b)
			}
		}
		if t.Failed() {
			break
		}
	}
	t.Logf("%d rounds: %d interrupted creates (%d kept, the rest rolled back or never stored), %d interrupted redeploys (%d finished, %d rolled back), "+
		"%d interrupted image deletes (%d finished at restart; %d killed after the rename)", n.rounds, n.createsCut, n.createsKept,
		n.redeploysCut, n.redeploysDone, n.redeploysBack, n.deletesCut, n.deletesDone, n.deletesRenamed)
	if n.createsCut < want || n.redeploysCut < want || n.deletesCut < want {
		t.Errorf("interrupted %d creates, %d redeploys and %d image deletes, want at least %d each", n.createsCut, n.redeploysCut, n.deletesCut, want)
	}
}

// checkOverlayConsistent asserts what must hold of a present AppVM after
// a restart: its root disk, if there, reads through to a build that
// exists (the record and the header agree on which); one that is not
// failed has its root disk, its image and, running, its processes.
func checkOverlayConsistent(t *testing.T, s *server, cat appvm.Catalog, v overlayView) {
	t.Helper()
	root := s.stateDir + "/vms/" + v.ID + "/root.qcow2"
	h, err := qcow2.ReadHeaderFile(root)
	switch {
	case err == nil && h.BackingFileOffset != 0:
		if !exists(h.BackingFile) {
			t.Errorf("%s (%s): its root disk reads through to %s, which is gone", v.ID, v.State, h.BackingFile)
		}
		if v.State != "failed" && (v.Disk == nil || v.Disk.Mode != "overlay" || v.Disk.BasePath != h.BackingFile) {
			t.Errorf("%s: the root disk is an overlay of %s, the view says %s", v.ID, h.BackingFile, v.raw)
		}
	case v.State != "failed":
		t.Errorf("%s looks healthy (%s/%s) without an overlay root disk: %v", v.ID, v.State, v.DisplayState, err)
	}
	if v.State == "failed" {
		if v.FailureReason == nil {
			t.Errorf("%s: failed without a failure_reason", v.ID)
		}
		return
	}
	if _, err := cat.Get(v.AppVM.ImageID); err != nil {
		t.Errorf("%s uses image %s, which is gone: %v", v.ID, v.AppVM.ImageID, err)
	}
	if v.State == "running" || v.State == "paused" {
		if v.PID == 0 || syscall.Kill(v.PID, 0) != nil || v.Disk == nil || syscall.Kill(v.Disk.QSDPid, 0) != nil {
			t.Errorf("%s is %s without its processes: %s", v.ID, v.State, v.raw)
		}
	}
}

// checkNoStrays asserts that no process and no directory of a VM that is
// not present is left (an AppVM's simulated guest has processes of its
// own besides CH and QSD, so processes are matched by the VM directory
// their command line names).
func checkNoStrays(t *testing.T, s *server, present map[string]bool) {
	t.Helper()
	for _, pid := range s.children() {
		cmd, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
		if len(cmd) == 0 {
			continue // it exited since children listed it (a zombie's is empty)
		}
		_, rest, _ := bytes.Cut(cmd, []byte(s.runDir+"/vms/"))
		id, _, _ := bytes.Cut(rest, []byte("/"))
		if !present[string(id)] {
			t.Errorf("process %d (%s) is left that no VM owns", pid, bytes.ReplaceAll(cmd, []byte{0}, []byte{' '}))
		}
	}
	for _, dir := range []string{s.stateDir + "/vms", s.runDir + "/vms"} {
		ents, _ := os.ReadDir(dir)
		for _, e := range ents {
			if atomicfile.IsTemp(e.Name()) {
				continue // a record write in flight
			}
			if id := strings.TrimSuffix(e.Name(), ".json"); !present[id] {
				t.Errorf("%s/%s is left that no VM owns", dir, e.Name())
			}
		}
	}
}

// checkCatalog asserts that the catalog holds no half-deleted image, that
// every image has its current build, and that, once the agent's sweeps
// have run, every build is its image's current one, the backing file of
// an AppVM's root disk, or the base of a present AppVM (bases).
func checkCatalog(t *testing.T, s *server, cat appvm.Catalog, bases []string) {
	t.Helper()
	if half, _ := filepath.Glob(cat.Dir + "/.deleted-*"); len(half) > 0 {
		t.Errorf("half-deleted images left after the restart: %q", half)
	}
	used := map[string]bool{}
	for _, b := range bases {
		used[b] = true
	}
	vms, _ := filepath.Glob(s.stateDir + "/vms/*/root.qcow2")
	for _, root := range vms {
		if h, err := qcow2.ReadHeaderFile(root); err == nil && h.BackingFileOffset != 0 {
			used[h.BackingFile] = true
		}
	}
	imgs, err := cat.List()
	if err != nil {
		t.Errorf("catalog: %v", err)
	}
	for _, im := range imgs {
		if im.Status == appvm.StatusReady {
			used[cat.RootFS(im)] = true
			if !exists(cat.RootFS(im)) {
				t.Errorf("image %s is ready without its build %s", im.ID, cat.RootFS(im))
			}
		}
	}
	var extra []string
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		builds, _ := filepath.Glob(cat.Dir + "/*/rootfs*.qcow2")
		extra = slices.DeleteFunc(builds, func(b string) bool { return used[b] })
		if len(extra) == 0 || time.Now().After(deadline) {
			break
		}
	}
	if len(extra) > 0 {
		t.Errorf("builds nothing uses are left: %q", extra)
	}
}
