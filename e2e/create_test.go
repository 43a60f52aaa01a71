//go:build linux

package e2e

import (
	"crypto/sha256"
	"encoding/hex"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"vmhost/config"
	"vmhost/qcow2"
)

// checkGone asserts that nothing of VM id is left: no record, no files, no
// run dir, no processes.
func checkGone(t *testing.T, s *server, id string) {
	t.Helper()
	if _, ok := s.get(id); ok {
		t.Errorf("VM %s still has a record", id)
	}
	for _, p := range []string{s.stateDir + "/vms/" + id, s.stateDir + "/vms/" + id + ".json", s.runDir + "/vms/" + id} {
		if exists(p) {
			t.Errorf("%s is left behind", p)
		}
	}
	if pids := s.children(); len(pids) > 0 {
		t.Errorf("processes left behind: %v", pids)
	}
	if slices.Contains(s.cgroupVMs(), id) || exists(s.runDir+"/jail/"+id) {
		t.Errorf("the jail of %s (its cgroup or root) is left behind", id)
	}
}

func TestCreateWithoutAutoBoot(t *testing.T) {
	s := startServer(t, serverOpts{})
	f := newFixture(t)
	v := s.create(f.body("plain", false, `,"cloud_init":null`), http.StatusCreated)
	if v.State != "created" || v.DisplayState != "created" {
		t.Errorf("state = %s/%s, want created/created", v.State, v.DisplayState)
	}
	if v.DiskPath != s.stateDir+"/vms/plain/root.qcow2" || v.ConsoleSocketPath != s.runDir+"/vms/plain/console.sock" {
		t.Errorf("paths = %q, %q", v.DiskPath, v.ConsoleSocketPath)
	}
	for _, p := range []string{v.DiskPath, s.stateDir + "/vms/plain/data0.qcow2"} {
		h, err := qcow2.ReadHeaderFile(p)
		if err != nil {
			t.Fatalf("%s: %v", p, err)
		}
		if p == v.DiskPath && h.Size != 2<<30 {
			t.Errorf("root disk virtual size = %d, want %d (grown by qemu-storage-daemon to size_gib)", h.Size, 2<<30)
		}
	}
	if v.Disk == nil || v.Disk.QSDPid == 0 || syscall.Kill(v.Disk.QSDPid, 0) != nil {
		t.Errorf("no running qemu-storage-daemon in the view: %+v", v.Disk)
	}
	if v.PID != 0 {
		t.Errorf("pid = %d before boot", v.PID)
	}
	if st, b := s.do("DELETE", "/api/vms/plain", ""); st != http.StatusNoContent {
		t.Fatalf("DELETE = %d %s", st, b)
	}
	checkGone(t, s, "plain")
	if !exists(f.base) {
		t.Error("delete removed the base image")
	}
}

func TestCreateAutoBoot(t *testing.T) {
	s := startServer(t, serverOpts{})
	f := newFixture(t)
	v := s.create(f.body("booted", true, ""), http.StatusCreated)
	if v.State != "running" || (v.DisplayState != "booting" && v.DisplayState != "running") {
		t.Errorf("state = %s/%s, want running/booting", v.State, v.DisplayState)
	}
	if v.PID == 0 || syscall.Kill(v.PID, 0) != nil {
		t.Errorf("pid %d is not a running process", v.PID)
	}
	v = s.waitDisplay("booted", "running", "running") // chsim activates its devices after 200ms
	if v.FailureReason != nil {
		t.Errorf("failure_reason = %+v on a running VM", v.FailureReason)
	}
	if st := s.act("booted", "stop"); st != http.StatusNoContent {
		t.Fatalf("stop = %d", st)
	}
	v, _ = s.get("booted")
	if v.State != "stopped" || v.FailureReason == nil || v.FailureReason.Cause != "operator_shutdown" || v.PID != 0 {
		t.Errorf("after stop: %+v", v)
	}
	if pids := s.children(); len(pids) > 0 {
		t.Errorf("a stopped VM runs processes: %v", pids)
	}
}

// TestGuestPoweroff: the guest powers off (chsim exits 0 after vm
// shutdown) → stopped, guest_shutdown, processes gone.
func TestGuestPoweroff(t *testing.T) {
	s := startServer(t, serverOpts{})
	f := newFixture(t)
	s.create(f.body("off", true, ""), http.StatusCreated)
	s.waitDisplay("off", "running", "running")
	s.sim("off", "poweroff", "")
	v := s.waitFor("off", "stopped", func(v view) bool { return v.State == "stopped" })
	if v.FailureReason == nil || v.FailureReason.Cause != "guest_shutdown" || v.FailureReason.Detail.Kind != "process_exit" {
		t.Errorf("failure_reason = %+v, want guest_shutdown", v.FailureReason)
	}
	s.waitFor("off", "processes gone", func(view) bool { return len(s.children()) == 0 })
	// Booting it again works, and clears the reason.
	if st := s.act("off", "start"); st != http.StatusNoContent {
		t.Fatalf("start after poweroff = %d", st)
	}
	v = s.waitDisplay("off", "running", "running")
	if v.FailureReason != nil {
		t.Errorf("failure_reason after a new boot = %+v", v.FailureReason)
	}
}

// TestShutdownPending: the power button sets shutting_down until the
// guest is off, and the poweroff that follows is an operator shutdown. A
// guest that ignores the button (the simulator's switch) stays running
// with shutting_down; one that honours it (the simulated guest by default,
// as systemd) powers off.
func TestShutdownPending(t *testing.T) {
	s := startServer(t, serverOpts{})
	f := newFixture(t)
	s.create(f.body("acpi", true, ""), http.StatusCreated)
	s.waitDisplay("acpi", "running", "running")
	s.sim("acpi", "power-button", `{"ignore":true}`)
	if st := s.act("acpi", "shutdown"); st != http.StatusNoContent {
		t.Fatalf("shutdown = %d", st)
	}
	time.Sleep(300 * time.Millisecond) // the simulated guest acts on the button within 50 ms
	if v, _ := s.get("acpi"); v.State != "running" || !v.ShuttingDown {
		t.Errorf("while the guest ignores the button: state %s, shutting_down %v; want running, true", v.State, v.ShuttingDown)
	}
	s.sim("acpi", "power-button", `{"ignore":false}`)
	if st := s.act("acpi", "shutdown"); st != http.StatusNoContent {
		t.Fatalf("second shutdown = %d", st)
	}
	v := s.waitFor("acpi", "stopped", func(v view) bool { return v.State == "stopped" })
	if v.ShuttingDown || v.FailureReason == nil || v.FailureReason.Cause != "operator_shutdown" {
		t.Errorf("after the guest powered off: %+v", v)
	}
}

// imageServer serves data at /image.qcow2 on loopback.
func imageServer(t *testing.T, data []byte) string {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/image.qcow2" {
			http.NotFound(w, r)
			return
		}
		w.Write(data)
	}))
	t.Cleanup(srv.Close)
	return srv.URL + "/image.qcow2"
}

func TestImageDownload(t *testing.T) {
	s := startServer(t, serverOpts{})
	f := newFixture(t)
	data, err := os.ReadFile(f.base)
	if err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(data)
	digest := hex.EncodeToString(sum[:])
	url := imageServer(t, data)
	body := `{"vm_id":"dl","vcpus":1,"memory_mb":128,"kernel_path":"` + f.kernel + `","disk":{"size_gib":3},` +
		`"image":{"image_id":"test-img","content_sha256":"` + digest + `","fetch_url":"` + url + `"},"auto_boot":true}`
	v := s.create(body, http.StatusAccepted)
	if v.State != "created" || (v.DisplayState != "downloading" && v.DisplayState != "creating") || v.DiskPath != "" || v.ConsoleSocketPath != "" {
		t.Errorf("202 view = %+v, want created/downloading with empty paths", v)
	}
	v = s.waitDisplay("dl", "running", "running")
	if v.DiskPath == "" || v.Disk == nil || v.Disk.VirtualSizeBytes != 3<<30 {
		t.Errorf("provisioned view = %+v", v)
	}
	cached := s.stateDir + "/images/sha256-" + digest + ".qcow2"
	if !exists(cached) {
		t.Errorf("image cache %s missing", cached)
	}
	// Without auto_boot the background provisioning ends in created; the
	// image comes from the cache this time.
	s.create(strings.Replace(strings.Replace(body, `"dl"`, `"dl2"`, 1), `"auto_boot":true`, `"auto_boot":false`, 1), http.StatusAccepted)
	v = s.waitDisplay("dl2", "created", "created")
	if v.DiskPath != s.stateDir+"/vms/dl2/root.qcow2" || !exists(v.DiskPath) {
		t.Errorf("dl2 view = %+v", v)
	}
	if st, b := s.do("DELETE", "/api/vms/dl2", ""); st != http.StatusNoContent {
		t.Fatalf("DELETE dl2 = %d %s", st, b)
	}
	if st := s.act("dl", "stop"); st != http.StatusNoContent {
		t.Fatalf("stop = %d", st)
	}
	if st, b := s.do("DELETE", "/api/vms/dl", ""); st != http.StatusNoContent {
		t.Fatalf("DELETE = %d %s", st, b)
	}
	checkGone(t, s, "dl")
	if !exists(cached) {
		t.Error("delete removed the shared image cache entry")
	}
}

func TestImageDigestMismatch(t *testing.T) {
	s := startServer(t, serverOpts{})
	f := newFixture(t)
	data, err := os.ReadFile(f.base)
	if err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(data)
	actual := hex.EncodeToString(sum[:])
	expected := strings.Repeat("ab", 32)
	body := `{"vm_id":"bad","vcpus":1,"memory_mb":128,"kernel_path":"` + f.kernel + `",` +
		`"image":{"image_id":"x","content_sha256":"` + expected + `","fetch_url":"` + imageServer(t, data) + `"}}`
	s.create(body, http.StatusAccepted)
	v := s.waitFor("bad", "provision failure", func(v view) bool { return v.State == "failed" })
	if v.DisplayState != "provision_failed" || v.FailureReason == nil || v.FailureReason.Detail.Kind != "provision_failed" || v.FailureReason.Cause != "provision_failed" {
		t.Fatalf("view = %+v", v)
	}
	if sm := v.FailureReason.Summary; !strings.Contains(sm, expected) || !strings.Contains(sm, actual) {
		t.Errorf("summary %q does not name the expected %s and actual %s digests", sm, expected, actual)
	}
	if exists(s.stateDir+"/vms/bad") || exists(s.runDir+"/vms/bad") || exists(s.stateDir+"/images/sha256-"+expected+".qcow2") {
		t.Error("files left behind by the failed provision")
	}
	if st := s.act("bad", "start"); st != http.StatusConflict {
		t.Errorf("start of a provision_failed VM = %d, want 409", st)
	}
	if st, b := s.do("DELETE", "/api/vms/bad", ""); st != http.StatusNoContent {
		t.Fatalf("DELETE = %d %s", st, b)
	}
	checkGone(t, s, "bad")
}

// TestBootTimeout: a guest that never shows life fails the VM with
// boot_timeout and the VMM is shut down. The configured CH binary is a
// script running chsim with --sim-no-activate.
func TestBootTimeout(t *testing.T) {
	s := startServer(t, serverOpts{simCHArgs: "--sim-no-activate", edit: func(c *config.Config) {
		c.BootTimeoutSecs = 1
	}})
	f := newFixture(t)
	s.create(f.body("slow", true, ""), http.StatusCreated)
	v := s.waitFor("slow", "boot timeout", func(v view) bool { return v.State == "failed" })
	if fr := v.FailureReason; fr == nil || fr.Detail.Kind != "boot_timeout" || fr.Cause != "boot_timeout" || fr.Detail.Seconds == nil || *fr.Detail.Seconds != 1 {
		t.Fatalf("failure_reason = %+v", v.FailureReason)
	}
	// The console the agent kept names what the guest printed last.
	if want := "last console lines: chsim: Linux version 6.1.0-chsim booting"; !strings.Contains(v.FailureReason.Summary, want) {
		t.Errorf("summary = %q, want it to contain %q", v.FailureReason.Summary, want)
	}
	fi, err := os.Stat(s.runDir + "/vms/slow/console.log")
	if err != nil || fi.Mode().Perm() != 0o600 {
		t.Errorf("console.log: %v, %v; want a 0600 file", fi, err)
	}
	s.waitFor("slow", "processes gone", func(view) bool { return len(s.children()) == 0 })
}

// TestRealQSD runs the real qemu-storage-daemon beside chsim.
func TestRealQSD(t *testing.T) {
	qsd, err := exec.LookPath("qemu-storage-daemon")
	if err != nil {
		t.Skip("qemu-storage-daemon not installed")
	}
	s := startServer(t, serverOpts{simulate: "ch", edit: func(c *config.Config) { c.Binaries.QemuStorageDaemon = qsd }})
	f := newFixture(t)
	v := s.create(f.body("real", true, `,"disk_bps_total":1048576`), http.StatusCreated)
	s.waitDisplay("real", "running", "running")
	h, err := qcow2.ReadHeaderFile(v.DiskPath)
	if err != nil {
		t.Fatal(err)
	}
	if h.Size != 2<<30 {
		t.Errorf("root disk virtual size = %d, want %d", h.Size, 2<<30)
	}
	if st := s.act("real", "stop"); st != http.StatusNoContent {
		t.Fatalf("stop = %d", st)
	}
	if st := s.act("real", "start"); st != http.StatusNoContent {
		t.Fatalf("start after stop (QSD relaunched) = %d", st)
	}
	s.waitDisplay("real", "running", "running")
	if st, b := s.do("DELETE", "/api/vms/real?force=true", ""); st != http.StatusNoContent {
		t.Fatalf("DELETE ?force=true = %d %s", st, b)
	}
	checkGone(t, s, "real")
}
