package qmp_test

import (
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"vmhost/proc"
	"vmhost/qcow2"
	"vmhost/qmp"
	"vmhost/qmp/qsdsim"
)

// simEnv makes the test binary run as the QSD simulator.
const simEnv = "VMHOST_TEST_QSDSIM"

func TestMain(m *testing.M) {
	if os.Getenv(simEnv) == "1" {
		os.Exit(qsdsim.Main(os.Args[1:]))
	}
	os.Exit(m.Run())
}

// backend is a way to run "qemu-storage-daemon".
type backend struct {
	name    string
	binary  string
	preArgs []string
	env     []string
}

// backends returns the real QSD (when installed) and the simulator, so
// every test body runs against both.
func backends(t *testing.T) []backend {
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	// atexit_sleep_ms: a race-enabled simulator would sleep a second on exit.
	bs := []backend{{name: "qsdsim", binary: self, env: append(os.Environ(), simEnv+"=1", "GORACE=atexit_sleep_ms=0")}}
	if p, err := exec.LookPath("qemu-storage-daemon"); err == nil {
		bs = append([]backend{{name: "qemu", binary: p}}, bs...)
	} else {
		t.Log("qemu-storage-daemon not installed (apt-get install qemu-system-common or qemu-storage-daemon); testing the simulator only")
	}
	return bs
}

// socketDir returns a short directory for sockets (t.TempDir() paths can
// exceed the 108 bytes a socket path may have).
func socketDir(t *testing.T) string {
	d, err := os.MkdirTemp("", "q")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(d) })
	return d
}

func config(b backend, dir string) qmp.QSDConfig {
	return qmp.QSDConfig{
		Binary:    b.binary,
		PreArgs:   b.preArgs,
		Env:       b.env,
		Root:      qmp.RootDisk{Path: filepath.Join(dir, "root.qcow2"), Socket: filepath.Join(dir, "root.vhost")},
		Data:      []qmp.DataDisk{{ID: "data0", Path: filepath.Join(dir, "data0.qcow2"), Socket: filepath.Join(dir, "data0.vhost")}},
		QMPSocket: filepath.Join(dir, "qsd.qmp"),
		PidFile:   filepath.Join(dir, "qsd.pid"),
		LogFile:   filepath.Join(dir, "qsd.log"),
	}
}

func isSocket(path string) bool {
	st, err := os.Stat(path)
	return err == nil && st.Mode()&os.ModeSocket != 0
}

func qemuImgSize(t *testing.T, path string) uint64 {
	t.Helper()
	if _, err := exec.LookPath("qemu-img"); err != nil {
		t.Skip("qemu-img not installed")
	}
	out, err := exec.Command("qemu-img", "info", "-U", "--output=json", path).Output()
	if err != nil {
		t.Fatalf("qemu-img info %s: %v", path, err)
	}
	s := string(out)
	i := strings.Index(s, `"virtual-size": `)
	j := strings.IndexAny(s[i+16:], ",\n")
	n, err := strconv.ParseUint(s[i+16:i+16+j], 10, 64)
	if err != nil {
		t.Fatalf("parsing %q: %v", s, err)
	}
	return n
}

func qemuImgCheck(t *testing.T, path string) {
	t.Helper()
	if out, err := exec.Command("qemu-img", "check", "-q", path).CombinedOutput(); err != nil {
		t.Errorf("qemu-img check %s: %v\n%s", path, err, out)
	}
}

// TestQSD is the one test body run against the real qemu-storage-daemon
// and against qsdsim: launch with a grow, handshake, exports listed,
// throttle changed and read back, resize visible, export added and
// removed, error classes, clean quit.
func TestQSD(t *testing.T) {
	for _, b := range backends(t) {
		t.Run(b.name, func(t *testing.T) { testQSD(t, b) })
	}
}

func testQSD(t *testing.T, b backend) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	dir := socketDir(t)
	cfg := config(b, dir)
	if err := qcow2.Create(cfg.Root.Path, 1<<30); err != nil {
		t.Fatal(err)
	}
	if err := qcow2.Create(cfg.Data[0].Path, 512<<20); err != nil {
		t.Fatal(err)
	}
	cfg.Root.Size = 2 << 30
	cfg.Root.Limits = qmp.ThrottleLimits{IopsTotal: 500}
	q, err := qmp.LaunchQSD(ctx, cfg)
	if err != nil {
		log, _ := os.ReadFile(cfg.LogFile)
		t.Fatalf("%v\nlog:\n%s", err, log)
	}
	defer func() {
		select {
		case <-q.Done():
		default:
			syscallKill(q.Pid)
		}
	}()

	// Ready: greeting, sockets, pidfile, recorded identity.
	c, err := q.Client(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if g := c.Greeting(); g.Version.QEMU.Major != 7 || len(g.Capabilities) == 0 || g.Capabilities[0] != "oob" {
		t.Errorf("greeting = %+v, want QEMU 7 with oob", g)
	}
	for _, p := range []string{cfg.QMPSocket, cfg.Root.Socket, cfg.Data[0].Socket} {
		if !isSocket(p) {
			t.Errorf("%s is not a socket", p)
		}
	}
	if pid, err := os.ReadFile(cfg.PidFile); err != nil || strings.TrimSpace(string(pid)) != strconv.Itoa(q.Pid) {
		t.Errorf("pidfile = %q (%v), want %d", pid, err, q.Pid)
	}
	if st, err := proc.StartTime(q.Pid); err != nil || st != q.StartTime {
		t.Errorf("start time of pid %d = %d (%v), recorded %d", q.Pid, st, err, q.StartTime)
	}

	// The guest-visible capacity already has the grown size: the root
	// export was added after the resize.
	if p := vhostProbe(t, cfg.Root.Socket); p.capacity != (2<<30)/512 || p.blkSize != 512 || p.numQueues != 1 || p.features&(1<<5) != 0 || p.features&(1<<32) == 0 {
		t.Errorf("root export probe = %+v, want 2 GiB of 512-byte sectors, 1 queue, writable, VERSION_1", p)
	}

	// Exports.
	exports, err := c.QueryBlockExports(ctx)
	if err != nil {
		t.Fatal(err)
	}
	wantExport := func(id, node string) {
		t.Helper()
		for _, e := range exports {
			if e.ID == id {
				if e.NodeName != node || e.Type != "vhost-user-blk" || e.ShuttingDown {
					t.Errorf("export %s = %+v, want vhost-user-blk on %s", id, e, node)
				}
				return
			}
		}
		t.Errorf("export %s missing from %+v", id, exports)
	}
	wantExport("root", "root")
	wantExport("data0", "data0")
	if len(exports) != 2 {
		t.Errorf("exports = %+v, want 2", exports)
	}

	// Graph and the grow done before the root export existed.
	nodes, err := c.QueryNamedBlockNodes(ctx)
	if err != nil {
		t.Fatal(err)
	}
	drv := map[string]qmp.BlockNode{}
	for _, n := range nodes {
		drv[n.NodeName] = n
	}
	for name, want := range map[string]string{"root": "throttle", "root-qcow2": "qcow2", "root-file": "file", "data0": "qcow2", "data0-file": "file"} {
		if drv[name].Drv != want {
			t.Errorf("node %s has driver %q, want %q", name, drv[name].Drv, want)
		}
	}
	if drv["root"].Image.VirtualSize != 2<<30 || drv["root-qcow2"].Image.VirtualSize != 2<<30 {
		t.Errorf("root sizes = %d/%d, want 2 GiB after the grow", drv["root"].Image.VirtualSize, drv["root-qcow2"].Image.VirtualSize)
	}
	if got := qemuImgSize(t, cfg.Root.Path); got != 2<<30 {
		t.Errorf("qemu-img info root = %d, want 2 GiB", got)
	}

	// Throttle: initial limits, change, read back; a bad combination fails.
	if l, err := q.RootLimits(ctx); err != nil || l != (qmp.ThrottleLimits{IopsTotal: 500}) {
		t.Errorf("initial limits = %+v (%v), want iops 500", l, err)
	}
	want := qmp.ThrottleLimits{BpsTotal: 10 << 20, IopsTotal: 200}
	if err := q.SetRootLimits(ctx, want); err != nil {
		t.Fatal(err)
	}
	if l, err := q.RootLimits(ctx); err != nil || l != want {
		t.Errorf("limits = %+v (%v), want %+v", l, err, want)
	}
	if err := q.SetRootLimits(ctx, qmp.ThrottleLimits{}); err != nil {
		t.Fatal(err)
	}
	if l, err := q.RootLimits(ctx); err != nil || l != (qmp.ThrottleLimits{}) {
		t.Errorf("limits after reset = %+v (%v), want unlimited", l, err)
	}
	err = c.Execute(ctx, "qom-set", map[string]any{"path": "/objects/root-tg", "property": "limits", "value": map[string]any{"bps-total": 1, "bps-read": 1}}, nil)
	wantQMPError(t, err, "GenericError", "cannot be used at the same time")
	err = c.Execute(ctx, "qom-set", map[string]any{"path": "/objects/nope", "property": "limits", "value": map[string]any{}}, nil)
	wantQMPError(t, err, "DeviceNotFound", "not found")

	// Errors: unknown command, bad sizes, unknown node.
	wantQMPError(t, c.Execute(ctx, "no-such-command", nil, nil), "CommandNotFound", "no-such-command")
	wantQMPError(t, c.BlockResize(ctx, "root", 2147483649), "GenericError", "multiple of 512")
	wantQMPError(t, c.BlockResize(ctx, "nope", 1<<30), "GenericError", "Cannot find device=''")

	// Resize visible in query-named-block-nodes.
	if err := c.BlockResize(ctx, "root", 3<<30); err != nil {
		t.Fatal(err)
	}
	if got, err := q.NodeSize(ctx, "root"); err != nil || got != 3<<30 {
		t.Errorf("root size after block_resize = %d (%v), want 3 GiB", got, err)
	}
	// ... but a 7.2 export keeps telling front-ends the size it had when it
	// was made, even on a new connection: why LaunchQSD grows first.
	if p := vhostProbe(t, cfg.Root.Socket); p.capacity != (2<<30)/512 {
		t.Errorf("root export capacity after a live resize = %d sectors, want the old %d", p.capacity, (2<<30)/512)
	}

	// A blank volume made by QMP blockdev-create (job events, dismissal),
	// then exported and removed at run time.
	data1 := qmp.DataDisk{ID: "data1", Path: filepath.Join(dir, "data1.qcow2"), Socket: filepath.Join(dir, "data1.vhost")}
	if err := c.CreateQcow2(ctx, "mk-data1", data1.Path, 256<<20); err != nil {
		t.Fatal(err)
	}
	if jobs, err := c.QueryJobs(ctx); err != nil || len(jobs) != 0 {
		t.Errorf("jobs after CreateQcow2 = %+v (%v), want none left", jobs, err)
	}
	var jerr *qmp.JobError
	if err := c.CreateQcow2(ctx, "mk-bad", filepath.Join(dir, "nodir", "x.qcow2"), 1<<20); !errors.As(err, &jerr) || !strings.Contains(jerr.Msg, "No such file or directory") {
		t.Errorf("CreateQcow2 in a missing dir = %v, want a JobError naming ENOENT", err)
	}
	if err := q.AddDataExport(ctx, data1); err != nil {
		t.Fatal(err)
	}
	if !isSocket(data1.Socket) {
		t.Errorf("%s is not a socket after AddDataExport", data1.Socket)
	}
	if got, err := q.NodeSize(ctx, "data1"); err != nil || got != 256<<20 {
		t.Errorf("data1 size = %d (%v), want 256 MiB", got, err)
	}
	if exports, err = c.QueryBlockExports(ctx); err != nil || len(exports) != 3 {
		t.Errorf("exports after add = %+v (%v), want 3", exports, err)
	}
	wantQMPError(t, q.AddDataExport(ctx, data1), "GenericError", "Duplicate nodes")
	if err := q.RemoveDataExport(ctx, "data1"); err != nil {
		t.Fatal(err)
	}
	if exports, err = c.QueryBlockExports(ctx); err != nil || len(exports) != 2 {
		t.Errorf("exports after remove = %+v (%v), want 2", exports, err)
	}
	if _, err := q.NodeSize(ctx, "data1"); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("node data1 after remove: %v, want ErrNotExist", err)
	}
	if isSocket(data1.Socket) {
		t.Errorf("%s still exists after RemoveDataExport", data1.Socket)
	}
	if err := q.RemoveDataExport(ctx, "data1"); err != nil {
		t.Errorf("RemoveDataExport of an export already gone = %v, want nothing done", err)
	}
	// What an AddDataExport cut short leaves (the file node alone) makes
	// the next add fail; RemoveDataExport clears it.
	if err := c.BlockdevAdd(ctx, qmp.FileNode("data1-file", data1.Path)); err != nil {
		t.Fatal(err)
	}
	wantQMPError(t, q.AddDataExport(ctx, data1), "GenericError", "Duplicate nodes")
	if err := q.RemoveDataExport(ctx, "data1"); err != nil {
		t.Fatalf("RemoveDataExport of a file node alone: %v", err)
	}
	if err := q.AddDataExport(ctx, data1); err != nil {
		t.Fatalf("AddDataExport after clearing a half-made export: %v", err)
	}
	if err := q.RemoveDataExport(ctx, "data1"); err != nil {
		t.Fatal(err)
	}
	wantQMPError(t, c.BlockdevAdd(ctx, qmp.FileNode("m", filepath.Join(dir, "missing.qcow2"))), "GenericError", "Could not open")

	// Clean quit: process exits 0, sockets and pidfile gone, image clean.
	events := c.Events()
	if err := q.Quit(ctx); err != nil {
		t.Fatal(err)
	}
	var deleted []string
	for ev := range events {
		if ev.Name == "BLOCK_EXPORT_DELETED" {
			deleted = append(deleted, string(ev.Data))
		}
		if ev.Name == "SHUTDOWN" {
			t.Error("QSD sent a SHUTDOWN event")
		}
	}
	if len(deleted) < 2 {
		t.Errorf("BLOCK_EXPORT_DELETED events = %v, want one per export", deleted)
	}
	for _, p := range []string{cfg.QMPSocket, cfg.Root.Socket, cfg.Data[0].Socket, cfg.PidFile} {
		if _, err := os.Stat(p); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s left behind after quit (%v)", p, err)
		}
	}
	qemuImgCheck(t, cfg.Root.Path)
	qemuImgCheck(t, data1.Path)
	if got := qemuImgSize(t, cfg.Root.Path); got != 3<<30 {
		t.Errorf("qemu-img info root after quit = %d, want 3 GiB", got)
	}
}

func wantQMPError(t *testing.T, err error, class, desc string) {
	t.Helper()
	var qe *qmp.Error
	if !errors.As(err, &qe) || qe.Class != class || !strings.Contains(qe.Desc, desc) {
		t.Errorf("error = %v, want a %s containing %q", err, class, desc)
	}
}

func syscallKill(pid int) {
	if p, err := os.FindProcess(pid); err == nil {
		p.Kill()
	}
}

// TestQSDRefusesShrink launches over an image larger than the requested
// size: LaunchQSD must refuse and leave no process behind.
func TestQSDRefusesShrink(t *testing.T) {
	for _, b := range backends(t) {
		t.Run(b.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			dir := socketDir(t)
			cfg := config(b, dir)
			cfg.Data = nil
			if err := qcow2.Create(cfg.Root.Path, 2<<30); err != nil {
				t.Fatal(err)
			}
			cfg.Root.Size = 1 << 30
			q, err := qmp.LaunchQSD(ctx, cfg)
			if err == nil {
				q.Quit(ctx)
				t.Fatal("LaunchQSD shrank the root disk")
			}
			if !strings.Contains(err.Error(), "refusing to shrink") {
				t.Errorf("error = %v, want a shrink refusal", err)
			}
			if got := qemuImgSize(t, cfg.Root.Path); got != 2<<30 {
				t.Errorf("root size = %d, want 2 GiB untouched", got)
			}
			if isSocket(cfg.Root.Socket) {
				t.Error("root export socket exists after a refused launch")
			}
		})
	}
}

// TestQSDStartupFailure: a missing image fails fast with QSD's text in the
// log tail and leaves no sockets.
func TestQSDStartupFailure(t *testing.T) {
	for _, b := range backends(t) {
		t.Run(b.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			dir := socketDir(t)
			cfg := config(b, dir)
			cfg.Data = nil
			start := time.Now()
			_, err := qmp.LaunchQSD(ctx, cfg)
			var early *proc.EarlyExitError
			if !errors.As(err, &early) {
				t.Fatalf("LaunchQSD with a missing image = %v, want an EarlyExitError", err)
			}
			want := "Could not open '" + cfg.Root.Path + "': No such file or directory"
			if !strings.Contains(early.LogTail, want) {
				t.Errorf("log tail = %q, want it to contain %q", early.LogTail, want)
			}
			if time.Since(start) > 10*time.Second {
				t.Errorf("failure took %v", time.Since(start))
			}
			for _, p := range []string{cfg.QMPSocket, cfg.Root.Socket} {
				if _, err := os.Stat(p); err == nil {
					t.Errorf("%s left behind", p)
				}
			}
			// A socket path of 108 bytes or more is refused before spawning.
			cfg.Root.Socket = filepath.Join(dir, strings.Repeat("x", 120))
			if _, err := qmp.LaunchQSD(ctx, cfg); err == nil || !strings.Contains(err.Error(), "socket path") {
				t.Errorf("LaunchQSD with a long socket path = %v", err)
			}
		})
	}
}

// TestQSDDottedArgs runs the ref's dotted command line (not the JSON one
// LaunchQSD writes) and checks SIGTERM, the pidfile lock and re-attaching
// after a detach, on both backends.
func TestQSDDottedArgs(t *testing.T) {
	for _, b := range backends(t) {
		t.Run(b.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			dir := socketDir(t)
			root, data := filepath.Join(dir, "root.qcow2"), filepath.Join(dir, "data0.qcow2")
			for _, p := range []string{root, data} {
				if err := qcow2.Create(p, 1<<30); err != nil {
					t.Fatal(err)
				}
			}
			qmpSock, pidFile, log := filepath.Join(dir, "qsd.qmp"), filepath.Join(dir, "qsd.pid"), filepath.Join(dir, "log")
			args := append(append([]string(nil), b.preArgs...),
				"--blockdev", "driver=file,node-name=root-file,filename="+root,
				"--blockdev", "driver=qcow2,node-name=root-qcow2,file=root-file",
				"--object", "throttle-group,id=root-tg,limits.bps-total=1048576,x-iops-total=50",
				"--blockdev", "driver=throttle,node-name=root,throttle-group=root-tg,file=root-qcow2",
				"--export", "type=vhost-user-blk,id=root,node-name=root,addr.type=unix,addr.path="+filepath.Join(dir, "root.vhost")+",writable=on,num-queues=1",
				"--blockdev", "driver=file,node-name=data0-file,filename="+data,
				"--blockdev", "driver=qcow2,node-name=data0,file=data0-file",
				"--export", "type=vhost-user-blk,id=data0,node-name=data0,addr.type=unix,addr.path="+filepath.Join(dir, "data0.vhost")+",writable=on",
				"--chardev", "socket,id=qmp,path="+qmpSock+",server=on,wait=off",
				"--monitor", "chardev=qmp",
				"--pidfile", pidFile)
			child, err := proc.Spawn(proc.SpawnConfig{Path: b.binary, Args: args, Env: b.env, LogFile: log})
			if err != nil {
				t.Fatal(err)
			}
			defer child.Signal(os.Kill)
			// QSD writes the pidfile once its sockets exist.
			for {
				if _, err := os.Stat(pidFile); err == nil {
					break
				}
				select {
				case <-child.Done():
					t.Fatalf("exited: %s", proc.LogTail(log, 20))
				case <-time.After(2 * time.Millisecond):
				}
			}
			q, err := qmp.AttachQSD(ctx, qmpSock, child.Pid, child.StartTime)
			if err != nil {
				t.Fatalf("%v\n%s", err, proc.LogTail(log, 20))
			}
			if l, err := q.RootLimits(ctx); err != nil || l != (qmp.ThrottleLimits{BpsTotal: 1 << 20, IopsTotal: 50}) {
				t.Errorf("limits from the command line = %+v (%v)", l, err)
			}
			// Detach and re-attach: a new session must negotiate again.
			if err := q.Close(); err != nil {
				t.Fatal(err)
			}
			q, err = qmp.AttachQSD(ctx, qmpSock, child.Pid, child.StartTime)
			if err != nil {
				t.Fatal(err)
			}
			c, err := q.Client(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if exports, err := c.QueryBlockExports(ctx); err != nil || len(exports) != 2 || exports[0].ID != "data0" {
				t.Errorf("exports = %+v (%v), want data0 then root (newest first)", exports, err)
			}
			if _, err := qmp.AttachQSD(ctx, qmpSock, child.Pid, child.StartTime+1); !errors.Is(err, proc.ErrIdentityMismatch) {
				t.Errorf("AttachQSD with a wrong start time = %v, want ErrIdentityMismatch", err)
			}

			// A second daemon on the same pidfile is refused.
			second := exec.Command(b.binary, append(append([]string(nil), b.preArgs...),
				"--chardev", "socket,id=m,path="+filepath.Join(dir, "2.qmp")+",server=on,wait=off",
				"--monitor", "chardev=m", "--pidfile", pidFile)...)
			second.Env = b.env
			out, err := second.CombinedOutput()
			if ee, ok := err.(*exec.ExitError); !ok || ee.ExitCode() != 1 || !strings.Contains(string(out), "Cannot lock pid file") {
				t.Errorf("second daemon on the pidfile: %v, %q; want exit 1 with a lock error", err, out)
			}
			// SIGTERM behaves like quit.
			q.Close()
			if err := child.Signal(syscall.SIGTERM); err != nil {
				t.Fatal(err)
			}
			select {
			case <-child.Done():
			case <-ctx.Done():
				t.Fatal("no exit after SIGTERM")
			}
			if st := child.Exit(); st.Code != 0 || st.Signaled() {
				t.Errorf("exit after SIGTERM = %v, want 0", st)
			}
			for _, p := range []string{qmpSock, pidFile, filepath.Join(dir, "root.vhost"), filepath.Join(dir, "data0.vhost")} {
				if _, err := os.Stat(p); !errors.Is(err, os.ErrNotExist) {
					t.Errorf("%s left behind after SIGTERM", p)
				}
			}
		})
	}
}

// TestQSDStartupErrors: startup failures exit 1 with QSD's message, on
// both backends.
func TestQSDStartupErrors(t *testing.T) {
	for _, b := range backends(t) {
		t.Run(b.name, func(t *testing.T) {
			dir := socketDir(t)
			img := filepath.Join(dir, "img.qcow2")
			raw := filepath.Join(dir, "raw.img")
			if err := qcow2.Create(img, 1<<30); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(raw, make([]byte, 1<<20), 0o600); err != nil {
				t.Fatal(err)
			}
			file := func(path string) []string {
				return []string{"--blockdev", "driver=file,node-name=f,filename=" + path}
			}
			// top → mid → gone, where gone no longer exists. CreateOverlay
			// takes base images only, so top is made while mid is one.
			gone, mid, top := filepath.Join(dir, "gone.qcow2"), filepath.Join(dir, "mid.qcow2"), filepath.Join(dir, "top.qcow2")
			for _, p := range []string{gone, mid} {
				if err := qcow2.Create(p, 1<<30); err != nil {
					t.Fatal(err)
				}
			}
			if err := qcow2.CreateOverlay(top, mid, 1<<30); err != nil {
				t.Fatal(err)
			}
			if err := os.Remove(mid); err != nil {
				t.Fatal(err)
			}
			if err := qcow2.CreateOverlay(mid, gone, 1<<30); err != nil {
				t.Fatal(err)
			}
			if err := os.Remove(gone); err != nil {
				t.Fatal(err)
			}
			qcow2On := []string{"--blockdev", "driver=qcow2,node-name=q,file=f"}
			for _, tc := range []struct {
				name string
				args []string
				want string
			}{
				{"missing image", file(filepath.Join(dir, "nope.qcow2")), "Could not open '" + filepath.Join(dir, "nope.qcow2") + "': No such file or directory"},
				{"raw file", append(file(raw), "--blockdev", "driver=qcow2,node-name=q,file=f"), "Image is not in qcow2 format"},
				{"group before object", append(file(img), "--blockdev", "driver=qcow2,node-name=q,file=f", "--blockdev", "driver=throttle,node-name=t,throttle-group=tg,file=q"), "Throttle group 'tg' does not exist"},
				{"export before node", []string{"--export", "type=vhost-user-blk,id=e,node-name=q,addr.type=unix,addr.path=" + filepath.Join(dir, "e.sock")}, "Cannot find device='' nor node-name='q'"},
				{"missing backing file", append(file(mid), qcow2On...), "--blockdev driver=qcow2,node-name=q,file=f: Could not open backing file: Could not open '" + gone + "': No such file or directory"},
				{"missing backing file down the chain", append(file(top), qcow2On...), "Could not open backing file: Could not open backing file: Could not open '" + gone + "': No such file or directory"},
				{"missing backing node", append(file(mid), "--blockdev", `{"driver":"qcow2","node-name":"q","file":"f","backing":"nope"}`), "Could not open backing file: Cannot find device='nope' nor node-name='nope'"},
				{"missing socket dir", append(file(img), "--export", "type=vhost-user-blk,id=e,node-name=f,addr.type=unix,addr.path="+filepath.Join(dir, "nodir", "e.sock")), "Failed to bind socket to " + filepath.Join(dir, "nodir", "e.sock") + ": No such file or directory"},
			} {
				t.Run(tc.name, func(t *testing.T) {
					cmd := exec.Command(b.binary, append(append([]string(nil), b.preArgs...), tc.args...)...)
					cmd.Env = b.env
					out, err := cmd.CombinedOutput()
					if ee, ok := err.(*exec.ExitError); !ok || ee.ExitCode() != 1 {
						t.Fatalf("exit = %v, want status 1; output %q", err, out)
					}
					if !strings.HasPrefix(string(out), "qemu-storage-daemon: ") || !strings.Contains(string(out), tc.want) {
						t.Errorf("output = %q, want %q", out, tc.want)
					}
				})
			}
		})
	}
}

// probe is what a vhost-user front-end learns before setting up rings.
type probe struct {
	features  uint64
	capacity  uint64 // 512-byte sectors
	blkSize   uint32
	numQueues uint16
}

// vhostProbe sends GET_FEATURES and GET_CONFIG to a vhost-user-blk socket
// (ref §10.11) and disconnects.
func vhostProbe(t *testing.T, path string) probe {
	t.Helper()
	c, err := net.Dial("unix", path)
	if err != nil {
		t.Fatalf("connecting to %s: %v", path, err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	le := binary.LittleEndian
	call := func(req uint32, payload []byte) []byte {
		msg := le.AppendUint32(nil, req)
		msg = le.AppendUint32(msg, 1) // version 1
		msg = le.AppendUint32(msg, uint32(len(payload)))
		if _, err := c.Write(append(msg, payload...)); err != nil {
			t.Fatalf("vhost-user request %d: %v", req, err)
		}
		var hdr [12]byte
		if _, err := io.ReadFull(c, hdr[:]); err != nil {
			t.Fatalf("vhost-user reply to %d: %v", req, err)
		}
		if le.Uint32(hdr[0:]) != req || le.Uint32(hdr[4:]) != 5 {
			t.Fatalf("vhost-user reply header %x to request %d", hdr, req)
		}
		body := make([]byte, le.Uint32(hdr[8:]))
		if _, err := io.ReadFull(c, body); err != nil {
			t.Fatalf("vhost-user reply to %d: %v", req, err)
		}
		return body
	}
	var p probe
	p.features = le.Uint64(call(1, nil))
	cfgReq := make([]byte, 12+60)
	le.PutUint32(cfgReq[4:], 60)
	cfg := call(24, cfgReq)[12:]
	p.capacity = le.Uint64(cfg[0:])
	p.blkSize = le.Uint32(cfg[20:])
	p.numQueues = le.Uint16(cfg[34:])
	return p
}
