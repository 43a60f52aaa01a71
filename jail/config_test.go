package jail

import (
	"errors"
	"slices"
	"strings"
	"testing"
)

func TestValidate(t *testing.T) {
	if err := DefaultConfig().Validate(); err != nil {
		t.Fatalf("the default configuration: %v", err)
	}
	for _, tc := range []struct {
		edit func(*Config)
		want string
	}{
		{func(c *Config) { c.IDRange = [2]uint32{0, 10} }, "jail.id_range: must not include 0"},
		{func(c *Config) { c.IDRange = [2]uint32{20, 10} }, "jail.id_range: first id 20 is above last id 10"},
		{func(c *Config) { c.IDRange = [2]uint32{10, 1<<32 - 1} }, "jail.id_range: last id 4294967295 must be below"},
		{func(c *Config) { c.IDRange = [2]uint32{60000, 70000} }, "jail.id_range: must not include 65534"},
		{func(c *Config) { c.CgroupParent = "" }, "jail.cgroup_parent: must not be empty"},
		{func(c *Config) { c.CgroupParent = "/vmhost" }, "jail.cgroup_parent: \"/vmhost\" must be a clean relative path"},
		{func(c *Config) { c.CgroupParent = "a/../b" }, "jail.cgroup_parent: \"a/../b\" must be a clean relative path"},
		{func(c *Config) { c.CgroupParent = "a/.hidden" }, "must not start with a dot"},
		{func(c *Config) { c.CgroupParent = "a b" }, "may hold only letters"},
		{func(c *Config) { c.PidsMax = 100 }, "jail.pids_max: 100 is below 128"},
	} {
		c := DefaultConfig()
		tc.edit(&c)
		err := c.Validate()
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: %v, want an error with %q", c, err, tc.want)
		}
	}
	c := DefaultConfig()
	c.CgroupParent = "machine.slice/vmhost"
	if err := c.Validate(); err != nil {
		t.Errorf("a nested cgroup parent: %v", err)
	}
}

func TestAllocateID(t *testing.T) {
	c := DefaultConfig()
	c.IDRange = [2]uint32{500, 509}
	inUse := map[uint32]bool{}
	for i := 0; i < 10; i++ {
		id, err := c.AllocateID(inUse)
		if err != nil {
			t.Fatalf("allocation %d: %v", i, err)
		}
		if id < 500 || id > 509 || inUse[id] {
			t.Fatalf("allocation %d gave %d (in use: %v)", i, id, inUse)
		}
		inUse[id] = true
	}
	if _, err := c.AllocateID(inUse); !errors.Is(err, ErrNoFreeID) {
		t.Fatalf("a full range: %v, want ErrNoFreeID", err)
	}
	delete(inUse, 503)
	if id, err := c.AllocateID(inUse); err != nil || id != 503 {
		t.Fatalf("the one free id: %d, %v; want 503", id, err)
	}

	// nobody is never given, even in a range that (wrongly) holds it.
	c.IDRange = [2]uint32{65534, 65535}
	for i := 0; i < 20; i++ {
		if id, _ := c.AllocateID(nil); id != 65535 {
			t.Fatalf("got %d from [65534, 65535], want 65535", id)
		}
	}

	// The start is random: a freed id is not the next one given.
	c = DefaultConfig()
	seen := map[uint32]bool{}
	for i := 0; i < 20; i++ {
		id, _ := c.AllocateID(nil)
		seen[id] = true
	}
	if len(seen) < 15 {
		t.Errorf("20 allocations from an empty range gave only %d ids", len(seen))
	}
}

func TestLimits(t *testing.T) {
	c := DefaultConfig()
	l := c.Limits(1024, 4)
	if l.MemoryBytes != (1024+256)<<20 || l.PidsMax != 1024 || l.VCPUs != 4 {
		t.Errorf("Limits(1024, 4) = %+v", l)
	}
	for _, tc := range []struct {
		vcpus          uint32
		weight, shares uint64
	}{{0, 1, 2}, {1, 100, 1024}, {4, 400, 4096}, {100, 10000, 102400}, {300, 10000, 262144}} {
		l := Limits{VCPUs: tc.vcpus}
		if l.cpuWeight() != tc.weight || l.cpuShares() != tc.shares {
			t.Errorf("%d vCPUs: weight %d shares %d, want %d %d", tc.vcpus, l.cpuWeight(), l.cpuShares(), tc.weight, tc.shares)
		}
	}
}

// A hybrid host's mountinfo (this project's CI machine has this shape), a
// cgroup2-only one, and mounts that must not count.
func TestParseMountinfo(t *testing.T) {
	hybrid := `25 30 0:23 / /sys rw,nosuid,nodev,noexec,relatime shared:7 - sysfs sysfs rw
31 25 0:26 / /sys/fs/cgroup rw,relatime shared:9 - tmpfs tmpfs rw,mode=755
32 31 0:27 / /sys/fs/cgroup/unified rw,relatime shared:10 - cgroup2 cgroup2 rw
33 31 0:28 / /sys/fs/cgroup/cpu,cpuacct rw,relatime shared:11 - cgroup cgroup rw,cpu,cpuacct
34 31 0:29 / /sys/fs/cgroup/memory rw,relatime shared:12 - cgroup cgroup rw,memory
35 31 0:30 / /sys/fs/cgroup/pids rw,relatime shared:13 - cgroup cgroup rw,pids
36 31 0:31 / /sys/fs/cgroup/systemd rw,relatime shared:14 - cgroup cgroup rw,xattr,name=systemd
37 90 0:29 /sub /mnt/memory\040copy rw,relatime - cgroup cgroup rw,memory
`
	l, err := parseMountinfo(strings.NewReader(hybrid))
	if err != nil {
		t.Fatal(err)
	}
	if l.Unified != "/sys/fs/cgroup/unified" || l.V1["cpu"] != "/sys/fs/cgroup/cpu,cpuacct" ||
		l.V1["cpuacct"] != "/sys/fs/cgroup/cpu,cpuacct" || l.V1["memory"] != "/sys/fs/cgroup/memory" ||
		l.V1["pids"] != "/sys/fs/cgroup/pids" || len(l.V1) != 4 {
		t.Errorf("hybrid: %+v", l)
	}
	if err := l.check(); err != nil {
		t.Errorf("hybrid: %v", err)
	}
	c := l.Cgroup("vmhost/a1/vm-x")
	wantDirs := []string{"/sys/fs/cgroup/unified/vmhost/a1/vm-x", "/sys/fs/cgroup/cpu,cpuacct/vmhost/a1/vm-x",
		"/sys/fs/cgroup/memory/vmhost/a1/vm-x", "/sys/fs/cgroup/pids/vmhost/a1/vm-x"}
	if got := c.dirs(); !sameSet(got, wantDirs) {
		t.Errorf("dirs = %v, want %v", got, wantDirs)
	}
	self := "12:pids:/system.slice/vmhost.service\n6:memory:/system.slice/vmhost.service\n3:cpu,cpuacct:/\n1:name=systemd:/system.slice/vmhost.service\n0::/system.slice/vmhost.service\n"
	join, leave := c.taskFiles([]byte(self))
	wantJoin := []string{"/sys/fs/cgroup/memory/vmhost/a1/vm-x/tasks", "/sys/fs/cgroup/pids/vmhost/a1/vm-x/tasks", "/sys/fs/cgroup/cpu,cpuacct/vmhost/a1/vm-x/tasks"}
	wantLeave := []string{"/sys/fs/cgroup/memory/system.slice/vmhost.service/tasks", "/sys/fs/cgroup/pids/system.slice/vmhost.service/tasks", "/sys/fs/cgroup/cpu,cpuacct/tasks"}
	if !sameSet(join, wantJoin) || !sameSet(leave, wantLeave) {
		t.Errorf("taskFiles = %v, %v; want %v, %v", join, leave, wantJoin, wantLeave)
	}

	v2 := "40 31 0:27 / /sys/fs/cgroup rw,relatime shared:10 - cgroup2 cgroup2 rw,nsdelegate\n"
	l, _ = parseMountinfo(strings.NewReader(v2))
	if l.Unified != "/sys/fs/cgroup" || len(l.V1) != 0 {
		t.Errorf("v2: %+v", l)
	}
	if err := l.check(); err == nil || !strings.Contains(err.Error(), "memory, pids, cpu, cpuacct") {
		t.Errorf("v2 without its controllers: %v", err)
	}
	l.UnifiedLimits = true
	if err := l.check(); err != nil {
		t.Errorf("v2 with its controllers: %v", err)
	}
	c = l.Cgroup("vmhost/a1/vm-x")
	if join, _ := c.taskFiles(nil); len(join) != 0 {
		t.Errorf("v2 tasks files %v", join)
	}
	if got := c.dirs(); len(got) != 1 || got[0] != "/sys/fs/cgroup/vmhost/a1/vm-x" {
		t.Errorf("v2 dirs %v", got)
	}
	if got := unescapeMountinfo(`/mnt/a\040b\134c`); got != `/mnt/a b\c` {
		t.Errorf("unescape: %q", got)
	}
}

func sameSet(a, b []string) bool {
	return slices.Equal(slices.Sorted(slices.Values(a)), slices.Sorted(slices.Values(b)))
}

func TestCgroupListed(t *testing.T) {
	procCgroup := []byte("12:pids:/vmhost/a/vm-x\n4:memory:/vmhost/a/vm-xy\n1:cpu,cpuacct:/\n0::/vmhost/a/vm-x\n")
	if !cgroupListed(procCgroup, "vmhost/a/vm-x") {
		t.Error("vm-x not found")
	}
	if cgroupListed(procCgroup, "vmhost/a/vm") || cgroupListed(procCgroup, "vmhost/a") {
		t.Error("a prefix matched")
	}
	if !cgroupListed(procCgroup, "vmhost/a/vm-xy") {
		t.Error("vm-xy not found")
	}
}

func TestCgroupNotIn(t *testing.T) {
	hybrid := Layout{Unified: "/sys/fs/cgroup/unified", V1: map[string]string{
		"memory": "/sys/fs/cgroup/memory", "pids": "/sys/fs/cgroup/pids", "cpu": "/sys/fs/cgroup/cpu,cpuacct", "cpuacct": "/sys/fs/cgroup/cpu,cpuacct"}}
	c := hybrid.Cgroup("vmhost/a/vm-x")
	all := "12:pids:/vmhost/a/vm-x\n4:memory:/vmhost/a/vm-x\n3:cpu,cpuacct:/vmhost/a/vm-x\n1:name=systemd:/\n0::/vmhost/a/vm-x\n"
	if m := c.notIn([]byte(all)); len(m) != 0 {
		t.Errorf("placed everywhere, notIn = %v", m)
	}
	// Moved out of its memory cgroup (into another VM's), and out of the
	// unified one: both named, nothing else.
	out := "12:pids:/vmhost/a/vm-x\n4:memory:/vmhost/a/vm-xy\n3:cpu,cpuacct:/vmhost/a/vm-x\n0::/\n"
	if m := c.notIn([]byte(out)); !slices.Equal(m, []string{"cgroup2", "memory"}) {
		t.Errorf("notIn = %v, want [cgroup2 memory]", m)
	}
	// With v2 limits only the unified line counts.
	v2 := Layout{Unified: "/sys/fs/cgroup", UnifiedLimits: true}.Cgroup("vmhost/a/vm-x")
	if m := v2.notIn([]byte("0::/vmhost/a/vm-x\n")); len(m) != 0 {
		t.Errorf("v2, placed: notIn = %v", m)
	}
	if m := v2.notIn([]byte("0::/vmhost/a\n")); !slices.Equal(m, []string{"cgroup2"}) {
		t.Errorf("v2, in the parent: notIn = %v", m)
	}
}
