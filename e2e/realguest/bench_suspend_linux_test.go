package realguest

import (
	"bytes"
	"compress/gzip"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"vmhost/qmp"
)

// TestRealGuestSuspendBench measures a suspend and a start from it through
// the agent's API beside the same guest saved and restored by hand with
// QEMU, and beside a cold boot (only with VMHOST_SUSPEND_BENCH=1;
// bench/suspend.sh runs it). Issue 32 asks for the time to the guest
// agent's first heartbeat, but QEMU 7.2 cannot migrate an AppVM (its
// vhost-user vsock), so the guest is a classic one whose heartbeat is a
// tick line it prints on its serial port every 50 ms: the first tick
// after a start is its first sign of life, seen on the agent's side in the
// console log the agent keeps (<run>/vms/<id>/console.log) and on the
// hand side on qemu's serial socket, both read every 5 ms.
//
// The guest: OVMF (as the lane's Debian guest), systemd-boot on a FAT root
// disk, the lane's cloud kernel and a busybox initramfs whose init starts
// the ticks at once and then fills a quarter of the guest's memory with
// random data (tmpfs), so the saved state is not only zero pages. The
// agent boots it as a classic VM; the hand side runs qemu with the argv
// of the agent's own qemu (read from /proc), its monitor and serial on
// socketpairs, its disk a copy of the same image served by a
// qemu-storage-daemon of its own.
//
// Each round runs four sides, in an order that rotates each round:
//
//   - agent: POST suspend until 204 (state saved, processes gone), then
//     POST start until the first new tick;
//   - by hand: stop + migrate to a file (exec:cat, the rate limit lifted,
//     as the backend does) until cat has written it + quit until qemu
//     exited; then qemu ... -incoming exec:cat + cont until the first new
//     tick; the suspend is also shown with an fsync of the file after it,
//     as the agent syncs its saved state;
//   - by hand as the backend: the same with the file passed to qemu
//     (getfd, migrate to fd:, -incoming fd:), as the simulator's qemu
//     backend, which stands in for Cloud Hypervisor, does it: what of
//     the agent's time is the stand-in's way rather than the agent's;
//   - cold: POST stop (not timed), then POST start until the first tick;
//     then, once the guest has filled its memory again, a suspend of the
//     guest just booted, timed apart, and a start from it (not timed).
//
// That last suspend is apart because a guest just booted has most of its
// memory untouched, and qemu's migration allocates each such page as it
// reads it, which takes longer than the rest of the save; a guest
// restored with -incoming has all of its memory in place. The hand side's
// qemu is always one restored from its previous save, so the agent's
// guest is too at each agent suspend: before the first round both guests
// are saved and restored once (the agent's suspend timed apart as above,
// the hand side's not timed).
//
// A resume must go on where the guest was: its first tick the one after
// the last before the suspend, and no boot in between (the line init
// prints first); a resume that booted fails the test.
//
// VMHOST_SUSPEND_BENCH_ROUNDS (default 5) and VMHOST_SUSPEND_BENCH_SIZES
// (MiB of guest memory, default "256,1024") set the run;
// VMHOST_SUSPEND_BENCH_JAIL=off runs the agent's VMs unconfined (the hand
// side never is), to see what confinement costs.
func TestRealGuestSuspendBench(t *testing.T) {
	if os.Getenv("VMHOST_SUSPEND_BENCH") != "1" {
		t.Skip("the suspend benchmark runs with VMHOST_SUSPEND_BENCH=1 (bench/suspend.sh)")
	}
	rounds := 5
	if n, err := strconv.Atoi(os.Getenv("VMHOST_SUSPEND_BENCH_ROUNDS")); err == nil && n > 0 {
		rounds = n
	}
	sizes := []int{256, 1024}
	if s := os.Getenv("VMHOST_SUSPEND_BENCH_SIZES"); s != "" {
		sizes = nil
		for _, f := range strings.Split(s, ",") {
			n, err := strconv.Atoi(strings.TrimSpace(f))
			if err != nil || n < 128 {
				t.Fatalf("VMHOST_SUSPEND_BENCH_SIZES=%q: want MiB, at least 128, comma-separated", s)
			}
			sizes = append(sizes, n)
		}
	}
	a := findArtifacts(t)
	for _, p := range []string{"mkfs.vfat", "mmd", "mcopy", "qemu-img"} {
		_, err := exec.LookPath(p)
		need(t, err == nil, p+" is not installed (run e2e/realguest/prepare.sh)")
	}
	_, err := os.Stat(systemdBoot)
	need(t, err == nil, systemdBoot+" is missing (run e2e/realguest/prepare.sh)")
	busybox := "/bin/busybox"
	_, err = os.Stat(busybox)
	need(t, err == nil, "no static busybox (run e2e/realguest/prepare.sh)")

	l := setUp(t, a)
	// A suspend of a large guest under TCG can take longer than the
	// lane's request timeout.
	hc := *l.hc
	hc.Timeout = 10 * time.Minute
	l.hc = &hc
	dir := filepath.Join(l.dir, "bench")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	l.restartServe("host_path_roots", []string{a.cache, filepath.Dir(ovmf), dir})
	confinement := "confined, as the lane runs them"
	if os.Getenv("VMHOST_SUSPEND_BENCH_JAIL") == "off" {
		l.restartServe("jail", map[string]any{"enabled": false})
		confinement = "unconfined (VMHOST_SUSPEND_BENCH_JAIL=off)"
	}

	loads := sampleLoad(t)
	var report strings.Builder
	fmt.Fprintf(&report, "suspend and start from it, real guests (qemu TCG, 1 vCPU, a quarter of memory filled; the agent's VMs %s), %d rounds, medians (min-max):\n", confinement, rounds)
	for _, mib := range sizes {
		fig := suspendBenchSize(l, a, dir, busybox, mib, rounds)
		fig.write(&report, mib)
	}
	fmt.Fprintf(&report, "  load average during the run: %s\n", loads())
	t.Log("\n" + report.String())
	fmt.Print(report.String())
}

const systemdBoot = "/usr/lib/systemd/boot/efi/systemd-bootx64.efi"

// benchBooted is what the bench guest prints when its init starts: never
// after a resume.
const benchBooted = "benchguest: booted"

// benchInit is the bench guest's /init: ticks every 50 ms from the start,
// then the fill.
const benchInit = `#!/bin/busybox sh
/bin/busybox mkdir -p /proc /sys /dev /tmp
/bin/busybox mount -t proc proc /proc
/bin/busybox mount -t devtmpfs dev /dev
/bin/busybox --install -s /bin
echo "benchguest: booted"
(
	i=0
	while :; do
		i=$((i+1))
		echo "benchguest: tick $i"
		usleep 50000
	done
) &
for a in $(cat /proc/cmdline); do
	case $a in benchguest.fill=*)
		mount -t tmpfs -o size=4g tmpfs /tmp
		dd if=/dev/urandom of=/tmp/fill bs=1M count=${a#benchguest.fill=} 2>/dev/null
		echo "benchguest: filled $(du -m /tmp/fill | cut -f1) MiB"
		;;
	esac
done
while :; do sleep 1000; done
`

// benchDisk makes the bench guest's root disk for a guest that fills
// fillMiB: a FAT file system (no partition table; OVMF reads it whole)
// with systemd-boot as the removable-media loader, its entry booting the
// kernel with the busybox initramfs at once (timeout 0), as qcow2.
func benchDisk(t *testing.T, dir, kernel, busybox string, fillMiB int) string {
	t.Helper()
	bb, err := os.ReadFile(busybox)
	if err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	zw := gzip.NewWriter(&buf)
	ino := 1
	entry := func(name string, mode uint32, data []byte) {
		fmt.Fprintf(zw, "070701%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x",
			ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(name)+1, 0)
		ino++
		zw.Write(append([]byte(name), 0))
		pad := func(n int) { zw.Write(make([]byte, (4-n%4)%4)) }
		pad(110 + len(name) + 1)
		zw.Write(data)
		pad(len(data))
	}
	entry("bin", 0o40755, nil)
	entry("bin/busybox", 0o100755, bb)
	entry("init", 0o100755, []byte(benchInit))
	entry("TRAILER!!!", 0, nil)
	if err := zw.Close(); err != nil {
		t.Fatal(err)
	}
	name := fmt.Sprintf("boot-fill%d", fillMiB)
	src := filepath.Join(dir, name+".files")
	if err := os.MkdirAll(src, 0o755); err != nil {
		t.Fatal(err)
	}
	for f, data := range map[string][]byte{
		"initrd.gz":   buf.Bytes(),
		"loader.conf": []byte("timeout 0\ndefault bench.conf\n"),
		"bench.conf": []byte(fmt.Sprintf("title bench\nlinux /vmlinuz\ninitrd /initrd.gz\n"+
			"options console=ttyS0 quiet panic=-1 no_timer_check benchguest.fill=%d\n", fillMiB)),
	} {
		if err := os.WriteFile(filepath.Join(src, f), data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	raw := filepath.Join(dir, name+".img")
	img := filepath.Join(dir, name+".qcow2")
	run(t, "mkfs.vfat", "-C", raw, "65536") // 64 MiB
	run(t, "mmd", "-i", raw, "::/EFI", "::/EFI/BOOT", "::/loader", "::/loader/entries")
	for from, to := range map[string]string{
		systemdBoot:                       "::/EFI/BOOT/BOOTX64.EFI",
		kernel:                            "::/vmlinuz",
		filepath.Join(src, "initrd.gz"):   "::/initrd.gz",
		filepath.Join(src, "loader.conf"): "::/loader/loader.conf",
		filepath.Join(src, "bench.conf"):  "::/loader/entries/bench.conf",
	} {
		run(t, "mcopy", "-i", raw, from, to)
	}
	run(t, "qemu-img", "convert", "-O", "qcow2", raw, img)
	os.Remove(raw)
	return img
}

// suspendFigures are one guest size's samples.
type suspendFigures struct {
	agentSuspend, agentStartAnswered, agentResume []time.Duration
	agentSuspendBooted                            []time.Duration
	handSuspend, handSuspendSynced                []time.Duration
	handContAnswered, handResume                  []time.Duration
	fdSuspend, fdSuspendSynced, fdResume          []time.Duration
	cold                                          []time.Duration
	agentBytes, handBytes                         []int64
	argv                                          []string
}

func (f *suspendFigures) write(w *strings.Builder, mib int) {
	med := func(d []time.Duration) time.Duration {
		d = slices.Clone(d)
		slices.Sort(d)
		return d[len(d)/2]
	}
	row := func(name string, d []time.Duration) {
		s := slices.Clone(d)
		slices.Sort(s)
		fmt.Fprintf(w, "    %-44s %9.0f ms  (%.0f-%.0f, n=%d)\n", name, ms(med(s)), ms(s[0]), ms(s[len(s)-1]), len(s))
	}
	perGiB := func(b []int64) float64 {
		b = slices.Clone(b)
		slices.Sort(b)
		return float64(b[len(b)/2]) / float64(mib<<20) * 1024
	}
	share := func(agent, hand []time.Duration) float64 {
		ag := ms(med(agent))
		return (ag - ms(med(hand))) / ag * 100
	}
	fmt.Fprintf(w, "  %d MiB guest:\n", mib)
	row("agent suspend (API until 204)", f.agentSuspend)
	row("by hand: stop+migrate to file+quit", f.handSuspend)
	row("by hand: the same + fsync of the file", f.handSuspendSynced)
	row("by hand as the backend: migrate to fd:+quit", f.fdSuspend)
	row("by hand as the backend + fsync of the file", f.fdSuspendSynced)
	row("agent suspend of a guest just cold-booted", f.agentSuspendBooted)
	row("agent start from suspend (API until 204)", f.agentStartAnswered)
	row("by hand: -incoming until cont answered", f.handContAnswered)
	row("agent start from suspend until first tick", f.agentResume)
	row("by hand: -incoming+cont until first tick", f.handResume)
	row("by hand as the backend: -incoming fd:, tick", f.fdResume)
	row("agent cold boot until first tick", f.cold)
	fmt.Fprintf(w, "    agent's share ((agent - by hand) / agent, medians): suspend %.0f%% (%.0f%% beside by hand + fsync), start to first tick %.0f%%\n",
		share(f.agentSuspend, f.handSuspend), share(f.agentSuspend, f.handSuspendSynced), share(f.agentResume, f.handResume))
	fmt.Fprintf(w, "    beside by hand as the backend: suspend %.0f%% (beside it + fsync), start to first tick %.0f%%\n",
		share(f.agentSuspend, f.fdSuspendSynced), share(f.agentResume, f.fdResume))
	fmt.Fprintf(w, "    saved state per GiB of guest memory: agent %.0f MiB, by hand %.0f MiB\n", perGiB(f.agentBytes), perGiB(f.handBytes))
}

// suspendBenchSize runs the rounds for a guest of mib MiB.
func suspendBenchSize(l *lane, a artifacts, dir, busybox string, mib, rounds int) *suspendFigures {
	t := l.t
	const ready = 15 * time.Minute // the boot and the fill, under TCG on a busy machine
	fig := &suspendFigures{}
	img := benchDisk(t, dir, a.cloudKernel, busybox, mib/4)

	// The agent's guest.
	id := fmt.Sprintf("sbench%d", mib)
	req := map[string]any{"vm_id": id, "vcpus": 1, "memory_mb": mib, "firmware_path": ovmf,
		"disk": map[string]any{"base_path": img}, "auto_boot": true}
	body, _ := json.Marshal(req)
	l.must("POST", "/api/vms", string(body), http.StatusCreated)
	log := &consoleLog{path: filepath.Join(l.runDir, "vms", id, "console.log")}
	log.waitText(t, 0, "benchguest: filled", ready)
	fig.argv = l.qemuArgv(id)

	// The same guest by hand: the agent's qemu argv, its own storage
	// daemon serving a copy of the same image.
	handImg := filepath.Join(dir, fmt.Sprintf("hand%d.qcow2", mib))
	run(t, "cp", img, handImg)
	sock := filepath.Join(dir, fmt.Sprintf("hand%d.vhost", mib))
	startHandQSD(t, handImg, sock)
	argv := handArgv(t, fig.argv, sock, l.runDir, l.stateDir)
	t.Logf("%d MiB: the agent's qemu runs %q; by hand: %q", mib, fig.argv, argv)
	h := startHandQemu(t, argv, nil)
	h.execute(t, "cont", nil)
	h.serial.waitText(t, "benchguest: filled", ready)

	agentSide := func(n int) {
		start := time.Now()
		l.must("POST", "/api/vms/"+id+"/suspend", "", http.StatusNoContent)
		fig.agentSuspend = append(fig.agentSuspend, time.Since(start))
		fig.agentBytes = append(fig.agentBytes, dirSize(t, filepath.Join(l.stateDir, "vms", id, "suspend")))
		if procs := l.vmProcesses(id); len(procs) > 0 {
			t.Fatalf("round %d: processes of the suspended VM run on: %v", n, procs)
		}
		// The console keeper may still write what the old process sent.
		off, last := log.settle(t)
		start = time.Now()
		l.must("POST", "/api/vms/"+id+"/start", "", http.StatusNoContent)
		fig.agentStartAnswered = append(fig.agentStartAnswered, time.Since(start))
		first := log.waitTick(t, off, last, time.Minute)
		fig.agentResume = append(fig.agentResume, time.Since(start))
		if s, _, _ := log.read(t, off); strings.Contains(s, benchBooted) || first != last+1 {
			t.Errorf("round %d: after the agent's resume the guest printed tick %d first (before the suspend: %d), booted again: %v",
				n, first, last, strings.Contains(s, benchBooted))
		}
	}
	// handSide saves the hand guest and restores it: with exec:cat as a
	// user types it, or (fd) with the file passed to qemu both ways, as
	// the simulator's qemu backend does.
	handSide := func(n int, fd bool) {
		way := "cat"
		if fd {
			way = "fd"
		}
		stream := filepath.Join(dir, fmt.Sprintf("hand%d-%s%d", mib, way, n))
		start := time.Now()
		if fd {
			h.saveFD(t, stream)
		} else {
			h.save(t, stream)
		}
		h.quit(t)
		took := time.Since(start)
		fi, err := os.Stat(stream)
		if err != nil {
			t.Fatal(err)
		}
		// What a suspend to disk must also do (the agent syncs its saved
		// state): the file on the disk.
		syncStart := time.Now()
		f, err := os.Open(stream)
		if err == nil {
			err = f.Sync()
			f.Close()
		}
		if err != nil {
			t.Fatal(err)
		}
		synced := took + time.Since(syncStart)
		if fd {
			fig.fdSuspend = append(fig.fdSuspend, took)
			fig.fdSuspendSynced = append(fig.fdSuspendSynced, synced)
		} else {
			fig.handSuspend = append(fig.handSuspend, took)
			fig.handSuspendSynced = append(fig.handSuspendSynced, synced)
			fig.handBytes = append(fig.handBytes, fi.Size())
		}
		<-h.serial.done
		off, last := h.serial.lastTick()

		var in *os.File
		incoming := "exec:cat " + stream
		if fd {
			if in, err = os.Open(stream); err != nil {
				t.Fatal(err)
			}
			incoming = "fd:5"
		}
		start = time.Now()
		if fd {
			h = startHandQemu(t, append(slices.Clone(argv), "-incoming", incoming), h.serial.bytes(), in)
			in.Close()
		} else {
			h = startHandQemu(t, append(slices.Clone(argv), "-incoming", incoming), h.serial.bytes())
		}
		h.waitMigration(t)
		h.execute(t, "cont", nil)
		if !fd {
			fig.handContAnswered = append(fig.handContAnswered, time.Since(start))
		}
		first := h.serial.waitTick(t, off, last, time.Minute)
		if fd {
			fig.fdResume = append(fig.fdResume, time.Since(start))
		} else {
			fig.handResume = append(fig.handResume, time.Since(start))
		}
		if s := h.serial.String()[off:]; strings.Contains(s, benchBooted) || first != last+1 {
			t.Errorf("round %d: after the hand resume (%s) the guest printed tick %d first (before the suspend: %d), booted again: %v",
				n, way, first, last, strings.Contains(s, benchBooted))
		}
		os.Remove(stream)
	}
	// suspendBooted suspends the agent's guest just booted (timed apart)
	// and starts it from there (not timed).
	suspendBooted := func() {
		start := time.Now()
		l.must("POST", "/api/vms/"+id+"/suspend", "", http.StatusNoContent)
		fig.agentSuspendBooted = append(fig.agentSuspendBooted, time.Since(start))
		off, last := log.settle(t)
		l.must("POST", "/api/vms/"+id+"/start", "", http.StatusNoContent)
		log.waitTick(t, off, last, time.Minute)
	}
	coldSide := func(n int) {
		l.must("POST", "/api/vms/"+id+"/stop", "", http.StatusNoContent)
		l.poll(id+": no process left after stop", time.Minute, func() bool { return len(l.vmProcesses(id)) == 0 })
		off, _ := log.settle(t)
		start := time.Now()
		l.must("POST", "/api/vms/"+id+"/start", "", http.StatusNoContent)
		log.waitTick(t, off, 0, ready)
		fig.cold = append(fig.cold, time.Since(start))
		// The next round starts from a filled guest again (not timed).
		log.waitText(t, off, "benchguest: filled", ready)
		// A freshly booted guest's memory is sparse: qemu's migration
		// faults in every page it has not touched yet (a read of a hole
		// of its memfd allocates the page), which a restored guest, as
		// the hand side's always is, has all in place. The agent's
		// suspend of this guest is timed apart, and a start from it
		// leaves the agent's guest as restored as the hand side's for
		// the next round.
		suspendBooted()
	}
	sides := []func(int){agentSide, func(n int) { handSide(n, false) }, func(n int) { handSide(n, true) }, coldSide}
	// Both guests were just booted: the rounds start from restored ones.
	suspendBooted()
	handSide(-1, true)
	fig.fdSuspend, fig.fdSuspendSynced, fig.fdResume = nil, nil, nil
	for r := range rounds {
		for i := range sides {
			sides[(i+r)%len(sides)](r)
		}
		t.Logf("%d MiB: round %d done", mib, r)
	}
	h.quit(t)
	l.deleteVM("/api/vms", id)
	return fig
}

// qemuArgv is the command line of the qemu that runs VM id (the
// simulator's qemu backend runs it in the VM's jail).
func (l *lane) qemuArgv(id string) []string {
	l.t.Helper()
	for _, pid := range pidsMentioning(l.runDir + "/vms/" + id + "/") {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
		if err != nil {
			continue
		}
		args := strings.Split(strings.TrimSuffix(string(b), "\x00"), "\x00")
		if filepath.Base(args[0]) == "qemu-system-x86_64" {
			return args[1:]
		}
	}
	l.t.Fatalf("%s: no qemu among its processes %v", id, l.vmProcesses(id))
	return nil
}

// handArgv turns the agent's qemu argv into the hand side's: the monitor
// on fd 3, the serial port on fd 4, the root disk on sock. Nothing else
// may name the agent's directories.
func handArgv(t *testing.T, agent []string, sock string, agentDirs ...string) []string {
	t.Helper()
	out := slices.Clone(agent)
	disks := 0
	for i := 1; i < len(out); i++ {
		if out[i-1] != "-chardev" {
			continue
		}
		switch {
		case strings.HasPrefix(out[i], "socket,id=qmp,"):
			out[i] = "socket,id=qmp,fd=3"
		case strings.HasPrefix(out[i], "socket,id=serial0,"):
			out[i] = "socket,id=serial0,fd=4"
		case strings.HasPrefix(out[i], "socket,id=vhost-disk0,"):
			out[i] = "socket,id=vhost-disk0,path=" + sock
			disks++
		}
	}
	if disks != 1 {
		t.Fatalf("the agent's qemu argv has %d vhost-user root disks, want 1: %q", disks, agent)
	}
	for _, a := range out {
		for _, d := range agentDirs {
			if strings.Contains(a, d) {
				t.Fatalf("the hand side's argv would still name %s: %q", d, out)
			}
		}
		if a == "-incoming" {
			t.Fatalf("the agent's qemu argv has -incoming: %q", agent)
		}
	}
	return out
}

// startHandQSD serves image (qcow2) as vhost-user-blk on socket.
func startHandQSD(t *testing.T, image, socket string) {
	t.Helper()
	cmd := exec.Command("qemu-storage-daemon",
		"--blockdev", "driver=file,node-name=file0,filename="+image,
		"--blockdev", "driver=qcow2,node-name=fmt0,file=file0",
		"--export", "type=vhost-user-blk,id=exp0,node-name=fmt0,writable=on,addr.type=unix,addr.path="+socket)
	cmd.Stderr = os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	deadline := time.Now().Add(30 * time.Second)
	for {
		if _, err := os.Stat(socket); err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("qemu-storage-daemon did not create its export socket")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// tickLine matches the bench guest's complete tick lines.
var tickLine = regexp.MustCompile(`benchguest: tick (\d+)\r?\n`)

// lastTickIn is the number of the last complete tick line in s, 0 if none.
func lastTickIn(s string) int {
	m := tickLine.FindAllStringSubmatch(s, -1)
	if len(m) == 0 {
		return 0
	}
	n, _ := strconv.Atoi(m[len(m)-1][1])
	return n
}

// firstTickAfter is the first complete tick line in s numbered above
// last that ends after index from, 0 if none. A line the suspend cut in
// two (its start printed before, its end after) counts once whole.
func firstTickAfter(s string, from, last int) int {
	for _, m := range tickLine.FindAllStringSubmatchIndex(s, -1) {
		if n, _ := strconv.Atoi(s[m[2]:m[3]]); m[1] > from && n > last {
			return n
		}
	}
	return 0
}

// tickLineMax is more than a tick line's length: where a search for the
// line that ends after an offset starts.
const tickLineMax = 64

// consoleLog reads the console log the agent keeps for a VM. Offsets are
// byte counts since the log was first seen; a rotation (the log moved to
// path.1) is followed.
type consoleLog struct {
	path string
	base int64 // bytes of the generations before the current file
	ino  uint64
}

// read returns what the log holds from offset off on (or from the
// oldest byte it still has), the offset that text starts at, and the
// offset of the log's end.
func (c *consoleLog) read(t *testing.T, off int64) (text string, start, end int64) {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Stat(c.path, &st); err != nil {
		if os.IsNotExist(err) {
			return "", off, off
		}
		t.Fatal(err)
	}
	if c.ino != 0 && st.Ino != c.ino {
		// Rotated: the file read so far is now the older generation.
		fi, err := os.Stat(c.path + ".1")
		if err != nil {
			t.Fatal(err)
		}
		c.base += fi.Size()
	}
	var b []byte
	start = -1
	if off < c.base {
		// The end of the older generation, then the current file.
		old, err := os.ReadFile(c.path + ".1")
		if err != nil {
			t.Fatal(err)
		}
		oldStart := c.base - int64(len(old))
		if from := max(off-oldStart, 0); from < int64(len(old)) {
			b, start = old[from:], oldStart+from
		}
	}
	c.ino = st.Ino
	cur, err := os.ReadFile(c.path)
	if err != nil {
		t.Fatal(err)
	}
	from := min(max(off-c.base, 0), int64(len(cur)))
	if start < 0 {
		start = c.base + from
	}
	b = append(b, cur[from:]...)
	return string(b), start, c.base + int64(len(cur))
}

// settle waits until nothing is written to the log for 300 ms, and
// returns its end and the last tick it holds.
func (c *consoleLog) settle(t *testing.T) (int64, int) {
	t.Helper()
	_, _, end := c.read(t, 0)
	for {
		time.Sleep(300 * time.Millisecond)
		_, _, now := c.read(t, 0)
		if now == end {
			break
		}
		end = now
	}
	all, _, end := c.read(t, 0)
	return end, lastTickIn(all)
}

// waitText waits until text is in the log after offset off.
func (c *consoleLog) waitText(t *testing.T, off int64, text string, timeout time.Duration) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		s, _, _ := c.read(t, off)
		if strings.Contains(s, text) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: no %q within %v; the log ends:\n%s", c.path, text, timeout, s[max(0, len(s)-2000):])
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// waitTick waits, reading every 5 ms, until a tick numbered above last
// ends in the log after offset off, and returns its number.
func (c *consoleLog) waitTick(t *testing.T, off int64, last int, timeout time.Duration) int {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		s, start, _ := c.read(t, max(off-tickLineMax, 0))
		if n := firstTickAfter(s, int(off-start), last); n > 0 {
			return n
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: no tick after %d within %v; the log ends:\n%s", c.path, last, timeout, s[max(0, len(s)-2000):])
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// serialConn collects what the hand side's guest prints on its serial
// socket.
type serialConn struct {
	mu   sync.Mutex
	out  []byte
	done chan struct{} // closed when qemu closed its end
}

// readSerialConn reads c into a transcript that starts with prev (what
// the guest printed on the previous qemu's serial port).
func readSerialConn(t *testing.T, c net.Conn, prev []byte) *serialConn {
	r := &serialConn{out: slices.Clone(prev), done: make(chan struct{})}
	t.Cleanup(func() { c.Close() })
	go func() {
		defer close(r.done)
		b := make([]byte, 4096)
		for {
			n, err := c.Read(b)
			r.mu.Lock()
			r.out = append(r.out, b[:n]...)
			r.mu.Unlock()
			if err != nil {
				return
			}
		}
	}()
	return r
}

func (r *serialConn) String() string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return string(r.out)
}

// lastTick returns the transcript's length and its last complete tick.
func (r *serialConn) lastTick() (int64, int) {
	s := r.String()
	return int64(len(s)), lastTickIn(s)
}

func (r *serialConn) bytes() []byte {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.out)
}

func (r *serialConn) waitText(t *testing.T, text string, timeout time.Duration) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !strings.Contains(r.String(), text) {
		if time.Now().After(deadline) {
			s := r.String()
			t.Fatalf("the hand guest did not print %q within %v; serial:\n%s", text, timeout, s[max(0, len(s)-2000):])
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// waitTick is consoleLog.waitTick on the serial socket.
func (r *serialConn) waitTick(t *testing.T, off int64, last int, timeout time.Duration) int {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		from := max(off-tickLineMax, 0)
		s := r.String()[from:]
		if n := firstTickAfter(s, int(off-from), last); n > 0 {
			return n
		}
		if time.Now().After(deadline) {
			t.Fatalf("the hand guest printed no tick after %d within %v; serial:\n%s", last, timeout, s[max(0, len(s)-2000):])
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// handQemu is qemu run by hand: its monitor and serial port on
// socketpairs (fds 3 and 4), more files from fd 5 on; the serial
// transcript goes on from the previous qemu's.
type handQemu struct {
	cmd    *exec.Cmd
	done   chan struct{}
	qmp    *qmp.Client
	serial *serialConn
}

func startHandQemu(t *testing.T, argv []string, prev []byte, extra ...*os.File) *handQemu {
	t.Helper()
	pair := func() (*os.File, *os.File) {
		fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			t.Fatal(err)
		}
		return os.NewFile(uintptr(fds[0]), "parent"), os.NewFile(uintptr(fds[1]), "child")
	}
	qmpParent, qmpChild := pair()
	serialParent, serialChild := pair()
	cmd := exec.Command("qemu-system-x86_64", argv...)
	cmd.ExtraFiles = append([]*os.File{qmpChild, serialChild}, extra...)
	cmd.Stderr = os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	qmpChild.Close()
	serialChild.Close()
	h := &handQemu{cmd: cmd, done: make(chan struct{})}
	go func() { cmd.Wait(); close(h.done) }()
	t.Cleanup(func() { cmd.Process.Kill(); <-h.done })
	conn := func(f *os.File) net.Conn {
		defer f.Close()
		c, err := net.FileConn(f)
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	h.serial = readSerialConn(t, conn(serialParent), prev)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	c, err := qmp.New(ctx, conn(qmpParent))
	if err != nil {
		t.Fatal(err)
	}
	h.qmp = c
	return h
}

func (h *handQemu) execute(t *testing.T, cmd string, args any) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	if err := h.qmp.Execute(ctx, cmd, args, nil); err != nil {
		t.Fatalf("%s: %v", cmd, err)
	}
}

// save stops the guest and has qemu migrate it into path, as by hand
// with QEMU 7.2: exec:cat, the rate limit lifted; it returns once cat has
// written everything.
func (h *handQemu) save(t *testing.T, path string) {
	t.Helper()
	h.execute(t, "stop", nil)
	h.execute(t, "migrate-set-parameters", map[string]any{"max-bandwidth": int64(1) << 40})
	h.execute(t, "migrate", map[string]string{"uri": "exec:cat >" + path})
	h.waitMigration(t)
	// "completed" may come while cat still holds data in its pipe.
	for hasChildren(h.cmd.Process.Pid) {
		time.Sleep(time.Millisecond)
	}
}

// saveFD is save as the simulator's qemu backend does it: the file
// passed to qemu (getfd) and migrate to fd:, complete when qemu says so.
func (h *handQemu) saveFD(t *testing.T, path string) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	h.execute(t, "stop", nil)
	h.execute(t, "migrate-set-parameters", map[string]any{"max-bandwidth": int64(1) << 40})
	if err := h.qmp.GetFD(context.Background(), "bench", f); err != nil {
		t.Fatal(err)
	}
	h.execute(t, "migrate", map[string]string{"uri": "fd:bench"})
	h.waitMigration(t)
}

func (h *handQemu) waitMigration(t *testing.T) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	for {
		var st struct {
			Status    string `json:"status"`
			ErrorDesc string `json:"error-desc"`
		}
		if err := h.qmp.Execute(ctx, "query-migrate", nil, &st); err != nil {
			t.Fatal(err)
		}
		switch st.Status {
		case "completed":
			return
		case "failed", "cancelled":
			t.Fatalf("migration %s: %s", st.Status, st.ErrorDesc)
		}
		time.Sleep(10 * time.Millisecond) // as the backend polls
	}
}

// quit ends qemu and waits until it exited.
func (h *handQemu) quit(t *testing.T) {
	t.Helper()
	h.qmp.Execute(context.Background(), "quit", nil, nil)
	select {
	case <-h.done:
	case <-time.After(30 * time.Second):
		t.Fatal("qemu did not quit")
	}
	h.qmp.Close()
}

func hasChildren(pid int) bool {
	tasks, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/children", pid))
	for _, f := range tasks {
		if b, _ := os.ReadFile(f); len(bytes.TrimSpace(b)) > 0 {
			return true
		}
	}
	return false
}

// sampleLoad samples the 1-minute load average every 10 s until the test
// ends; the function it returns summarizes the samples so far.
func sampleLoad(t *testing.T) func() string {
	var mu sync.Mutex
	var samples []float64
	stop := make(chan struct{})
	t.Cleanup(func() { close(stop) })
	sample := func() {
		b, err := os.ReadFile("/proc/loadavg")
		if err != nil {
			return
		}
		f, err := strconv.ParseFloat(strings.Fields(string(b))[0], 64)
		if err == nil {
			mu.Lock()
			samples = append(samples, f)
			mu.Unlock()
		}
	}
	sample()
	go func() {
		for {
			select {
			case <-stop:
				return
			case <-time.After(10 * time.Second):
				sample()
			}
		}
	}()
	return func() string {
		sample()
		mu.Lock()
		defer mu.Unlock()
		s := slices.Clone(samples)
		slices.Sort(s)
		return fmt.Sprintf("1-min load median %.2f, min %.2f, max %.2f (%d samples every 10 s, %d CPUs)",
			s[len(s)/2], s[0], s[len(s)-1], len(s), runtime.NumCPU())
	}
}
