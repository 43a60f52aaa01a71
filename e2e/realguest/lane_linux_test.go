// Package realguest is the end-to-end lane with real guests: the real
// `vmhost serve`, configured as on a host, drives Debian and busybox guests
// booted in qemu (the Cloud Hypervisor stand-in `vmhost sim-ch --sim-backend
// qemu`, real qemu-storage-daemon, vhost-device-vsock), on a bridge in a
// network namespace of the test with a dnsmasq serving DHCP. prepare.sh
// builds the artifacts; without them or without root the lane skips, unless
// VMHOST_REAL_GUESTS=1 (CI), where a missing piece fails it.
package realguest

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"vmhost/disk"
	"vmhost/jail"
)

// The lane's network: the bridge and the dnsmasq live in the test's
// namespace, with the host side at hostIP.
const (
	bridge     = "vhl0"
	hostIP     = "10.77.0.1"
	staticIP   = "10.77.0.10"
	dhcpFirst  = "10.77.0.100"
	dhcpLast   = "10.77.0.150"
	ovmf       = "/usr/share/ovmf/OVMF.fd"
	laneSecret = "lane-s3cret-value-71"
)

// artifacts are what prepare.sh left in the cache.
type artifacts struct {
	image       string // classic guest qcow2
	cloudKernel string // Debian cloud kernel (AppVM kernel)
	modules     string // its lib/modules/<version>
	vsock       string // vhost-device-vsock binary
	cache       string // the cache directory holding them
}

// need skips the lane with reason, or fails it when VMHOST_REAL_GUESTS=1.
func need(t *testing.T, ok bool, reason string) {
	t.Helper()
	if ok {
		return
	}
	if os.Getenv("VMHOST_REAL_GUESTS") == "1" {
		t.Fatalf("real-guest lane required (VMHOST_REAL_GUESTS=1) but %s", reason)
	}
	t.Skipf("real-guest lane skipped: %s; run e2e/realguest/run.sh as root", reason)
}

func findArtifacts(t *testing.T) artifacts {
	t.Helper()
	if os.Getenv("VMHOST_REAL_GUESTS") == "0" {
		t.Skip("real-guest lane disabled by VMHOST_REAL_GUESTS=0")
	}
	need(t, os.Geteuid() == 0, "needs root (network namespace, taps, qemu)")
	cache := os.Getenv("VMHOST_LANE_CACHE")
	if cache == "" {
		cache = "/var/cache/vmhost-lane"
	}
	cur := filepath.Join(cache, "current")
	a := artifacts{
		image:       filepath.Join(cur, "debian.qcow2"),
		cloudKernel: filepath.Join(cur, "cloud-kernel", "vmlinuz"),
		vsock:       filepath.Join(cache, "vhost-device-vsock", "usr", "bin", "vhost-device-vsock"),
		cache:       cache,
	}
	mods, _ := filepath.Glob(filepath.Join(cur, "cloud-kernel", "lib", "modules", "*"))
	need(t, len(mods) == 1, "no cloud kernel modules in "+cur+"/cloud-kernel (run e2e/realguest/prepare.sh)")
	a.modules = mods[0]
	for _, f := range []string{a.image, a.cloudKernel, a.vsock, ovmf} {
		_, err := os.Stat(f)
		need(t, err == nil, fmt.Sprintf("%s is missing (run e2e/realguest/prepare.sh)", f))
	}
	for _, p := range []string{"qemu-system-x86_64", "qemu-storage-daemon", "dnsmasq", "ssh", "ssh-keygen", "ip"} {
		_, err := exec.LookPath(p)
		need(t, err == nil, p+" is not installed (run e2e/realguest/prepare.sh)")
	}
	return a
}

// phase logs how long a step of the lane took.
func phase(t *testing.T, name string, start time.Time) {
	t.Logf("lane phase %-28s %6.1f s", name, time.Since(start).Seconds())
}

// lane is the running environment: namespace, dnsmasq, vmhost serve.
type lane struct {
	t        *testing.T
	dir      string
	ns       string
	bin      string
	stateDir string
	runDir   string
	sock     string
	token    string
	sshKey   string
	sshPub   string
	leases   string
	serve    *exec.Cmd
	serveLog *bytes.Buffer
	hc       *http.Client
	vsock    string // vhost-device-vsock, which the simulator's qemu backend runs
}

func TestRealGuests(t *testing.T) {
	a := findArtifacts(t)
	total := time.Now()
	l := setUp(t, a)

	start := time.Now()
	importImage(l)
	phase(t, "image import", start)

	// The four guests boot concurrently (run.sh passes -parallel 4; the
	// default is GOMAXPROCS): each waits mostly on its own guest (TCG), so
	// together they take little more than the slowest.
	t.Run("guests", func(t *testing.T) {
		t.Run("classic-static", func(t *testing.T) { t.Parallel(); classicStatic(l.with(t), a) })
		t.Run("classic-dhcp", func(t *testing.T) { t.Parallel(); classicDHCP(l.with(t), a) })
		t.Run("appvm", func(t *testing.T) { t.Parallel(); appVM(l.with(t), a) })
		t.Run("appvm-ops", func(t *testing.T) { t.Parallel(); appVMOps(l.with(t), a) })
		t.Run("appvm-logs", func(t *testing.T) { t.Parallel(); appVMLogs(l.with(t), a) })
	})
	// Alone, since it restarts the agent (appvm_root_disk): guest IO
	// through an overlay root disk beside a copied one.
	t.Run("appvm-io", func(t *testing.T) { appVMIO(l.with(t), l) })
	phase(t, "lane test total", total)
}

// with is l for a subtest: helpers fail t.
func (l *lane) with(t *testing.T) *lane {
	c := *l
	c.t = t
	return &c
}

// setUp builds vmhost, makes the namespace with its bridge and dnsmasq,
// writes the config and a key, and starts vmhost serve in the namespace.
func setUp(t *testing.T, a artifacts) *lane {
	start := time.Now()
	dir, err := os.MkdirTemp("/tmp", "vhl")
	if err != nil {
		t.Fatal(err)
	}
	l := &lane{t: t, dir: dir, ns: fmt.Sprintf("vhl%d", os.Getpid()), bin: dir + "/vmhost",
		stateDir: dir + "/state", runDir: dir + "/run", sock: dir + "/api.sock", leases: dir + "/dnsmasq.leases",
		serveLog: new(bytes.Buffer), vsock: a.vsock}
	t.Cleanup(l.tearDown)

	// The initramfs's /init is this binary: it must be static.
	build := exec.Command("go", "build", "-o", l.bin, "vmhost")
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("building vmhost: %v\n%s", err, out)
	}
	phase(t, "build vmhost", start)

	start = time.Now()
	run(t, "ip", "netns", "add", l.ns)
	l.inNS(t, "ip", "link", "set", "lo", "up")
	l.inNS(t, "ip", "link", "add", bridge, "type", "bridge")
	l.inNS(t, "ip", "addr", "add", hostIP+"/24", "dev", bridge)
	l.inNS(t, "ip", "link", "set", bridge, "up")
	dnsmasq := exec.Command("ip", "netns", "exec", l.ns, "dnsmasq", "--keep-in-foreground", "--port=0",
		"--interface="+bridge, "--bind-interfaces", "--dhcp-range="+dhcpFirst+","+dhcpLast+",255.255.255.0,1h",
		"--dhcp-option=option:router,"+hostIP, "--dhcp-leasefile="+l.leases, "--pid-file="+dir+"/dnsmasq.pid", "--user=root", "--log-dhcp",
		"--conf-file=/dev/null")
	dnsmasq.Stderr = os.Stderr
	if err := dnsmasq.Start(); err != nil {
		t.Fatalf("starting dnsmasq: %v", err)
	}
	t.Cleanup(func() { dnsmasq.Process.Kill(); dnsmasq.Wait() })

	l.sshKey = dir + "/id_ed25519"
	run(t, "ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "lane", "-f", l.sshKey)
	pub, err := os.ReadFile(l.sshKey + ".pub")
	if err != nil {
		t.Fatal(err)
	}
	l.sshPub = strings.TrimSpace(string(pub))

	qsd, _ := exec.LookPath("qemu-storage-daemon")
	cfg := map[string]any{
		"networks":        []any{map[string]any{"id": "lane", "bridge": bridge}},
		"default_network": "lane",
		"appvm_kernel":    a.cloudKernel,
		"appvm_modules":   a.modules,
		// no_timer_check: under TCG on a loaded host the IO-APIC timer
		// check can miss its ticks and panic the kernel (seen here).
		"appvm_cmdline":     "console=ttyS0 quiet panic=-1 no_timer_check",
		"boot_timeout_secs": 300,
		// The guest image lives in the lane's cache, OVMF in Debian's ovmf.
		"host_path_roots": []string{a.cache, filepath.Dir(ovmf)},
		"binaries":        map[string]any{"qemu_storage_daemon": qsd},
		// The VMs run confined (the agent is root). qemu under TCG, which
		// stands in for Cloud Hypervisor here, keeps a translation cache
		// of its own that CH has not: more room beside guest memory.
		"jail": map[string]any{"memory_overhead_mb": 1024},
	}
	b, _ := json.MarshalIndent(cfg, "", "  ")
	if err := os.WriteFile(dir+"/config.json", b, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(l.stateDir, 0o700); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(l.bin, "key", "add", "--state-dir", l.stateDir, "--name", "lane", "--scope", "readwrite").Output()
	if err != nil {
		t.Fatalf("vmhost key add: %v", err)
	}
	l.token = strings.TrimSpace(string(out))

	l.hc = &http.Client{Timeout: 60 * time.Second, Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", l.sock)
		}}}
	l.startServe()
	phase(t, "namespace, dnsmasq, serve", start)
	return l
}

// startServe starts vmhost serve in the namespace and waits until it
// answers.
func (l *lane) startServe() {
	// Cloud Hypervisor is the simulator with its qemu backend: the agent
	// runs it, confined, as it runs CH (--simulate ch), and gives its jail
	// what the backend runs (qemu, vhost-device-vsock). The agent enters
	// the namespace's network only: `ip netns exec` would also mount a
	// sysfs of the namespace over /sys, hiding the cgroup hierarchies
	// under /sys/fs/cgroup that confinement needs.
	l.serve = exec.Command("nsenter", "--net=/run/netns/"+l.ns, l.bin, "serve", "--listen", "unix:"+l.sock,
		"--state-dir", l.stateDir, "--run-dir", l.runDir, "--config", l.dir+"/config.json",
		"--simulate", "ch", "--sim-ch-args", "--sim-backend qemu --sim-vsock-backend "+l.vsock)
	l.serve.Stdout, l.serve.Stderr = l.serveLog, l.serveLog
	l.serve.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := l.serve.Start(); err != nil {
		l.t.Fatal(err)
	}
	l.poll("vmhost serve answers", 30*time.Second, func() bool {
		st, _ := l.do("GET", "/api/networks", "")
		return st == http.StatusOK
	})
}

// restartServe stops vmhost serve (its VMs run on), sets config key to
// value and starts it again.
func (l *lane) restartServe(key string, value any) {
	l.t.Helper()
	syscall.Kill(-l.serve.Process.Pid, syscall.SIGTERM)
	l.serve.Wait()
	var cfg map[string]any
	b, err := os.ReadFile(l.dir + "/config.json")
	if err == nil {
		err = json.Unmarshal(b, &cfg)
	}
	if err != nil {
		l.t.Fatal(err)
	}
	cfg[key] = value
	b, _ = json.MarshalIndent(cfg, "", "  ")
	if err := os.WriteFile(l.dir+"/config.json", b, 0o600); err != nil {
		l.t.Fatal(err)
	}
	l.startServe()
}

// tearDown stops serve, kills what it left (VMs outlive the agent by
// design), removes the namespace and the directory. On failure it shows
// serve's output and the VMs' logs.
func (l *lane) tearDown() {
	if l.serve != nil && l.serve.Process != nil {
		syscall.Kill(-l.serve.Process.Pid, syscall.SIGTERM)
		done := make(chan struct{})
		go func() { l.serve.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(15 * time.Second):
			syscall.Kill(-l.serve.Process.Pid, syscall.SIGKILL)
			<-done
		}
	}
	for _, pid := range pidsMentioning(l.dir + "/") {
		syscall.Kill(pid, syscall.SIGKILL)
	}
	l.removeCgroups()
	if l.t.Failed() {
		l.t.Logf("vmhost serve output (tail):\n%s", tail(l.serveLog.Bytes(), 8000))
		logs, _ := filepath.Glob(l.runDir + "/vms/*/*.log*")
		more, _ := filepath.Glob(l.stateDir + "/vms/*/*.log*")
		for _, f := range append(logs, more...) {
			if b, err := os.ReadFile(f); err == nil && len(b) > 0 {
				l.t.Logf("%s (tail):\n%s", f, tail(b, 6000))
			}
		}
	}
	exec.Command("ip", "netns", "del", l.ns).Run()
	disk.RemoveAll(l.dir) // the catalog's builds are sealed (immutable, as root)
}

func tail(b []byte, n int) []byte {
	if len(b) > n {
		return b[len(b)-n:]
	}
	return b
}

func run(t *testing.T, name string, args ...string) string {
	t.Helper()
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
	return string(out)
}

func (l *lane) inNS(t *testing.T, args ...string) string {
	t.Helper()
	return run(t, "ip", append([]string{"netns", "exec", l.ns}, args...)...)
}

// do sends one API request with the lane's key.
func (l *lane) do(method, path, body string) (int, []byte) {
	var r io.Reader
	if body != "" {
		r = strings.NewReader(body)
	}
	req, err := http.NewRequest(method, "http://vmhost"+path, r)
	if err != nil {
		l.t.Fatal(err)
	}
	req.Header.Set("Authorization", "Bearer "+l.token)
	req.Header.Set("Content-Type", "application/json")
	resp, err := l.hc.Do(req)
	if err != nil {
		return 0, []byte(err.Error())
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, b
}

// must sends a request and fails unless the status is want.
func (l *lane) must(method, path, body string, want int) []byte {
	l.t.Helper()
	st, b := l.do(method, path, body)
	if st != want {
		l.t.Fatalf("%s %s = %d %s, want %d", method, path, st, b, want)
	}
	return b
}

// poll checks cond every 250 ms until it holds or timeout passes.
func (l *lane) poll(what string, timeout time.Duration, cond func() bool) {
	l.t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			l.t.Fatalf("%s: not within %v", what, timeout)
		}
		time.Sleep(250 * time.Millisecond)
	}
}

// vmView is the part of a VM view (classic or AppVM) the lane reads.
type vmView struct {
	ID          string `json:"id"`
	PID         int    `json:"pid"`
	State       string `json:"state"`
	Confinement *struct {
		UID    uint32 `json:"uid"`
		Cgroup string `json:"cgroup"`
	} `json:"confinement"`
	DisplayState   string `json:"display_state"`
	DiscoveredIPv4 string `json:"discovered_ipv4"`
	BalloonMB      uint64 `json:"balloon_mb"`
	FailureReason  *struct {
		Summary string `json:"summary"`
		Cause   string `json:"cause"`
	} `json:"failure_reason"`
	Nets []struct {
		TapName         string `json:"tap_name"`
		MAC             string `json:"mac"`
		DHCPSnoopedIPv4 string `json:"dhcp_snooped_ipv4"`
	} `json:"nets"`
	AppVM *struct {
		WorkloadExitCode *int   `json:"workload_exit_code"`
		RestartCount     uint32 `json:"restart_count"`
		HeartbeatStale   bool   `json:"heartbeat_stale"`
	} `json:"appvm"`
	Disk *struct {
		Mode     string `json:"mode"`
		BasePath string `json:"base_path"`
	} `json:"disk"`
}

// view reads a VM of family prefix ("/api/vms" or "/api/appvm/vms").
func (l *lane) view(prefix, id string) (vmView, int) {
	st, b := l.do("GET", prefix+"/"+id, "")
	var v vmView
	if st == http.StatusOK {
		if err := json.Unmarshal(b, &v); err != nil {
			l.t.Fatalf("decoding %s: %v", b, err)
		}
	}
	return v, st
}

// waitView polls a view until cond holds; a VM that fails ends the wait.
func (l *lane) waitView(prefix, id, what string, timeout time.Duration, cond func(vmView) bool) vmView {
	l.t.Helper()
	var v vmView
	l.poll(id+": "+what, timeout, func() bool {
		v, _ = l.view(prefix, id)
		if v.State == "failed" && !cond(v) {
			l.t.Fatalf("%s: failed while waiting for %s: %+v", id, what, v.FailureReason)
		}
		return cond(v)
	})
	return v
}

// ssh runs a command in a guest from the namespace, with the lane's key.
func (l *lane) ssh(user, ip, command string) (string, error) {
	return l.sshIn(user, ip, command, "")
}

// waitSSH waits until the guest answers over SSH with the key.
func (l *lane) waitSSH(user, ip string, timeout time.Duration) {
	l.t.Helper()
	l.poll("ssh "+user+"@"+ip, timeout, func() bool {
		_, err := l.sshOnce(user, ip, "true", "")
		return err == nil
	})
}

// pidsMentioning lists live processes whose command line contains s.
func pidsMentioning(s string) []int {
	var pids []int
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		var pid int
		if _, err := fmt.Sscanf(e.Name(), "%d", &pid); err != nil || pid == os.Getpid() {
			continue
		}
		cmd, err := os.ReadFile("/proc/" + e.Name() + "/cmdline")
		if err != nil || !bytes.Contains(cmd, []byte(s)) {
			continue
		}
		if st, err := os.ReadFile("/proc/" + e.Name() + "/stat"); err == nil {
			if f := strings.Fields(string(st[bytes.LastIndexByte(st, ')')+1:])); len(f) > 0 && f[0] == "Z" {
				continue
			}
		}
		pids = append(pids, pid)
	}
	return pids
}

// vmProcesses lists the processes of VM id: qemu, qemu-storage-daemon and
// vhost-device-vsock all name a socket in its run directory.
func (l *lane) vmProcesses(id string) []string {
	var out []string
	for _, pid := range pidsMentioning(l.runDir + "/vms/" + id + "/") {
		cmd, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
		out = append(out, fmt.Sprintf("%d %s", pid, bytes.ReplaceAll(cmd, []byte{0}, []byte{' '})))
	}
	return out
}

// stopVM stops a running VM and checks that none of its processes remain.
func (l *lane) stopVM(prefix, id string) {
	l.t.Helper()
	l.must("POST", prefix+"/"+id+"/stop", "", http.StatusNoContent)
	l.waitView(prefix, id, "stopped", 60*time.Second, func(v vmView) bool { return v.State == "stopped" })
	l.poll(id+": no process left after stop", 10*time.Second, func() bool { return len(l.vmProcesses(id)) == 0 })
}

// deleteVM deletes a VM and checks that nothing of it is left: record,
// processes, taps, run directory, state files.
func (l *lane) deleteVM(prefix, id string) {
	l.t.Helper()
	v, _ := l.view(prefix, id)
	l.must("DELETE", prefix+"/"+id+"?force=true", "", http.StatusNoContent)
	if _, st := l.view(prefix, id); st != http.StatusNotFound {
		l.t.Errorf("%s: read after delete = %d, want 404", id, st)
	}
	l.poll(id+": no process left after delete", 10*time.Second, func() bool { return len(l.vmProcesses(id)) == 0 })
	for _, n := range v.Nets {
		if err := exec.Command("ip", "-n", l.ns, "link", "show", n.TapName).Run(); err == nil {
			l.t.Errorf("%s: tap %s still exists after delete", id, n.TapName)
		}
	}
	for _, p := range []string{l.runDir + "/vms/" + id, l.stateDir + "/vms/" + id, l.stateDir + "/vms/" + id + ".json", l.runDir + "/jail/" + id} {
		if _, err := os.Stat(p); err == nil {
			l.t.Errorf("%s: %s still exists after delete", id, p)
		}
	}
	if v.Confinement != nil {
		if cg, err := jail.DetectLayout(); err == nil {
			if d := cgroupDir(cg, v.Confinement.Cgroup); d != "" {
				if _, err := os.Stat(d); err == nil {
					l.t.Errorf("%s: its cgroup %s still exists after delete", id, d)
				}
			}
		}
	}
}

// removeCgroups removes the cgroups of the lane's agent (VMs outlive the
// agent, so those of VMs a failed lane did not delete are left), once
// their processes are gone.
func (l *lane) removeCgroups() {
	b, err := os.ReadFile(l.stateDir + "/agent_id")
	if err != nil {
		return
	}
	agent := strings.TrimSpace(string(b))
	j, err := jail.New(jail.DefaultConfig(), jail.Host{RunDir: l.runDir, AgentID: agent})
	if err != nil || !j.Enabled() {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	ids, _ := j.Leftovers()
	for _, id := range ids {
		if err := j.Destroy(ctx, id); err != nil {
			l.t.Logf("removing the cgroup of VM %s: %v", id, err)
		}
	}
	j.Layout().Cgroup(jail.DefaultConfig().CgroupParent + "/" + agent).Remove(ctx)
}

// cgroupDir is the directory of cgroup name where its memory limit is.
func cgroupDir(l jail.Layout, name string) string {
	if l.UnifiedLimits {
		return filepath.Join(l.Unified, name)
	}
	if l.V1["memory"] == "" {
		return ""
	}
	return filepath.Join(l.V1["memory"], name)
}

// checkConfined checks that every process of the running VM id (its Cloud
// Hypervisor stand-in, the qemu and vhost-device-vsock it runs, and the
// real qemu-storage-daemon) runs as the VM's uid, without capabilities,
// with no_new_privs, in the VM's cgroup.
func (l *lane) checkConfined(prefix, id string) {
	l.t.Helper()
	v, _ := l.view(prefix, id)
	if v.Confinement == nil {
		l.t.Errorf("%s: no confinement in its view: the agent runs as root, its VMs must be confined", id)
		return
	}
	uid := fmt.Sprint(v.Confinement.UID)
	procs := pidsMentioning(l.runDir + "/vms/" + id + "/")
	if len(procs) < 3 {
		l.t.Errorf("%s: processes %v, want CH, qemu and QSD at least", id, l.vmProcesses(id))
	}
	for _, pid := range procs {
		status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
		if err != nil {
			continue
		}
		cg, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
		st := map[string]string{}
		for _, line := range strings.Split(string(status), "\n") {
			if k, val, ok := strings.Cut(line, ":"); ok {
				st[k] = strings.TrimSpace(val)
			}
		}
		ok := strings.Fields(st["Uid"])[0] == uid && strings.Fields(st["Gid"])[0] == uid && st["CapEff"] == "0000000000000000" &&
			st["CapPrm"] == "0000000000000000" && st["CapBnd"] == "0000000000000000" && st["NoNewPrivs"] == "1" &&
			strings.Contains(string(cg), ":/"+v.Confinement.Cgroup+"\n")
		if !ok {
			cmd, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
			l.t.Errorf("%s: process %d (%s) is not confined as uid %s in %s: Uid %q CapEff %q CapBnd %q NoNewPrivs %q, cgroups:\n%s",
				id, pid, bytes.ReplaceAll(cmd, []byte{0}, []byte{' '}), uid, v.Confinement.Cgroup, st["Uid"], st["CapEff"], st["CapBnd"], st["NoNewPrivs"], cg)
		}
	}
}

func randomHex(n int) string {
	b := make([]byte, n)
	rand.Read(b)
	return hex.EncodeToString(b)
}
