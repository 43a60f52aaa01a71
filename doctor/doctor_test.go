package doctor

import (
	"bytes"
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"vmhost/config"
	"vmhost/kmod/kmodtest"
)

// tool finds a program a test needs: skip without it, except in CI, which
// installs it (.ci/run) and must not pass by skipping.
func tool(t *testing.T, name, pkg string) string {
	t.Helper()
	p, err := exec.LookPath(name)
	if err != nil {
		if os.Getenv("CI") != "" {
			t.Fatalf("%s not installed (apt-get install %s), and CI is set", name, pkg)
		}
		t.Skipf("%s not installed (apt-get install %s)", name, pkg)
	}
	return p
}

func wantCheck(t *testing.T, c Check, status Status, detail ...string) {
	t.Helper()
	if c.Status != status {
		t.Errorf("%s: status %s, want %s (%s; fix: %s)", c.Name, c.Status, status, c.Detail, c.Fix)
	}
	for _, d := range detail {
		if !strings.Contains(c.Detail, d) {
			t.Errorf("%s: detail %q does not say %q", c.Name, c.Detail, d)
		}
	}
	if (status == OK) != (c.Fix == "") {
		t.Errorf("%s: status %s with fix %q: a check that is not ok says how to fix it, and only then", c.Name, c.Status, c.Fix)
	}
}

// TestPrograms: a program in PATH is found and its --version shown; a
// missing one, or one that fails --version, fails with a fix naming the
// config key; a simulated one is not looked for.
func TestPrograms(t *testing.T) {
	qsd := tool(t, "qemu-storage-daemon", "qemu-system-common")
	c := checkProgram(context.Background(), "qemu-storage-daemon", "binaries.qemu_storage_daemon", "qemu-storage-daemon", false, "install it")
	wantCheck(t, c, OK, qsd+": qemu-storage-daemon version ")

	c = checkProgram(context.Background(), "cloud-hypervisor", "binaries.cloud_hypervisor", "no-such-cloud-hypervisor", false, "install it")
	wantCheck(t, c, Fail, `binaries.cloud_hypervisor = "no-such-cloud-hypervisor"`, "not in PATH")
	c = checkProgram(context.Background(), "cloud-hypervisor", "binaries.cloud_hypervisor", "/nonexistent/cloud-hypervisor", false, "install it")
	wantCheck(t, c, Fail, "not an executable file")
	c = checkProgram(context.Background(), "cloud-hypervisor", "binaries.cloud_hypervisor", "false", false, "install it")
	wantCheck(t, c, Fail, "does not answer --version")
	if !strings.Contains(c.Fix, "binaries.cloud_hypervisor") {
		t.Errorf("fix %q does not name the config key", c.Fix)
	}
	wantCheck(t, checkProgram(context.Background(), "cloud-hypervisor", "k", "absent", true, "x"), OK, "simulated")
}

// TestNftablesNeedsTheSpoofGuard: when nf_tables does not answer, a
// network with spoof_guard makes it a failure, else a warning.
func TestNftablesNeedsTheSpoofGuard(t *testing.T) {
	if nftablesUsable() == nil {
		t.Skip("nf_tables answers here; the failing side is shown without CAP_NET_ADMIN (run as another user)")
	}
	cfg := config.Default()
	wantCheck(t, checkNftables(cfg), Warn, "spoof_guard fail")
	cfg.Networks[0].SpoofGuard = true
	wantCheck(t, checkNftables(cfg), Fail, "network default has spoof_guard")
}

// moduleTree writes an extracted kernel package: boot/vmlinuz-<release>
// and lib/modules/<release> with the modules given (name → depends) built
// for vermagicRelease, and modules.builtin listing builtin.
func moduleTree(t *testing.T, release, vermagicRelease string, mods map[string]string, builtin ...string) string {
	t.Helper()
	root := t.TempDir()
	os.MkdirAll(filepath.Join(root, "boot"), 0o755)
	os.WriteFile(filepath.Join(root, "boot", "vmlinuz-"+release), kmodtest.BzImage(release+" (debian-kernel@lists.debian.org) #1 SMP"), 0o644)
	dir := filepath.Join(root, "lib/modules", release)
	os.MkdirAll(filepath.Join(dir, "kernel"), 0o755)
	for name, deps := range mods {
		os.WriteFile(filepath.Join(dir, "kernel", name+".ko"), kmodtest.Module("name="+name, "depends="+deps, "vermagic="+vermagicRelease+" SMP mod_unload"), 0o644)
	}
	var b strings.Builder
	for _, m := range builtin {
		b.WriteString("kernel/" + m + ".ko\n")
	}
	os.WriteFile(filepath.Join(dir, "modules.builtin"), []byte(b.String()), 0o644)
	return root
}

// TestAppVMKernel: without appvm_kernel AppVMs cannot boot (a warning:
// classic VMs can); a kernel with a module tree passes when the modules
// resolve for its release, and fails naming a missing module or one built
// for another kernel; a kernel alone is judged by its config file.
func TestAppVMKernel(t *testing.T) {
	required := []string{"virtio_blk", "ext4"}
	cfg := config.Default()
	got := checkAppVMKernel(cfg, required, nil)
	if len(got) != 1 {
		t.Fatalf("checks = %+v", got)
	}
	wantCheck(t, got[0], Warn, "appvm_kernel is not set")

	tree := moduleTree(t, "6.1.0-9-cloud-amd64", "6.1.0-9-cloud-amd64", map[string]string{"virtio_blk": "virtio", "virtio": ""}, "ext4")
	cfg.AppVMKernel = filepath.Join(tree, "boot/vmlinuz-6.1.0-9-cloud-amd64")
	cfg.AppVMModules = tree
	got = checkAppVMKernel(cfg, required, []string{"evdev"})
	wantCheck(t, got[0], OK, "Linux 6.1.0-9-cloud-amd64")
	wantCheck(t, got[1], OK, "2 modules for Linux 6.1.0-9-cloud-amd64", "built in: ext4")

	got = checkAppVMKernel(cfg, []string{"virtio_blk", "vsock"}, nil)
	wantCheck(t, got[1], Fail, "module vsock is not in")

	other := moduleTree(t, "6.1.0-9-cloud-amd64", "6.1.0-8-cloud-amd64", map[string]string{"virtio_blk": "", "ext4": ""})
	cfg.AppVMModules = other
	wantCheck(t, checkAppVMKernel(cfg, required, nil)[1], Fail, "6.1.0-8-cloud-amd64")

	cfg.AppVMKernel = filepath.Join(t.TempDir(), "vmlinuz")
	wantCheck(t, checkAppVMKernel(cfg, required, nil)[0], Fail, "appvm_kernel: ")

	// No appvm_modules: the kernel's config beside it decides.
	cfg.AppVMModules = ""
	cfg.AppVMKernel = filepath.Join(tree, "boot/vmlinuz-6.1.0-9-cloud-amd64")
	got = checkAppVMKernel(cfg, required, nil)
	wantCheck(t, got[1], Warn, "no "+filepath.Join(tree, "boot/config-6.1.0-9-cloud-amd64"))
	conf := filepath.Join(tree, "boot/config-6.1.0-9-cloud-amd64")
	os.WriteFile(conf, []byte("CONFIG_VIRTIO_BLK=m\nCONFIG_EXT4_FS=y\n"), 0o644)
	wantCheck(t, checkAppVMKernel(cfg, required, nil)[1], Fail, "virtio_blk (CONFIG_VIRTIO_BLK=m)")
	os.WriteFile(conf, []byte("# comment\nCONFIG_VIRTIO_BLK=y\nCONFIG_EXT4_FS=y\n"), 0o644)
	wantCheck(t, checkAppVMKernel(cfg, required, nil)[1], OK, "built into the kernel")
}

// TestAppVMKernelRealTree runs the check on Debian's cloud kernel as the
// real-guest lane extracts it (VMHOST_TEST_KERNEL_TREE): with its modules
// it passes; alone, its own config file shows virtio built as modules.
func TestAppVMKernelRealTree(t *testing.T) {
	tree := os.Getenv("VMHOST_TEST_KERNEL_TREE")
	if tree == "" {
		t.Skip("VMHOST_TEST_KERNEL_TREE is not set (CI points it at /var/cache/vmhost-lane/linux-image-cloud)")
	}
	kernels, _ := filepath.Glob(filepath.Join(tree, "boot/vmlinuz-*"))
	if len(kernels) != 1 {
		t.Fatalf("want one boot/vmlinuz-* in %s, found %q", tree, kernels)
	}
	required := []string{"virtio_pci", "virtio_blk", "virtio_net", "ext4", "vsock", "vmw_vsock_virtio_transport"}
	cfg := config.Default()
	cfg.AppVMKernel, cfg.AppVMModules = kernels[0], tree
	got := checkAppVMKernel(cfg, required, []string{"crc32c_generic", "button", "evdev"})
	wantCheck(t, got[0], OK, "Linux 6.")
	wantCheck(t, got[1], OK, "modules for Linux 6.")
	cfg.AppVMModules = ""
	wantCheck(t, checkAppVMKernel(cfg, required, nil)[1], Fail, "virtio_blk (CONFIG_VIRTIO_BLK=m)")
}

// TestCgroups reads mount tables: this host's own, and v1 and v2 tables as
// hosts have them, the v2 controllers from a cgroup.controllers file.
func TestCgroups(t *testing.T) {
	j := DefaultJail()
	host := checkCgroups("/proc/self/mountinfo", j)
	t.Logf("this host: %+v", host)

	dir := t.TempDir()
	write := func(name, content string) string {
		p := filepath.Join(dir, name)
		os.WriteFile(p, []byte(content), 0o644)
		return p
	}
	v2root := filepath.Join(dir, "v2")
	os.MkdirAll(v2root, 0o755)
	os.WriteFile(filepath.Join(v2root, "cgroup.controllers"), []byte("cpuset cpu io memory hugetlb pids rdma misc\n"), 0o644)
	v2 := write("mountinfo-v2", "24 1 0:21 / "+v2root+" rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate,memory_recursiveprot\n")
	wantCheck(t, checkCgroups(v2, j), OK, "cgroup v2 at "+v2root+" with memory, pids, cpu")

	v2ro := write("mountinfo-v2ro", "24 1 0:21 / "+v2root+" ro,nosuid - cgroup2 cgroup2 ro\n")
	wantCheck(t, checkCgroups(v2ro, j), Fail, "read-only")

	// systemd's hybrid layout: v1 controllers, a controller-less v2.
	bare := filepath.Join(dir, "unified")
	os.MkdirAll(bare, 0o755)
	os.WriteFile(filepath.Join(bare, "cgroup.controllers"), []byte("\n"), 0o644)
	hybrid := write("mountinfo-hybrid", ""+
		"30 25 0:26 / "+bare+" rw,nosuid - cgroup2 cgroup2 rw\n"+
		"31 25 0:27 / /sys/fs/cgroup/memory rw,nosuid shared:9 - cgroup cgroup rw,memory\n"+
		"32 25 0:28 / /sys/fs/cgroup/pids rw,nosuid shared:10 - cgroup cgroup rw,pids\n"+
		"33 25 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid shared:11 - cgroup cgroup rw,cpu,cpuacct\n")
	wantCheck(t, checkCgroups(hybrid, j), OK, "cgroup v1: memory at /sys/fs/cgroup/memory, pids at /sys/fs/cgroup/pids, cpu at /sys/fs/cgroup/cpu,cpuacct, cpuacct at /sys/fs/cgroup/cpu,cpuacct")

	nopids := write("mountinfo-nopids", "31 25 0:27 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"+
		"33 25 0:29 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu,cpuacct\n")
	wantCheck(t, checkCgroups(nopids, j), Fail, "no v1 hierarchy for pids")
	j.Enabled = false
	wantCheck(t, checkCgroups(nopids, j), Warn, "no v1 hierarchy for pids")
}

// TestJailIDs: accounts, groups and subordinate id ranges inside the
// jail's range fail the check, naming each; ones outside it do not.
func TestJailIDs(t *testing.T) {
	etc := t.TempDir()
	write := func(name, content string) { os.WriteFile(filepath.Join(etc, name), []byte(content), 0o644) }
	write("passwd", "root:x:0:0:root:/root:/bin/bash\nalice:x:1000:1000::/home/alice:/bin/bash\n")
	write("group", "root:x:0:\nalice:x:1000:\n")
	write("subuid", "alice:100000:65536\n")
	j := DefaultJail()
	wantCheck(t, checkJailIDs(etc, j), OK, "1000000..1999999")

	write("passwd", "root:x:0:0:root:/root:/bin/bash\nsvc:x:1500000:1000::/:/usr/sbin/nologin\n")
	write("group", "root:x:0:\n# a comment\nsvcgrp:x:1999999:\n")
	write("subgid", "bob:1999000:65536\n")
	c := checkJailIDs(etc, j)
	wantCheck(t, c, Fail, "user svc (1500000) in passwd", "group svcgrp (1999999) in group", "bob's range 1999000..2064535 in subgid")
	if strings.Contains(c.Detail, "alice") {
		t.Errorf("detail %q names an id outside the range", c.Detail)
	}
	j.IDRange = [2]uint32{0, 10}
	wantCheck(t, checkJailIDs(etc, j), Fail, "includes root")
	// The host's own files.
	t.Logf("this host: %+v", checkJailIDs("/etc", DefaultJail()))
}

// TestRunAndPrint runs every check on this host with a configuration whose
// network's bridge does not exist: one line per check, the failure with
// its fix, and Failed true.
func TestRunAndPrint(t *testing.T) {
	cfg := config.Default()
	cfg.Networks = []config.Network{{ID: "lan", Bridge: "br-absent-doc"}}
	cfg.DefaultNetwork = "lan"
	checks := Run(context.Background(), Host{Config: cfg, StateDir: t.TempDir(), Jail: DefaultJail(), Euid: -1,
		SimulateCH: true, SimulateQSD: true, AppVMModules: []string{"virtio_blk"}})
	var names []string
	for _, c := range checks {
		names = append(names, c.Name)
	}
	want := "root kvm cloud-hypervisor qemu-storage-daemon mkfs.ext4 tun network lan nftables appvm kernel cgroups jail ids state dir"
	if strings.Join(names, " ") != want {
		t.Errorf("checks %q, want %q", strings.Join(names, " "), want)
	}
	if !Failed(checks) {
		t.Error("Failed = false with a missing bridge")
	}
	var b bytes.Buffer
	Print(&b, checks)
	lines := strings.Split(strings.TrimSuffix(b.String(), "\n"), "\n")
	if len(lines) != len(checks) {
		t.Fatalf("%d lines for %d checks:\n%s", len(lines), len(checks), b.String())
	}
	for i, l := range lines {
		if !strings.HasPrefix(l, string(checks[i].Status)+" ") || !strings.Contains(l, checks[i].Detail) {
			t.Errorf("line %q does not show %+v", l, checks[i])
		}
	}
	if !strings.Contains(b.String(), "FAIL  network lan") || !strings.Contains(b.String(), "fix: ip link add br-absent-doc type bridge") {
		t.Errorf("output:\n%s", b.String())
	}
	if Failed([]Check{{Status: OK}, {Status: Warn}}) {
		t.Error("Failed = true with warnings only")
	}
}

// TestJailCheck: the jail check fails when a jailed process is not
// confined (the self-test, or a running VM's process), warns when VMs run
// unconfined or some were booted before they were, and is left out
// without a probe.
func TestJailCheck(t *testing.T) {
	wantCheck(t, checkJail(JailProbe{Off: "the agent does not run as root"}), Warn, "does not run as root")
	wantCheck(t, checkJail(JailProbe{Layout: "cgroup v2 at /sys/fs/cgroup", SelfTest: errors.New("jail: self-test: CapEff is \"000001ff\", not empty")}), Fail, "CapEff")
	wantCheck(t, checkJail(JailProbe{Layout: "cgroup v2", Checked: 4, Problems: []string{"VM web1: not in cgroup vmhost/a/vm-web1"}}), Fail, "1 of 4 processes")
	wantCheck(t, checkJail(JailProbe{Layout: "cgroup v2", Checked: 2, Unconfined: []string{"old1"}}), Warn, "running unconfined: old1")
	wantCheck(t, checkJail(JailProbe{Layout: "cgroup v1 memory=/sys/fs/cgroup/memory", Checked: 6}), OK, "6 processes of running VMs are confined")
	probed := false
	j := DefaultJail()
	j.Probe = func(_ context.Context, h Host) JailProbe {
		probed = h.StateDir != ""
		return JailProbe{Layout: "cgroup v2"}
	}
	checks := Run(context.Background(), Host{Config: config.Default(), StateDir: t.TempDir(), Jail: j, Euid: -1})
	if !probed || !slices.ContainsFunc(checks, func(c Check) bool { return c.Name == "jail" && c.Status == OK }) {
		t.Errorf("with a probe: %+v, want a jail check", checks)
	}
}
