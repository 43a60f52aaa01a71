//go:build linux

package e2e

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"vmhost/config"
	"vmhost/internal/netnstest"
	"vmhost/jail"
	"vmhost/metrics/metricstest"
	"vmhost/proc"
	"vmhost/qcow2"
	"vmhost/vm/record"
)

// jailer is the jail of the server's agent (its agent id from the state
// directory), for looking at the VMs' cgroups; nil without root.
func (s *server) jailer() *jail.Jailer {
	if os.Geteuid() != 0 {
		return nil
	}
	b, err := os.ReadFile(filepath.Join(s.stateDir, "agent_id"))
	if err != nil {
		return nil
	}
	j, err := jail.New(jail.DefaultConfig(), jail.Host{RunDir: s.runDir, AgentID: strings.TrimSpace(string(b))})
	if err != nil || !j.Enabled() {
		return nil
	}
	return j
}

// cgroupVMs lists the VMs that have a cgroup of the server's agent.
func (s *server) cgroupVMs() []string {
	j := s.jailer()
	if j == nil {
		return nil
	}
	ids, err := j.Leftovers()
	if err != nil {
		s.t.Errorf("listing the agent's cgroups: %v", err)
	}
	return ids
}

// removeCgroups kills what runs in the cgroups of the server's agent and
// removes them (VMs outlive the agent, so a test's VMs are still there
// when it ends).
func (s *server) removeCgroups() {
	j := s.jailer()
	if j == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	ids, _ := j.Leftovers()
	for _, id := range ids {
		if err := j.Destroy(ctx, id); err != nil {
			s.t.Logf("removing the cgroup of VM %s: %v", id, err)
		}
	}
	b, _ := os.ReadFile(filepath.Join(s.stateDir, "agent_id"))
	j.Layout().Cgroup(path.Join(jail.DefaultConfig().CgroupParent, strings.TrimSpace(string(b)))).Remove(ctx)
}

// checkJails asserts what the jail leaves on the host matches the records:
// every cgroup of the agent belongs to a VM in present, every process in
// a VM's cgroup is one its view names (its CH and QSD), and no two records
// hold one uid. Without root (no jail) it checks nothing.
func checkJails(t *testing.T, s *server, present map[string]view) {
	t.Helper()
	j := s.jailer()
	if j == nil {
		return
	}
	for _, id := range s.cgroupVMs() {
		v, ok := present[id]
		if !ok {
			t.Errorf("cgroup of VM %s is left that no VM owns", id)
			continue
		}
		want := map[int]bool{}
		if v.PID != 0 {
			want[v.PID] = true
		}
		if v.Disk != nil && v.Disk.QSDPid != 0 {
			want[v.Disk.QSDPid] = true
		}
		vm, err := j.VM(id, 1)
		if err != nil {
			t.Fatal(err)
		}
		pids, err := vm.Cgroup().Procs()
		if err != nil {
			t.Errorf("cgroup of VM %s: %v", id, err)
		}
		for _, p := range pids {
			if !want[p] {
				t.Errorf("process %d runs in the cgroup of VM %s (%s/%s) but its view names %v", p, id, v.State, v.DisplayState, want)
			}
		}
	}
	uids := map[uint32]string{}
	files, _ := filepath.Glob(filepath.Join(s.stateDir, "vms", "*.json"))
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		r, err := record.Decode(b)
		if err != nil || r.Jail == nil {
			continue
		}
		if other, dup := uids[r.Jail.UID]; dup {
			t.Errorf("VMs %s and %s both hold uid %d", other, r.ID, r.Jail.UID)
		}
		uids[r.Jail.UID] = r.ID
	}
}

// jview is the part of a view the jail tests read.
type jview struct {
	view
	Confinement *struct {
		UID    uint32 `json:"uid"`
		GID    uint32 `json:"gid"`
		Cgroup string `json:"cgroup"`
	} `json:"confinement"`
}

func (s *server) jview(id string) jview {
	s.t.Helper()
	st, b := s.do("GET", "/api/vms/"+id, "")
	if st != http.StatusOK {
		s.t.Fatalf("GET %s = %d %s", id, st, b)
	}
	var v jview
	if err := json.Unmarshal(b, &v); err != nil {
		s.t.Fatal(err)
	}
	return v
}

// simTry asks VM id's simulator to do action and returns the status and
// body, without judging them.
func (s *server) simTry(id, action, body string) (int, []byte) {
	s.t.Helper()
	// One connection per request: the simulator, as CH, serves only a few
	// at a time.
	c := &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{DisableKeepAlives: true, DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", s.runDir+"/vms/"+id+"/ch.sock")
	}}}
	req, _ := http.NewRequest("PUT", "http://localhost/sim/v1/"+action, strings.NewReader(body))
	resp, err := c.Do(req)
	if err != nil {
		return 0, []byte(err.Error())
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, b
}

// statusOf reads /proc/PID/status into a map.
func statusOf(t *testing.T, pid int) map[string]string {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatalf("process %d: %v", pid, err)
	}
	m := map[string]string{}
	for _, line := range strings.Split(string(b), "\n") {
		if k, v, ok := strings.Cut(line, ":"); ok {
			m[k] = strings.TrimSpace(v)
		}
	}
	return m
}

// checkConfined asserts, from /proc, that process pid (what of VM id) runs
// as the VM's uid and gid with no supplementary group, no capability in
// any set, no_new_privs, and in the VM's cgroup in every hierarchy.
func checkConfined(t *testing.T, what string, pid int, c jview) {
	t.Helper()
	st := statusOf(t, pid)
	u := strconv.FormatUint(uint64(c.Confinement.UID), 10)
	g := strconv.FormatUint(uint64(c.Confinement.GID), 10)
	for key, want := range map[string]string{
		"Uid": u + "\t" + u + "\t" + u + "\t" + u, "Gid": g + "\t" + g + "\t" + g + "\t" + g, "Groups": "",
		"CapInh": "0000000000000000", "CapPrm": "0000000000000000", "CapEff": "0000000000000000",
		"CapBnd": "0000000000000000", "CapAmb": "0000000000000000", "NoNewPrivs": "1",
	} {
		if st[key] != want {
			t.Errorf("%s (pid %d): %s is %q, want %q", what, pid, key, st[key], want)
		}
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
	if err != nil {
		t.Fatal(err)
	}
	l, err := jail.DetectLayout()
	if err != nil {
		t.Fatal(err)
	}
	var want []string
	if l.Unified != "" {
		want = append(want, "0::/"+c.Confinement.Cgroup)
	}
	if !l.UnifiedLimits {
		for _, ctrl := range []string{"memory", "pids", "cpu", "cpuacct"} {
			want = append(want, ctrl)
		}
	}
	for _, w := range want {
		found := false
		for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
			parts := strings.SplitN(line, ":", 3)
			if len(parts) != 3 || parts[2] != "/"+c.Confinement.Cgroup {
				continue
			}
			found = found || line == w || slices.Contains(strings.Split(parts[1], ","), w)
		}
		if !found {
			t.Errorf("%s (pid %d) is not in cgroup %s for %s:\n%s", what, pid, c.Confinement.Cgroup, w, b)
		}
	}
}

// TestJailConfinesVMs: as root, a VM's Cloud Hypervisor and
// qemu-storage-daemon (the simulators here) run as the VM's own uid and
// gid (given at create, in the view), with no capability, no_new_privs,
// in the VM's cgroup with its limits; from inside its CH, another VM's
// disk, the state directory and the keys cannot be opened, while its own
// files can; its tap is its own; the metrics show its cgroup's counters;
// and after a delete nothing of the jail is left.
func TestJailConfinesVMs(t *testing.T) {
	netnstest.RequireRoot(t)
	s := startServer(t, serverOpts{netns: true, confine: true})
	f := newFixture(t)
	s.create(f.body("ja", true, `,"nets":[{}],"cloud_init":{"ssh_authorized_keys":["ssh-ed25519 AAAAC3Nza jail@test"]}`), http.StatusCreated)
	s.create(f.body("jb", true, ""), http.StatusCreated)
	s.waitDisplay("ja", "running", "running")
	s.waitDisplay("jb", "running", "running")
	a, b := s.jview("ja"), s.jview("jb")
	if a.Confinement == nil || b.Confinement == nil {
		t.Fatalf("confinement missing from the views: %+v %+v", a.Confinement, b.Confinement)
	}
	agent, _ := os.ReadFile(s.stateDir + "/agent_id")
	if want := "vmhost/" + strings.TrimSpace(string(agent)) + "/vm-ja"; a.Confinement.Cgroup != want {
		t.Errorf("cgroup %q, want %q", a.Confinement.Cgroup, want)
	}
	if a.Confinement.UID == b.Confinement.UID || a.Confinement.UID < 1000000 || a.Confinement.UID > 1999999 || a.Confinement.GID != a.Confinement.UID {
		t.Errorf("uids %d/%d and %d: want each VM its own, in 1000000..1999999", a.Confinement.UID, a.Confinement.GID, b.Confinement.UID)
	}
	checkConfined(t, "ja's CH", a.PID, a)
	checkConfined(t, "ja's QSD", a.Disk.QSDPid, a)
	checkConfined(t, "jb's CH", b.PID, b)

	// The limits, in the cgroup files: memory_mb + 256 MiB, 1024 tasks,
	// CPU weight for one vCPU.
	l, _ := jail.DetectLayout()
	memDir, pidsDir, cpuDir := l.V1["memory"], l.V1["pids"], l.V1["cpu"]
	memFile, cpuFile, cpuWant := "memory.limit_in_bytes", "cpu.shares", "1024"
	if l.UnifiedLimits {
		memDir, pidsDir, cpuDir = l.Unified, l.Unified, l.Unified
		memFile, cpuFile, cpuWant = "memory.max", "cpu.weight", "100"
	}
	for file, want := range map[string]string{
		filepath.Join(memDir, a.Confinement.Cgroup, memFile):     strconv.Itoa((128 + 256) << 20),
		filepath.Join(pidsDir, a.Confinement.Cgroup, "pids.max"): "1024",
		filepath.Join(cpuDir, a.Confinement.Cgroup, cpuFile):     cpuWant,
	} {
		if got, err := os.ReadFile(file); err != nil || strings.TrimSpace(string(got)) != want {
			t.Errorf("%s = %q (%v), want %s", file, got, err, want)
		}
	}

	// From inside ja's CH: what a VMM taken over by its guest could open.
	for _, p := range []struct {
		path  string
		write bool
		ok    bool
	}{
		{s.stateDir + "/vms/ja/seed.img", false, true},
		{s.stateDir + "/vms/ja/root.qcow2", false, true},
		{s.runDir + "/vms/ja/ch.log", true, true},
		{s.stateDir + "/vms/jb/root.qcow2", false, false},
		{s.stateDir + "/vms/jb/data0.qcow2", true, false},
		{s.stateDir + "/keys.json", false, false},
		{s.stateDir + "/vms/ja.json", false, false},
		{s.stateDir + "/vms/jb", false, false},
		{s.stateDir + "/agent_id", false, false},
		{s.stateDir + "/images", false, false},
		{s.runDir + "/vms/jb/ch.sock", true, false},
		{"/etc/shadow", false, false},
	} {
		st, body := s.simTry("ja", "open", fmt.Sprintf(`{"path":%q,"write":%t}`, p.path, p.write))
		switch {
		case p.ok && st != http.StatusNoContent:
			t.Errorf("from inside ja's CH, open %s = %d %s, want it to open", p.path, st, body)
		case !p.ok:
			var r struct{ Errno int }
			json.Unmarshal(body, &r)
			if st != http.StatusConflict || (r.Errno != int(syscall.ENOENT) && r.Errno != int(syscall.EACCES)) {
				t.Errorf("from inside ja's CH, open %s = %d %s, want ENOENT or EACCES", p.path, st, body)
			}
		}
	}
	// CH attached its tap without CAP_NET_ADMIN: the tap is the VM's.
	if st, body := simStatus(s, "ja"); !strings.Contains(string(body), a.Nets[0].TapName) {
		t.Errorf("sim status %d %s: want tap %s attached", st, body, a.Nets[0].TapName)
	}

	// The metrics: each VM's cgroup counters.
	_, m := s.do("GET", "/metrics", "")
	for _, fam := range []string{"vmhost_vm_cpu_seconds_total", "vmhost_vm_memory_bytes", "vmhost_vm_pids"} {
		if !strings.Contains(string(m), fam+`{vm_id="ja",mode="vm"}`) {
			t.Errorf("metrics lack %s of ja", fam)
		}
	}
	metricstest.Check(t, m)

	if t.Failed() {
		for _, f := range []string{"ch.log", "ch.log.out"} {
			b, _ := os.ReadFile(s.runDir + "/vms/ja/" + f)
			t.Logf("ja's %s:\n%s", f, b)
		}
	}
	if st, b := s.do("DELETE", "/api/vms/ja?force=true", ""); st != http.StatusNoContent {
		t.Fatalf("DELETE = %d %s", st, b)
	}
	if slices.Contains(s.cgroupVMs(), "ja") || exists(s.runDir+"/jail/ja") {
		t.Errorf("ja's cgroup (%v) or jail root is left after its delete", s.cgroupVMs())
	}
	checkJails(t, s, map[string]view{"jb": s.jview("jb").view})
	if st, b := s.do("DELETE", "/api/vms/jb?force=true", ""); st != http.StatusNoContent {
		t.Fatalf("DELETE = %d %s", st, b)
	}
	checkGone(t, s, "ja")
	checkGone(t, s, "jb")
}

// simStatus reads VM id's simulator status.
func simStatus(s *server, id string) (int, []byte) {
	c := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{DisableKeepAlives: true, DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", s.runDir+"/vms/"+id+"/ch.sock")
	}}}
	resp, err := c.Get("http://localhost/sim/v1/status")
	if err != nil {
		return 0, []byte(err.Error())
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, b
}

// TestJailMemoryLimitStopsHog: a simulated VMM that takes more memory than
// its VM's cgroup allows (memory_mb + 256 MiB) is killed by that cgroup's
// OOM killer, which its VM's failure reports; another VM runs on,
// untouched.
func TestJailMemoryLimitStopsHog(t *testing.T) {
	netnstest.RequireRoot(t)
	s := startServer(t, serverOpts{confine: true})
	f := newFixture(t)
	s.create(f.body("hog", true, ""), http.StatusCreated)
	s.create(f.body("calm", true, ""), http.StatusCreated)
	s.waitDisplay("hog", "running", "running")
	s.waitDisplay("calm", "running", "running")
	calm := s.jview("calm")
	calmStart, err := proc.StartTime(calm.PID)
	if err != nil {
		t.Fatal(err)
	}
	// 128 + 256 MiB is the limit: 640 MiB cannot fit.
	s.simTry("hog", "hog", `{"mb":640}`)
	v := s.waitFor("hog", "its VMM killed", func(v view) bool { return v.State == "failed" })
	if fr := v.FailureReason; fr == nil || fr.Cause != "ch_crash" {
		t.Errorf("hog's failure: %+v, want ch_crash (killed by a signal)", v.FailureReason)
	}
	hog := s.jview("hog")
	l, _ := jail.DetectLayout()
	if l.UnifiedLimits {
		if n := keyedValue(t, filepath.Join(l.Unified, hog.Confinement.Cgroup, "memory.events"), "oom_kill"); n < 1 {
			t.Errorf("memory.events oom_kill = %d, want the kill counted", n)
		}
	} else if n := keyedValue(t, filepath.Join(l.V1["memory"], hog.Confinement.Cgroup, "memory.oom_control"), "oom_kill"); n < 1 {
		t.Errorf("memory.oom_control oom_kill = %d, want the kill counted", n)
	}
	if !proc.Alive(calm.PID, calmStart) {
		t.Error("calm's VMM died with hog's")
	}
	if v := s.jview("calm"); v.State != "running" {
		t.Errorf("calm is %s/%s, want running", v.State, v.DisplayState)
	}
}

// keyedValue reads the value of key in a "key value" per line file.
func keyedValue(t *testing.T, file, key string) int {
	t.Helper()
	b, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if k, v, ok := strings.Cut(line, " "); ok && k == key {
			n, _ := strconv.Atoi(strings.TrimSpace(v))
			return n
		}
	}
	t.Fatalf("%s has no %s", file, key)
	return 0
}

// TestJailAdoptedAfterRestart: an agent killed and started again adopts its
// confined VMs (their processes found in their cgroups and checked), which
// keep running as they were; a stop then empties the cgroup and a start
// confines the VM again.
func TestJailAdoptedAfterRestart(t *testing.T) {
	netnstest.RequireRoot(t)
	s := startServer(t, serverOpts{confine: true})
	f := newFixture(t)
	s.create(f.body("ad", true, ""), http.StatusCreated)
	s.waitDisplay("ad", "running", "running")
	before := s.jview("ad")
	s.kill()
	s.restart()
	after := s.jview("ad")
	if after.State != "running" || after.PID != before.PID || after.Disk.QSDPid != before.Disk.QSDPid || *after.Confinement != *before.Confinement {
		t.Fatalf("after the restart: %+v %+v, want the same running VM as %+v %+v", after.view, after.Confinement, before.view, before.Confinement)
	}
	if out := s.stderr.String(); strings.Contains(out, "not confined") || strings.Contains(out, "not in its cgroup") || !strings.Contains(out, "VM adopted") {
		t.Errorf("the restarted agent did not adopt the VM as confined:\n%s", out)
	}
	checkConfined(t, "adopted CH", after.PID, after)
	checkJails(t, s, map[string]view{"ad": after.view})
	if st := s.act("ad", "stop"); st != http.StatusNoContent {
		t.Fatalf("stop = %d", st)
	}
	if pids := s.cgroupProcs(t, "ad"); len(pids) != 0 {
		t.Errorf("processes %v left in the cgroup of a stopped VM", pids)
	}
	if st := s.act("ad", "start"); st != http.StatusNoContent {
		t.Fatalf("start = %d", st)
	}
	s.waitDisplay("ad", "running", "running")
	again := s.jview("ad")
	checkConfined(t, "restarted CH", again.PID, again)
	checkConfined(t, "restarted QSD", again.Disk.QSDPid, again)
}

// cgroupProcs lists the processes in VM id's cgroup.
func (s *server) cgroupProcs(t *testing.T, id string) []int {
	t.Helper()
	j := s.jailer()
	if j == nil {
		return nil
	}
	v, err := j.VM(id, 1)
	if err != nil {
		t.Fatal(err)
	}
	pids, err := v.Cgroup().Procs()
	if err != nil {
		t.Fatal(err)
	}
	return pids
}

// setJail rewrites the server's config with jail.enabled on or off (for
// its next restart).
func (s *server) setJail(t *testing.T, on bool) {
	t.Helper()
	cfg, err := config.Load(s.dir + "/config.json")
	if err != nil {
		t.Fatal(err)
	}
	cfg.Jail.Enabled = new(on)
	b, err := cfg.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(s.dir+"/config.json", b, 0o600); err != nil {
		t.Fatal(err)
	}
}

// TestJailOlderVMKeepsRunningUnconfined: a VM booted unconfined (by an
// older vmhost; here an agent with jail.enabled false) is adopted by an
// agent that confines VMs and keeps running as it was, unconfined, with
// no confinement in its view; its next boot confines it, storage daemon
// included. vmhost doctor, as an operator runs it, says so at each point:
// the unconfined VM named, then every process confined, then a process
// taken out of its cgroup named as a failure.
func TestJailOlderVMKeepsRunningUnconfined(t *testing.T) {
	netnstest.RequireRoot(t)
	s := startServer(t, serverOpts{edit: func(c *config.Config) { c.Jail.Enabled = new(false) }})
	f := newFixture(t)
	s.create(f.body("old", true, ""), http.StatusCreated)
	s.waitDisplay("old", "running", "running")
	before := s.jview("old")
	if before.Confinement != nil {
		t.Fatalf("confinement %+v with the jail off", before.Confinement)
	}
	if st := statusOf(t, before.PID); !strings.HasPrefix(st["Uid"], "0\t") {
		t.Fatalf("unconfined CH runs as %s", st["Uid"])
	}
	s.kill()
	s.setJail(t, true)
	s.restart()
	after := s.jview("old")
	if after.State != "running" || after.PID != before.PID || after.Confinement != nil {
		t.Fatalf("after the restart: %s pid %d confinement %+v; want running pid %d, unconfined", after.State, after.PID, after.Confinement, before.PID)
	}
	if st := statusOf(t, after.PID); !strings.HasPrefix(st["Uid"], "0\t") {
		t.Errorf("the adopted CH runs as %s, want it left as it was", st["Uid"])
	}
	if !strings.Contains(s.stderr.String(), "VM runs unconfined (booted before VMs were confined)") {
		t.Errorf("the agent did not say the adopted VM runs unconfined:\n%s", s.stderr)
	}
	// The operator's view: doctor names the VM that runs unconfined.
	if c := s.doctorJail(t); c.Status != "warn" || !strings.Contains(c.Detail, "running unconfined: old") {
		t.Errorf("doctor's jail check with an unconfined VM running: %+v", c)
	}
	if st := s.act("old", "stop"); st != http.StatusNoContent {
		t.Fatalf("stop = %d", st)
	}
	if st := s.act("old", "start"); st != http.StatusNoContent {
		t.Fatalf("start = %d", st)
	}
	s.waitDisplay("old", "running", "running")
	now := s.jview("old")
	if now.Confinement == nil {
		t.Fatal("no confinement after the VM's next boot")
	}
	checkConfined(t, "CH after the next boot", now.PID, now)
	checkConfined(t, "QSD after the next boot", now.Disk.QSDPid, now)
	if c := s.doctorJail(t); c.Status != "ok" || !strings.Contains(c.Detail, "2 processes of running VMs are confined") {
		t.Errorf("doctor's jail check with the VM confined: %+v", c)
	}
	// A process taken out of its VM's cgroup is no longer fenced by its
	// limits: doctor fails, naming the VM.
	l, err := jail.DetectLayout()
	if err != nil {
		t.Fatal(err)
	}
	hier := l.V1["pids"]
	if l.UnifiedLimits {
		hier = l.Unified
	}
	move := func(cgroup string) {
		t.Helper()
		if err := os.WriteFile(filepath.Join(hier, cgroup, "cgroup.procs"), []byte(strconv.Itoa(now.PID)), 0); err != nil {
			t.Fatal(err)
		}
	}
	move("")
	c := s.doctorJail(t)
	move(now.Confinement.Cgroup)
	if c.Status != "FAIL" || !strings.Contains(c.Detail, "1 of 2 processes") || !strings.Contains(c.Detail, "VM old") {
		t.Errorf("doctor's jail check with CH out of its cgroup: %+v", c)
	}
}

// doctorJail runs vmhost doctor on the server's configuration and
// directories, as an operator would on the host, and returns its "jail"
// check (the other checks judge this test machine, not the agent).
func (s *server) doctorJail(t *testing.T) (c struct{ Status, Detail string }) {
	t.Helper()
	out, err := exec.Command(vmhostBin, "doctor", "--config", s.dir+"/config.json", "--state-dir", s.stateDir, "--run-dir", s.runDir, "-o", "json").Output()
	var r struct {
		Checks []struct{ Name, Status, Detail string }
	}
	if jerr := json.Unmarshal(out, &r); jerr != nil {
		t.Fatalf("vmhost doctor: %v %v\n%s", err, jerr, out)
	}
	for _, x := range r.Checks {
		if x.Name == "jail" {
			c.Status, c.Detail = x.Status, x.Detail
			return c
		}
	}
	t.Fatalf("vmhost doctor has no jail check:\n%s", out)
	return c
}

// TestJailConcurrentCreatesGetTheirOwnIDs: creates at once never give two
// VMs one uid, and every VM's record carries its uid and gid.
func TestJailConcurrentCreatesGetTheirOwnIDs(t *testing.T) {
	netnstest.RequireRoot(t)
	s := startServer(t, serverOpts{confine: true, edit: func(c *config.Config) {
		c.HostCPUs = 64
		c.Jail.IDRange = [2]uint32{1500000, 1500015} // 16 ids for 16 VMs
	}})
	f := newFixture(t)
	const n = 16
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if st, b := s.do("POST", "/api/vms", f.body(fmt.Sprintf("c%d", i), false, "")); st != http.StatusCreated {
				t.Errorf("create c%d = %d %s", i, st, b)
			}
		}()
	}
	wg.Wait()
	seen := map[uint32]string{}
	present := map[string]view{}
	for i := range n {
		id := fmt.Sprintf("c%d", i)
		v := s.jview(id)
		present[id] = v.view
		if v.Confinement == nil {
			t.Fatalf("%s has no confinement", id)
		}
		if other, dup := seen[v.Confinement.UID]; dup {
			t.Errorf("%s and %s both got uid %d", other, id, v.Confinement.UID)
		}
		seen[v.Confinement.UID] = id
		checkConfined(t, id+"'s QSD", v.Disk.QSDPid, v)
	}
	// The range is full: one more create is refused before anything is made.
	st, b := s.do("POST", "/api/vms", f.body("c16", false, ""))
	if st != http.StatusInternalServerError || !strings.Contains(string(b), "jail.id_range") {
		t.Errorf("a create with every id held = %d %s, want 500 naming jail.id_range", st, b)
	}
	if _, ok := s.get("c16"); ok || exists(s.stateDir+"/vms/c16") || slices.Contains(s.cgroupVMs(), "c16") {
		t.Error("the refused create left something")
	}
	checkJails(t, s, present)
}

// TestJailOffWithoutRoot: an agent that is not root runs VMs unconfined, as
// its own uid, says so once (not once per VM), and shows no confinement.
func TestJailOffWithoutRoot(t *testing.T) {
	netnstest.RequireRoot(t) // to start the agent as another user
	const nobody = 65534
	// The test binaries' directory must be open to that user.
	bin := filepath.Dir(vmhostBin)
	fi, err := os.Stat(bin)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(bin, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Chmod(bin, fi.Mode().Perm()) })
	s := startServer(t, serverOpts{uid: nobody})
	// The kernel and base image where that user can read them.
	f := fixture{kernel: s.dir + "/vmlinux", base: s.dir + "/base.qcow2"}
	if err := os.WriteFile(f.kernel, []byte("not really a kernel"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := qcow2.Create(f.base, 1<<30); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(f.base, nobody, nobody); err != nil {
		t.Fatal(err)
	}
	for i := range 2 {
		id := fmt.Sprintf("u%d", i)
		s.create(f.body(id, true, ""), http.StatusCreated)
		s.waitDisplay(id, "running", "running")
		v := s.jview(id)
		if v.Confinement != nil {
			t.Errorf("%s: confinement %+v from an agent without root", id, v.Confinement)
		}
		if st := statusOf(t, v.PID); !strings.HasPrefix(st["Uid"], strconv.Itoa(nobody)+"\t") {
			t.Errorf("%s's CH runs as %s, want the agent's uid %d", id, st["Uid"], nobody)
		}
	}
	out := s.stderr.String()
	if n := strings.Count(out, `msg="VMs run unconfined"`); n != 1 || !strings.Contains(out, "does not run as root") {
		t.Errorf("the agent said %d times that VMs run unconfined (want once, saying why):\n%s", n, out)
	}
	if ids := s.cgroupVMs(); len(ids) > 0 {
		t.Errorf("cgroups %v made by an agent without root", ids)
	}
}

// TestRunDirLinksNotFollowed: a confined VM owns its run directory, so it
// can put a link there; the agent never follows one. VM a's API socket
// swapped for a link to VM b's: an action on a fails instead of reaching
// b, which goes on running, unpaused.
func TestRunDirLinksNotFollowed(t *testing.T) {
	s := startServer(t, serverOpts{confine: true})
	f := newFixture(t)
	s.create(f.body("la", true, ""), http.StatusCreated)
	s.create(f.body("lb", true, ""), http.StatusCreated)
	s.waitDisplay("la", "running", "running")
	s.waitDisplay("lb", "running", "running")
	sock := s.runDir + "/vms/la/ch.sock"
	if err := os.Remove(sock); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(s.runDir+"/vms/lb/ch.sock", sock); err != nil {
		t.Fatal(err)
	}
	if st, b := s.do("POST", "/api/vms/la/pause", ""); st == http.StatusNoContent {
		t.Errorf("pause of la through a link = %d %s, want a failure", st, b)
	}
	if v := s.jview("lb"); v.State != "running" {
		t.Errorf("lb is %s/%s after la's pause: the agent followed la's link", v.State, v.DisplayState)
	}
	st, body := simStatus(s, "lb")
	if st != http.StatusOK || !strings.Contains(string(body), `"state":"Running"`) {
		t.Errorf("lb's VMM says %d %s, want Running", st, body)
	}
}

// TestJailVolumeGivenAndTakenBack: a first-class volume hot-attached to a
// confined VM becomes its (through a link in its directory: nothing can
// be mounted into its storage daemon's running jail); detached, or with
// the VM deleted, it is root's again and the link is gone.
func TestJailVolumeGivenAndTakenBack(t *testing.T) {
	netnstest.RequireRoot(t)
	s := startServer(t, serverOpts{confine: true})
	f := newFixture(t)
	s.create(f.body("vo", true, ""), http.StatusCreated)
	s.waitDisplay("vo", "running", "running")
	uid := s.jview("vo").Confinement.UID
	if st, b := s.do("POST", "/api/volumes", `{"volume_id":"fcv","size_gib":1}`); st != http.StatusCreated {
		t.Fatalf("POST /api/volumes = %d %s", st, b)
	}
	vol, link := s.stateDir+"/volumes/fcv.qcow2", s.stateDir+"/vms/vo/volumes/fcv.qcow2"
	owner := func(p string) uint32 {
		var st syscall.Stat_t
		if err := syscall.Stat(p, &st); err != nil {
			t.Fatalf("%s: %v", p, err)
		}
		return st.Uid
	}
	attach := func() {
		if st, b := s.do("POST", "/api/vms/vo/volumes", `{"volume_id":"fcv"}`); st != http.StatusOK {
			t.Fatalf("attach = %d %s", st, b)
		}
		if o := owner(vol); o != uid || !exists(link) {
			t.Errorf("attached: the volume is %d's (link there: %t), want the VM's %d", o, exists(link), uid)
		}
	}
	attach()
	if st, b := s.do("DELETE", "/api/vms/vo/volumes/fcv", ""); st != http.StatusOK {
		t.Fatalf("detach = %d %s", st, b)
	}
	if o := owner(vol); o != 0 || exists(link) {
		t.Errorf("detached: the volume is %d's (link there: %t), want root's and no link", o, exists(link))
	}
	attach()
	if st, b := s.do("DELETE", "/api/vms/vo?force=true", ""); st != http.StatusNoContent {
		t.Fatalf("DELETE = %d %s", st, b)
	}
	if o := owner(vol); o != 0 {
		t.Errorf("after the VM's delete the volume is %d's, want root's", o)
	}
}

// TestJailUnreadableKernel: a confined CH opens its kernel as the VM's
// uid, so a kernel only root may read fails the boot, saying which file
// and how to fix it; made readable, the VM boots.
func TestJailUnreadableKernel(t *testing.T) {
	netnstest.RequireRoot(t)
	s := startServer(t, serverOpts{confine: true})
	f := newFixture(t)
	if err := os.Chmod(f.kernel, 0o600); err != nil {
		t.Fatal(err)
	}
	st, b := s.do("POST", "/api/vms", f.body("k6", true, ""))
	if st < 500 || !strings.Contains(string(b), f.kernel) || !strings.Contains(string(b), "chmod a+r") {
		t.Fatalf("create with a kernel of mode 0600 = %d %s, want a failed boot naming the kernel and the fix", st, b)
	}
	if err := os.Chmod(f.kernel, 0o644); err != nil {
		t.Fatal(err)
	}
	if st := s.act("k6", "start"); st != http.StatusNoContent {
		t.Fatalf("start with the kernel readable = %d", st)
	}
	s.waitDisplay("k6", "running", "running")
}

// TestJailNeedsCgroupsAsRoot: an agent that runs as root confines its
// VMs or does not start: where no cgroup hierarchy is mounted (here, a
// mount namespace with /sys/fs/cgroup unmounted, as `ip netns exec`
// leaves an agent), serve stops at once, saying what is missing and the
// way out, jail.enabled false, with which it starts and says, once, that
// VMs run unconfined. With jail.enabled unset and the simulator's
// process-mode guests (serve --dev) it starts too, saying why once.
func TestJailNeedsCgroupsAsRoot(t *testing.T) {
	netnstest.RequireRoot(t)
	unshare, err := exec.LookPath("unshare")
	if err != nil {
		t.Skip("unshare (util-linux) is not installed")
	}
	dir := t.TempDir()
	serve := func(jailOn *bool, ready time.Duration) (string, error) {
		cfg := config.Default()
		cfg.Jail.Enabled = jailOn
		data, err := cfg.Marshal()
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(dir+"/config.json", data, 0o600); err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), ready)
		defer cancel()
		cmd := exec.CommandContext(ctx, unshare, "-m", "--propagation", "private", "sh", "-c", `umount -R /sys/fs/cgroup && exec "$0" "$@"`,
			vmhostBin, "serve", "--listen", "unix:"+dir+"/api.sock", "--state-dir", dir+"/state", "--run-dir", dir+"/run",
			"--config", dir+"/config.json", "--simulate", "ch,qsd", "--simulator", simBin)
		out, err := cmd.CombinedOutput()
		return string(out), err
	}
	out, err := serve(new(true), 30*time.Second)
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.ExitCode() <= 0 || !strings.Contains(out, "cgroup") || !strings.Contains(out, "set jail.enabled to false") {
		t.Errorf("serve as root without cgroups: %v, want it to stop naming the cgroups and jail.enabled:\n%s", err, out)
	}
	// With the jail off it serves until killed (the context's end).
	out, err = serve(new(false), 3*time.Second)
	if !errors.As(err, &exit) || exit.ExitCode() != -1 || strings.Count(out, `msg="VMs run unconfined"`) != 1 || !strings.Contains(out, "jail.enabled is false") {
		t.Errorf("serve with jail.enabled false: %v, want it serving and saying once that VMs run unconfined:\n%s", err, out)
	}
	// Unset, with the simulator's process-mode guests (serve --dev's):
	// it serves, every VM unconfined, saying why once.
	out, err = serve(nil, 3*time.Second)
	if !errors.As(err, &exit) || exit.ExitCode() != -1 || strings.Count(out, `msg="VMs run unconfined"`) != 1 || !strings.Contains(out, "the jail cannot work on this host") {
		t.Errorf("serve with jail.enabled unset and the process-mode simulator: %v, want it serving and saying once that VMs run unconfined:\n%s", err, out)
	}
}

// TestJailSavedStates: a confined VM suspended and started again resumes
// in a Cloud Hypervisor confined as a boot confines it (its uid, its
// cgroup, no capabilities), which reads the saved state its suspended one
// wrote as the VM's uid; so does one restored from a snapshot with memory;
// and a VM created from that snapshot runs confined as itself, from files
// the first VM's hypervisor wrote.
func TestJailSavedStates(t *testing.T) {
	netnstest.RequireRoot(t)
	s := startServer(t, serverOpts{confine: true})
	f := newFixture(t)
	s.create(f.body("sa", true, ""), http.StatusCreated)
	s.waitDisplay("sa", "running", "running")
	resumed := func(id string, before int) jview {
		t.Helper()
		if st, b := s.do("POST", "/api/vms/"+id+"/start", ""); st != http.StatusNoContent {
			t.Fatalf("start of %s = %d %s", id, st, b)
		}
		v := s.jview(id)
		if v.State != "running" || v.PID == 0 || v.PID == before || v.Confinement == nil {
			t.Fatalf("%s after its start: %+v %+v, want running in a new, confined CH", id, v.view, v.Confinement)
		}
		checkConfined(t, id+"'s resumed CH", v.PID, v)
		return v
	}
	a := s.jview("sa")
	if st, b := s.do("POST", "/api/vms/sa/suspend", ""); st != http.StatusNoContent {
		t.Fatalf("suspend = %d %s", st, b)
	}
	a = resumed("sa", a.PID)
	if st, b := s.do("POST", "/api/vms/sa/snapshots", `{"snapshot_id":"sa-s","memory":true}`); st != http.StatusCreated {
		t.Fatalf("snapshot = %d %s", st, b)
	}
	if st, b := s.do("POST", "/api/vms/sa/stop", ""); st != http.StatusNoContent {
		t.Fatalf("stop = %d %s", st, b)
	}
	if st, b := s.do("POST", "/api/vms/sa/restore", `{"snapshot_id":"sa-s"}`); st/100 != 2 {
		t.Fatalf("restore = %d %s", st, b)
	}
	resumed("sa", a.PID)
	s.create(fmt.Sprintf(`{"vm_id":"sc","vcpus":1,"memory_mb":128,"kernel_path":%q,"from_snapshot":"sa-s","auto_boot":true}`, f.kernel), http.StatusCreated)
	s.waitDisplay("sc", "running", "running")
	c := s.jview("sc")
	if c.Confinement == nil || c.Confinement.UID == a.Confinement.UID {
		t.Fatalf("sc's confinement %+v, want its own (sa's is %+v)", c.Confinement, a.Confinement)
	}
	checkConfined(t, "sc's CH", c.PID, c)
	checkJails(t, s, map[string]view{"sa": s.jview("sa").view, "sc": c.view})
}

// TestJailDefaultWithProcessGuests: as root with the simulator's
// process-mode guests and jail.enabled unset (serve --dev, and this
// harness's default), a classic VM is confined (its CH and storage daemon
// checked from /proc) while an AppVM, whose simulated guest runs the
// workload on the host, is not; the agent says so once at start.
func TestJailDefaultWithProcessGuests(t *testing.T) {
	netnstest.RequireRoot(t)
	s := startAppVMServer(t, map[string]string{"idle": "exec sleep 300"})
	f := newFixture(t)
	s.create(f.body("classic", true, ""), http.StatusCreated)
	s.waitDisplay("classic", "running", "running")
	c := s.jview("classic")
	if c.Confinement == nil {
		t.Fatalf("classic VM not confined: %+v", c)
	}
	checkConfined(t, "classic CH", c.PID, c)
	checkConfined(t, "classic QSD", c.Disk.QSDPid, c)

	if st, b := s.do("POST", "/api/appvm/vms", `{"vm_id":"app","image_id":"idle","vcpus":1,"memory_mb":128,"disk_gib":1,`+
		`"ip":"10.80.0.6","prefix":24,"gateway":"10.80.0.1"}`); st != http.StatusCreated {
		t.Fatalf("AppVM create = %d %s", st, b)
	}
	s.appvmWait("app", "running", 60*time.Second, func(v appvmView) bool { return v.DisplayState == "running" })
	var a jview
	if err := json.Unmarshal(s.appvmGet("app").raw, &a); err != nil {
		t.Fatal(err)
	}
	if a.PID == 0 {
		t.Fatalf("the AppVM's view names no CH pid: %+v", a)
	}
	if a.Confinement != nil {
		t.Errorf("AppVM confined under the process-mode guest: %+v", a.Confinement)
	}
	if st := statusOf(t, a.PID); !strings.HasPrefix(st["Uid"], "0\t") {
		t.Errorf("the AppVM's CH runs as %s, want the agent's uid", st["Uid"])
	}
	out := s.stderr.String()
	if n := strings.Count(out, `AppVMs run unconfined`); n != 1 || !strings.Contains(out, "VMs run confined") {
		t.Errorf("the agent said %d times that AppVMs run unconfined (want once, beside VMs run confined):\n%s", n, out)
	}
	checkJails(t, s, map[string]view{"classic": c.view})
	// A restart adopts both, and does not call the AppVM one of an
	// unconfined past that its next boot confines: it never will be.
	s.kill()
	s.restart()
	if out := s.stderr.String(); strings.Contains(out, "booted before VMs were confined") || strings.Count(out, "VM adopted") != 2 {
		t.Errorf("the restarted agent's adoption of a confined VM and an unconfined AppVM:\n%s", out)
	}
	for _, p := range []string{"/api/vms/classic?force=true", "/api/appvm/vms/app?force=true"} {
		if st, b := s.do("DELETE", p, ""); st != http.StatusNoContent {
			t.Fatalf("DELETE %s = %d %s", p, st, b)
		}
	}
	checkJails(t, s, nil)
}

// TestJailFailedProvisionLeavesNoCgroup: a create's cgroup is made while
// its disks are (here, while its image downloads); a provision that fails
// waits for it and its rollback removes it: the failed VM keeps its record,
// with no cgroup and no files.
func TestJailFailedProvisionLeavesNoCgroup(t *testing.T) {
	netnstest.RequireRoot(t)
	s := startServer(t, serverOpts{confine: true})
	f := newFixture(t)
	data, err := os.ReadFile(f.base)
	if err != nil {
		t.Fatal(err)
	}
	body := `{"vm_id":"bad","vcpus":1,"memory_mb":128,"kernel_path":"` + f.kernel + `",` +
		`"image":{"image_id":"x","content_sha256":"` + strings.Repeat("ab", 32) + `","fetch_url":"` + imageServer(t, data) + `"}}`
	s.create(body, http.StatusAccepted)
	s.waitFor("bad", "provision failure", func(v view) bool { return v.State == "failed" })
	if slices.Contains(s.cgroupVMs(), "bad") {
		t.Error("the failed provision left its VM's cgroup")
	}
	if exists(s.stateDir+"/vms/bad") || exists(s.runDir+"/vms/bad") || exists(s.runDir+"/jail/bad") {
		t.Error("the failed provision left files")
	}
	if st, b := s.do("DELETE", "/api/vms/bad", ""); st != http.StatusNoContent {
		t.Fatalf("DELETE = %d %s", st, b)
	}
	checkGone(t, s, "bad")
}

// TestJailAgentCgroupAtStop: an agent stopped while a VM runs keeps its
// cgroup (the VM's is in it, and the VM outlives the agent); one stopped
// with no VMs leaves no cgroup of its own behind.
func TestJailAgentCgroupAtStop(t *testing.T) {
	netnstest.RequireRoot(t)
	s := startServer(t, serverOpts{confine: true})
	f := newFixture(t)
	s.create(f.body("held", true, ""), http.StatusCreated)
	s.waitDisplay("held", "running", "running")
	agentCgroup := func() *jail.Cgroup {
		b, err := os.ReadFile(filepath.Join(s.stateDir, "agent_id"))
		if err != nil {
			t.Fatal(err)
		}
		return s.jailer().Layout().Cgroup(path.Join(jail.DefaultConfig().CgroupParent, strings.TrimSpace(string(b))))
	}
	stop := func() {
		s.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-s.exited:
		case <-time.After(10 * time.Second):
			t.Fatal("the agent did not stop on SIGTERM")
		}
	}
	stop()
	if c := agentCgroup(); !c.Exists() || !slices.Contains(s.cgroupVMs(), "held") {
		t.Fatalf("stopped with a VM running: the agent's cgroup is there: %t, its VMs' cgroups: %v", c.Exists(), s.cgroupVMs())
	}
	s.restart()
	if st, b := s.do("DELETE", "/api/vms/held?force=true", ""); st != http.StatusNoContent {
		t.Fatalf("DELETE = %d %s", st, b)
	}
	stop()
	if c := agentCgroup(); c.Exists() {
		t.Errorf("stopped with no VMs: the agent's cgroup %s is still there", c.Name())
	}
}
