package server

import (
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"vmhost/doctor"
)

// TestRunLogsHostChecks: serve runs the host checks of vmhost doctor once,
// before it serves, and logs what fails with its fix (a missing
// cloud-hypervisor, a network whose bridge does not exist), each once;
// it serves all the same. A dev agent says in one line what the
// simulators stand in for.
func TestRunLogsHostChecks(t *testing.T) {
	dir := shortTempDir(t)
	state, runDir := filepath.Join(dir, "state"), filepath.Join(dir, "run")
	cfg := filepath.Join(dir, "config.json")
	os.WriteFile(cfg, []byte(`{"networks": [{"id": "lan", "bridge": "br-srv-none"}], "default_network": "lan",
		"binaries": {"cloud_hypervisor": "/nonexistent/cloud-hypervisor", "qemu_storage_daemon": "qemu-storage-daemon"}}`), 0o600)
	stub := newStub()
	close(stub.release)
	r := startRun(t, Options{Listen: "127.0.0.1:0", StateDir: state, RunDir: runDir, ConfigPath: cfg, Simulate: "qsd",
		Doctor: &doctor.Host{Euid: -1}}, stub.build)
	addr := r.addr(t)
	if st, _ := get(t, addr, "/healthz", ""); st != 200 && st != 503 {
		t.Errorf("healthz = %d: the agent does not serve", st)
	}
	log := r.log.String()
	for _, want := range []string{
		`msg="doctor: cloud-hypervisor: real VMs cannot run" found="cloud-hypervisor (binaries.cloud_hypervisor = \"/nonexistent/cloud-hypervisor\") is not an executable file"`,
		`msg="doctor: network lan: real VMs cannot run" found="bridge br-srv-none does not exist: creates on this network fail" fix="ip link add br-srv-none type bridge`,
	} {
		if n := strings.Count(log, want); n != 1 {
			t.Errorf("the log says %q %d times, want once:\n%s", want, n, log)
		}
	}
	if strings.Contains(log, "doctor: qemu-storage-daemon") {
		t.Errorf("the simulated storage daemon was checked:\n%s", log)
	}
	if s, c := strings.Index(log, "doctor: cloud-hypervisor"), strings.Index(log, "msg=serving"); s < 0 || c < s {
		t.Errorf("the checks were not logged before serving:\n%s", log)
	}
}

// TestCheckHostDev: a dev agent logs one line naming the checks a host for
// real VMs would have to pass, and nothing when all pass.
func TestCheckHostDev(t *testing.T) {
	var b logBuffer
	checkHost(slog.New(slog.NewTextHandler(&b, nil)), []doctor.Check{{Name: "root", Status: doctor.Fail}, {Name: "kvm", Status: doctor.OK}, {Name: "appvm kernel", Status: doctor.Warn}}, true)
	if got := b.String(); strings.Count(got, "\n") != 1 || !strings.Contains(got, `level=INFO msg="dev mode: the simulators stand in`) || !strings.Contains(got, `lacking="root, appvm kernel"`) {
		t.Errorf("dev log:\n%s", got)
	}
	var b2 logBuffer
	checkHost(slog.New(slog.NewTextHandler(&b2, nil)), []doctor.Check{{Name: "kvm", Status: doctor.OK}}, true)
	if b2.String() != "" {
		t.Errorf("all checks pass, dev log:\n%s", b2.String())
	}
}
