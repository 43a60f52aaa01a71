package realguest

import (
	"encoding/json"
	"fmt"
	"io/fs"
	"net/http"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// Saved states in the lane (docs/api.md, Suspend and snapshots), with the
// simulator's qemu backend: QEMU 7.2 migrates a guest (its vhost-user
// disks, seed, tap, serial) to a file and loads it again; an AppVM's
// vhost-user vsock, which QEMU cannot migrate, is unplugged for the save
// and plugged back when the guest runs again (chclient/chsim doc.go).

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

// suspendAppVM: the AppVM's workload keeps a counter only in memory (its
// tick loop, a shell variable) and prints it to its log. Suspended and
// started, the workload's processes have the same PIDs, the counter goes on
// where it was, the guest's /proc/uptime did not reset, and the log shows
// no new run in between (a boot would start the workload again: its
// "key: " line and "tick 0" a second time). Then a snapshot with memory of
// the running AppVM (its tick loop stopped, so the snapshot's last tick is
// known), more ticks, a stop, a restore and a start: the counter goes on
// from the snapshot's value, not from the later one, in the same processes,
// the log holds every tick after the restore from the first one, and the
// uptime is the snapshot's again. PIDs and uptime come
// from execs, the counter from the logs, as a user sees them. The lane logs
// the suspend's time and the start from it until the guest agent answers.
func suspendAppVM(l *lane, id string, start time.Time) {
	t := l.t
	const prefix = "/api/appvm/vms"
	exec := func(cmd ...string) string {
		t.Helper()
		body, _ := json.Marshal(map[string]any{"command": cmd})
		var r struct {
			ExitCode int    `json:"exit_code"`
			Stdout   string `json:"stdout"`
			Stderr   string `json:"stderr"`
		}
		var st int
		var b []byte
		// After a start from saved state the guest agent connects again: until
		// then an exec may find no session.
		l.poll("an exec of "+strings.Join(cmd, " "), 2*time.Minute, func() bool {
			st, b = l.do("POST", prefix+"/"+id+"/exec", string(body))
			return st == http.StatusOK && json.Unmarshal(b, &r) == nil
		})
		if r.ExitCode != 0 {
			t.Fatalf("exec %q: exit %d, stderr %q", cmd, r.ExitCode, r.Stderr)
		}
		return r.Stdout
	}
	// The workload's shell and its tick loop (a subshell, the same command line);
	// the image's busybox has no pgrep. "ti[c]k" matches them, not the exec's shell.
	pids := func() string {
		t.Helper()
		return strings.Join(strings.Fields(exec("/bin/sh", "-c",
			`for p in /proc/[0-9]*; do grep -q 'ti[c]k' $p/cmdline 2>/dev/null && echo ${p#/proc/}; done`)), " ")
	}
	uptime := func() float64 {
		t.Helper()
		out := exec("/bin/busybox", "cat", "/proc/uptime")
		f, err := strconv.ParseFloat(strings.Fields(out)[0], 64)
		if err != nil {
			t.Fatalf("the guest's uptime %q: %v", out, err)
		}
		return f
	}
	ticksOf := func(out string) []int {
		var ns []int
		for _, line := range strings.Split(out, "\n") {
			var k int
			if _, err := fmt.Sscanf(line, "tick %d", &k); err == nil {
				ns = append(ns, k)
			}
		}
		return ns
	}
	// noRestart checks that the log shows one run of the workload with a counter that
	// never went back.
	noRestart := func(when string) {
		t.Helper()
		out := l.output(id)
		ns := ticksOf(out)
		if strings.Count(out, "key: ") != 1 || strings.Count(out, "tick 0\n") != 1 {
			t.Errorf("%s: the log shows the workload starting again:\n%s", when, out)
		}
		for k := 1; k < len(ns); k++ {
			if ns[k] <= ns[k-1] {
				t.Errorf("%s: the counter went from %d to %d:\n%s", when, ns[k-1], ns[k], out)
				break
			}
		}
	}
	running := func(what string) {
		t.Helper()
		l.waitView(prefix, id, what, appvmTimeout, func(v vmView) bool { return v.State == "running" && v.DisplayState == "running" })
	}

	workload := pids()
	if len(strings.Fields(workload)) < 2 {
		t.Fatalf("the workload's processes: %q, want its shell and its tick loop", workload)
	}
	upBefore := uptime()
	suspendAt := time.Now()
	l.must("POST", prefix+"/"+id+"/suspend", "", http.StatusNoContent)
	suspendTook := time.Since(suspendAt)
	phase(t, "logs: appvm suspended", start)
	saved := dirSize(t, l.stateDir+"/vms/"+id+"/suspend")
	if v, _ := l.view(prefix, id); v.State != "stopped" {
		t.Fatalf("after the suspend: %+v", v)
	}
	if procs := l.vmProcesses(id); len(procs) > 0 {
		t.Errorf("processes of the suspended AppVM run on: %v", procs)
	}
	atSuspend := lastTick(l.output(id))
	resumeAt := time.Now()
	l.must("POST", prefix+"/"+id+"/start", "", http.StatusNoContent)
	running("running after the start from its suspend")
	l.poll("ticks after the start", 2*time.Minute, func() bool { return lastTick(l.output(id)) >= atSuspend+2 })
	resumeTook := time.Since(resumeAt)
	phase(t, "logs: appvm started from suspend", start)
	t.Logf("AppVM (256 MiB): suspend %.2f s, saved state %d MiB; start from it until the guest agent reports and the counter goes on %.2f s",
		suspendTook.Seconds(), saved>>20, resumeTook.Seconds())
	if got := pids(); got != workload {
		t.Errorf("the workload's processes after the suspend: %q, before %q", got, workload)
	}
	if up := uptime(); up < upBefore {
		t.Errorf("the guest's uptime went from %.1f s to %.1f s across the suspend: it booted", upBefore, up)
	}
	noRestart("after the suspend")

	// A snapshot with memory of the workload with its tick loop stopped
	// (SIGSTOP), so that the snapshot's last tick is known; then a change
	// the snapshot does not have (the loop goes on, its counter set to 1000,
	// in memory); then back to the snapshot, and the restored loop goes on.
	const snap = "lane-logs-snap"
	var loop string
	if _, err := fmt.Sscanf(l.output(id)[strings.Index(l.output(id), "tick loop "):], "tick loop %s", &loop); err != nil {
		t.Fatalf("the tick loop's pid is not in the log: %v", err)
	}
	exec("/bin/busybox", "kill", "-STOP", loop)
	// A tick printed just before the stop may be on its way to the log:
	// the last tick is the snapshot's once two reads 2 s apart agree.
	atSnap := lastTick(l.output(id))
	l.poll("the stopped loop's last tick in the log", 2*time.Minute, func() bool {
		time.Sleep(2 * time.Second)
		last := atSnap
		atSnap = lastTick(l.output(id))
		return atSnap == last
	})
	upSnap := uptime()
	l.must("POST", prefix+"/"+id+"/snapshots", `{"snapshot_id":"`+snap+`","memory":true}`, http.StatusCreated)
	exec("/bin/busybox", "kill", "-CONT", loop)
	exec("/bin/busybox", "kill", "-USR1", loop)
	l.poll("the changed counter", 2*time.Minute, func() bool { return lastTick(l.output(id)) >= 1001 })
	l.stopVM(prefix, id)
	logged := len(ticksOf(l.output(id)))
	l.must("POST", prefix+"/"+id+"/restore", `{"snapshot_id":"`+snap+`"}`, http.StatusOK)
	l.must("POST", prefix+"/"+id+"/start", "", http.StatusNoContent)
	running("running after the restore and start")
	exec("/bin/busybox", "kill", "-CONT", loop) // stopped at the snapshot
	var next []int
	l.poll("ticks after the restore", 2*time.Minute, func() bool {
		next = ticksOf(l.output(id))[logged:]
		return len(next) >= 3
	})
	phase(t, "logs: appvm snapshot restored", start)
	// The restored loop goes on from the snapshot's counter, not from 1000,
	// and the log holds all of its ticks, the first ones too: the guest
	// agent numbers them from its count at the snapshot, numbers the
	// discarded ticks (atSnap+1, 1000, 1001 …) had, which the host must not
	// take for replays.
	t.Logf("tick %d at the snapshot; after the restore: %v", atSnap, next)
	for k, n := range next {
		if n != atSnap+1+k {
			t.Errorf("after the restore the log shows the ticks %v: want the snapshot's counter going on, all of it (%d, %d, %d …)\n%s",
				next, atSnap+1, atSnap+2, atSnap+3, l.output(id))
			break
		}
	}
	if got := pids(); got != workload {
		t.Errorf("the workload's processes after the restore: %q, before %q", got, workload)
	}
	if up := uptime(); up < upSnap {
		t.Errorf("the guest's uptime after the restore: %.1f s, %.1f s at the snapshot: it booted", up, upSnap)
	}
	l.must("DELETE", "/api/snapshots/"+snap, "", http.StatusNoContent)
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
