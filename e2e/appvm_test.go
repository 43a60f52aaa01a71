//go:build linux

package e2e

import (
	"bytes"
	"encoding/json"
	"io/fs"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"vmhost/appvm"
	"vmhost/chclient/chsim"
	"vmhost/config"
	"vmhost/qcow2"
	"vmhost/vm"
)

// appvmView is the part of an AppVM view these tests read.
type appvmView struct {
	State         string `json:"state"`
	DisplayState  string `json:"display_state"`
	FailureReason *struct {
		Cause string `json:"cause"`
	} `json:"failure_reason"`
	AppVM struct {
		WorkloadExitCode   *int       `json:"workload_exit_code"`
		WorkloadExitSignal int        `json:"workload_exit_signal"`
		LastHeartbeatAt    *time.Time `json:"last_heartbeat_at"`
		RestartCount       int        `json:"restart_count"`
		LastRestartAt      *time.Time `json:"last_restart_at"`
		DataMounts         []struct {
			Device     string `json:"device"`
			Mountpoint string `json:"mountpoint"`
		} `json:"data_mounts"`
	} `json:"appvm"`
	raw []byte
}

// startAppVMServer starts vmhost serve in its own network namespace with an
// AppVM kernel and a catalog image per workload (name → shell command).
func startAppVMServer(t testing.TB, workloads map[string]string) *server {
	t.Helper()
	return startAppVMServerWith(t, serverOpts{}, workloads)
}

// startAppVMServerWith is startAppVMServer with the options of o (its
// edit runs after the AppVM kernel is set).
func startAppVMServerWith(t testing.TB, o serverOpts, workloads map[string]string) *server {
	t.Helper()
	f := newFixture(t)
	edit := o.edit
	o.netns = true
	o.edit = func(c *config.Config) {
		c.AppVMKernel = f.kernel
		if edit != nil {
			edit(c)
		}
	}
	s := startServer(t, o)
	addImages(t, s, workloads)
	return s
}

// addImages puts a catalog image per workload (name → shell command) in
// s's state directory, as an import would.
func addImages(t testing.TB, s *server, workloads map[string]string) {
	t.Helper()
	cat := appvm.Catalog{Dir: filepath.Join(s.stateDir, "appvm-images")}
	for id, cmd := range workloads {
		im := &appvm.Image{ID: id, Status: appvm.StatusReady, CreatedAt: time.Now().UTC(), Workload: vm.Workload{
			BuildDigest: "sha256:feedfacecafe", SizeBytes: 64 << 20, Cmd: []string{"/bin/sh", "-c", cmd},
			Env: []string{"PATH=/usr/local/bin:/usr/bin:/bin"}}}
		if err := cat.Put(im); err != nil {
			t.Fatal(err)
		}
		if err := qcow2.Create(cat.RootFS(im), 64<<20); err != nil {
			t.Fatal(err)
		}
	}
}

func (s *server) appvmGet(id string) appvmView {
	s.t.Helper()
	st, b := s.do("GET", "/api/appvm/vms/"+id, "")
	if st != http.StatusOK {
		s.t.Fatalf("GET /api/appvm/vms/%s = %d %s", id, st, b)
	}
	var v appvmView
	if err := json.Unmarshal(b, &v); err != nil {
		s.t.Fatal(err)
	}
	v.raw = b
	return v
}

func (s *server) appvmWait(id, what string, timeout time.Duration, cond func(appvmView) bool) appvmView {
	s.t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		v := s.appvmGet(id)
		if cond(v) {
			return v
		}
		if time.Now().After(deadline) {
			s.t.Fatalf("AppVM %s: %s did not happen within %v; view %s", id, what, timeout, v.raw)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TestAppVMCrashLoopRestarts: through the real binary, a workload that
// exits 3 under restart_policy on-failure is booted again and again with
// restart_count, last_restart_at and its exit code shown, and its output
// lands in the workload log.
func TestAppVMCrashLoopRestarts(t *testing.T) {
	s := startAppVMServer(t, map[string]string{"boom": "echo boom; exit 3"})
	st, b := s.do("POST", "/api/appvm/vms", `{"vm_id":"crash","image_id":"boom","vcpus":1,"memory_mb":128,"disk_gib":1,`+
		`"ip":"10.80.0.5","prefix":24,"gateway":"10.80.0.1","restart_policy":"on-failure"}`)
	if st != http.StatusCreated || !bytes.Contains(b, []byte(`"booted":true`)) {
		t.Fatalf("create = %d %s", st, b)
	}
	// A new boot clears the previous run's exit code: it shows between an
	// exit and the next boot (the backoff), so every poll is looked at.
	exit3 := false
	v := s.appvmWait("crash", "two restarts and exit code 3", 60*time.Second, func(v appvmView) bool {
		exit3 = exit3 || (v.AppVM.WorkloadExitCode != nil && *v.AppVM.WorkloadExitCode == 3)
		return v.AppVM.RestartCount >= 2 && exit3
	})
	if v.AppVM.LastRestartAt == nil {
		t.Errorf("view: %s", v.raw)
	}
	if logs := output(s.logs("crash", "tail=100"), "stdout"); strings.Count(logs, "boom\n") < 2 {
		t.Errorf("workload log %q: want one boom per run", logs)
	}
}

// TestAppVMSecretAndShutdown: through the real binary, a secret env value
// reaches the workload and no response, server output or state file other
// than the 0600 record; an ext4 data volume is provisioned; the shutdown
// action stops the workload (SIGTERM) and the guest powers off, and the
// restart policy does not bring an operator-stopped AppVM back.
func TestAppVMSecretAndShutdown(t *testing.T) {
	const secret = "e2e-S3cret-token-value"
	s := startAppVMServer(t, map[string]string{"sec": `printf %s "$TOKEN" > token.out; exec sleep 300`})
	var bodies [][]byte
	st, b := s.do("POST", "/api/appvm/vms", `{"vm_id":"sec","image_id":"sec","vcpus":1,"memory_mb":128,"disk_gib":1,`+
		`"ip":"10.80.0.6","prefix":24,"gateway":"10.80.0.1","restart_policy":"always",`+
		`"secret_env":["TOKEN=`+secret+`"],"data_volumes":[{"size_gib":1,"mountpoint":"/data"}]}`)
	if st != http.StatusCreated {
		t.Fatalf("create = %d %s", st, b)
	}
	bodies = append(bodies, b)
	v := s.appvmWait("sec", "display running", 30*time.Second, func(v appvmView) bool { return v.DisplayState == "running" })
	bodies = append(bodies, v.raw)
	if len(v.AppVM.DataMounts) != 1 || v.AppVM.DataMounts[0].Device != "/dev/vdb" || v.AppVM.DataMounts[0].Mountpoint != "/data" {
		t.Errorf("data_mounts: %s", v.raw)
	}
	tokenFile := filepath.Join(s.runDir, "vms", "sec", "vsock.sock.root", "token.out")
	deadline := time.Now().Add(10 * time.Second)
	var got []byte
	for time.Now().Before(deadline) {
		if got, _ = os.ReadFile(tokenFile); len(got) > 0 {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	if string(got) != secret {
		t.Fatalf("the workload saw TOKEN=%q", got)
	}
	if h, err := qcow2.ReadHeaderFile(filepath.Join(s.stateDir, "vms", "sec", "data0.qcow2")); err != nil || h.Size != 1<<30 {
		t.Errorf("data volume: %+v %v", h, err)
	}
	for _, p := range []string{"/api/appvm/vms", "/api/appvm/vms/sec"} {
		_, b := s.do("GET", p, "")
		bodies = append(bodies, b)
	}

	if st, b := s.do("POST", "/api/appvm/vms/sec/shutdown", ""); st != http.StatusNoContent {
		t.Fatalf("shutdown = %d %s", st, b)
	}
	v = s.appvmWait("sec", "stopped", 30*time.Second, func(v appvmView) bool { return v.State == "stopped" })
	if v.AppVM.WorkloadExitSignal != 15 {
		t.Errorf("workload_exit_signal = %d, want 15 (SIGTERM from the stop): %s", v.AppVM.WorkloadExitSignal, v.raw)
	}
	time.Sleep(1500 * time.Millisecond) // past the first restart backoff
	if v := s.appvmGet("sec"); v.State != "stopped" || v.AppVM.RestartCount != 0 {
		t.Errorf("an operator shutdown was restarted: %s", v.raw)
	}
	bodies = append(bodies, v.raw)

	for i, b := range bodies {
		if bytes.Contains(b, []byte(secret)) {
			t.Errorf("response %d holds the secret: %s", i, b)
		}
	}
	s.kill() // its output is complete (and safe to read) once it is gone
	if strings.Contains(s.stderr.String(), secret) {
		t.Error("the server's output holds the secret")
	}
	record := filepath.Join(s.stateDir, "vms", "sec.json")
	filepath.WalkDir(s.stateDir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || !d.Type().IsRegular() {
			return nil
		}
		data, err := os.ReadFile(p)
		if err != nil {
			t.Error(err)
			return nil
		}
		has := bytes.Contains(data, []byte(secret))
		if p == record {
			fi, _ := d.Info()
			if !has || fi.Mode().Perm() != 0o600 {
				t.Errorf("record: mode %v, holds the secret %v", fi.Mode(), has)
			}
		} else if has {
			t.Errorf("%s holds the secret", p)
		}
		return nil
	})
}

// TestAppVMSurvivesAgentRestart: after the agent dies (SIGKILL) and starts
// again, a running AppVM is adopted with log_stream_detached set until its
// guest agent reconnects (resume), which clears it; the resumed session
// carries heartbeats and the shutdown's stop.
func TestAppVMSurvivesAgentRestart(t *testing.T) {
	s := startAppVMServer(t, map[string]string{"idle": "exec sleep 300"})
	if st, b := s.do("POST", "/api/appvm/vms", `{"vm_id":"adopt","image_id":"idle","vcpus":1,"memory_mb":128,"disk_gib":1,`+
		`"ip":"10.80.0.7","prefix":24,"gateway":"10.80.0.1"}`); st != http.StatusCreated {
		t.Fatalf("create = %d %s", st, b)
	}
	s.appvmWait("adopt", "display running", 30*time.Second, func(v appvmView) bool { return v.DisplayState == "running" })
	// A stopped guest agent cannot redial before the test has looked.
	s.sim("adopt", "guest-agent", `{"signal":19}`)
	s.kill()
	s.restart()
	// Adoption finishes in the background once the AppVM hooks are there.
	v := s.appvmWait("adopt", "log_stream_detached", 10*time.Second, func(v appvmView) bool {
		return bytes.Contains(v.raw, []byte(`"log_stream_detached":true`))
	})
	if v.State != "running" {
		t.Fatalf("after the agent restart: %s", v.raw)
	}
	s.sim("adopt", "guest-agent", `{"signal":18}`)
	v = s.appvmWait("adopt", "the guest agent's reconnection", 30*time.Second, func(v appvmView) bool {
		return !bytes.Contains(v.raw, []byte("log_stream_detached"))
	})
	before := v.AppVM.LastHeartbeatAt
	s.appvmWait("adopt", "a heartbeat on the resumed session", 15*time.Second, func(v appvmView) bool {
		return v.AppVM.LastHeartbeatAt != nil && (before == nil || v.AppVM.LastHeartbeatAt.After(*before))
	})
	if st, b := s.do("POST", "/api/appvm/vms/adopt/shutdown", ""); st != http.StatusNoContent {
		t.Fatalf("shutdown = %d %s", st, b)
	}
	v = s.appvmWait("adopt", "stopped", 30*time.Second, func(v appvmView) bool { return v.State == "stopped" })
	if v.AppVM.WorkloadExitSignal != 15 {
		t.Errorf("after shutdown over the resumed session: %s", v.raw)
	}
}

// TestAppVMExitWhileAgentDown: a workload that fails while the agent is
// down (killed) is not lost with the VM: the guest keeps its exit until the
// next agent acknowledges it (replayed on resume), and only then powers
// off, so restart_policy on-failure boots it again.
func TestAppVMExitWhileAgentDown(t *testing.T) {
	// The gate is in the guest's root (its working directory), which the
	// simulated guest sees whatever confines it.
	s := startAppVMServer(t, map[string]string{"late": "while ! test -f fail-now; do sleep 0.05; done; rm -f fail-now; exit 3"})
	gate := filepath.Join(chsim.GuestRoot(s.runDir+"/vms/late/vsock.sock"), "fail-now")
	if st, b := s.do("POST", "/api/appvm/vms", `{"vm_id":"late","image_id":"late","vcpus":1,"memory_mb":128,"disk_gib":1,`+
		`"ip":"10.80.0.8","prefix":24,"gateway":"10.80.0.1","restart_policy":"on-failure"}`); st != http.StatusCreated {
		t.Fatalf("create = %d %s", st, b)
	}
	s.appvmWait("late", "a heartbeat", 30*time.Second, func(v appvmView) bool {
		return v.DisplayState == "running" && v.AppVM.LastHeartbeatAt != nil
	})
	s.kill()
	if err := os.WriteFile(gate, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	// The workload exits now, with no agent to tell.
	deadline := time.Now().Add(10 * time.Second)
	for {
		if _, err := os.Stat(gate); os.IsNotExist(err) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the workload did not see the gate")
		}
		time.Sleep(20 * time.Millisecond)
	}
	time.Sleep(500 * time.Millisecond)
	s.restart()
	exit3 := false
	v := s.appvmWait("late", "the restart of the exit that happened while the agent was down", 30*time.Second, func(v appvmView) bool {
		exit3 = exit3 || (v.AppVM.WorkloadExitCode != nil && *v.AppVM.WorkloadExitCode == 3)
		return v.AppVM.RestartCount >= 1 && exit3
	})
	if v.AppVM.LastRestartAt == nil {
		t.Errorf("view: %s", v.raw)
	}
}
