package realguest

import (
	"encoding/json"
	"io/fs"
	"net/http"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// Saved states in the lane (docs/api.md, Suspend and snapshots), with the
// simulator's qemu backend: QEMU 7.2 migrates a classic guest (its
// vhost-user disks, seed, tap, serial) to a file and loads it again, but
// not a guest with vhost-user vsock, so an AppVM cannot be suspended there.

// uptime is the guest's /proc/uptime in seconds.
func (l *lane) uptime(user, ip string) float64 {
	l.t.Helper()
	out, err := l.ssh(user, ip, "cut -d' ' -f1 /proc/uptime")
	if err != nil {
		l.t.Fatalf("reading the guest's uptime: %v %s", err, out)
	}
	f, err := strconv.ParseFloat(strings.TrimSpace(out), 64)
	if err != nil {
		l.t.Fatalf("the guest's uptime %q: %v", out, err)
	}
	return f
}

// suspendClassic: the running DHCP guest is suspended (its processes gone)
// and started: it goes on without a boot (its uptime did not reset), with
// its address, and answers SSH. A snapshot of its disks then makes a new
// VM that boots cold with the file the guest wrote before the snapshot,
// and cloud-init runs there as a new instance: its own hostname and
// instance id. The lane logs the suspend's time, the saved state's bytes
// per GiB of guest memory, and the start from it until SSH answers beside
// coldBoot, the same guest's cold start until SSH answers (one sample each,
// under TCG: a figure to read, not a benchmark).
func suspendClassic(l *lane, id, ip string, start time.Time, coldBoot time.Duration) {
	t := l.t
	const marker = "lane-written-before-the-snapshot"
	if out, err := l.ssh("lane", ip, "echo "+marker+" > ~/snapfile && sync && cat ~/snapfile"); err != nil || !strings.Contains(out, marker) {
		t.Fatalf("writing the file the snapshot keeps: %q %v", out, err)
	}
	before := l.uptime("lane", ip)
	suspendAt := time.Now()
	l.must("POST", "/api/vms/"+id+"/suspend", "", http.StatusNoContent)
	suspendTook := time.Since(suspendAt)
	phase(t, "classic dhcp: suspended", start)
	saved := dirSize(t, l.stateDir+"/vms/"+id+"/suspend")
	st, b := l.do("GET", "/api/vms/"+id, "")
	var sv struct {
		State       string     `json:"state"`
		SuspendedAt *time.Time `json:"suspended_at"`
	}
	if st != http.StatusOK || json.Unmarshal(b, &sv) != nil || sv.State != "stopped" || sv.SuspendedAt == nil {
		t.Fatalf("after the suspend: %d %s", st, b)
	}
	if procs := l.vmProcesses(id); len(procs) > 0 {
		t.Errorf("processes of the suspended VM run on: %v", procs)
	}
	resumeAt := time.Now()
	l.must("POST", "/api/vms/"+id+"/start", "", http.StatusNoContent)
	if v, _ := l.view("/api/vms", id); v.State != "running" || v.DisplayState != "running" {
		t.Errorf("right after the start: %+v, want running at once (no boot)", v)
	}
	l.waitSSH("lane", ip, bootTimeout)
	resumeTook := time.Since(resumeAt)
	phase(t, "classic dhcp: resumed, ssh answers", start)
	t.Logf("classic dhcp (768 MiB): suspend %.2f s, saved state %d MiB (%.0f MiB per GiB of memory); start from it until ssh answers %.2f s, cold start until ssh answers %.2f s",
		suspendTook.Seconds(), saved>>20, float64(saved)/(768<<20)*1024, resumeTook.Seconds(), coldBoot.Seconds())
	if after := l.uptime("lane", ip); after < before {
		t.Errorf("the guest's uptime went from %.1f s to %.1f s across the suspend: it booted", before, after)
	}
	if out, err := l.ssh("lane", ip, "ip -4 -o addr show"); err != nil || !strings.Contains(out, ip+"/24") {
		t.Errorf("after the resume the guest's addresses are %q (%v), want %s/24", out, err, ip)
	}
	if v, _ := l.view("/api/vms", id); len(v.Nets) != 1 || v.Nets[0].DHCPSnoopedIPv4 != ip {
		t.Errorf("after the resume dhcp_snooped_ipv4 is %+v, want %s", v.Nets, ip)
	}

	l.must("POST", "/api/vms/"+id+"/snapshots", `{"snapshot_id":"lane-snap"}`, http.StatusCreated)
	phase(t, "classic dhcp: disk snapshot", start)
	const clone = "lane-clone"
	req := map[string]any{
		"vm_id": clone, "vcpus": 1, "memory_mb": 768, "firmware_path": ovmf, "from_snapshot": "lane-snap",
		"nets":       []any{map[string]any{"network_id": "lane"}},
		"cloud_init": map[string]any{"user": "lane", "sudo": true, "ssh_authorized_keys": []string{l.sshPub}},
		"auto_boot":  true,
	}
	body, _ := json.Marshal(req)
	l.must("POST", "/api/vms", string(body), http.StatusCreated)
	v := l.waitView("/api/vms", clone, "dhcp_snooped_ipv4", bootTimeout, func(v vmView) bool {
		return len(v.Nets) == 1 && v.Nets[0].DHCPSnoopedIPv4 != ""
	})
	cip := v.Nets[0].DHCPSnoopedIPv4
	if cip == ip {
		t.Errorf("the clone got the original's address %s", ip)
	}
	l.waitSSH("lane", cip, bootTimeout)
	out, err := l.ssh("lane", cip, "hostname; cat ~/snapfile; sudo -n cat /var/lib/cloud/data/instance-id")
	if err != nil || !strings.Contains(out, clone+"\n") || !strings.Contains(out, marker) {
		t.Errorf("the clone says %q (%v): want hostname %s, the file written before the snapshot and instance id %s", out, err, clone, clone)
	}
	if lines := strings.Split(strings.TrimSpace(out), "\n"); len(lines) != 3 || lines[2] != clone {
		t.Errorf("the clone's instance id: %q, want %s (cloud-init ran as a new instance)", out, clone)
	}
	phase(t, "classic dhcp: clone from the snapshot", start)
	l.deleteVM("/api/vms", clone)
	l.must("DELETE", "/api/snapshots/lane-snap", "", http.StatusNoContent)
}

// suspendAppVMRefused: QEMU 7.2 cannot migrate the AppVM (its vsock
// device): the suspend answers 500 CH_ERROR with QEMU's own reason and the
// AppVM runs on.
func suspendAppVMRefused(l *lane, id string) {
	t := l.t
	st, b := l.do("POST", "/api/appvm/vms/"+id+"/suspend", "")
	var e struct {
		Code    string `json:"code"`
		Message string `json:"message"`
	}
	json.Unmarshal(b, &e)
	t.Logf("AppVM suspend under QEMU 7.2: %d %s", st, b)
	if st != http.StatusInternalServerError || e.Code != "CH_ERROR" ||
		!strings.Contains(e.Message, "Migration disabled: vhost-user backend lacks VHOST_USER_PROTOCOL_F_LOG_SHMFD feature.") ||
		!strings.Contains(e.Message, "non-migratable device") || !strings.Contains(e.Message, "vhost-user-vsock") {
		t.Errorf("AppVM suspend = %d %s, want 500 CH_ERROR with QEMU's refusal", st, b)
	}
	if v, _ := l.view("/api/appvm/vms", id); v.State != "running" {
		t.Errorf("after the refused suspend: %+v, want it running on", v)
	}
}

// dirSize sums the sizes of the regular files under dir.
func dirSize(t *testing.T, dir string) int64 {
	t.Helper()
	var n int64
	err := filepath.WalkDir(dir, func(_ string, d fs.DirEntry, err error) error {
		if err != nil || !d.Type().IsRegular() {
			return err
		}
		fi, err := d.Info()
		if err == nil {
			n += fi.Size()
		}
		return err
	})
	if err != nil {
		t.Errorf("the saved state's size: %v", err)
	}
	return n
}
