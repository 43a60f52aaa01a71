package jail_test

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"vmhost/jail"
	"vmhost/proc"
)

// The test binary is also every jailed "VMM" the tests start: a child
// whose behaviour JAILTEST_CHILD names. A child writes what it finds to stdout, which is its
// log file on the host, and "ready" when it has done its part.
func TestMain(m *testing.M) {
	if mode := os.Getenv("JAILTEST_CHILD"); mode != "" {
		os.Exit(child(mode))
	}
	os.Exit(m.Run())
}

// probeOpen is one open a probe child tries from inside its jail.
type probeOpen struct {
	Path  string
	Write bool
}

func child(mode string) int {
	switch mode {
	case "exit":
		return 0
	case "sleep":
		fmt.Println("ready")
		select {}
	case "probe":
		probe()
		fmt.Println("ready")
		select {}
	case "hog":
		fmt.Println("ready")
		var keep [][]byte
		for {
			b := make([]byte, 1<<20)
			for i := 0; i < len(b); i += 4096 {
				b[i] = 1
			}
			keep = append(keep, b)
		}
	case "forker":
		// A child that leaves the forker's session and one that is
		// orphaned by its parent (a double fork): both must die with the
		// cgroup.
		self := os.Args[0] // no /proc/self/exe in a jail without /proc
		fmt.Println("pid", os.Getpid())
		sess := exec.Command(self)
		sess.Env = []string{"JAILTEST_CHILD=sleep"}
		sess.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
		if err := sess.Start(); err != nil {
			fmt.Println("error", err)
			return 1
		}
		fmt.Println("pid", sess.Process.Pid)
		mid := exec.Command(self)
		mid.Env = []string{"JAILTEST_CHILD=middle"}
		mid.Stdout = os.Stdout
		if err := mid.Run(); err != nil {
			fmt.Println("error", err)
			return 1
		}
		fmt.Println("ready")
		select {}
	case "middle":
		self := os.Args[0] // no /proc/self/exe in a jail without /proc
		g := exec.Command(self)
		g.Env = []string{"JAILTEST_CHILD=sleep"}
		g.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
		if err := g.Start(); err != nil {
			fmt.Println("error", err)
			return 1
		}
		fmt.Println("pid", g.Process.Pid)
		return 0 // g is orphaned
	case "off":
		j, err := jail.New(jail.DefaultConfig(), jail.Host{RunDir: "/nonexistent", AgentID: "a"})
		if err != nil {
			fmt.Println("error", err)
			return 1
		}
		fmt.Printf("enabled=%v off=%s\n", j.Enabled(), j.Off())
		return 0
	}
	fmt.Println("unknown mode", mode)
	return 2
}

// probe tries, from inside the jail, what a compromised VMM would: the opens
// of JAILTEST_OPEN, listings, gaining privileges back; and serves a socket
// in its run directory as Cloud Hypervisor does.
func probe() {
	var opens []probeOpen
	json.Unmarshal([]byte(os.Getenv("JAILTEST_OPEN")), &opens)
	for _, o := range opens {
		flag := os.O_RDONLY
		if o.Write {
			flag = os.O_RDWR
		}
		f, err := os.OpenFile(o.Path, flag, 0)
		if err == nil {
			f.Close()
		}
		fmt.Printf("open %s %s\n", o.Path, errName(err))
	}
	for _, d := range strings.Fields(os.Getenv("JAILTEST_LIST")) {
		ents, err := os.ReadDir(d)
		var names []string
		for _, e := range ents {
			names = append(names, e.Name())
		}
		fmt.Printf("list %s %s %s\n", d, errName(err), strings.Join(names, ","))
	}
	fmt.Printf("create / %s\n", errName(os.WriteFile("/x", nil, 0o600)))
	fmt.Printf("setuid0 %s\n", errName(syscall.Setuid(0)))
	fmt.Printf("chroot %s\n", errName(syscall.Chroot("/")))
	fmt.Printf("mount %s\n", errName(syscall.Mount("none", "/dev", "tmpfs", 0, "")))
	if s := os.Getenv("JAILTEST_LISTEN"); s != "" {
		l, err := net.Listen("unix", s)
		fmt.Printf("listen %s %s\n", s, errName(err))
		if err == nil {
			go func() {
				for {
					c, err := l.Accept()
					if err != nil {
						return
					}
					c.Write([]byte("hello from the jail\n"))
					c.Close()
				}
			}()
		}
	}
}

func errName(err error) string {
	if err == nil {
		return "ok"
	}
	var errno syscall.Errno
	if errors.As(err, &errno) {
		return unix.ErrnoName(errno)
	}
	return strings.ReplaceAll(err.Error(), " ", "_")
}

// requireRoot skips t unless it runs as root.
func requireRoot(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: the jail switches uids, mounts, makes device nodes and cgroups (run go test as root)")
	}
}

// testJailer returns a Jailer for t under a run directory of its own, with
// a random agent id under the cgroup parent vmhost-jailtest (so that tests
// running at once, and a real agent, never share a cgroup). layout nil
// detects the host's. The agent's cgroups are removed when t ends.
func testJailer(t testing.TB, layout *jail.Layout) (*jail.Jailer, string) {
	t.Helper()
	requireRoot(t)
	base := t.TempDir()
	run := filepath.Join(base, "run")
	if err := os.Mkdir(run, 0o700); err != nil {
		t.Fatal(err)
	}
	b := make([]byte, 6)
	rand.Read(b)
	agent := "t" + hex.EncodeToString(b)
	cfg := jail.DefaultConfig()
	cfg.CgroupParent = "vmhost-jailtest"
	j, err := jail.New(cfg, jail.Host{RunDir: run, AgentID: agent, Layout: layout})
	if err != nil {
		t.Fatal(err)
	}
	if !j.Enabled() {
		t.Fatalf("jail off as root: %s", j.Off())
	}
	t.Cleanup(func() {
		ids, _ := j.Leftovers()
		for _, id := range ids {
			t.Errorf("cgroup of VM %s left behind", id)
			if v, err := j.VM(id, 1000000); err == nil {
				ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
				v.Destroy(ctx)
				cancel()
			}
		}
		l := j.Layout()
		for _, m := range hierarchies(l) {
			os.Remove(filepath.Join(m, cfg.CgroupParent, agent))
			os.Remove(filepath.Join(m, cfg.CgroupParent)) // shared with other tests: kept while in use
		}
	})
	return j, base
}

// hierarchies lists the mount points a layout's cgroups live in.
func hierarchies(l jail.Layout) []string {
	var ms []string
	if l.Unified != "" {
		ms = append(ms, l.Unified)
	}
	if !l.UnifiedLimits {
		for _, c := range []string{"memory", "pids", "cpu", "cpuacct"} {
			if m := l.V1[c]; m != "" && !contains(ms, m) {
				ms = append(ms, m)
			}
		}
	}
	return ms
}

func contains(ss []string, s string) bool {
	for _, x := range ss {
		if x == s {
			return true
		}
	}
	return false
}

// testBinary is the path of the running test binary, the jailed "VMM".
func testBinary(t testing.TB) string {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	return exe
}

// spawn starts the test binary jailed in v with x, as child mode, with its
// output in logFile, and waits for its "ready" line.
func spawn(t testing.TB, v *jail.VM, x jail.Exec, mode, logFile string, env ...string) *proc.Child {
	t.Helper()
	c, err := proc.Spawn(proc.SpawnConfig{
		Path:    testBinary(t),
		Env:     append([]string{"JAILTEST_CHILD=" + mode}, env...),
		LogFile: logFile,
		Confine: v.Confine(x),
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		c.Signal(syscall.SIGKILL)
		c.Exit()
	})
	waitLine(t, logFile, "ready", c.Done())
	return c
}

// waitLine waits until file holds line, failing if exited closes first.
func waitLine(t testing.TB, file, line string, exited <-chan struct{}) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		if lines := readLines(t, file); contains(lines, line) {
			return
		}
		select {
		case <-exited:
			if contains(readLines(t, file), line) {
				return
			}
			t.Fatalf("child exited before %q; its output:\n%s", line, strings.Join(readLines(t, file), "\n"))
		case <-time.After(2 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatalf("no %q in %s after 20s; output:\n%s", line, file, strings.Join(readLines(t, file), "\n"))
		}
	}
}

func readLines(t testing.TB, file string) []string {
	t.Helper()
	b, err := os.ReadFile(file)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		t.Fatal(err)
	}
	var lines []string
	sc := bufio.NewScanner(strings.NewReader(string(b)))
	for sc.Scan() {
		lines = append(lines, sc.Text())
	}
	return lines
}

// procStatus reads the fields of /proc/PID/status.
func procStatus(t testing.TB, pid int) map[string]string {
	t.Helper()
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		t.Fatal(err)
	}
	m := map[string]string{}
	for _, line := range strings.Split(string(b), "\n") {
		if k, v, ok := strings.Cut(line, ":"); ok {
			m[k] = strings.TrimSpace(v)
		}
	}
	return m
}

// mountTable is the host's mount table without the fields that change by
// themselves (none do for the same mounts): the test compares it whole.
func mountTable(t testing.TB) string {
	t.Helper()
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}
