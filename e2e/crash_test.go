//go:build linux

package e2e

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"slices"
	"testing"
	"time"

	"vmhost/internal/netnstest"
)

// TestCrashAtEachStep kills the agent with SIGKILL at every provisioning
// and boot step in turn (the engine blocks there through the
// VMHOST_TEST_STOP_AT_STEP hook): after each provisioning step, done but
// not recorded (the image step is recorded), once the storage daemon runs,
// once the provision's result is staged (a create with auto_boot stores it
// with the boot), once CH runs, once the guest booted, and once the boot
// is recorded. It restarts the agent and checks that the VM ends fully
// provisioned and running, since the create asked for auto_boot (the
// unrecorded steps redone), and that nothing is left that the record does
// not own: no process, tap, file or directory.
func TestCrashAtEachStep(t *testing.T) {
	root := os.Geteuid() == 0
	steps := crashSteps(root, "image", "root_disk", "data0", "seed", "run_dir", "tap0", "qsd", "provisioned", "ch", "booted", "running")
	f := newFixture(t)
	data, err := os.ReadFile(f.base)
	if err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(data)
	digest := hex.EncodeToString(sum[:])
	for _, step := range steps {
		t.Run(step, func(t *testing.T) {
			marker := t.TempDir() + "/stopped"
			t.Setenv("VMHOST_TEST_STOP_AT_STEP", step)
			t.Setenv("VMHOST_TEST_STOP_MARKER", marker)
			s := startServer(t, serverOpts{netns: root, confine: true})
			url := s.imageServer(t, data)
			body := `{"vm_id":"crash","vcpus":1,"memory_mb":128,"kernel_path":"` + f.kernel + `","disk":{"size_gib":2},"volumes":[{"size_gib":1}],` +
				`"image":{"image_id":"img","content_sha256":"` + digest + `","fetch_url":"` + url + `"},` +
				`"auto_boot":true` + crashNetworking(root) + `}`
			if st, b := s.do("POST", "/api/vms", body); st != http.StatusAccepted {
				t.Fatalf("POST = %d %s", st, b)
			}
			deadline := time.Now().Add(20 * time.Second)
			for !exists(marker) {
				if time.Now().After(deadline) {
					t.Fatalf("the agent never reached step %s", step)
				}
				time.Sleep(10 * time.Millisecond)
			}
			s.kill()
			s.restart()
			v := s.waitFor("crash", "a settled state", func(v view) bool {
				return v.State == "failed" || v.DisplayState == "running"
			})
			t.Logf("crash at %s → %s/%s", step, v.State, v.DisplayState)
			if v.State != "running" {
				t.Errorf("create cut short at %s: state %s/%s %+v, want it resumed and booted", step, v.State, v.DisplayState, v.FailureReason)
			}
			checkOwnedOnly(t, s, "crash", v, digest, root)
		})
	}
}

// crashNetworking is what the crash tests add to a VM's spec: as root, an
// interface and a cloud-init seed, so the tap and seed steps happen;
// without root neither, since an agent without root creates no taps (and
// cloud_init implies an interface).
func crashNetworking(root bool) string {
	if !root {
		return ""
	}
	return `,"cloud_init":{"ssh_authorized_keys":["ssh-ed25519 AAAAC3Nza crash@test"]},"nets":[{}]`
}

// crashSteps is steps without the tap and seed steps when not root (see
// crashNetworking).
func crashSteps(root bool, steps ...string) []string {
	if root {
		return steps
	}
	return slices.DeleteFunc(steps, func(s string) bool { return s == "tap0" || s == "seed" })
}

// checkOwnedOnly asserts that what is on the host for VM id is exactly
// what its view says it owns; root is as for crashNetworking (taps and
// the seed are expected only then).
func checkOwnedOnly(t *testing.T, s *server, id string, v view, digest string, root bool) {
	t.Helper()
	var want []int
	if v.PID != 0 {
		want = append(want, v.PID)
	}
	if v.Disk != nil && v.Disk.QSDPid != 0 {
		want = append(want, v.Disk.QSDPid)
	}
	got := s.children()
	slices.Sort(want)
	slices.Sort(got)
	if !slices.Equal(got, want) {
		t.Errorf("VM processes %v, want exactly the view's CH and QSD %v", got, want)
	}
	provisioned := v.State != "failed"
	names := func(dir string) []string {
		ents, _ := os.ReadDir(dir)
		var out []string
		for _, e := range ents {
			out = append(out, e.Name())
		}
		return out
	}
	wantVMs := []string{id + ".json"}
	if provisioned {
		wantVMs = append(wantVMs, id)
		files := []string{"data0.qcow2", "root.qcow2"}
		if root {
			files = append(files, "seed.img")
		}
		if got := names(s.stateDir + "/vms/" + id); !slices.Equal(got, files) {
			t.Errorf("VM directory holds %v", got)
		}
	}
	slices.Sort(wantVMs)
	if got := names(s.stateDir + "/vms"); !slices.Equal(got, wantVMs) {
		t.Errorf("%s/vms holds %v, want %v", s.stateDir, got, wantVMs)
	}
	var wantRun []string
	if provisioned {
		wantRun = []string{id}
	}
	if got := names(s.runDir + "/vms"); !slices.Equal(got, wantRun) {
		t.Errorf("%s/vms holds %v, want %v", s.runDir, got, wantRun)
	}
	var wantImages []string
	if digest != "" {
		wantImages = []string{"sha256-" + digest + ".qcow2"}
	}
	if got := names(s.stateDir + "/images"); !slices.Equal(got, wantImages) {
		t.Errorf("image cache holds %v, want %v", got, wantImages)
	}
	if !root {
		return
	}
	checkJails(t, s, map[string]view{id: v})
	var tapNames, wantTaps []string
	for _, o := range s.ownedTaps(t) {
		tapNames = append(tapNames, o.Name)
	}
	if provisioned {
		for _, n := range v.Nets {
			wantTaps = append(wantTaps, n.TapName)
		}
	}
	if !slices.Equal(tapNames, wantTaps) {
		t.Errorf("taps %v, want %v", tapNames, wantTaps)
	}
}

// imageServer serves data at /image.qcow2 where the server can reach it:
// on loopback, inside the server's network namespace when it has one.
func (s *server) imageServer(t *testing.T, data []byte) string {
	t.Helper()
	if s.nsFD == 0 {
		return imageServer(t, data)
	}
	var ln net.Listener
	err := netnstest.RunIn(s.nsFD, func() error {
		if out, err := exec.Command("ip", "link", "set", "lo", "up").CombinedOutput(); err != nil {
			return fmt.Errorf("ip link set lo up: %v: %s", err, out)
		}
		var err error
		ln, err = net.Listen("tcp", "127.0.0.1:0")
		return err
	})
	if err != nil {
		t.Fatalf("image server in the server's namespace: %v", err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		if req.URL.Path != "/image.qcow2" {
			http.NotFound(w, req)
			return
		}
		w.Write(data)
	})}
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
	return "http://" + ln.Addr().String() + "/image.qcow2"
}

// TestCrashDuringSyncCreate kills the agent during a synchronous create
// with auto_boot (no image: the caller waits for the answer) at its
// provisioning and boot steps: its caller saw the request fail, so at
// restart the create is rolled back (docs/design.md §4) and the VM failed
// (provision_failed), with nothing left but the record that says why;
// delete and a retry with the same id work. The provision's result is
// stored with the boot, so a create cut after the provision, during the
// boot, is rolled back too; cut once the boot is recorded, it runs.
func TestCrashDuringSyncCreate(t *testing.T) {
	root := os.Geteuid() == 0
	steps := crashSteps(root, "root_disk", "data0", "seed", "tap0", "qsd", "provisioned", "ch", "running")
	f := newFixture(t)
	body := f.body("sync", true, crashNetworking(root))
	for _, step := range steps {
		t.Run(step, func(t *testing.T) {
			marker := t.TempDir() + "/stopped"
			t.Setenv("VMHOST_TEST_STOP_AT_STEP", step)
			t.Setenv("VMHOST_TEST_STOP_MARKER", marker)
			s := startServer(t, serverOpts{netns: root, confine: true})
			done := make(chan int, 1)
			go func() { st, _ := s.do("POST", "/api/vms", body); done <- st }()
			deadline := time.Now().Add(20 * time.Second)
			for !exists(marker) {
				if time.Now().After(deadline) {
					t.Fatalf("the agent never reached step %s", step)
				}
				time.Sleep(10 * time.Millisecond)
			}
			s.kill()
			if st := <-done; st == http.StatusCreated {
				t.Fatalf("the create answered %d although the agent was killed", st)
			}
			s.restart()
			v := s.waitFor("sync", "a settled state", func(v view) bool {
				return v.State == "failed" || v.DisplayState == "running"
			})
			t.Logf("crash at %s → %s/%s", step, v.State, v.DisplayState)
			switch step {
			case "running":
				if v.State != "running" {
					t.Errorf("boot recorded: %s/%s, want running", v.State, v.DisplayState)
				}
			default:
				if v.State != "failed" || v.DisplayState != "provision_failed" || v.FailureReason == nil || v.FailureReason.Cause != "provision_failed" {
					t.Errorf("interrupted synchronous create: %+v %+v, want failed/provision_failed", v, v.FailureReason)
				}
			}
			checkOwnedOnly(t, s, "sync", v, "", root)
			if st, b := s.do("DELETE", "/api/vms/sync?force=true", ""); st != http.StatusNoContent {
				t.Fatalf("DELETE = %d %s", st, b)
			}
			checkGone(t, s, "sync")
			s.create(body, http.StatusCreated)
			s.waitDisplay("sync", "running", "running")
		})
	}
}

// TestCrashDuringStart kills the agent during the boot of a start, once CH
// runs and once the guest booted, neither recorded: at restart the VM is
// created again, as a start that fails leaves it, with its unrecorded CH
// reaped and its provisioned storage daemon kept; a start then works.
func TestCrashDuringStart(t *testing.T) {
	root := os.Geteuid() == 0
	f := newFixture(t)
	body := f.body("later", false, crashNetworking(root))
	for _, step := range []string{"ch", "booted"} {
		t.Run(step, func(t *testing.T) {
			marker := t.TempDir() + "/stopped"
			t.Setenv("VMHOST_TEST_STOP_AT_STEP", step)
			t.Setenv("VMHOST_TEST_STOP_MARKER", marker)
			s := startServer(t, serverOpts{netns: root, confine: true})
			s.create(body, http.StatusCreated)
			done := make(chan int, 1)
			go func() { done <- s.act("later", "start") }()
			deadline := time.Now().Add(20 * time.Second)
			for !exists(marker) {
				if time.Now().After(deadline) {
					t.Fatalf("the agent never reached step %s", step)
				}
				time.Sleep(10 * time.Millisecond)
			}
			s.kill()
			if st := <-done; st == http.StatusNoContent {
				t.Fatalf("the start answered %d although the agent was killed", st)
			}
			s.restart()
			v := s.waitFor("later", "a settled state", func(v view) bool {
				return v.State == "failed" || v.DisplayState == "running" || (v.State == "created" && v.DisplayState == "created")
			})
			t.Logf("crash at %s → %s/%s", step, v.State, v.DisplayState)
			if v.State != "created" || v.DisplayState != "created" {
				t.Errorf("start cut short at %s: %s/%s, want created/created", step, v.State, v.DisplayState)
			}
			checkOwnedOnly(t, s, "later", v, "", root)
			if st := s.act("later", "start"); st != http.StatusNoContent {
				t.Fatalf("start after the restart = %d", st)
			}
			s.waitDisplay("later", "running", "running")
		})
	}
}
