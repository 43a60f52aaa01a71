package jail

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// Controllers a VM's cgroup needs. With cgroup v2 they must all be available
// in the unified hierarchy; otherwise each needs a v1 hierarchy (cpuacct
// gives the CPU time v2 reports in cpu.stat without any controller).
var (
	v2Controllers = []string{"memory", "pids", "cpu"}
	v1Controllers = []string{"memory", "pids", "cpu", "cpuacct"}
)

// Layout says where this host's cgroup hierarchies are mounted and which of
// them a VM's cgroup lives in.
//
// With cgroup v2 whose root offers memory, pids and cpu, a VM's cgroup is in
// the unified hierarchy alone. Otherwise (v1 controllers, as on a hybrid
// host) its limits and counters are in the v1 hierarchies memory, pids, cpu
// and cpuacct; and when a controller-less cgroup2 is mounted beside them
// (systemd's hybrid layout), the VM has a cgroup there too: its processes are
// placed in it as they are cloned and killed all at once through cgroup.kill,
// which v1 has no equivalent of.
type Layout struct {
	// Unified is the cgroup2 mount point, "" when none is mounted.
	Unified string
	// UnifiedLimits reports that the unified hierarchy offers every
	// controller a VM needs, so that v1 is not used.
	UnifiedLimits bool
	// V1 maps each v1 controller a VM needs to its hierarchy's mount point
	// (co-mounted controllers share one). Unused when UnifiedLimits.
	V1 map[string]string
}

// DetectLayout reads /proc/self/mountinfo and the unified root's controllers.
// It fails when neither cgroup v2 with memory, pids and cpu nor v1
// hierarchies for memory, pids, cpu and cpuacct are mounted.
func DetectLayout() (Layout, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return Layout{}, err
	}
	defer f.Close()
	l, err := parseMountinfo(f)
	if err != nil {
		return Layout{}, err
	}
	if l.Unified != "" {
		b, err := os.ReadFile(filepath.Join(l.Unified, "cgroup.controllers"))
		if err != nil {
			return Layout{}, fmt.Errorf("reading the cgroup v2 controllers: %w", err)
		}
		have := strings.Fields(string(b))
		l.UnifiedLimits = true
		for _, c := range v2Controllers {
			if !slices.Contains(have, c) {
				l.UnifiedLimits = false
			}
		}
	}
	return l, l.check()
}

func (l Layout) check() error {
	if l.UnifiedLimits {
		return nil
	}
	var missing []string
	for _, c := range v1Controllers {
		if l.V1[c] == "" {
			missing = append(missing, c)
		}
	}
	if len(missing) > 0 {
		return fmt.Errorf("no cgroup hierarchy for %s: neither cgroup v2 with memory, pids and cpu enabled at its root nor v1 hierarchies for memory, pids, cpu and cpuacct are mounted",
			strings.Join(missing, ", "))
	}
	return nil
}

// String describes the layout for logs and doctor.
func (l Layout) String() string {
	if l.UnifiedLimits {
		return "cgroup v2 at " + l.Unified
	}
	var b strings.Builder
	b.WriteString("cgroup v1")
	for _, c := range v1Controllers {
		fmt.Fprintf(&b, " %s=%s", c, l.V1[c])
	}
	if l.Unified != "" {
		b.WriteString("; controller-less cgroup v2 at " + l.Unified + " for placement and kill")
	}
	return b.String()
}

// parseMountinfo finds the cgroup2 mount and the v1 mounts of the
// controllers a VM needs. Only mounts of a hierarchy's root ("/" in field 4)
// count: a mount of a sub-cgroup would not show the paths /proc/PID/cgroup
// names. The first mount of each wins.
func parseMountinfo(r io.Reader) (Layout, error) {
	l := Layout{V1: map[string]string{}}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		// 36 35 0:30 / /sys/fs/cgroup/memory rw,nosuid shared:17 - cgroup cgroup rw,memory
		pre, post, ok := strings.Cut(sc.Text(), " - ")
		if !ok {
			continue
		}
		f, g := strings.Fields(pre), strings.Fields(post)
		if len(f) < 5 || len(g) < 3 || f[3] != "/" {
			continue
		}
		mnt := unescapeMountinfo(f[4])
		switch g[0] {
		case "cgroup2":
			if l.Unified == "" {
				l.Unified = mnt
			}
		case "cgroup":
			for _, opt := range strings.Split(g[2], ",") {
				if slices.Contains(v1Controllers, opt) && l.V1[opt] == "" {
					l.V1[opt] = mnt
				}
			}
		}
	}
	return l, sc.Err()
}

// unescapeMountinfo undoes the octal escapes (\040 for a space) mountinfo
// uses in paths.
func unescapeMountinfo(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			if v, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(v))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// Limits are what a VM's cgroup allows.
type Limits struct {
	MemoryBytes uint64 // memory.max (v1: memory.limit_in_bytes); swap is not allowed beyond it
	PidsMax     uint64 // pids.max
	VCPUs       uint32 // the CPU weight is proportional to it
}

// Limits returns the limits of a VM with memoryMB of guest memory and vcpus
// vCPUs under c.
func (c Config) Limits(memoryMB uint64, vcpus uint32) Limits {
	return Limits{MemoryBytes: (memoryMB + c.MemoryOverheadMB) << 20, PidsMax: c.PidsMax, VCPUs: vcpus}
}

// cpuWeight is v2's cpu.weight (1..10000, 100 is one default task's share):
// 100 per vCPU.
func (l Limits) cpuWeight() uint64 { return clamp(100*uint64(l.VCPUs), 1, 10000) }

// cpuShares is v1's cpu.shares (2..262144, 1024 the default): 1024 per vCPU.
func (l Limits) cpuShares() uint64 { return clamp(1024*uint64(l.VCPUs), 2, 262144) }

func clamp(v, lo, hi uint64) uint64 { return max(lo, min(v, hi)) }

// Stats are a cgroup's counters, for metrics.
type Stats struct {
	CPU         time.Duration // CPU time used by every process that has been in it
	MemoryBytes uint64        // memory charged to it now
	Pids        uint64        // tasks (processes and threads) in it now
}

// Cgroup is one cgroup, by its name relative to each hierarchy's root, in
// every hierarchy of a Layout. Its methods read and write the cgroup files
// and keep no state.
type Cgroup struct {
	name   string
	layout Layout
}

// Cgroup returns the cgroup called name (a relative path, like
// "vmhost/<agent_id>/vm-<id>") in l's hierarchies. Nothing is made.
func (l Layout) Cgroup(name string) *Cgroup { return &Cgroup{name: name, layout: l} }

// Name is the cgroup's path relative to each hierarchy's root.
func (c *Cgroup) Name() string { return c.name }

// unifiedDir is the cgroup's directory in the unified hierarchy, "" if none.
func (c *Cgroup) unifiedDir() string {
	if c.layout.Unified == "" {
		return ""
	}
	return filepath.Join(c.layout.Unified, c.name)
}

// v1Dir is the cgroup's directory in controller ctrl's v1 hierarchy, "" when
// v1 is not used.
func (c *Cgroup) v1Dir(ctrl string) string {
	if c.layout.UnifiedLimits || c.layout.V1[ctrl] == "" {
		return ""
	}
	return filepath.Join(c.layout.V1[ctrl], c.name)
}

// dirs lists the cgroup's directory in every hierarchy it lives in, once.
func (c *Cgroup) dirs() []string {
	var ds []string
	if d := c.unifiedDir(); d != "" {
		ds = append(ds, d)
	}
	for _, ctrl := range v1Controllers {
		if d := c.v1Dir(ctrl); d != "" && !slices.Contains(ds, d) {
			ds = append(ds, d)
		}
	}
	return ds
}

// limitDir is where ctrl's files are: the unified directory when it holds
// the limits, else ctrl's v1 directory.
func (c *Cgroup) limitDir(ctrl string) string {
	if c.layout.UnifiedLimits {
		return c.unifiedDir()
	}
	return c.v1Dir(ctrl)
}

// taskFiles lists, for every v1 hierarchy the cgroup lives in (once
// each), the "tasks" file of the cgroup (join) and of the cgroup a
// /proc/thread-self/cgroup text places the thread in (leave; the
// hierarchy's root when it names none). A thread writes "0" there to move
// itself alone.
func (c *Cgroup) taskFiles(procCgroup []byte) (join, leave []string) {
	for _, ctrl := range v1Controllers {
		d := c.v1Dir(ctrl)
		if d == "" || slices.Contains(join, filepath.Join(d, "tasks")) {
			continue
		}
		join = append(join, filepath.Join(d, "tasks"))
		now := "/"
		for _, line := range strings.Split(string(procCgroup), "\n") {
			parts := strings.SplitN(line, ":", 3)
			if len(parts) == 3 && slices.Contains(strings.Split(parts[1], ","), ctrl) {
				now = parts[2]
			}
		}
		leave = append(leave, filepath.Join(c.layout.V1[ctrl], now, "tasks"))
	}
	return join, leave
}

// Create makes the cgroup in every hierarchy (what exists already is kept)
// and sets lim. In a v2 hierarchy that holds the limits, it first enables
// memory, pids and cpu in cgroup.subtree_control from the root down to the
// cgroup's parent.
func (c *Cgroup) Create(lim Limits) error {
	err := c.makeDirs()
	if errors.Is(err, fs.ErrNotExist) {
		// A parent removed between two of the steps (the agent's
		// cgroup, which a self-test that made it removes after): once
		// more.
		err = c.makeDirs()
	}
	if err != nil {
		return err
	}
	return c.SetLimits(lim)
}

// makeDirs makes the cgroup's directory in every hierarchy, and enables
// the controllers on the way where the unified hierarchy holds the limits.
func (c *Cgroup) makeDirs() error {
	if c.layout.UnifiedLimits {
		dir := c.layout.Unified
		enable := "+" + strings.Join(v2Controllers, " +")
		for _, seg := range append([]string{""}, strings.Split(path.Dir(c.name), "/")...) {
			dir = filepath.Join(dir, seg)
			if err := os.Mkdir(dir, 0o755); err != nil && !errors.Is(err, fs.ErrExist) {
				return fmt.Errorf("creating cgroup %s: %w", dir, err)
			}
			if err := writeCgroupFile(filepath.Join(dir, "cgroup.subtree_control"), enable); err != nil {
				return fmt.Errorf("enabling %s below %s: %w", strings.Join(v2Controllers, ", "), dir, err)
			}
		}
	}
	for _, d := range c.dirs() {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return fmt.Errorf("creating cgroup %s: %w", d, err)
		}
	}
	return nil
}

// SetLimits writes lim into the cgroup's files.
func (c *Cgroup) SetLimits(lim Limits) error {
	mem, pids, cpu := c.limitDir("memory"), c.limitDir("pids"), c.limitDir("cpu")
	var steps []cgroupWrite
	if c.layout.UnifiedLimits {
		steps = []cgroupWrite{
			{filepath.Join(mem, "memory.max"), u64(lim.MemoryBytes), false},
			// The VM's memory limit is a limit of memory, not of memory
			// plus swap; absent when the kernel has no swap accounting.
			{filepath.Join(mem, "memory.swap.max"), "0", true},
			{filepath.Join(pids, "pids.max"), u64(lim.PidsMax), false},
			{filepath.Join(cpu, "cpu.weight"), u64(lim.cpuWeight()), false},
		}
	} else {
		steps = []cgroupWrite{
			{filepath.Join(pids, "pids.max"), u64(lim.PidsMax), false},
			{filepath.Join(cpu, "cpu.shares"), u64(lim.cpuShares()), false},
		}
		if err := setV1Memory(mem, lim.MemoryBytes); err != nil {
			return err
		}
	}
	for _, s := range steps {
		if err := writeCgroupFile(s.file, s.value); err != nil && !(s.optional && errors.Is(err, fs.ErrNotExist)) {
			return fmt.Errorf("setting %s to %s: %w", s.file, s.value, err)
		}
	}
	return nil
}

type cgroupWrite struct {
	file, value string
	optional    bool // may be missing (a feature the kernel was built without)
}

// setV1Memory sets memory.limit_in_bytes and, when the kernel accounts swap,
// memory.memsw.limit_in_bytes to the same value (no swap beyond the limit).
// The kernel keeps memsw >= limit at every step, so which goes first
// depends on the direction.
func setV1Memory(dir string, bytes uint64) error {
	limit, memsw := filepath.Join(dir, "memory.limit_in_bytes"), filepath.Join(dir, "memory.memsw.limit_in_bytes")
	v := u64(bytes)
	order := []string{limit, memsw}
	if err := writeCgroupFile(limit, v); err != nil {
		if !errors.Is(err, syscall.EINVAL) {
			return fmt.Errorf("setting %s to %s: %w", limit, v, err)
		}
		order = []string{memsw, limit} // growing above the current memsw limit
	}
	for _, f := range order {
		if err := writeCgroupFile(f, v); err != nil && !(f == memsw && errors.Is(err, fs.ErrNotExist)) {
			return fmt.Errorf("setting %s to %s: %w", f, v, err)
		}
	}
	return nil
}

func u64(v uint64) string { return strconv.FormatUint(v, 10) }

// writeCgroupFile writes value to an existing cgroup file in one write, as
// the kernel wants (no O_CREAT: a missing file is a missing feature).
func writeCgroupFile(name, value string) error {
	f, err := os.OpenFile(name, os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	_, err = f.WriteString(value)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return err
}

// Stats reads the cgroup's CPU time, memory and task count.
func (c *Cgroup) Stats() (Stats, error) {
	var s Stats
	var err error
	if c.layout.UnifiedLimits {
		d := c.unifiedDir()
		usec, e1 := readKeyed(filepath.Join(d, "cpu.stat"), "usage_usec")
		s.MemoryBytes, err = readUint(filepath.Join(d, "memory.current"))
		s.CPU = time.Duration(usec) * time.Microsecond
		err = errors.Join(e1, err)
	} else {
		var ns uint64
		var e1 error
		ns, e1 = readUint(filepath.Join(c.v1Dir("cpuacct"), "cpuacct.usage"))
		s.MemoryBytes, err = readUint(filepath.Join(c.v1Dir("memory"), "memory.usage_in_bytes"))
		s.CPU = time.Duration(ns)
		err = errors.Join(e1, err)
	}
	pids, e3 := readUint(filepath.Join(c.limitDir("pids"), "pids.current"))
	s.Pids = pids
	if err = errors.Join(err, e3); err != nil {
		return Stats{}, fmt.Errorf("reading the counters of cgroup %s: %w", c.name, err)
	}
	return s, nil
}

func readUint(name string) (uint64, error) {
	b, err := os.ReadFile(name)
	if err != nil {
		return 0, err
	}
	return strconv.ParseUint(strings.TrimSpace(string(b)), 10, 64)
}

// readKeyed reads the value of key in a "key value" per line file (cpu.stat).
func readKeyed(name, key string) (uint64, error) {
	b, err := os.ReadFile(name)
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(string(b), "\n") {
		if k, v, ok := strings.Cut(line, " "); ok && k == key {
			return strconv.ParseUint(strings.TrimSpace(v), 10, 64)
		}
	}
	return 0, fmt.Errorf("%s has no %s", name, key)
}

// Exists reports whether the cgroup's directory exists in any hierarchy.
func (c *Cgroup) Exists() bool {
	for _, d := range c.dirs() {
		if _, err := os.Stat(d); err == nil {
			return true
		}
	}
	return false
}

// Procs lists the processes in the cgroup (the union over its hierarchies),
// sorted. A cgroup that does not exist has none.
func (c *Cgroup) Procs() ([]int, error) {
	var pids []int
	for _, d := range c.dirs() {
		b, err := os.ReadFile(filepath.Join(d, "cgroup.procs"))
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("listing the processes of cgroup %s: %w", d, err)
		}
		for _, f := range bytes.Fields(b) {
			pid, err := strconv.Atoi(string(f))
			if err != nil {
				return nil, fmt.Errorf("parsing %s/cgroup.procs: %w", d, err)
			}
			if !slices.Contains(pids, pid) {
				pids = append(pids, pid)
			}
		}
	}
	slices.Sort(pids)
	return pids, nil
}

// Contains reports whether process pid is in the cgroup in any of its
// hierarchies, from /proc/PID/cgroup. A process that is gone is in none.
func (c *Cgroup) Contains(pid int) (bool, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cgroup")
	if errors.Is(err, fs.ErrNotExist) || errors.Is(err, syscall.ESRCH) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	return cgroupListed(b, c.name), nil
}

// notIn lists the hierarchies of the cgroup's layout in which a
// /proc/PID/cgroup text does not place the process in the cgroup: the
// unified one ("cgroup2") and, where the limits are v1's, each v1
// controller's. A process moved out of one hierarchy (say, out of its
// memory cgroup) escapes that limit while its other lines still name
// the VM's cgroup.
func (c *Cgroup) notIn(procCgroup []byte) []string {
	want := "/" + c.name
	var missing []string
	if c.layout.Unified != "" {
		found := false
		for _, line := range strings.Split(string(procCgroup), "\n") {
			if p, ok := strings.CutPrefix(line, "0::"); ok && p == want {
				found = true
			}
		}
		if !found {
			missing = append(missing, "cgroup2")
		}
	}
	if c.layout.UnifiedLimits {
		return missing
	}
	for _, ctrl := range v1Controllers {
		if c.layout.V1[ctrl] == "" {
			continue
		}
		found := false
		for _, line := range strings.Split(string(procCgroup), "\n") {
			parts := strings.SplitN(line, ":", 3)
			if len(parts) == 3 && parts[2] == want && slices.Contains(strings.Split(parts[1], ","), ctrl) {
				found = true
			}
		}
		if !found {
			missing = append(missing, ctrl)
		}
	}
	return missing
}

// cgroupListed reports whether a /proc/PID/cgroup text ("N:ctrls:/path"
// lines) places the process in cgroup name, in any hierarchy.
func cgroupListed(procCgroup []byte, name string) bool {
	want := "/" + name
	for _, line := range strings.Split(string(procCgroup), "\n") {
		parts := strings.SplitN(line, ":", 3)
		if len(parts) == 3 && parts[2] == want {
			return true
		}
	}
	return false
}

// Kill kills every process in the cgroup, including those that forked away
// from their parent or started a session of their own, and returns once
// none is left (or ctx ends). With cgroup.kill (cgroup v2, Linux 5.14) the
// kernel does it at once; otherwise forks are stopped first (pids.max 0) and
// every listed process is killed until the list stays empty.
func (c *Cgroup) Kill(ctx context.Context) error {
	if d := c.unifiedDir(); d != "" {
		err := writeCgroupFile(filepath.Join(d, "cgroup.kill"), "1")
		switch {
		case err == nil:
			if err := c.waitEmpty(ctx); err != nil {
				return err
			}
			return c.renewUnified(ctx, d)
		case errors.Is(err, fs.ErrNotExist):
			if _, serr := os.Stat(d); serr == nil {
				break // the directory is there: a kernel without cgroup.kill
			}
			// No unified directory: nothing was placed there; use v1.
		default:
			return fmt.Errorf("killing cgroup %s: %w", c.name, err)
		}
	}
	if d := c.limitDir("pids"); d != "" {
		// Forks stop for the kill, and resume after: the cgroup may be
		// used again (a VM stopped, to be started later).
		file := filepath.Join(d, "pids.max")
		limit, err := os.ReadFile(file)
		if err == nil {
			err = writeCgroupFile(file, "0")
		}
		if err != nil && !errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("stopping forks in cgroup %s: %w", c.name, err)
		}
		if err == nil {
			defer writeCgroupFile(file, strings.TrimSpace(string(limit)))
		}
	}
	for {
		pids, err := c.Procs()
		if err != nil {
			return err
		}
		if len(pids) == 0 {
			return nil
		}
		for _, pid := range pids {
			if err := c.killMember(pid); err != nil {
				return fmt.Errorf("killing cgroup %s: %w", c.name, err)
			}
		}
		if err := pause(ctx, time.Millisecond); err != nil {
			return fmt.Errorf("killing cgroup %s: processes %v remain: %w", c.name, pids, err)
		}
	}
}

// unifiedLimitFiles are the files of a v2 cgroup that hold a VM's limits.
var unifiedLimitFiles = []string{"memory.max", "memory.swap.max", "pids.max", "cpu.weight"}

// renewUnified makes the cgroup's unified directory d anew, with the limits
// it held, once cgroup.kill has emptied it. A cgroup once killed through
// cgroup.kill stays deadly to a process cloned into it: the kernel (6.18,
// run: TestKillCgroup) kills, at its first instruction, a child started
// there with CLONE_INTO_CGROUP (a process that joins through cgroup.procs
// is spared). A VM's cgroup is used again at its next boot, so it is
// removed (it is empty) and made again.
func (c *Cgroup) renewUnified(ctx context.Context, d string) error {
	var saved []cgroupWrite
	if c.layout.UnifiedLimits {
		for _, f := range unifiedLimitFiles {
			if b, err := os.ReadFile(filepath.Join(d, f)); err == nil {
				saved = append(saved, cgroupWrite{filepath.Join(d, f), strings.TrimSpace(string(b)), true})
			}
		}
	}
	for {
		err := os.Remove(d)
		if err == nil || errors.Is(err, fs.ErrNotExist) {
			break
		}
		if !errors.Is(err, syscall.EBUSY) {
			return fmt.Errorf("renewing killed cgroup %s: %w", d, err)
		}
		// A killed task still being torn down.
		if err := pause(ctx, time.Millisecond); err != nil {
			return fmt.Errorf("renewing killed cgroup %s: %w", d, err)
		}
	}
	if err := os.Mkdir(d, 0o755); err != nil {
		return fmt.Errorf("renewing killed cgroup %s: %w", d, err)
	}
	for _, s := range saved {
		if err := writeCgroupFile(s.file, s.value); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("renewing killed cgroup %s: setting %s to %s: %w", d, s.file, s.value, err)
		}
	}
	return nil
}

// waitEmpty waits until no process is listed in the cgroup.
func (c *Cgroup) waitEmpty(ctx context.Context) error {
	// Killed processes take a millisecond or so to exit: short steps at
	// first, so the wait ends close to when they are gone.
	for wait := 50 * time.Microsecond; ; wait = min(wait*3/2, 5*time.Millisecond) {
		pids, err := c.Procs()
		if err != nil {
			return err
		}
		if len(pids) == 0 {
			return nil
		}
		if err := pause(ctx, wait); err != nil {
			return fmt.Errorf("killing cgroup %s: processes %v remain: %w", c.name, pids, err)
		}
	}
}

func pause(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// Remove kills what is in the cgroup and removes its directory from every
// hierarchy. A process that joins while it runs (one being started) is
// killed on the next round. A cgroup that does not exist is
// removed already.
func (c *Cgroup) Remove(ctx context.Context) error {
	for {
		if err := c.Kill(ctx); err != nil {
			return err
		}
		var busy error
		for _, d := range c.dirs() {
			err := os.Remove(d)
			switch {
			case err == nil || errors.Is(err, fs.ErrNotExist):
			case errors.Is(err, syscall.EBUSY):
				// A task still being torn down, or one that joined.
				busy = fmt.Errorf("removing cgroup %s: %w", d, err)
			default:
				return fmt.Errorf("removing cgroup %s: %w", d, err)
			}
		}
		if busy == nil {
			return nil
		}
		if err := pause(ctx, time.Millisecond); err != nil {
			return fmt.Errorf("%w (%w)", busy, err)
		}
	}
}

// Children lists the names of the cgroups directly below the cgroup, in any
// of its hierarchies, sorted.
func (c *Cgroup) Children() ([]string, error) {
	var names []string
	for _, d := range c.dirs() {
		ents, err := os.ReadDir(d)
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return nil, err
		}
		for _, e := range ents {
			if e.IsDir() && !slices.Contains(names, e.Name()) {
				names = append(names, e.Name())
			}
		}
	}
	slices.Sort(names)
	return names, nil
}
