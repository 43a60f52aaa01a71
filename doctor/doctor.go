// Package doctor checks whether a host can run vmhost's VMs, and says how
// to fix what it lacks: KVM, the Cloud Hypervisor and qemu-storage-daemon
// programs, each configured network's bridge, nftables, the AppVM kernel
// and its modules, cgroups, the jail's id range and the state directory's
// file system. `vmhost doctor` prints the checks; `vmhost serve` logs the
// failures of the same checks once at start (and starts anyway).
//
// A check only reads the host, except the state directory's, which writes
// and removes two small temporary files to learn whether the file system
// can share extents (reflink) or copies root disks in full, and the
// jail's (when main wires its probe), which starts one process in a
// throwaway jail (a cgroup and a directory under the run directory) and
// removes it.
//
// The package imports only config and kmod of vmhost's packages; what the
// agent knows beyond the configuration (the modules an AppVM needs, the
// jail's settings) comes in through Host.
package doctor

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"vmhost/config"
	"vmhost/internal/sbin"
	"vmhost/kmod"
)

// Status is the outcome of a check.
type Status string

const (
	// OK: nothing to do.
	OK Status = "ok"
	// Warn: VMs can run, but something an operator wants is missing
	// (AppVMs without a kernel, a bridge that is down, a small disk).
	Warn Status = "warn"
	// Fail: real VMs cannot run (or cannot run safely) until it is fixed.
	Fail Status = "FAIL"
)

// Check is the result of one check.
type Check struct {
	// Name says what was checked ("kvm", "network default").
	Name string `json:"name"`
	// Status is OK, Warn or Fail.
	Status Status `json:"status"`
	// Detail is what was found, in one line.
	Detail string `json:"detail"`
	// Fix says how to fix a warning or a failure; empty when OK.
	Fix string `json:"fix,omitempty"`
}

// Host is what the checks look at.
type Host struct {
	// Config is the host configuration (required).
	Config *config.Config
	// StateDir is the agent's state directory; it need not exist yet.
	StateDir string
	// RunDir is the agent's run directory, where the jail's probe makes
	// its throwaway jail; it need not exist yet.
	RunDir string
	// SimulateCH and SimulateQSD: the simulators stand in for the programs
	// (serve --simulate), which are then not looked for.
	SimulateCH, SimulateQSD bool
	// AppVMModules are the kernel modules the AppVM guest agent needs
	// (appvm.AgentModules), and AppVMOptionalModules those it loads when
	// the tree has them.
	AppVMModules, AppVMOptionalModules []string
	// Jail is the confinement of the VMs' processes.
	Jail Jail

	// KVMDevice is /dev/kvm, TunDevice /dev/net/tun, EtcDir /etc and
	// MountInfo /proc/self/mountinfo when empty; tests point them
	// elsewhere.
	KVMDevice, TunDevice, EtcDir, MountInfo string
	// Euid is the effective user id the agent runs as; -1 means
	// os.Geteuid().
	Euid int
}

// Jail is the part of the jail's configuration the checks need (its
// defaults come from DefaultJail).
type Jail struct {
	// Enabled: VMs run confined (the default when the agent runs as root).
	Enabled bool
	// IDRange is the first and last uid/gid handed to VMs.
	IDRange [2]uint32
	// CgroupParent is the cgroup under which each VM gets its own.
	CgroupParent string
	// Probe, when set, proves the jail on this host with h's
	// configuration and directories (main wires package jail's self-test
	// and checks the running VMs' processes); the "jail" check shows what
	// it found. Nil: the check is left out.
	Probe func(ctx context.Context, h Host) JailProbe
}

// JailProbe is what proving the jail on this host found.
type JailProbe struct {
	// Off says why VMs run unconfined ("" when they are confined).
	Off string
	// Layout names the cgroup hierarchies VMs' cgroups live in.
	Layout string
	// SelfTest is the result of starting a process in a throwaway jail
	// and checking, from inside, its uid, capabilities, no_new_privs,
	// cgroup, mount namespace and root.
	SelfTest error
	// Checked is how many processes of running VMs were checked against
	// their jails; Problems what was wrong with them (and VMs that run
	// unconfined, booted before VMs were confined).
	Checked  int
	Problems []string
	// Unconfined lists running VMs without a jail (booted by an older
	// vmhost, or while VMs ran unconfined: confined from their next boot;
	// or AppVMs of the simulator's process-mode guests).
	Unconfined []string
}

// DefaultJail is the jail's default configuration.
func DefaultJail() Jail {
	return Jail{Enabled: true, IDRange: [2]uint32{1_000_000, 1_999_999}, CgroupParent: "vmhost"}
}

// Minimum free space of the state directory before a warning, and before a
// failure: a root disk copy of a cloud image is a few GiB.
const (
	warnFreeBytes = 10 << 30
	failFreeBytes = 1 << 30
)

// Run runs every check, in a fixed order, and returns their results.
func Run(ctx context.Context, h Host) []Check {
	if h.KVMDevice == "" {
		h.KVMDevice = "/dev/kvm"
	}
	if h.TunDevice == "" {
		h.TunDevice = "/dev/net/tun"
	}
	if h.EtcDir == "" {
		h.EtcDir = "/etc"
	}
	if h.MountInfo == "" {
		h.MountInfo = "/proc/self/mountinfo"
	}
	if h.Euid < 0 {
		h.Euid = os.Geteuid()
	}
	cfg := h.Config
	// The configuration's jail settings: its ids, its cgroup, whether it
	// is on at all.
	h.Jail.IDRange, h.Jail.CgroupParent = cfg.Jail.IDRange, cfg.Jail.CgroupParent
	h.Jail.Enabled = h.Jail.Enabled && cfg.Jail.On()
	checks := []Check{
		checkRoot(h.Euid),
		checkKVM(h.KVMDevice),
		checkProgram(ctx, "cloud-hypervisor", "binaries.cloud_hypervisor", cfg.Binaries.CloudHypervisor, h.SimulateCH,
			"install Cloud Hypervisor's static release binary as /usr/bin/cloud-hypervisor (it is not packaged in Debian), or set binaries.cloud_hypervisor"),
		checkProgram(ctx, "qemu-storage-daemon", "binaries.qemu_storage_daemon", cfg.Binaries.QemuStorageDaemon, h.SimulateQSD,
			"apt-get install qemu-system-common (Debian, Ubuntu), or set binaries.qemu_storage_daemon"),
		checkMkfsExt4(),
		checkTun(h.TunDevice),
	}
	for _, n := range cfg.Networks {
		checks = append(checks, checkBridge(cfg.SysfsRoot, n))
	}
	checks = append(checks, checkNftables(cfg))
	checks = append(checks, checkAppVMKernel(cfg, h.AppVMModules, h.AppVMOptionalModules)...)
	checks = append(checks,
		checkCgroups(h.MountInfo, h.Jail),
		checkJailIDs(h.EtcDir, h.Jail),
	)
	if h.Jail.Probe != nil {
		checks = append(checks, checkJail(h.Jail.Probe(ctx, h)))
	}
	checks = append(checks, checkStateDir(h.StateDir))
	return checks
}

// checkJail shows what proving the jail found: a failure when a jailed
// process is not confined (the self-test, or a running VM's process), a
// warning when VMs run unconfined.
func checkJail(p JailProbe) Check {
	const name = "jail"
	switch {
	case p.Off != "":
		return Check{Name: name, Status: Warn, Detail: p.Off,
			Fix: "run vmhost serve as root with jail.enabled true (docs/operating.md, Confinement)"}
	case p.SelfTest != nil:
		return Check{Name: name, Status: Fail, Detail: oneLine(p.SelfTest.Error()),
			Fix: "VMs would run unconfined or fail to start; see docs/operating.md, Confinement"}
	case len(p.Problems) > 0:
		return Check{Name: name, Status: Fail, Detail: fmt.Sprintf("%d of %d processes of running VMs checked: %s", len(p.Problems), p.Checked, strings.Join(p.Problems, "; ")),
			Fix: "restart the VMs named (stop, start): each boot confines them again"}
	}
	detail := fmt.Sprintf("a process started in a throwaway jail runs as its own uid, with no capability, no_new_privs, in its own cgroup and root (%s); %d processes of running VMs are confined", p.Layout, p.Checked)
	if len(p.Unconfined) > 0 {
		return Check{Name: name, Status: Warn, Detail: detail + "; running unconfined: " + strings.Join(p.Unconfined, ", "),
			Fix: "stop and start those VMs (booted by an older vmhost, or while VMs ran unconfined): each boot confines them; AppVMs of the simulator's process-mode guests (serve --dev) are never confined"}
	}
	return ok(name, "%s", detail)
}

// oneLine joins a message's lines.
func oneLine(s string) string { return strings.Join(strings.Fields(s), " ") }

// KVMReady reports whether dev (/dev/kvm) is a KVM this process can use:
// the kvm check passes. GET /api/host reports it.
func KVMReady(dev string) bool { return checkKVM(dev).Status == OK }

// Failed reports whether any check failed: real VMs cannot run.
func Failed(checks []Check) bool {
	return slices.ContainsFunc(checks, func(c Check) bool { return c.Status == Fail })
}

// Print writes one line per check: its status, its name, what was found
// and, for a warning or a failure, how to fix it.
func Print(w io.Writer, checks []Check) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	for _, c := range checks {
		line := c.Detail
		if c.Fix != "" {
			line += "; fix: " + c.Fix
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\n", c.Status, c.Name, line)
	}
	tw.Flush()
}

func ok(name, format string, a ...any) Check {
	return Check{Name: name, Status: OK, Detail: fmt.Sprintf(format, a...)}
}

func checkRoot(euid int) Check {
	if euid == 0 {
		return ok("root", "running as root")
	}
	return Check{Name: "root", Status: Fail, Detail: fmt.Sprintf("running as uid %d: the agent makes taps, cgroups and jails, which need root", euid),
		Fix: "run vmhost serve (and vmhost doctor) as root; vmhost serve --dev runs without root, on simulators"}
}

// checkProgram finds a program the agent runs and asks its version.
func checkProgram(ctx context.Context, name, key, path string, simulated bool, fix string) Check {
	if simulated {
		return ok(name, "simulated (vmhost serve --simulate): the real program is not used")
	}
	found, err := exec.LookPath(path)
	if err != nil {
		where := "not in PATH"
		if filepath.IsAbs(path) {
			where = "not an executable file"
		}
		return Check{Name: name, Status: Fail, Detail: fmt.Sprintf("%s (%s = %q) is %s", name, key, path, where), Fix: fix}
	}
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, found, "--version").Output()
	first, _, _ := strings.Cut(strings.TrimSpace(string(out)), "\n")
	if err != nil || first == "" {
		return Check{Name: name, Status: Fail, Detail: fmt.Sprintf("%s does not answer --version (%v)", found, err),
			Fix: "reinstall it, or point " + key + " at a working " + name}
	}
	return ok(name, "%s: %s", found, first)
}

func checkMkfsExt4() Check {
	const name = "mkfs.ext4"
	p := sbin.Path("mkfs.ext4")
	if !filepath.IsAbs(p) {
		return Check{Name: name, Status: Warn, Detail: "mkfs.ext4 is not in PATH, /usr/sbin or /sbin: AppVM image imports and ext4 volumes fail",
			Fix: "apt-get install e2fsprogs (1.43 or later, for mkfs.ext4 -d)"}
	}
	return ok(name, "%s (AppVM images and ext4 volumes)", p)
}

// checkBridge looks at a network's bridge in sysfs, as the agent does when
// it lists networks.
func checkBridge(sysfs string, n config.Network) Check {
	name := "network " + n.ID
	dev := filepath.Join(sysfs, "class/net", n.Bridge)
	create := fmt.Sprintf("ip link add %s type bridge && ip link set %s up (to keep it across reboots, see docs/operating.md, Networks)", n.Bridge, n.Bridge)
	if _, err := os.Stat(dev); err != nil {
		return Check{Name: name, Status: Fail, Detail: fmt.Sprintf("bridge %s does not exist: creates on this network fail", n.Bridge), Fix: create}
	}
	if _, err := os.Stat(filepath.Join(dev, "bridge")); err != nil {
		return Check{Name: name, Status: Fail, Detail: fmt.Sprintf("%s exists but is not a bridge: taps cannot join it", n.Bridge),
			Fix: "name a bridge in networks[].bridge, or replace the interface: " + create}
	}
	flags, err := readHex(filepath.Join(dev, "flags"))
	if err == nil && flags&0x1 == 0 { // IFF_UP
		return Check{Name: name, Status: Warn, Detail: fmt.Sprintf("bridge %s is down: its VMs have no network", n.Bridge),
			Fix: "ip link set " + n.Bridge + " up"}
	}
	return ok(name, "bridge %s is up", n.Bridge)
}

func readHex(path string) (uint64, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, err
	}
	return strconv.ParseUint(strings.TrimPrefix(strings.TrimSpace(string(b)), "0x"), 16, 64)
}

func checkNftables(cfg *config.Config) Check {
	const name = "nftables"
	err := nftablesUsable()
	if err == nil {
		return ok(name, "nf_tables answers over netlink (anti-spoof rules)")
	}
	c := Check{Name: name, Status: Warn, Detail: fmt.Sprintf("nf_tables does not answer over netlink (%v): creates with spoof_guard fail", err),
		Fix: "load it (modprobe nf_tables nft_chain_filter), on a kernel with CONFIG_NF_TABLES_BRIDGE; run as root"}
	for _, n := range cfg.Networks {
		if n.SpoofGuard {
			c.Status = Fail
			c.Detail = fmt.Sprintf("nf_tables does not answer over netlink (%v): network %s has spoof_guard, so its creates fail", err, n.ID)
			break
		}
	}
	return c
}

// kernelConfig maps the modules an AppVM needs to the kernel options that
// build them in, for a kernel given without appvm_modules.
var kernelConfig = map[string]string{
	"virtio_pci":                 "CONFIG_VIRTIO_PCI",
	"virtio_blk":                 "CONFIG_VIRTIO_BLK",
	"virtio_net":                 "CONFIG_VIRTIO_NET",
	"ext4":                       "CONFIG_EXT4_FS",
	"vsock":                      "CONFIG_VSOCKETS",
	"vmw_vsock_virtio_transport": "CONFIG_VIRTIO_VSOCKETS",
}

// checkAppVMKernel checks appvm_kernel and the modules an AppVM needs: in
// appvm_modules, resolved and checked against the kernel's release as a
// boot does, or built in (by the kernel's config file beside it, as
// Debian's /boot/config-<release>).
func checkAppVMKernel(cfg *config.Config, required, optional []string) []Check {
	const kname, mname = "appvm kernel", "appvm modules"
	if cfg.AppVMKernel == "" {
		return []Check{{Name: kname, Status: Warn, Detail: "appvm_kernel is not set: AppVMs cannot boot (classic VMs can)",
			Fix: "extract a distribution kernel and set appvm_kernel and appvm_modules (docs/appvm.md, Kernels)"}}
	}
	release, err := kmod.KernelRelease(cfg.AppVMKernel)
	if err != nil {
		fix := "point appvm_kernel at a readable bzImage (/boot/vmlinuz-*) or ELF vmlinux"
		if errors.Is(err, fs.ErrPermission) {
			fix = "run as root (Ubuntu's /boot/vmlinuz-* is readable by root only)"
		}
		return []Check{{Name: kname, Status: Fail, Detail: fmt.Sprintf("appvm_kernel: %v", err), Fix: fix}}
	}
	checks := []Check{ok(kname, "%s: Linux %s", cfg.AppVMKernel, release)}
	if cfg.AppVMModules != "" {
		return append(checks, checkModuleTree(cfg.AppVMModules, release, required, optional))
	}
	confPath := filepath.Join(filepath.Dir(cfg.AppVMKernel), "config-"+release)
	opts, err := readKernelConfig(confPath)
	if err != nil {
		return append(checks, Check{Name: mname, Status: Warn,
			Detail: fmt.Sprintf("appvm_modules is not set and there is no %s to tell whether the kernel builds in %s", confPath, strings.Join(required, ", ")),
			Fix:    "set appvm_modules to the kernel's module tree (docs/appvm.md, Kernels)"})
	}
	var missing, unknown []string
	for _, m := range required {
		opt, known := kernelConfig[m]
		switch {
		case !known:
			unknown = append(unknown, m)
		case opts[opt] != "y":
			missing = append(missing, fmt.Sprintf("%s (%s=%s)", m, opt, or(opts[opt], "unset")))
		}
	}
	if len(missing) > 0 {
		return append(checks, Check{Name: mname, Status: Fail,
			Detail: fmt.Sprintf("appvm_modules is not set and the kernel does not build in %s (%s)", strings.Join(missing, ", "), confPath),
			Fix:    "set appvm_modules to the kernel's module tree, or build them in (=y)"})
	}
	if len(unknown) > 0 {
		return append(checks, Check{Name: mname, Status: Warn,
			Detail: fmt.Sprintf("cannot tell from %s whether the kernel builds in %s", confPath, strings.Join(unknown, ", ")),
			Fix:    "set appvm_modules to the kernel's module tree"})
	}
	return append(checks, ok(mname, "built into the kernel (%s): %s", confPath, strings.Join(required, ", ")))
}

func or(s, def string) string {
	if s == "" {
		return def
	}
	return s
}

// checkModuleTree does what an AppVM boot does with appvm_modules: resolve
// the modules with their dependencies and check they were built for the
// kernel's release.
func checkModuleTree(dir, release string, required, optional []string) Check {
	const name = "appvm modules"
	fail := func(err error) Check {
		return Check{Name: name, Status: Fail, Detail: fmt.Sprintf("appvm_modules: %v", err),
			Fix: "point appvm_modules at the lib/modules/<release> tree of appvm_kernel (or the root of its extracted package); with Ubuntu, extract linux-modules-<release> too"}
	}
	tree, err := kmod.Open(dir)
	if err != nil {
		return fail(err)
	}
	mods, err := tree.Resolve(required, optional)
	if err != nil {
		return fail(err)
	}
	if err := kmod.CheckVermagic(mods, release); err != nil {
		return fail(err)
	}
	var builtin []string
	for _, m := range required {
		if tree.Builtin(m) {
			builtin = append(builtin, m)
		}
	}
	detail := fmt.Sprintf("%d modules for Linux %s from %s", len(mods), release, tree.Dir)
	if len(builtin) > 0 {
		detail += "; built in: " + strings.Join(builtin, ", ")
	}
	return ok(name, "%s", detail)
}

// readKernelConfig reads the CONFIG_X=v lines of a kernel config file.
func readKernelConfig(path string) (map[string]string, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	opts := map[string]string{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if k, v, ok := strings.Cut(sc.Text(), "="); ok && strings.HasPrefix(k, "CONFIG_") {
			opts[k] = v
		}
	}
	return opts, sc.Err()
}

// mount is one line of /proc/self/mountinfo, the fields the checks need.
type mount struct {
	point, fstype string
	options       []string // mount options and super options together
}

func readMountInfo(path string) ([]mount, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var ms []mount
	for _, line := range strings.Split(string(b), "\n") {
		// id parent major:minor root point options [optional...] - fstype source superoptions
		pre, post, found := strings.Cut(line, " - ")
		f, g := strings.Fields(pre), strings.Fields(post)
		if !found || len(f) < 6 || len(g) < 3 {
			continue
		}
		opts := strings.Split(f[5], ",")
		opts = append(opts, strings.Split(g[2], ",")...)
		ms = append(ms, mount{point: unescapeMount(f[4]), fstype: g[0], options: opts})
	}
	return ms, nil
}

// unescapeMount undoes mountinfo's octal escapes (\040 for a space).
func unescapeMount(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			if n, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(n))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// jailControllers are the controllers the jail limits a VM with.
var jailControllers = []string{"memory", "pids", "cpu"}

// checkCgroups finds what the jail needs: cgroup v2 with the memory, pids
// and cpu controllers, else the v1 hierarchies memory, pids, cpu and
// cpuacct, mounted read-write.
func checkCgroups(mountInfo string, j Jail) Check {
	const name = "cgroups"
	ms, err := readMountInfo(mountInfo)
	if err != nil {
		return Check{Name: name, Status: Fail, Detail: fmt.Sprintf("reading the mount table: %v", err), Fix: "mount /proc"}
	}
	status := Fail
	if !j.Enabled {
		status = Warn // the jail is off: VMs run, unconfined
	}
	for _, m := range ms {
		if m.fstype != "cgroup2" {
			continue
		}
		b, err := os.ReadFile(filepath.Join(m.point, "cgroup.controllers"))
		if err != nil {
			continue
		}
		have := strings.Fields(string(b))
		if missing := subtract(jailControllers, have); len(missing) == 0 {
			if slices.Contains(m.options, "ro") {
				return Check{Name: name, Status: status, Detail: fmt.Sprintf("cgroup v2 at %s is mounted read-only", m.point),
					Fix: "mount -o remount,rw " + m.point}
			}
			return ok(name, "cgroup v2 at %s with %s", m.point, strings.Join(jailControllers, ", "))
		}
	}
	v1 := map[string]string{}
	var ro []string
	for _, m := range ms {
		if m.fstype != "cgroup" {
			continue
		}
		for _, c := range []string{"memory", "pids", "cpu", "cpuacct"} {
			if slices.Contains(m.options, c) {
				if _, seen := v1[c]; !seen {
					v1[c] = m.point
					if slices.Contains(m.options, "ro") {
						ro = append(ro, m.point)
					}
				}
			}
		}
	}
	var missing, found []string
	for _, c := range []string{"memory", "pids", "cpu", "cpuacct"} {
		if p, ok := v1[c]; ok {
			found = append(found, c+" at "+p)
		} else {
			missing = append(missing, c)
		}
	}
	switch {
	case len(missing) > 0:
		return Check{Name: name, Status: status,
			Detail: fmt.Sprintf("no cgroup v2 with %s, and no v1 hierarchy for %s: the jail cannot limit VMs", strings.Join(jailControllers, ", "), strings.Join(missing, ", ")),
			Fix:    "boot with cgroup v2 (systemd's default) and enable its memory, pids and cpu controllers, or mount the v1 hierarchies"}
	case len(ro) > 0:
		return Check{Name: name, Status: status, Detail: "cgroup v1 hierarchies mounted read-only: " + strings.Join(slices.Compact(ro), ", "),
			Fix: "remount them read-write"}
	}
	return ok(name, "cgroup v1: %s", strings.Join(found, ", "))
}

// subtract returns the items of want not in have.
func subtract(want, have []string) []string {
	var out []string
	for _, w := range want {
		if !slices.Contains(have, w) {
			out = append(out, w)
		}
	}
	return out
}

// checkJailIDs makes sure no account or user-namespace range of the host
// uses the ids the jail hands to VMs: a VM's processes must not share a uid
// with anyone.
func checkJailIDs(etc string, j Jail) Check {
	const name = "jail ids"
	lo, hi := j.IDRange[0], j.IDRange[1]
	if lo > hi || lo == 0 {
		return Check{Name: name, Status: Fail, Detail: fmt.Sprintf("jail id range %d..%d is empty or includes root", lo, hi),
			Fix: "set jail.id_range to [first, last] with 0 < first <= last"}
	}
	in := func(id uint64) bool { return id >= uint64(lo) && id <= uint64(hi) }
	var clashes []string
	for _, f := range []struct {
		file, what string
		idField    int
	}{{"passwd", "user", 2}, {"group", "group", 2}} {
		lines, err := readLines(filepath.Join(etc, f.file))
		if err != nil && !errors.Is(err, fs.ErrNotExist) {
			return Check{Name: name, Status: Fail, Detail: fmt.Sprintf("reading %s: %v", filepath.Join(etc, f.file), err), Fix: "run as root"}
		}
		for _, l := range lines {
			fields := strings.Split(l, ":")
			if len(fields) <= f.idField {
				continue
			}
			if id, err := strconv.ParseUint(fields[f.idField], 10, 32); err == nil && in(id) {
				clashes = append(clashes, fmt.Sprintf("%s %s (%d) in %s", f.what, fields[0], id, f.file))
			}
		}
	}
	for _, file := range []string{"subuid", "subgid"} {
		lines, err := readLines(filepath.Join(etc, file))
		if err != nil && !errors.Is(err, fs.ErrNotExist) {
			return Check{Name: name, Status: Fail, Detail: fmt.Sprintf("reading %s: %v", filepath.Join(etc, file), err), Fix: "run as root"}
		}
		for _, l := range lines {
			fields := strings.Split(l, ":") // name:first:count
			if len(fields) != 3 {
				continue
			}
			first, err1 := strconv.ParseUint(fields[1], 10, 32)
			count, err2 := strconv.ParseUint(fields[2], 10, 32)
			if err1 != nil || err2 != nil || count == 0 {
				continue
			}
			if first <= uint64(hi) && first+count-1 >= uint64(lo) {
				clashes = append(clashes, fmt.Sprintf("%s's range %d..%d in %s", fields[0], first, first+count-1, file))
			}
		}
	}
	if len(clashes) > 0 {
		return Check{Name: name, Status: Fail,
			Detail: fmt.Sprintf("jail id range %d..%d is in use: %s", lo, hi, strings.Join(clashes, ", ")),
			Fix:    "set jail.id_range to a range no account or subordinate id range uses"}
	}
	return ok(name, "no account or subordinate id range in %d..%d (%s/passwd, group, subuid, subgid)", lo, hi, etc)
}

func readLines(path string) ([]string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var out []string
	for _, l := range strings.Split(string(b), "\n") {
		if l = strings.TrimSpace(l); l != "" && !strings.HasPrefix(l, "#") {
			out = append(out, l)
		}
	}
	return out, nil
}

// checkStateDir looks at the file system of the state directory (or, before
// the agent made it, of its nearest existing parent): its type, whether
// copies of root disks share extents (reflink) or are full copies, and the
// free space.
func checkStateDir(dir string) Check {
	const name = "state dir"
	probe := dir
	for {
		st, err := os.Stat(probe)
		if err == nil && st.IsDir() {
			break
		}
		parent := filepath.Dir(probe)
		if parent == probe {
			return Check{Name: name, Status: Fail, Detail: fmt.Sprintf("no existing directory on the way to %s", dir), Fix: "give an absolute --state-dir"}
		}
		probe = parent
	}
	where := dir
	if probe != dir {
		where = fmt.Sprintf("%s (not made yet; %s)", dir, probe)
	}
	fsType, free, err := statFS(probe)
	if err != nil {
		return Check{Name: name, Status: Fail, Detail: fmt.Sprintf("%s: %v", where, err), Fix: "check the directory"}
	}
	copies := "copy (each root disk is a full copy of its image)"
	shared, err := canReflink(probe)
	switch {
	case err != nil:
		return Check{Name: name, Status: Fail, Detail: fmt.Sprintf("%s on %s: cannot write there: %v", where, fsType, err), Fix: "run as root, or give a writable --state-dir"}
	case shared:
		copies = "reflink (root disks share their image's blocks until written)"
	}
	detail := fmt.Sprintf("%s on %s: %s, %s free", where, fsType, copies, gib(free))
	switch {
	case free < failFreeBytes:
		return Check{Name: name, Status: Fail, Detail: detail, Fix: "free space on " + probe + ", or move the state directory"}
	case fsType == "tmpfs":
		return Check{Name: name, Status: Warn, Detail: detail + "; tmpfs loses every VM at reboot",
			Fix: "put the state directory on a disk (btrfs or XFS copy root disks by reflink)"}
	case free < warnFreeBytes:
		return Check{Name: name, Status: Warn, Detail: detail, Fix: "free space on " + probe + ": each VM's root disk may grow to its size_gib"}
	}
	return ok(name, "%s", detail)
}

func gib(n uint64) string {
	return strconv.FormatFloat(float64(n)/(1<<30), 'f', 1, 64) + " GiB"
}

// Log logs each check that is not OK, once: a warning for Warn, an error
// for Fail, with its fix. `vmhost serve` calls it at start, and starts
// anyway.
func Log(log *slog.Logger, checks []Check) {
	for _, c := range checks {
		switch c.Status {
		case Warn:
			log.Warn("doctor: "+c.Name, "found", c.Detail, "fix", c.Fix)
		case Fail:
			log.Error("doctor: "+c.Name+": real VMs cannot run", "found", c.Detail, "fix", c.Fix)
		}
	}
}
