//go:build linux

package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"vmhost/chclient"
	"vmhost/config"
	"vmhost/vm/record"
)

// TestCrashDuringVolumeChange kills the agent with SIGKILL at every step
// of a hot attach and of a hot detach (the engine blocks there through the
// VMHOST_TEST_STOP_AT_STEP hook), restarts it, and checks that the VM's
// record, its CH's disks and its storage daemon's exports agree: the
// change is finished, as the request meant, never half done, and the
// volume is attached to at most one VM. Run with the simulated and with
// the real qemu-storage-daemon.
func TestCrashDuringVolumeChange(t *testing.T) {
	daemons := map[string]serverOpts{"qsdsim": {confine: true}}
	if qsd, err := exec.LookPath("qemu-storage-daemon"); err == nil {
		daemons["real-qsd"] = serverOpts{simulate: "ch", confine: true, edit: func(c *config.Config) { c.Binaries.QemuStorageDaemon = qsd }}
	} else if os.Getenv("CI") != "" {
		t.Fatal("qemu-storage-daemon not installed")
	}
	cases := []struct {
		step string
		want []string // the VM's volumes after recovery
	}{
		{"attach:start", []string{"data0", "data1"}},
		{"attach:exported", []string{"data0", "data1"}},
		{"attach:added", []string{"data0", "data1"}},
		{"detach:start", []string{"data0"}},
		{"detach:unmounted", []string{"data0"}},
		{"detach:removed", []string{"data0"}},
		{"detach:unexported", []string{"data0"}},
	}
	for name, opts := range daemons {
		for _, tc := range cases {
			t.Run(name+"/"+tc.step, func(t *testing.T) {
				marker := t.TempDir() + "/stopped"
				t.Setenv("VMHOST_TEST_STOP_AT_STEP", tc.step)
				t.Setenv("VMHOST_TEST_STOP_MARKER", marker)
				s := startServer(t, opts)
				f := newFixture(t)
				s.create(f.body("vc", true, ""), http.StatusCreated)
				s.waitDisplay("vc", "running", "running")
				if st, b := s.do("POST", "/api/volumes", `{"volume_id":"fc","size_gib":1}`); st != http.StatusCreated {
					t.Fatalf("POST /api/volumes = %d %s", st, b)
				}
				change := func() (int, []byte) {
					return s.do("POST", "/api/vms/vc/volumes", `{"volume_id":"fc"}`)
				}
				if strings.HasPrefix(tc.step, "detach:") {
					if st, b := change(); st != http.StatusOK {
						t.Fatalf("attach = %d %s", st, b)
					}
					change = func() (int, []byte) { return s.do("DELETE", "/api/vms/vc/volumes/fc", "") }
				}
				done := make(chan struct{})
				go func() { defer close(done); change() }()
				deadline := time.Now().Add(20 * time.Second)
				for !exists(marker) {
					if time.Now().After(deadline) {
						t.Fatalf("the agent never reached step %s", tc.step)
					}
					time.Sleep(10 * time.Millisecond)
				}
				s.kill()
				<-done
				s.restart()
				got := waitVolumesAgree(t, s, "vc")
				if !slices.Equal(got, tc.want) {
					t.Errorf("after a crash at %s the VM has volumes %v, want %v", tc.step, got, tc.want)
				}
				attached := slices.Contains(got, "data1")
				var vol struct {
					AttachedTo *struct {
						VMID string `json:"vm_id"`
					} `json:"attached_to"`
				}
				st, b := s.do("GET", "/api/volumes/fc", "")
				if st != http.StatusOK || json.Unmarshal(b, &vol) != nil || (vol.AttachedTo != nil) != attached {
					t.Errorf("GET /api/volumes/fc = %d %s; want attached=%t", st, b, attached)
				}
				// Nothing is left pending: the volume can change again.
				if attached {
					if st, b := s.do("DELETE", "/api/vms/vc/volumes/fc", ""); st != http.StatusOK {
						t.Fatalf("detach after recovery = %d %s", st, b)
					}
				} else if st, b := s.do("POST", "/api/vms/vc/volumes", `{"volume_id":"fc"}`); st != http.StatusOK {
					t.Fatalf("attach after recovery = %d %s", st, b)
				}
				waitVolumesAgree(t, s, "vc")
			})
		}
	}
}

// waitVolumesAgree waits (recovery finishes an interrupted change in the
// background) until VM id's view, its CH's disks and its storage daemon's
// exports (the vhost-user sockets it serves) name the same volumes, in the
// same order, the VM runs and its record holds no change in progress; it
// fails the test if they do not within
// 20 s, and returns them.
func waitVolumesAgree(t *testing.T, s *server, id string) []string {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		view, ch, qsd, state := volumesNow(t, s, id)
		sorted := slices.Sorted(slices.Values(view))
		if !volumeChangePending(t, s, id) && state == "running" && slices.Equal(ch, view) && slices.Equal(qsd, sorted) {
			return view
		}
		if time.Now().After(deadline) {
			t.Fatalf("VM %s (%s): view %v, CH %v, exports %v", id, state, view, ch, qsd)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// volumeChangePending reports whether VM id's record (its file) holds a
// volume change not finished yet.
func volumeChangePending(t *testing.T, s *server, id string) bool {
	t.Helper()
	b, err := os.ReadFile(s.stateDir + "/vms/" + id + ".json")
	if err != nil {
		t.Fatal(err)
	}
	var r struct {
		Spec struct {
			Volumes []struct {
				Pending string `json:"pending"`
			} `json:"volumes"`
		} `json:"spec"`
	}
	if err := json.Unmarshal(b, &r); err != nil {
		t.Fatalf("record of %s: %v", id, err)
	}
	return slices.ContainsFunc(r.Spec.Volumes, func(v struct {
		Pending string `json:"pending"`
	}) bool {
		return v.Pending != ""
	})
}

// volumesNow reads VM id's volumes as its view, its CH (vm.info) and its
// storage daemon's sockets name them, and its state; the view's devices
// must follow its order.
func volumesNow(t *testing.T, s *server, id string) (view, ch, qsd []string, state string) {
	t.Helper()
	st, b := s.do("GET", "/api/vms/"+id, "")
	if st == http.StatusNotFound { // an AppVM
		st, b = s.do("GET", "/api/appvm/vms/"+id, "")
	}
	var v struct {
		State   string `json:"state"`
		Volumes []struct {
			ID     string `json:"id"`
			Device string `json:"device"`
		} `json:"volumes"`
	}
	if st != http.StatusOK || json.Unmarshal(b, &v) != nil {
		t.Fatalf("GET /api/vms/%s = %d %s", id, st, b)
	}
	for i, vol := range v.Volumes {
		view = append(view, vol.ID)
		if want := fmt.Sprintf("/dev/vd%c", 'b'+i); vol.Device != want {
			t.Errorf("volume %s is %s, want %s", vol.ID, vol.Device, want)
		}
	}
	l := record.Layout{StateDir: s.stateDir, RunDir: s.runDir}
	c := chclient.New(l.APISocket(id))
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	info, err := c.VMInfo(ctx)
	if err != nil {
		t.Fatalf("vm.info: %v", err)
	}
	for _, d := range info.Config.Disks {
		if d.ID != "" && !strings.HasPrefix(d.ID, "_") {
			ch = append(ch, d.ID)
		}
	}
	socks, _ := filepath.Glob(l.RunVMDir(id) + "/data*.vhost")
	for _, p := range socks {
		qsd = append(qsd, strings.TrimSuffix(filepath.Base(p), ".vhost"))
	}
	return view, ch, qsd, v.State
}
