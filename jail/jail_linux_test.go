package jail_test

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"vmhost/jail"
	"vmhost/proc"
)

// vmFiles lays out what the agent keeps for VMs a and b under base, as
// docs/design.md §3 does: state/vms/<id>/root.qcow2, state/keys.json and
// run/vms/<id>/, agent-owned (root, 0600 files, 0700 directories).
func vmFiles(t *testing.T, base string) (state, run string) {
	t.Helper()
	state, run = filepath.Join(base, "state"), filepath.Join(base, "run")
	for _, d := range []string{state + "/vms/a", state + "/vms/b", run + "/vms/a", run + "/vms/b"} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	for _, f := range []string{state + "/vms/a/root.qcow2", state + "/vms/b/root.qcow2", state + "/keys.json"} {
		if err := os.WriteFile(f, []byte("secret"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return state, run
}

// jailMounts lists the host's mounts that name base or the jail's tmpfs:
// a jail must never show in the host's mount table.
func jailMounts(t *testing.T, base string) []string {
	t.Helper()
	var out []string
	for _, line := range strings.Split(mountTable(t), "\n") {
		if strings.Contains(line, base) || strings.Contains(line, "vmhost-jail") {
			out = append(out, line)
		}
	}
	return out
}

// probeResults parses a probe's output: "open PATH RESULT", "list DIR RESULT
// NAMES", "setuid0 RESULT"... keyed by everything before the last field.
func probeResults(t *testing.T, log string) map[string]string {
	t.Helper()
	m := map[string]string{}
	for _, line := range readLines(t, log) {
		f := strings.Fields(line)
		switch {
		case len(f) >= 3 && f[0] == "list":
			m["list "+f[1]] = strings.Join(f[2:], " ")
		case len(f) >= 2:
			m[strings.Join(f[:len(f)-1], " ")] = f[len(f)-1]
		}
	}
	return m
}

func hostDevices() []string {
	devs := []string{"/dev/null", "/dev/urandom"}
	for _, d := range []string{"/dev/kvm", "/dev/net/tun"} {
		if _, err := os.Stat(d); err == nil {
			devs = append(devs, d)
		}
	}
	return devs
}

// TestJailedProcess starts a process jailed as a VM's Cloud Hypervisor is
// and checks, on the real process, every property docs/ref/confinement.md lists:
// ids, groups, capabilities, no_new_privs, cgroups and their limits, what
// it can open from inside, and that nothing of it is left after Destroy.
func TestJailedProcess(t *testing.T) {
	j, base := testJailer(t, nil)
	state, run := vmFiles(t, base)
	cfg := j.Config()
	ida, err := j.AllocateID(nil)
	if err != nil {
		t.Fatal(err)
	}
	idb, err := j.AllocateID(map[uint32]bool{ida: true})
	if err != nil {
		t.Fatal(err)
	}
	va, err := j.VM("a", ida)
	if err != nil {
		t.Fatal(err)
	}
	vb, err := j.VM("b", idb)
	if err != nil {
		t.Fatal(err)
	}
	if err := va.Create(cfg.Limits(512, 3)); err != nil {
		t.Fatal(err)
	}
	if err := vb.Create(cfg.Limits(256, 1)); err != nil {
		t.Fatal(err)
	}
	// The VM owns its disk and its run directory (it makes sockets there),
	// not its state directory: the agent's own, bound writable so the disk
	// opens read-write, searchable (0711) so the VM reaches its files, with
	// nothing in it the VM can list, rename or remove.
	if err := jail.Own(ida, ida, state+"/vms/a/root.qcow2"); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(state+"/vms/a", 0o711); err != nil {
		t.Fatal(err)
	}
	if err := jail.OwnTree(ida, ida, run+"/vms/a"); err != nil {
		t.Fatal(err)
	}
	if err := jail.Own(idb, idb, state+"/vms/b/root.qcow2"); err != nil {
		t.Fatal(err)
	}

	devices := hostDevices()
	opens := []probeOpen{
		{state + "/vms/a/root.qcow2", true},
		{state + "/vms/b/root.qcow2", false},
		{state + "/keys.json", false},
		{"/etc/shadow", false},
		{"/proc/self/status", false},
		{"/proc/1/status", false},
		{"/proc/sys/kernel/hostname", false},
		{"/sys/class/net", false},
	}
	for _, d := range devices {
		opens = append(opens, probeOpen{d, true})
	}
	openJSON, _ := json.Marshal(opens)
	sock := run + "/vms/a/probe.sock"
	logFile := filepath.Join(base, "a.log")
	x := jail.Exec{
		Binds:   []jail.Bind{{Path: state + "/vms/a", Writable: true}, {Path: run + "/vms/a", Writable: true}},
		Devices: devices,
		Proc:    true,
		// Below this machine's hard limit: its root lacks CAP_SYS_RESOURCE.
		MemlockBytes: 4 << 20,
	}
	c := spawn(t, va, x, "probe", logFile,
		"JAILTEST_OPEN="+string(openJSON),
		"JAILTEST_LIST="+state+" "+state+"/vms /dev",
		"JAILTEST_LISTEN="+sock)

	// From inside: its own disk and devices open; another VM's disk, the
	// keys and the host's files are not there at all.
	res := probeResults(t, logFile)
	t.Logf("probe output:\n%s", strings.Join(readLines(t, logFile), "\n"))
	want := map[string]string{
		"open " + state + "/vms/a/root.qcow2": "ok",
		"open " + state + "/vms/b/root.qcow2": "ENOENT",
		"open " + state + "/keys.json":        "ENOENT",
		"open /etc/shadow":                    "ENOENT",
		"open /proc/self/status":              "ok",
		"open /proc/1/status":                 "ENOENT", // hidepid: other uids' processes are invisible
		"open /proc/sys/kernel/hostname":      "ENOENT", // subset=pid
		"open /sys/class/net":                 "ENOENT",
		"list " + state:                       "ok vms",
		"list " + state + "/vms":              "ok a",
		"setuid0":                             "EPERM",
		"chroot":                              "EPERM",
		"mount":                               "EPERM",
		"listen " + sock:                      "ok",
	}
	for _, d := range devices {
		want["open "+d] = "ok"
	}
	for k, v := range want {
		if res[k] != v {
			t.Errorf("inside the jail, %s: got %q, want %q", k, res[k], v)
		}
	}
	if r := res["create /"]; r != "EROFS" && r != "EACCES" {
		t.Errorf("inside the jail, creating a file in /: got %q, want EROFS or EACCES", r)
	}
	var devNames []string
	for _, d := range devices {
		if filepath.Dir(d) == "/dev" {
			devNames = append(devNames, filepath.Base(d))
		}
	}
	if slices.Contains(devices, "/dev/net/tun") {
		devNames = append(devNames, "net")
	}
	slices.Sort(devNames)
	if got := res["list /dev"]; got != "ok "+strings.Join(devNames, ",") {
		t.Errorf("inside the jail, /dev holds %q, want ok %s", got, strings.Join(devNames, ","))
	}

	// Its identity and privileges, as the kernel reports them.
	st := procStatus(t, c.Pid)
	id := strconv.Itoa(int(ida))
	for _, k := range []string{"Uid", "Gid"} {
		if got := strings.Fields(st[k]); !slices.Equal(got, []string{id, id, id, id}) {
			t.Errorf("%s: %q, want %s four times", k, st[k], id)
		}
	}
	if st["Groups"] != "" {
		t.Errorf("Groups: %q, want none", st["Groups"])
	}
	for _, k := range []string{"CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"} {
		if st[k] != "0000000000000000" {
			t.Errorf("%s: %q, want every capability dropped", k, st[k])
		}
	}
	if st["NoNewPrivs"] != "1" {
		t.Errorf("NoNewPrivs: %q, want 1", st["NoNewPrivs"])
	}
	limits, err := os.ReadFile("/proc/" + strconv.Itoa(c.Pid) + "/limits")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(limits), "Max locked memory         4194304              4194304              bytes") {
		t.Errorf("RLIMIT_MEMLOCK is not 4 MiB:\n%s", limits)
	}

	if err := va.Verify(c.Pid); err != nil {
		t.Errorf("Verify: %v", err)
	}
	if err := vb.Verify(c.Pid); err == nil || !strings.Contains(err.Error(), "Uid is") || !strings.Contains(err.Error(), "not in cgroup") {
		t.Errorf("VM b's Verify of VM a's process: %v, want its uid and cgroup named", err)
	}
	err = va.Verify(os.Getpid())
	for _, want := range []string{"Uid is", "Gid is", "CapEff is", "CapBnd is", "NoNewPrivs is", "not in cgroup", "mount namespace"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("Verify of the test process itself: %v, want %q", err, want)
		}
	}

	// Its cgroup in every hierarchy, and the limits there.
	checkCgroupMembership(t, j.Layout(), c.Pid, j.CgroupName("a"))
	checkLimits(t, j.Layout(), j.CgroupName("a"), cfg.Limits(512, 3))
	if in, err := va.Cgroup().Contains(c.Pid); err != nil || !in {
		t.Errorf("Contains(%d) = %v, %v; want true", c.Pid, in, err)
	}
	if in, _ := vb.Cgroup().Contains(c.Pid); in {
		t.Errorf("VM b's cgroup contains VM a's process")
	}
	stats, err := va.Cgroup().Stats()
	if err != nil {
		t.Fatal(err)
	}
	if stats.Pids < 1 || stats.MemoryBytes == 0 || stats.CPU <= 0 {
		t.Errorf("stats %+v: want tasks, memory and CPU time counted", stats)
	}

	// Its socket, made by the jailed uid in its run directory, serves the
	// agent (root) on the host.
	fi, err := os.Stat(sock)
	if err != nil {
		t.Fatal(err)
	}
	if uid := fi.Sys().(*syscall.Stat_t).Uid; uid != ida {
		t.Errorf("the socket is owned by %d, want the VM's uid %d", uid, ida)
	}
	conn, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	line, err := bufio.NewReader(conn).ReadString('\n')
	conn.Close()
	if err != nil || line != "hello from the jail\n" {
		t.Errorf("reading the jailed socket: %q, %v", line, err)
	}

	// The jail is in the process's mount namespace only.
	if m := jailMounts(t, base); len(m) > 0 {
		t.Errorf("the host's mount table shows the jail while it runs:\n%s", strings.Join(m, "\n"))
	}
	if ents, _ := os.ReadDir(va.Root); len(ents) > 0 {
		t.Errorf("the host sees %d entries in the jail root %s; want an empty directory", len(ents), va.Root)
	}

	// Destroy: the process is killed, nothing is left.
	if err := va.Destroy(bounded(t)); err != nil {
		t.Fatal(err)
	}
	select {
	case <-c.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("the jailed process outlived Destroy")
	}
	if ex := c.Exit(); ex.Signal != syscall.SIGKILL {
		t.Errorf("the jailed process ended with %v, want SIGKILL", ex)
	}
	checkGone(t, j.Layout(), j.CgroupName("a"), va.Root)
	if err := vb.Destroy(bounded(t)); err != nil {
		t.Fatal(err)
	}
	checkGone(t, j.Layout(), j.CgroupName("b"), vb.Root)
	if m := jailMounts(t, base); len(m) > 0 {
		t.Errorf("the host's mount table shows the jail after Destroy:\n%s", strings.Join(m, "\n"))
	}
	if err := va.Destroy(bounded(t)); err != nil {
		t.Errorf("a second Destroy: %v", err)
	}
}

// checkCgroupMembership reads /proc/PID/cgroup: the process is in name in
// each hierarchy the layout uses.
func checkCgroupMembership(t *testing.T, l jail.Layout, pid int, name string) {
	t.Helper()
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cgroup")
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	in := func(ctrl string) bool {
		for _, line := range lines {
			p := strings.SplitN(line, ":", 3)
			if len(p) == 3 && p[2] == "/"+name && (ctrl == "" && p[0] == "0" || ctrl != "" && slices.Contains(strings.Split(p[1], ","), ctrl)) {
				return true
			}
		}
		return false
	}
	if l.Unified != "" && !in("") {
		t.Errorf("/proc/%d/cgroup has no 0::/%s line:\n%s", pid, name, b)
	}
	if !l.UnifiedLimits {
		for _, ctrl := range []string{"memory", "pids", "cpu", "cpuacct"} {
			if !in(ctrl) {
				t.Errorf("/proc/%d/cgroup does not place it in %s:/%s:\n%s", pid, ctrl, name, b)
			}
		}
	}
}

// checkLimits reads the cgroup files back.
func checkLimits(t *testing.T, l jail.Layout, name string, lim jail.Limits) {
	t.Helper()
	read := func(dir, file string) string {
		b, err := os.ReadFile(filepath.Join(dir, name, file))
		if err != nil {
			t.Error(err)
		}
		return strings.TrimSpace(string(b))
	}
	mem := strconv.FormatUint(lim.MemoryBytes, 10)
	pids := strconv.FormatUint(lim.PidsMax, 10)
	if l.UnifiedLimits {
		for file, want := range map[string]string{"memory.max": mem, "pids.max": pids, "memory.swap.max": "0",
			"cpu.weight": strconv.Itoa(int(100 * lim.VCPUs))} {
			if got := read(l.Unified, file); got != want {
				t.Errorf("%s: %q, want %q", file, got, want)
			}
		}
		return
	}
	if got := read(l.V1["memory"], "memory.limit_in_bytes"); got != mem {
		t.Errorf("memory.limit_in_bytes: %s, want %s", got, mem)
	}
	if _, err := os.Stat(filepath.Join(l.V1["memory"], name, "memory.memsw.limit_in_bytes")); err == nil {
		if got := read(l.V1["memory"], "memory.memsw.limit_in_bytes"); got != mem {
			t.Errorf("memory.memsw.limit_in_bytes: %s, want %s (no swap beyond the limit)", got, mem)
		}
	}
	if got := read(l.V1["pids"], "pids.max"); got != pids {
		t.Errorf("pids.max: %s, want %s", got, pids)
	}
	if got, want := read(l.V1["cpu"], "cpu.shares"), strconv.Itoa(int(1024*lim.VCPUs)); got != want {
		t.Errorf("cpu.shares: %s, want %s", got, want)
	}
}

// checkGone: no directory of cgroup name in any hierarchy, no jail root.
func checkGone(t *testing.T, l jail.Layout, name, root string) {
	t.Helper()
	for _, m := range hierarchies(l) {
		if _, err := os.Stat(filepath.Join(m, name)); !os.IsNotExist(err) {
			t.Errorf("cgroup %s/%s is still there (%v)", m, name, err)
		}
	}
	if _, err := os.Stat(root); !os.IsNotExist(err) {
		t.Errorf("jail root %s is still there (%v)", root, err)
	}
}

// bounded is a context for Destroy that ends in 20 s: a kill that does not
// converge fails the test instead of hanging it.
func bounded(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// TestJailUIDFence: a file that reaches a jail by mistake is still fenced by
// the uid: another VM's disk and the keys, bound in, answer EACCES.
func TestJailUIDFence(t *testing.T) {
	j, base := testJailer(t, nil)
	state, _ := vmFiles(t, base)
	ida, _ := j.AllocateID(nil)
	idb, _ := j.AllocateID(map[uint32]bool{ida: true})
	va, err := j.VM("a", ida)
	if err != nil {
		t.Fatal(err)
	}
	if err := va.Create(j.Config().Limits(64, 1)); err != nil {
		t.Fatal(err)
	}
	defer va.Destroy(bounded(t))
	if err := jail.Own(idb, idb, state+"/vms/b/root.qcow2"); err != nil {
		t.Fatal(err)
	}
	opens, _ := json.Marshal([]probeOpen{{state + "/vms/b/root.qcow2", false}, {state + "/keys.json", false}})
	logFile := filepath.Join(base, "a.log")
	spawn(t, va, jail.Exec{Binds: []jail.Bind{{Path: state + "/vms/b/root.qcow2"}, {Path: state + "/keys.json"}}},
		"probe", logFile, "JAILTEST_OPEN="+string(opens))
	res := probeResults(t, logFile)
	for _, f := range []string{state + "/vms/b/root.qcow2", state + "/keys.json"} {
		if got := res["open "+f]; got != "EACCES" {
			t.Errorf("opening %s bound into another VM's jail: %q, want EACCES", f, got)
		}
	}
}

// TestMemoryLimit: a process that allocates without end is stopped by its
// VM's memory limit, and a second jailed VM is not touched.
func TestMemoryLimit(t *testing.T) {
	j, base := testJailer(t, nil)
	ida, _ := j.AllocateID(nil)
	idb, _ := j.AllocateID(map[uint32]bool{ida: true})
	cfg := j.Config()
	cfg.MemoryOverheadMB = 32
	va, _ := j.VM("hog", ida)
	vb, _ := j.VM("quiet", idb)
	for _, v := range []*jail.VM{va, vb} {
		if err := v.Create(cfg.Limits(32, 1)); err != nil {
			t.Fatal(err)
		}
		defer v.Destroy(bounded(t))
	}
	quiet := spawn(t, vb, jail.Exec{}, "sleep", filepath.Join(base, "quiet.log"))
	hog := spawn(t, va, jail.Exec{}, "hog", filepath.Join(base, "hog.log"))
	select {
	case <-hog.Done():
	case <-time.After(60 * time.Second):
		t.Fatal("the memory hog was not stopped by its limit within 60s")
	}
	if ex := hog.Exit(); ex.Signal != syscall.SIGKILL {
		t.Errorf("the hog ended with %v, want SIGKILL from the OOM killer", ex)
	}
	if !proc.Alive(quiet.Pid, quiet.StartTime) {
		t.Error("the other VM's process died with the hog")
	}
	l := j.Layout()
	if l.UnifiedLimits {
		if n := keyed(t, filepath.Join(l.Unified, j.CgroupName("hog"), "memory.events"), "oom_kill"); n < 1 {
			t.Errorf("memory.events oom_kill = %d, want >= 1", n)
		}
		if n := keyed(t, filepath.Join(l.Unified, j.CgroupName("quiet"), "memory.events"), "oom_kill"); n != 0 {
			t.Errorf("the quiet VM's oom_kill = %d, want 0", n)
		}
	} else {
		if n := keyed(t, filepath.Join(l.V1["memory"], j.CgroupName("hog"), "memory.oom_control"), "oom_kill"); n < 1 {
			t.Errorf("memory.oom_control oom_kill = %d, want >= 1", n)
		}
		if n := keyed(t, filepath.Join(l.V1["memory"], j.CgroupName("quiet"), "memory.oom_control"), "oom_kill"); n != 0 {
			t.Errorf("the quiet VM's oom_kill = %d, want 0", n)
		}
	}
}

func keyed(t *testing.T, file, key string) int {
	t.Helper()
	b, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if k, v, ok := strings.Cut(line, " "); ok && k == key {
			n, _ := strconv.Atoi(v)
			return n
		}
	}
	t.Fatalf("%s has no %s:\n%s", file, key, b)
	return 0
}

// TestKillCgroup: killing the cgroup leaves no process of the VM, not one
// that started a session of its own nor one orphaned by a double fork; with
// the controller-less cgroup2 (cgroup.kill) and with v1 alone (forks
// stopped, kill until cgroup.procs stays empty, limits restored); Destroy
// then leaves nothing.
func TestKillCgroup(t *testing.T) {
	requireRoot(t)
	host, err := jail.DetectLayout()
	if err != nil {
		t.Fatal(err)
	}
	layouts := map[string]*jail.Layout{"detected": &host}
	if !host.UnifiedLimits {
		v1 := host
		v1.Unified = ""
		layouts["v1 only"] = &v1
	}
	for name, l := range layouts {
		t.Run(name, func(t *testing.T) {
			if name == "detected" && host.Unified == "" {
				t.Log("no cgroup2 is mounted: this case proves the v1 kill loop again")
			}
			j, base := testJailer(t, l)
			id, _ := j.AllocateID(nil)
			v, _ := j.VM("f", id)
			if err := v.Create(j.Config().Limits(128, 1)); err != nil {
				t.Fatal(err)
			}
			logFile := filepath.Join(base, "f.log")
			c := spawn(t, v, jail.Exec{Devices: []string{"/dev/null"}}, "forker", logFile)
			var pids []int
			for _, line := range readLines(t, logFile) {
				if p, ok := strings.CutPrefix(line, "pid "); ok {
					n, _ := strconv.Atoi(p)
					pids = append(pids, n)
				}
			}
			if len(pids) != 3 {
				t.Fatalf("forker reported pids %v, want 3; output:\n%s", pids, strings.Join(readLines(t, logFile), "\n"))
			}
			listed, err := v.Cgroup().Procs()
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(listed, slices.Sorted(slices.Values(pids))) {
				t.Errorf("cgroup lists %v, want %v", listed, slices.Sorted(slices.Values(pids)))
			}
			starts := map[int]uint64{}
			for _, p := range pids {
				st, err := proc.StartTime(p)
				if err != nil {
					t.Fatal(err)
				}
				starts[p] = st
			}
			if err := v.Cgroup().Kill(bounded(t)); err != nil {
				t.Fatal(err)
			}
			<-c.Done()
			for _, p := range pids {
				if proc.Alive(p, starts[p]) {
					t.Errorf("pid %d survived the kill", p)
				}
			}
			// The cgroup stays usable: its limits are back, and a process
			// started in it after the kill runs (a VM stopped and started).
			checkLimits(t, j.Layout(), j.CgroupName("f"), j.Config().Limits(128, 1))
			again := spawn(t, v, jail.Exec{Devices: []string{"/dev/null"}}, "sleep", filepath.Join(base, "again.log"))
			if in, err := v.Cgroup().Contains(again.Pid); err != nil || !in {
				t.Errorf("a process started after the kill is not in the cgroup (%v)", err)
			}
			if err := v.Destroy(bounded(t)); err != nil {
				t.Fatal(err)
			}
			checkGone(t, j.Layout(), j.CgroupName("f"), v.Root)
		})
	}
}

// TestAdoptionByCgroup: after an agent restart the VM's processes are found
// by their cgroup: both processes (and a grandchild) are listed with the
// start times Spawn reported, and can be adopted.
func TestAdoptionByCgroup(t *testing.T) {
	j, base := testJailer(t, nil)
	id, _ := j.AllocateID(nil)
	v, _ := j.VM("adopt", id)
	if err := v.Create(j.Config().Limits(128, 2)); err != nil {
		t.Fatal(err)
	}
	defer v.Destroy(bounded(t))
	other, _ := j.VM("other", id+1)
	if err := other.Create(j.Config().Limits(128, 1)); err != nil {
		t.Fatal(err)
	}
	defer other.Destroy(bounded(t))

	// A second supplementary group, to see that Groups reaches the process.
	ch := spawn(t, v, jail.Exec{Groups: []uint32{id + 7}}, "sleep", filepath.Join(base, "ch.log"))
	qsd := spawn(t, v, jail.Exec{Devices: []string{"/dev/null"}}, "forker", filepath.Join(base, "qsd.log"))
	spawn(t, other, jail.Exec{}, "sleep", filepath.Join(base, "other.log"))
	if g := procStatus(t, ch.Pid)["Groups"]; g != strconv.Itoa(int(id+7)) {
		t.Errorf("Groups: %q, want %d", g, id+7)
	}

	// "Restart": only the cgroup's name is known.
	again, err := j.VM("adopt", id)
	if err != nil {
		t.Fatal(err)
	}
	pids, err := again.Cgroup().Procs()
	if err != nil {
		t.Fatal(err)
	}
	members, err := proc.Members(pids)
	if err != nil {
		t.Fatal(err)
	}
	byPid := map[int]proc.Member{}
	for _, m := range members {
		byPid[m.Pid] = m
		if len(m.Args) == 0 {
			t.Errorf("member %d has no command line", m.Pid)
		}
	}
	if len(members) != 4 {
		t.Errorf("found %d members in %v, want 4 (ch, forker and the forker's two children)", len(members), pids)
	}
	for _, c := range []*proc.Child{ch, qsd} {
		m, ok := byPid[c.Pid]
		if !ok {
			t.Errorf("pid %d is not listed in the VM's cgroup %v", c.Pid, pids)
			continue
		}
		if m.StartTime != c.StartTime {
			t.Errorf("pid %d: start time %d, Spawn reported %d", c.Pid, m.StartTime, c.StartTime)
		}
		a, err := proc.Adopt(m.Pid, m.StartTime)
		if err != nil {
			t.Errorf("adopting %d: %v", m.Pid, err)
			continue
		}
		a.Close()
	}
	otherPids, _ := other.Cgroup().Procs()
	for _, p := range otherPids {
		if _, ok := byPid[p]; ok {
			t.Errorf("another VM's pid %d is listed as this VM's", p)
		}
	}
	left, err := j.Leftovers()
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(left, []string{"adopt", "other"}) {
		t.Errorf("Leftovers = %v, want [adopt other]", left)
	}
	// A leftover no record names is reaped by its VM id alone.
	if err := j.Destroy(bounded(t), "other"); err != nil {
		t.Fatal(err)
	}
	checkGone(t, j.Layout(), j.CgroupName("other"), other.Root)
	if left, _ := j.Leftovers(); !slices.Equal(left, []string{"adopt"}) {
		t.Errorf("Leftovers after reaping: %v, want [adopt]", left)
	}
}

// TestStartFailure: a jail that cannot be built (a bind that does not
// exist) fails the start with its reason, and leaves no process.
func TestStartFailure(t *testing.T) {
	j, base := testJailer(t, nil)
	id, _ := j.AllocateID(nil)
	v, _ := j.VM("bad", id)
	if err := v.Create(j.Config().Limits(64, 1)); err != nil {
		t.Fatal(err)
	}
	defer v.Destroy(bounded(t))
	missing := filepath.Join(base, "no-such-disk.qcow2")
	_, err := proc.Spawn(proc.SpawnConfig{
		Path:    testBinary(t),
		Env:     []string{"JAILTEST_CHILD=sleep"},
		LogFile: filepath.Join(base, "bad.log"),
		Confine: v.Confine(jail.Exec{Binds: []jail.Bind{{Path: missing}}}),
	})
	if err == nil || !strings.Contains(err.Error(), missing) || !strings.Contains(err.Error(), "no such file") {
		t.Fatalf("Spawn with a missing bind: %v; want an error naming %s", err, missing)
	}
	if pids, _ := v.Cgroup().Procs(); len(pids) > 0 {
		t.Errorf("processes %v left in the cgroup after a failed start", pids)
	}
}

// TestOffWithoutRoot: an agent that is not root runs VMs unconfined and
// says why. The test binary runs as another uid to see it.
func TestOffWithoutRoot(t *testing.T) {
	requireRoot(t)
	dir, err := os.MkdirTemp("", "jailtest-off-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	os.Chmod(dir, 0o755)
	bin := filepath.Join(dir, "jail.test")
	b, err := os.ReadFile(testBinary(t))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(bin, b, 0o755); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin)
	cmd.Env = []string{"JAILTEST_CHILD=off"}
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65533, Gid: 65533}}
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	want := "enabled=false off=the agent does not run as root: VMs run unconfined, as the agent's uid 65533"
	if !strings.HasPrefix(string(out), want) {
		t.Errorf("as uid 65533: %q, want it to start with %q", out, want)
	}
}

// TestDestroyMissing: destroying a jail that was never made, or made in
// part (a crash between the steps of Create), succeeds and leaves nothing.
func TestDestroyMissing(t *testing.T) {
	j, _ := testJailer(t, nil)
	for _, partial := range []string{"no root", "one hierarchy"} {
		v, _ := j.VM("partial", 1000124)
		if err := v.Create(j.Config().Limits(64, 1)); err != nil {
			t.Fatal(err)
		}
		switch partial {
		case "no root":
			os.Remove(v.Root)
		case "one hierarchy":
			// Only the first directory Create makes is left.
			ms := hierarchies(j.Layout())
			for _, m := range ms[1:] {
				if err := os.Remove(filepath.Join(m, j.CgroupName("partial"))); err != nil {
					t.Fatal(err)
				}
			}
		}
		if left, _ := j.Leftovers(); !slices.Equal(left, []string{"partial"}) {
			t.Errorf("%s: Leftovers = %v, want [partial]", partial, left)
		}
		if err := v.Destroy(bounded(t)); err != nil {
			t.Fatalf("%s: %v", partial, err)
		}
		checkGone(t, j.Layout(), j.CgroupName("partial"), v.Root)
	}
	v, err := j.VM("never", 1000123)
	if err != nil {
		t.Fatal(err)
	}
	if err := v.Destroy(bounded(t)); err != nil {
		t.Fatal(err)
	}
	if pids, err := v.Cgroup().Procs(); err != nil || len(pids) != 0 {
		t.Fatalf("Procs of a missing cgroup: %v, %v", pids, err)
	}
	if v.Cgroup().Exists() {
		t.Error("a cgroup never made exists")
	}
}

// TestOwnTree: the tree becomes the VM's, links are changed themselves and
// never followed (a link to a host file leaves that file root's), and
// Disown gives a file back.
func TestOwnTree(t *testing.T) {
	requireRoot(t)
	dir := t.TempDir()
	outside := filepath.Join(t.TempDir(), "host-file")
	for _, d := range []string{dir + "/run/sub/deeper"} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	for _, f := range []string{dir + "/run/ch.log", dir + "/run/sub/deeper/x", outside} {
		if err := os.WriteFile(f, nil, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Symlink(outside, dir+"/run/sub/link"); err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("unix", dir+"/run/sock")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	const id = 1000777
	if err := jail.OwnTree(id, id, dir+"/run"); err != nil {
		t.Fatal(err)
	}
	owner := func(p string) (uint32, uint32) {
		var st syscall.Stat_t
		if err := syscall.Lstat(p, &st); err != nil {
			t.Fatal(err)
		}
		return st.Uid, st.Gid
	}
	for _, p := range []string{"", "/ch.log", "/sub", "/sub/deeper", "/sub/deeper/x", "/sub/link", "/sock"} {
		if u, g := owner(dir + "/run" + p); u != id || g != id {
			t.Errorf("run%s: owned by %d:%d, want %d:%d", p, u, g, id, id)
		}
	}
	if u, g := owner(outside); u != 0 || g != 0 {
		t.Errorf("the file a link names became %d:%d: the link was followed", u, g)
	}
	if err := jail.Disown(dir + "/run/ch.log"); err != nil {
		t.Fatal(err)
	}
	if u, g := owner(dir + "/run/ch.log"); u != 0 || g != 0 {
		t.Errorf("after Disown: %d:%d", u, g)
	}
	if err := jail.Own(id, id, dir+"/run/sub/link"); err != nil {
		t.Fatal(err)
	}
	if u, _ := owner(outside); u != 0 {
		t.Error("Own followed a link")
	}
	if err := jail.OwnTree(id, id, dir+"/run/sub/link"); err == nil {
		t.Error("OwnTree of a link: no error")
	}
}

// TestStorageDaemonJailed runs the real qemu-storage-daemon (a dynamically
// linked program: its twenty-odd libraries come from ExecFiles) jailed as a
// VM's is, serving a qcow2 disk over vhost-user-blk, and talks QMP to it
// from the host: what the jail holds is enough for it.
func TestStorageDaemonJailed(t *testing.T) {
	qsdBin, err1 := exec.LookPath("qemu-storage-daemon")
	qemuImg, err2 := exec.LookPath("qemu-img")
	if err1 != nil || err2 != nil {
		if os.Getenv("CI") != "" {
			t.Fatalf("CI installs qemu-storage-daemon and qemu-img: %v %v", err1, err2)
		}
		t.Skip("needs qemu-storage-daemon and qemu-img (Debian: qemu-system-common, qemu-utils)")
	}
	j, base := testJailer(t, nil)
	state, run := vmFiles(t, base)
	disk := state + "/vms/a/data0.qcow2"
	if out, err := exec.Command(qemuImg, "create", "-q", "-f", "qcow2", disk, "64M").CombinedOutput(); err != nil {
		t.Fatalf("qemu-img: %v: %s", err, out)
	}
	id, _ := j.AllocateID(nil)
	v, _ := j.VM("a", id)
	if err := v.Create(j.Config().Limits(128, 1)); err != nil {
		t.Fatal(err)
	}
	defer v.Destroy(bounded(t))
	if err := jail.Own(id, id, disk); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(state+"/vms/a", 0o711); err != nil {
		t.Fatal(err)
	}
	if err := jail.OwnTree(id, id, run+"/vms/a"); err != nil {
		t.Fatal(err)
	}
	qmpSock, vhost := run+"/vms/a/qsd.qmp", run+"/vms/a/data0.vhost"
	logFile := filepath.Join(base, "qsd.log")
	c, err := proc.Spawn(proc.SpawnConfig{
		Path: qsdBin,
		Args: []string{
			"--blockdev", "driver=file,node-name=file0,filename=" + disk,
			"--blockdev", "driver=qcow2,node-name=data0,file=file0",
			"--export", "type=vhost-user-blk,id=data0,node-name=data0,writable=on,addr.type=unix,addr.path=" + vhost,
			"--chardev", "socket,id=qmp,path=" + qmpSock + ",server=on,wait=off",
			"--monitor", "chardev=qmp",
		},
		LogFile: logFile,
		Confine: v.Confine(jail.Exec{
			Binds: []jail.Bind{{Path: state + "/vms/a", Writable: true}, {Path: run + "/vms/a", Writable: true}},
			// QEMU opens /dev/null to probe for open file description
			// locks, and falls back to process-wide ones without it.
			Devices: []string{"/dev/null"},
		}),
	})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		c.Signal(syscall.SIGKILL)
		c.Exit()
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	// QSD makes the export's socket before its monitor's, and binds the
	// monitor's before it listens: dial until it answers (as the agent
	// does), without probing the export, which would take its one client.
	var conn net.Conn
	for conn == nil {
		conn, err = net.Dial("unix", qmpSock)
		if err != nil && !errors.Is(err, syscall.ENOENT) && !errors.Is(err, syscall.ECONNREFUSED) {
			t.Fatal(err)
		}
		select {
		case <-c.Done():
			t.Fatalf("qemu-storage-daemon exited: %s", proc.LogTail(logFile, 20))
		case <-ctx.Done():
			t.Fatalf("its monitor never answered: %v", err)
		case <-time.After(2 * time.Millisecond):
		}
	}
	defer conn.Close()
	if _, err := os.Stat(vhost); err != nil {
		t.Errorf("the export's socket: %v", err)
	}
	r := bufio.NewReader(conn)
	greeting, err := r.ReadString('\n')
	if err != nil || !strings.Contains(greeting, `"QMP"`) {
		t.Fatalf("QMP greeting: %q, %v", greeting, err)
	}
	for _, cmd := range []string{`{"execute":"qmp_capabilities"}`, `{"execute":"query-block-exports"}`} {
		if _, err := conn.Write([]byte(cmd + "\n")); err != nil {
			t.Fatal(err)
		}
		reply, err := r.ReadString('\n')
		if err != nil || !strings.Contains(reply, `"return"`) {
			t.Fatalf("%s: %q, %v", cmd, reply, err)
		}
		if strings.Contains(cmd, "exports") && !strings.Contains(reply, `"data0"`) {
			t.Errorf("exports: %s", reply)
		}
	}
	st := procStatus(t, c.Pid)
	if f := strings.Fields(st["Uid"]); len(f) != 4 || f[0] != strconv.Itoa(int(id)) || st["CapEff"] != "0000000000000000" {
		t.Errorf("qemu-storage-daemon runs as %q with CapEff %s", st["Uid"], st["CapEff"])
	}
	checkCgroupMembership(t, j.Layout(), c.Pid, j.CgroupName("a"))
	if out := proc.LogTail(logFile, 20); out != "" {
		t.Errorf("qemu-storage-daemon complained in its jail:\n%s", out)
	}
}

// TestJailedCProgram: a dynamically linked C program (/bin/sleep) runs in a
// jail holding only it, its loader and libraries, with no signal blocked or
// ignored by the agent's Go runtime on the way.
func TestJailedCProgram(t *testing.T) {
	sleep, err := filepath.EvalSymlinks("/bin/sleep")
	if err != nil {
		t.Skip("no /bin/sleep")
	}
	j, base := testJailer(t, nil)
	id, _ := j.AllocateID(nil)
	v, _ := j.VM("c", id)
	if err := v.Create(j.Config().Limits(64, 1)); err != nil {
		t.Fatal(err)
	}
	defer v.Destroy(bounded(t))
	c := startJailedSleep(t, v, sleep, filepath.Join(base, "sleep.log"))
	st := procStatus(t, c.Pid)
	if st["SigBlk"] != "0000000000000000" || st["SigIgn"] != "0000000000000000" {
		t.Errorf("SigBlk %s SigIgn %s: the start left signals blocked or ignored", st["SigBlk"], st["SigIgn"])
	}
	if err := v.Verify(c.Pid); err != nil {
		t.Error(err)
	}
}

// startJailedSleep starts sleep (a dynamic C program) in v's jail, waits
// until its loader has run and fails the test if it ended; it is killed
// at the test's end.
func startJailedSleep(t *testing.T, v *jail.VM, sleep, logFile string) *proc.Child {
	t.Helper()
	c, err := proc.Spawn(proc.SpawnConfig{Path: sleep, Args: []string{"30"}, LogFile: logFile, Confine: v.Confine(jail.Exec{})})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		c.Signal(syscall.SIGKILL)
		c.Exit()
	})
	// Until the loader has run: the command line is sleep's once exec'd,
	// and a missing library would end it at once.
	deadline := time.Now().Add(10 * time.Second)
	for {
		st := procStatus(t, c.Pid)
		if st["Name"] == "sleep" && st["State"] != "" && !strings.HasPrefix(st["State"], "R") || time.Now().After(deadline) {
			break
		}
		time.Sleep(2 * time.Millisecond)
	}
	select {
	case <-c.Done():
		t.Fatalf("sleep ended in its jail: %v; output: %s", c.Exit(), proc.LogTail(logFile, 10))
	case <-time.After(100 * time.Millisecond):
	}
	return c
}

// TestSysfsLinks: a bind of /sys/class/net/<if> (a link into
// /sys/devices, as Cloud Hypervisor reads a tap's) shows the interface at
// both paths and nothing else of /sys.
func TestSysfsLinks(t *testing.T) {
	j, base := testJailer(t, nil)
	id, _ := j.AllocateID(nil)
	v, _ := j.VM("s", id)
	if err := v.Create(j.Config().Limits(64, 1)); err != nil {
		t.Fatal(err)
	}
	defer v.Destroy(bounded(t))
	real, err := filepath.EvalSymlinks("/sys/class/net/lo")
	if err != nil {
		t.Skip("no /sys/class/net/lo")
	}
	opens, _ := json.Marshal([]probeOpen{{"/sys/class/net/lo/mtu", false}, {real + "/mtu", false},
		{"/sys/kernel/mm/transparent_hugepage/enabled", false}})
	logFile := filepath.Join(base, "s.log")
	spawn(t, v, jail.Exec{Binds: []jail.Bind{{Path: "/sys/class/net/lo"}}}, "probe", logFile,
		"JAILTEST_OPEN="+string(opens), "JAILTEST_LIST=/sys/class/net /sys")
	res := probeResults(t, logFile)
	for k, want := range map[string]string{
		"open /sys/class/net/lo/mtu":                       "ok",
		"open " + real + "/mtu":                            "ok",
		"open /sys/kernel/mm/transparent_hugepage/enabled": "ENOENT",
		"list /sys/class/net":                              "ok lo",
		"list /sys":                                        "ok class,devices",
	} {
		if res[k] != want {
			t.Errorf("%s: %q, want %q", k, res[k], want)
		}
	}
}

// TestSelfTest: doctor's check passes on this host, and leaves nothing.
func TestSelfTest(t *testing.T) {
	j, _ := testJailer(t, nil)
	agentDirs := func() []string {
		var ds []string
		for _, m := range hierarchies(j.Layout()) {
			d := filepath.Join(m, path.Dir(j.CgroupName("x")))
			if _, err := os.Stat(d); err == nil {
				ds = append(ds, d)
			}
		}
		return ds
	}
	if err := j.SelfTest(t.Context(), nil); err != nil {
		t.Fatal(err)
	}
	if left, err := j.Leftovers(); err != nil || len(left) > 0 {
		t.Errorf("Leftovers after the self-test: %v, %v", left, err)
	}
	// It leaves the host as it found it: no agent cgroup it made, and one
	// that holds a VM's kept.
	if ds := agentDirs(); len(ds) > 0 {
		t.Errorf("the self-test left the agent's cgroup it made: %v", ds)
	}
	id, _ := j.AllocateID(nil)
	v, _ := j.VM("kept", id)
	if err := v.Create(j.Config().Limits(64, 1)); err != nil {
		t.Fatal(err)
	}
	defer v.Destroy(bounded(t))
	if err := j.SelfTest(t.Context(), map[uint32]bool{id: true}); err != nil {
		t.Fatal(err)
	}
	if left, err := j.Leftovers(); err != nil || !slices.Equal(left, []string{"kept"}) || len(agentDirs()) == 0 {
		t.Errorf("a self-test beside a VM's cgroup: Leftovers %v, %v; the agent's cgroup in %v", left, err, agentDirs())
	}
}

// TestV2Placement runs the path of a host whose cgroup v2 holds the limits,
// as far as this one allows: in its controller-less cgroup2, a layout that
// uses v2 alone places the processes by CLONE_INTO_CGROUP (no v1 join at
// all), lists and kills them with cgroup.kill, and removes the cgroup. The
// limits and counters of v2 (memory.max, pids.max, cpu.weight,
// memory.current) cannot be written or read where v2 has no controllers.
func TestV2Placement(t *testing.T) {
	requireRoot(t)
	host, err := jail.DetectLayout()
	if err != nil {
		t.Fatal(err)
	}
	if host.Unified == "" {
		t.Skip("no cgroup2 mounted: nothing to place processes in")
	}
	l := host
	if !l.UnifiedLimits {
		l.UnifiedLimits = true // v2 alone; the cgroup is made by hand below, without limits
	}
	j, base := testJailer(t, &l)
	id, _ := j.AllocateID(nil)
	v, _ := j.VM("v2", id)
	if err := os.MkdirAll(v.Root, 0o755); err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(l.Unified, j.CgroupName("v2"))
	if host.UnifiedLimits {
		if err := v.Create(j.Config().Limits(64, 1)); err != nil {
			t.Fatal(err)
		}
	} else if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	logFile := filepath.Join(base, "v2.log")
	c := spawn(t, v, jail.Exec{Devices: []string{"/dev/null"}}, "forker", logFile)
	b, err := os.ReadFile("/proc/" + strconv.Itoa(c.Pid) + "/cgroup")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(b), "0::/"+j.CgroupName("v2")+"\n") {
		t.Errorf("/proc/%d/cgroup:\n%s\nwant 0::/%s", c.Pid, b, j.CgroupName("v2"))
	}
	if !host.UnifiedLimits {
		// Not joined to any v1 hierarchy: v1 shows the agent's own cgroups.
		for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
			if !strings.HasPrefix(line, "0::") && strings.HasSuffix(line, j.CgroupName("v2")) {
				t.Errorf("placed in a v1 hierarchy: %s", line)
			}
		}
	}
	if err := v.Verify(c.Pid); err != nil {
		t.Error(err)
	}
	pids, err := v.Cgroup().Procs()
	if err != nil || len(pids) != 3 {
		t.Errorf("Procs = %v, %v; want the forker and its two children", pids, err)
	}
	members, err := proc.Members(pids)
	if err != nil {
		t.Fatal(err)
	}
	if err := v.Destroy(bounded(t)); err != nil {
		t.Fatal(err)
	}
	<-c.Done()
	for _, m := range members {
		if proc.Alive(m.Pid, m.StartTime) {
			t.Errorf("pid %d survived", m.Pid)
		}
	}
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Errorf("%s is still there", dir)
	}
}

// TestStartLeavesTheAgentAlone: a jailed start confines an OS thread of
// the agent's on the way (its cgroups, mount namespace, root, bounding set,
// no_new_privs), which must end with the start. After many starts, some at
// once, every thread the test process still has is as it was: in the
// agent's mount namespace and root, with its bounding set and without
// no_new_privs, and none is in a VM's cgroup.
func TestStartLeavesTheAgentAlone(t *testing.T) {
	j, base := testJailer(t, nil)
	before := threadFacts(t)
	id, _ := j.AllocateID(nil)
	v, _ := j.VM("many", id)
	if err := v.Create(j.Config().Limits(64, 1)); err != nil {
		t.Fatal(err)
	}
	defer v.Destroy(bounded(t))
	var wg sync.WaitGroup
	errs := make(chan error, 16)
	for i := range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c, err := proc.Spawn(proc.SpawnConfig{Path: testBinary(t), Env: []string{"JAILTEST_CHILD=exit"},
				LogFile: filepath.Join(base, fmt.Sprintf("c%d.log", i)), Confine: v.Confine(jail.Exec{})})
			if err != nil {
				errs <- err
				return
			}
			c.Exit()
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if pids, _ := v.Cgroup().Procs(); slices.Contains(pids, os.Getpid()) {
		t.Errorf("the test process is in the VM's cgroup after the starts: %v", pids)
	}
	time.Sleep(50 * time.Millisecond) // the starting threads' ends
	for tid, facts := range threadFacts(t) {
		if facts != before["main"] {
			t.Errorf("thread %s: %s; the agent's threads: %s", tid, facts, before["main"])
		}
	}
}

// threadFacts says, for each thread of the test process, what a jailed
// start changes of the thread it runs on; "main" is the main thread's.
func threadFacts(t *testing.T) map[string]string {
	t.Helper()
	tids, err := os.ReadDir("/proc/self/task")
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]string{}
	for _, e := range tids {
		dir := "/proc/self/task/" + e.Name()
		ns, err1 := os.Readlink(dir + "/ns/mnt")
		root, err2 := os.Readlink(dir + "/root")
		status, err3 := os.ReadFile(dir + "/status")
		cgroup, err4 := os.ReadFile(dir + "/cgroup")
		if errors.Join(err1, err2, err3, err4) != nil {
			continue // the thread ended meanwhile
		}
		st := map[string]string{}
		for _, line := range strings.Split(string(status), "\n") {
			if k, val, ok := strings.Cut(line, ":"); ok {
				st[k] = strings.TrimSpace(val)
			}
		}
		if strings.Contains(string(cgroup), "vmhost-jailtest") {
			ns += " in a VM cgroup"
		}
		facts := fmt.Sprintf("mnt %s root %s CapBnd %s NoNewPrivs %s", ns, root, st["CapBnd"], st["NoNewPrivs"])
		out[e.Name()] = facts
		if e.Name() == strconv.Itoa(os.Getpid()) {
			out["main"] = facts
		}
	}
	return out
}

// TestDestroySparesTheAgent: a thread of the agent's in a VM's cgroup (one
// starting a process there) makes Destroy wait until it leaves; the agent's
// process, which the cgroup then lists, is never killed: a process is
// killed only when /proc/PID/cgroup (its main thread's, never a starting
// one) places it in the cgroup.
func TestDestroySparesTheAgent(t *testing.T) {
	j, _ := testJailer(t, nil)
	l := j.Layout()
	if l.UnifiedLimits {
		t.Skip("the agent's threads join only v1 cgroups")
	}
	id, _ := j.AllocateID(nil)
	v, _ := j.VM("spare", id)
	if err := v.Create(j.Config().Limits(64, 1)); err != nil {
		t.Fatal(err)
	}
	tasks := filepath.Join(l.V1["memory"], j.CgroupName("spare"), "tasks")
	joined, leave := make(chan error), make(chan struct{})
	go func() {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		self, err := os.ReadFile("/proc/thread-self/cgroup")
		back := l.V1["memory"]
		for _, line := range strings.Split(string(self), "\n") {
			if parts := strings.SplitN(line, ":", 3); len(parts) == 3 && parts[1] == "memory" {
				back = filepath.Join(back, parts[2])
			}
		}
		if err == nil {
			err = os.WriteFile(tasks, []byte("0"), 0)
		}
		joined <- err
		<-leave
		if err := os.WriteFile(filepath.Join(back, "tasks"), []byte("0"), 0); err != nil {
			t.Error(err)
		}
	}()
	if err := <-joined; err != nil {
		t.Fatal(err)
	}
	destroyed := make(chan error, 1)
	go func() { destroyed <- v.Destroy(bounded(t)) }()
	select {
	case err := <-destroyed:
		t.Fatalf("Destroy returned (%v) while a thread of the agent's was in the cgroup", err)
	case <-time.After(200 * time.Millisecond):
	}
	close(leave)
	if err := <-destroyed; err != nil {
		t.Fatal(err)
	}
}

// TestProgramPathsKeptAndRenewed: a start keeps what it saw of the paths
// to the program and its libraries, which the next start uses instead of
// looking again; when that is no longer so (here, a library of the
// program's is remembered as a link to a file an upgrade removed), the
// start looks again and succeeds, and keeps what it saw now.
func TestProgramPathsKeptAndRenewed(t *testing.T) {
	sleep, err := filepath.EvalSymlinks("/bin/sleep")
	if err != nil {
		t.Skip("no /bin/sleep")
	}
	files, err := jail.ExecFiles(sleep)
	if err != nil {
		t.Fatal(err)
	}
	var lib string
	for _, f := range files {
		if strings.Contains(filepath.Base(f), "libc.so") {
			lib = f
		}
	}
	if lib == "" {
		t.Skipf("sleep links no libc: %v", files)
	}
	j, base := testJailer(t, nil)
	id, _ := j.AllocateID(nil)
	v, _ := j.VM("kept", id)
	if err := v.Create(j.Config().Limits(64, 1)); err != nil {
		t.Fatal(err)
	}
	defer v.Destroy(bounded(t))
	start := func() {
		t.Helper()
		c := startJailedSleep(t, v, sleep, filepath.Join(base, "sleep.log"))
		c.Signal(syscall.SIGKILL)
		c.Exit()
	}
	start()
	real, err := filepath.EvalSymlinks(lib)
	if err != nil {
		t.Fatal(err)
	}
	if kept, link := jail.KeptProgramPath(real); !kept || link != "" {
		t.Fatalf("after a start, what is kept of %s: %t %q, want the file", real, kept, link)
	}
	jail.SetProgramPath(real, filepath.Base(real)+".gone")
	start()
	if kept, link := jail.KeptProgramPath(real); !kept || link != "" {
		t.Errorf("after the start that found it stale, what is kept of %s: %t %q, want the file", real, kept, link)
	}
}

// TestRemoveAgentCgroup: an agent's cgroup is kept while a VM's cgroup is
// in it (the VMs outlive the agent), and removed from every hierarchy once
// none is.
func TestRemoveAgentCgroup(t *testing.T) {
	j, _ := testJailer(t, nil)
	id, _ := j.AllocateID(nil)
	v, _ := j.VM("held", id)
	if err := v.Create(j.Config().Limits(64, 1)); err != nil {
		t.Fatal(err)
	}
	agentDirs := func() []string {
		var ds []string
		for _, m := range hierarchies(j.Layout()) {
			d := filepath.Join(m, path.Dir(j.CgroupName("held")))
			if _, err := os.Stat(d); err == nil {
				ds = append(ds, d)
			}
		}
		return ds
	}
	if gone, err := j.RemoveAgentCgroup(); gone || err != nil || len(agentDirs()) == 0 || !v.Cgroup().Exists() {
		t.Fatalf("with a VM's cgroup in it: gone %t, %v; the agent's cgroup in %v, the VM's there: %t", gone, err, agentDirs(), v.Cgroup().Exists())
	}
	if err := v.Destroy(bounded(t)); err != nil {
		t.Fatal(err)
	}
	if gone, err := j.RemoveAgentCgroup(); !gone || err != nil || len(agentDirs()) != 0 {
		t.Errorf("with no VM's cgroup in it: gone %t, %v; still in %v", gone, err, agentDirs())
	}
}
