package chsim_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"vmhost/chclient/chsim"
	"vmhost/qmp"
)

// BenchmarkQemuSnapshotRestore saves and restores a real guest under TCG (the counter
// guest on a qemu-storage-daemon root disk, holding a quarter of its RAM in random data)
// through the simulator's CH API, beside the same guest run by hand: the same qemu command
// line, QEMU 7.2's own migrate to a file (exec:cat, the migration rate limit lifted) and
// -incoming from it. Every iteration does both sides, in alternating order; medians:
//
//   - sim-snapshot-ms, qemu-snapshot-ms: vm.pause + vm.snapshot, beside stop + migrate
//     until the stream is in its file;
//   - sim-restore-ms, qemu-restore-ms: a new process started until the guest runs again
//     (vm.restore with resume answered; -incoming loaded and cont answered);
//   - sim-tick-ms, qemu-tick-ms: the same, until the guest's workload prints again;
//   - sim-MiB/GiB, qemu-MiB/GiB: bytes written per GiB of guest RAM.
//
// The process that took the snapshot exits before each restore, as in a suspend.
//
//	go test ./chclient/chsim -run '^$' -bench QemuSnapshotRestore -benchtime 3x -timeout 30m
func BenchmarkQemuSnapshotRestore(b *testing.B) {
	for _, size := range []struct {
		name   string
		memory int64
	}{{"256MiB", 256 << 20}, {"1GiB", 1 << 30}} {
		b.Run(size.name, func(b *testing.B) { benchSnapshotRestore(b, size.memory) })
	}
}

type benchSide struct {
	snapshot, restore, tick []time.Duration
	bytes                   []int64
}

func (s *benchSide) report(b *testing.B, name string, memory int64) {
	median := func(d []time.Duration) float64 {
		d = slices.Clone(d)
		slices.Sort(d)
		return float64(d[len(d)/2].Microseconds()) / 1000
	}
	bytes := slices.Clone(s.bytes)
	slices.Sort(bytes)
	b.ReportMetric(median(s.snapshot), name+"-snapshot-ms")
	b.ReportMetric(median(s.restore), name+"-restore-ms")
	b.ReportMetric(median(s.tick), name+"-tick-ms")
	b.ReportMetric(float64(bytes[len(bytes)/2])/float64(memory)*1024, name+"-MiB/GiB")
}

func benchSnapshotRestore(b *testing.B, memory int64) {
	kernel, modules := laneKernel(b)
	needQemu(b)
	busybox := staticBusybox(b)
	opts := tinyGuestOpts{mode: "counter", vhostDisk0: true, memory: memory,
		cmdline: fmt.Sprintf("tinyguest.fill=%d", memory>>20/4)}
	const ready = 10 * time.Minute // the fill, under TCG on a busy machine

	// The simulator's guest.
	g := bootTinyGuest(b, opts)
	g.p.timeout = ready
	g.serial.wait(b, "tinyguest: filled", ready)
	g.serial.waitTick(b, 1, time.Minute)
	consoleSock := filepath.Join(g.p.dir, "console.sock")

	// The same guest by hand.
	hdir := shortDir(b)
	initrd := buildInitramfs(b, hdir, busybox, modules, nil)
	cfg, _ := tinyGuestConfig(b, hdir, kernel, initrd, opts)
	body, _ := json.Marshal(cfg)
	argv, err := chsim.QemuCommandLine(body, "tcg")
	if err != nil {
		b.Fatal(err)
	}
	h := startHandQemu(b, argv)
	if err := h.qmp.Execute(context.Background(), "cont", nil, nil); err != nil {
		b.Fatal(err)
	}
	h.serial.wait(b, "tinyguest: filled", ready)
	h.serial.waitTick(b, 1, time.Minute)

	var sim, hand benchSide
	simRound := func(n int) {
		dir := filepath.Join(g.p.dir, fmt.Sprintf("suspend%d", n))
		os.Mkdir(dir, 0o700)
		last := lastTick(g.serial)
		start := time.Now()
		g.p.wantStatus("PUT", "/api/v1/vm.pause", "", 204)
		g.p.wantStatus("PUT", "/api/v1/vm.snapshot", snapshotBody(dir), 204)
		sim.snapshot = append(sim.snapshot, time.Since(start))
		sim.bytes = append(sim.bytes, dirBytes(b, dir))
		g.p.wantStatus("PUT", "/api/v1/vmm.shutdown", "", 200)
		g.p.wait(b)

		start = time.Now()
		p := startSim(b, "--sim-backend", "qemu")
		p.timeout = ready
		p.wantStatus("PUT", "/api/v1/vm.restore", fmt.Sprintf(`{"source_url":%q,"resume":true}`, "file://"+dir), 204)
		sim.restore = append(sim.restore, time.Since(start))
		g.p, g.serial = p, readSerial(b, consoleSock)
		g.serial.waitTick(b, last+1, time.Minute)
		sim.tick = append(sim.tick, time.Since(start))
	}
	handRound := func(n int) {
		stream := filepath.Join(hdir, fmt.Sprintf("stream%d", n))
		last := lastTick(h.serial)
		start := time.Now()
		h.save(b, stream)
		hand.snapshot = append(hand.snapshot, time.Since(start))
		fi, err := os.Stat(stream)
		if err != nil {
			b.Fatal(err)
		}
		hand.bytes = append(hand.bytes, fi.Size())
		h.quit(b)

		start = time.Now()
		h = startHandQemu(b, append(slices.Clone(argv), "-incoming", "exec:cat "+stream))
		h.waitMigration(b)
		if err := h.qmp.Execute(context.Background(), "cont", nil, nil); err != nil {
			b.Fatal(err)
		}
		hand.restore = append(hand.restore, time.Since(start))
		h.serial.waitTick(b, last+1, time.Minute)
		hand.tick = append(hand.tick, time.Since(start))
	}
	b.ResetTimer()
	for n := range b.N {
		if n%2 == 0 {
			simRound(n)
			handRound(n)
		} else {
			handRound(n)
			simRound(n)
		}
	}
	b.StopTimer()
	sim.report(b, "sim", memory)
	hand.report(b, "qemu", memory)
}

func lastTick(r *serialReader) int {
	ts := ticks(r.String())
	if len(ts) == 0 {
		return 0
	}
	return ts[len(ts)-1].n
}

// dirBytes is the size of the files in dir.
func dirBytes(b testing.TB, dir string) int64 {
	entries, err := os.ReadDir(dir)
	if err != nil {
		b.Fatal(err)
	}
	var n int64
	for _, e := range entries {
		fi, err := e.Info()
		if err != nil {
			b.Fatal(err)
		}
		n += fi.Size()
	}
	return n
}

// handQemu is qemu run by hand with the backend's command line: its monitor and serial
// port on socketpairs (fds 3 and 4).
type handQemu struct {
	cmd    *exec.Cmd
	done   chan struct{}
	qmp    *qmp.Client
	serial *serialReader
}

func startHandQemu(b testing.TB, argv []string) *handQemu {
	b.Helper()
	pair := func() (*os.File, *os.File) {
		fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			b.Fatal(err)
		}
		return os.NewFile(uintptr(fds[0]), "parent"), os.NewFile(uintptr(fds[1]), "child")
	}
	qmpParent, qmpChild := pair()
	serialParent, serialChild := pair()
	cmd := exec.Command("qemu-system-x86_64", argv...)
	cmd.ExtraFiles = []*os.File{qmpChild, serialChild}
	cmd.Stderr = os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	qmpChild.Close()
	serialChild.Close()
	h := &handQemu{cmd: cmd, done: make(chan struct{})}
	go func() { cmd.Wait(); close(h.done) }()
	b.Cleanup(func() { cmd.Process.Kill(); <-h.done })
	conn := func(f *os.File) net.Conn {
		defer f.Close()
		c, err := net.FileConn(f)
		if err != nil {
			b.Fatal(err)
		}
		return c
	}
	h.serial = readConn(b, conn(serialParent))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c, err := qmp.New(ctx, conn(qmpParent))
	if err != nil {
		b.Fatal(err)
	}
	h.qmp = c
	return h
}

// save stops the guest and has qemu migrate it into path, as by hand with qemu 7.2:
// exec:cat, with the rate limit lifted; it returns once cat has written everything.
func (h *handQemu) save(b testing.TB, path string) {
	b.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	for _, c := range []struct {
		cmd  string
		args any
	}{
		{"stop", nil},
		{"migrate-set-parameters", map[string]any{"max-bandwidth": int64(1) << 40}},
		{"migrate", map[string]string{"uri": "exec:cat >" + path}},
	} {
		if err := h.qmp.Execute(ctx, c.cmd, c.args, nil); err != nil {
			b.Fatalf("%s: %v", c.cmd, err)
		}
	}
	h.waitMigration(b)
	// "completed" comes while cat may still hold data in its pipe: wait for it to exit.
	for len(children(h.cmd.Process.Pid)) > 0 {
		time.Sleep(time.Millisecond)
	}
}

func (h *handQemu) waitMigration(b testing.TB) {
	b.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	for {
		var st struct {
			Status    string `json:"status"`
			ErrorDesc string `json:"error-desc"`
		}
		if err := h.qmp.Execute(ctx, "query-migrate", nil, &st); err != nil {
			b.Fatal(err)
		}
		switch st.Status {
		case "completed":
			return
		case "failed", "cancelled":
			b.Fatalf("migration %s: %s", st.Status, st.ErrorDesc)
		}
		time.Sleep(10 * time.Millisecond) // as the backend polls
	}
}

func (h *handQemu) quit(b testing.TB) {
	b.Helper()
	h.qmp.Execute(context.Background(), "quit", nil, nil)
	select {
	case <-h.done:
	case <-time.After(10 * time.Second):
		b.Fatal("qemu did not quit")
	}
	h.qmp.Close()
}
