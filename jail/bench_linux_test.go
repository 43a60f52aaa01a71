package jail_test

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"syscall"
	"testing"
	"time"

	"vmhost/jail"
	"vmhost/proc"
)

// BenchmarkCreate measures what the jail adds to a VM's create: its cgroup
// and root directory, its two processes started jailed, and, at delete, its
// cgroup killed and removed; beside the same two processes started and
// killed plainly, as vmhost did before. The sides alternate in one loop and
// the medians are reported in ms per create: plain, jailed (on this host's
// cgroup layout) and jail (the difference); create, spawn and destroy split
// the jailed side; jail-cpu is the CPU time the jail adds per create (mean),
// which, unlike the wall time, a busy machine does not inflate.
//
// On a host whose cgroup v2 has no controllers but which mounts it (the
// hybrid layout), a third side, v2-placement, starts the same jailed
// processes placed by CLONE_INTO_CGROUP alone in a controller-less v2
// cgroup, without limits: what the jail costs where v1 is not used.
//
// The processes are the real shapes: the static vmhost binary (as the Cloud
// Hypervisor simulator, and as a static CH is) and qemu-storage-daemon (a
// dynamic program of 21 libraries, each a bind in its jail). The plain side
// kills each as soon as it is exec'd, while a jailed one runs on until its
// cgroup is killed: the CPU figure counts the programs' own start-up on the
// jailed side only (the create+boot cost through the agent is e2e's
// BenchmarkCreateJail).
//
//	go test ./jail -run '^$' -bench Create -benchtime 200x
func BenchmarkCreate(b *testing.B) {
	requireRoot(b)
	qsd, err := exec.LookPath("qemu-storage-daemon")
	if err != nil {
		b.Skip("needs qemu-storage-daemon (Debian: qemu-system-common)")
	}
	vmhost := filepath.Join(b.TempDir(), "vmhost")
	build := exec.Command(filepath.Join(runtime.GOROOT(), "bin", "go"), "build", "-o", vmhost, "vmhost")
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		b.Fatalf("building vmhost: %v\n%s", err, out)
	}
	j, base := testJailer(b, nil)
	progs := []proc.SpawnConfig{
		{Path: vmhost, Args: []string{"sim-ch", "--api-socket", "path=" + base + "/ch.sock"}, LogFile: base + "/ch.log"},
		{Path: qsd, LogFile: base + "/qsd.log"},
	}
	x := jail.Exec{Devices: []string{"/dev/null", "/dev/urandom"}}
	cfg := j.Config()
	id, _ := j.AllocateID(nil)
	var v2 *jail.Jailer
	if l := j.Layout(); l.Unified != "" && !l.UnifiedLimits {
		l.UnifiedLimits = true // placement and kill only: the bench makes no limits there
		v2, _ = testJailer(b, &l)
	}

	spawnAll := func(v *jail.VM) []*proc.Child {
		var cs []*proc.Child
		for _, p := range progs {
			if v != nil {
				p.Confine = v.Confine(x)
			}
			c, err := proc.Spawn(p)
			if err != nil {
				b.Fatal(err)
			}
			cs = append(cs, c)
		}
		return cs
	}
	plain := func() time.Duration {
		start := time.Now()
		for _, c := range spawnAll(nil) {
			c.Signal(syscall.SIGKILL)
			c.Exit()
		}
		return time.Since(start)
	}
	destroy := func(v *jail.VM, cs []*proc.Child) {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		if err := v.Destroy(ctx); err != nil {
			b.Fatal(err)
		}
		for _, c := range cs {
			c.Exit()
		}
	}
	var phases [3][]time.Duration
	jailed := func() time.Duration {
		t0 := time.Now()
		v, err := j.VM("bench", id)
		if err != nil {
			b.Fatal(err)
		}
		if err := v.Create(cfg.Limits(512, 2)); err != nil {
			b.Fatal(err)
		}
		t1 := time.Now()
		cs := spawnAll(v)
		t2 := time.Now()
		destroy(v, cs)
		t3 := time.Now()
		for i, d := range []time.Duration{t1.Sub(t0), t2.Sub(t1), t3.Sub(t2)} {
			phases[i] = append(phases[i], d)
		}
		return t3.Sub(t0)
	}
	v2Placement := func() time.Duration {
		t0 := time.Now()
		v, err := v2.VM("bench", id)
		if err != nil {
			b.Fatal(err)
		}
		if err := os.MkdirAll(v.Root, 0o755); err != nil {
			b.Fatal(err)
		}
		if err := os.MkdirAll(filepath.Join(v2.Layout().Unified, v2.CgroupName("bench")), 0o755); err != nil {
			b.Fatal(err)
		}
		destroy(v, spawnAll(v))
		return time.Since(t0)
	}
	plain()
	jailed() // warm: ExecFiles' cache, the page cache
	var p, jl, p2 []time.Duration
	var cpuPlain, cpuJailed time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		c0 := cpuTime(b)
		p = append(p, plain())
		c1 := cpuTime(b)
		jl = append(jl, jailed())
		c2 := cpuTime(b)
		cpuPlain += c1 - c0
		cpuJailed += c2 - c1
		if v2 != nil {
			p2 = append(p2, v2Placement())
		}
	}
	b.StopTimer()
	mp, mj := median(p), median(jl)
	b.ReportMetric(ms(mp), "plain-ms/create")
	b.ReportMetric(ms(mj), "jailed-ms/create")
	b.ReportMetric(ms(mj-mp), "jail-ms/create")
	// CPU time (this process and its reaped children, user and system),
	// which a busy machine does not inflate as it does the wall time.
	b.ReportMetric(ms((cpuJailed-cpuPlain)/time.Duration(b.N)), "jail-cpu-ms/create")
	b.ReportMetric(ms(median(phases[0])), "create-ms")
	b.ReportMetric(ms(median(phases[1])), "spawn-ms")
	b.ReportMetric(ms(median(phases[2])), "destroy-ms")
	if v2 != nil {
		b.ReportMetric(ms(median(p2)-mp), "v2-placement-jail-ms/create")
	}
}

// cpuTime is the user and system time of this process and of its children
// that have been reaped.
func cpuTime(b *testing.B) time.Duration {
	var self, kids syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &self); err != nil {
		b.Fatal(err)
	}
	if err := syscall.Getrusage(syscall.RUSAGE_CHILDREN, &kids); err != nil {
		b.Fatal(err)
	}
	var d time.Duration
	for _, tv := range []syscall.Timeval{self.Utime, self.Stime, kids.Utime, kids.Stime} {
		d += time.Duration(tv.Nano())
	}
	return d
}

func median(ds []time.Duration) time.Duration {
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[len(s)/2]
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
