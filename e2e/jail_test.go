//go:build linux

package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"vmhost/internal/netnstest"
	"vmhost/jail"
	"vmhost/metrics/metricstest"
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
	s := startServer(t, serverOpts{netns: true})
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
