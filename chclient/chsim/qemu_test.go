package chsim_test

import (
	"bytes"
	"compress/gzip"
	"debug/elf"
	"encoding/json"
	"fmt"
	"io/fs"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"vmhost/chclient"
)

// The qemu backend boots a real tiny guest: Debian's cloud kernel (a stock bzImage whose
// virtio drivers are modules) with an initramfs built here whose /init is a busybox script
// that prints on the serial port, loads the modules, and then waits for the ACPI power
// button or panics. It runs where qemu-system-x86_64, a static busybox and the kernel are
// present; under TCG on 2 cores each boot takes 5-15 s.

// laneKernel finds the guest kernel: $VMHOST_LANE_KERNEL, or a kernel package unpacked under
// /var/cache/vmhost-lane (chclient/chsim/testdata/fetch-lane-kernel.sh), and the module
// tree beside it.
func laneKernel(t *testing.T) (kernel, modules string) {
	t.Helper()
	kernel = os.Getenv("VMHOST_LANE_KERNEL")
	if kernel == "" {
		found, _ := filepath.Glob("/var/cache/vmhost-lane/*/boot/vmlinuz-*")
		if len(found) == 0 {
			t.Skip("no guest kernel: set VMHOST_LANE_KERNEL or run chclient/chsim/testdata/fetch-lane-kernel.sh")
		}
		sort.Strings(found)
		kernel = found[len(found)-1]
	}
	if _, err := os.Stat(kernel); err != nil {
		t.Skipf("guest kernel: %v", err)
	}
	version := strings.TrimPrefix(filepath.Base(kernel), "vmlinuz-")
	modules = os.Getenv("VMHOST_LANE_MODULES")
	if modules == "" {
		modules = filepath.Join(filepath.Dir(filepath.Dir(kernel)), "lib", "modules", version)
	}
	return kernel, modules
}

func needQemu(t *testing.T) {
	t.Helper()
	if _, err := exec.LookPath("qemu-system-x86_64"); err != nil {
		t.Skip("qemu-system-x86_64 is not installed")
	}
}

// staticBusybox returns a busybox that runs without a dynamic loader.
func staticBusybox(t *testing.T) string {
	t.Helper()
	for _, p := range []string{"/bin/busybox", "/usr/bin/busybox"} {
		f, err := elf.Open(p)
		if err != nil {
			continue
		}
		dynamic := false
		for _, prog := range f.Progs {
			dynamic = dynamic || prog.Type == elf.PT_INTERP
		}
		f.Close()
		if !dynamic {
			return p
		}
	}
	t.Skip("no static busybox (apt-get install busybox-static)")
	return ""
}

// guestModules are the modules the tiny guest loads, in dependency order; the first group
// before virtio_blk so that its driver loads at a moment the test can see.
var (
	busModules   = []string{"virtio", "virtio_ring", "virtio_pci_modern_dev", "virtio_pci_legacy_dev", "virtio_pci"}
	laterModules = []string{"virtio_blk", "button", "evdev", "pvpanic", "pvpanic-pci"}
)

const tinyInit = `#!/bin/busybox sh
/bin/busybox mkdir -p /proc /sys /dev
/bin/busybox mount -t proc proc /proc
/bin/busybox mount -t sysfs sys /sys
/bin/busybox mount -t devtmpfs dev /dev
/bin/busybox --install -s /bin
load() { for m in "$@"; do [ -e /lib/$m.ko ] && insmod /lib/$m.ko; done; }
load BUS
echo "tinyguest: loading virtio_blk"
sleep 2
load LATER
echo "tinyguest: disks vda=$(cat /sys/block/vda/size) vdb=$(cat /sys/block/vdb/size)"
case "$(cat /proc/cmdline)" in
*tinyguest=panic*)
	echo "tinyguest: panicking"
	echo c >/proc/sysrq-trigger
	;;
esac
ev=
for e in /sys/class/input/event*; do
	grep -q "Power Button" $e/device/name && ev=/dev/input/${e##*/}
done
# Open the device before saying so: a press before the open would be lost.
exec 3<$ev
echo "tinyguest: waiting for the power button on $ev"
dd of=/dev/null bs=24 count=1 <&3 2>/dev/null
echo "tinyguest: power button pressed"
poweroff -f
`

// buildInitramfs writes a gzipped newc cpio with busybox, the modules and /init.
func buildInitramfs(t *testing.T, dir, busybox, modules string) string {
	t.Helper()
	files := map[string][]byte{}
	var names []string
	bb, err := os.ReadFile(busybox)
	if err != nil {
		t.Fatal(err)
	}
	files["bin/busybox"] = bb
	paths := map[string]string{}
	filepath.WalkDir(modules, func(p string, d fs.DirEntry, err error) error {
		if err == nil && !d.IsDir() && strings.HasSuffix(p, ".ko") {
			paths[strings.TrimSuffix(d.Name(), ".ko")] = p
		}
		return nil
	})
	if len(paths) == 0 {
		t.Skipf("no uncompressed modules under %s (set VMHOST_LANE_MODULES)", modules)
	}
	for _, m := range append(append([]string{}, busModules...), laterModules...) {
		p, ok := paths[m]
		if !ok {
			t.Logf("module %s not found under %s: assuming it is built in", m, modules)
			continue
		}
		data, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		files["lib/"+m+".ko"] = data
	}
	init := strings.NewReplacer("load BUS", "load "+strings.Join(busModules, " "),
		"load LATER", "load "+strings.Join(laterModules, " ")).Replace(tinyInit)
	files["init"] = []byte(init)
	for n := range files {
		names = append(names, n)
	}
	sort.Strings(names)

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
	for _, d := range []string{"bin", "lib", "dev", "proc", "sys"} {
		entry(d, 0o40755, nil)
	}
	for _, n := range names {
		entry(n, 0o100755, files[n])
	}
	entry("TRAILER!!!", 0, nil)
	zw.Close()
	path := filepath.Join(dir, "initrd.gz")
	if err := os.WriteFile(path, buf.Bytes(), 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

// serialReader collects what the guest prints on the CH serial socket.
type serialReader struct {
	mu  sync.Mutex
	out []byte
}

func readSerial(t *testing.T, path string) *serialReader {
	t.Helper()
	c, err := net.Dial("unix", path)
	if err != nil {
		t.Fatalf("connecting to the serial socket: %v", err)
	}
	t.Cleanup(func() { c.Close() })
	r := &serialReader{}
	go func() {
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

func (r *serialReader) String() string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return string(r.out)
}

func (r *serialReader) wait(t *testing.T, want string, timeout time.Duration) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !strings.Contains(r.String(), want) {
		if time.Now().After(deadline) {
			out := r.String()
			t.Fatalf("the guest did not print %q in %v; serial:\n%s", want, timeout, out[max(0, len(out)-3000):])
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func hasEvent(evs []chclient.Event, name, id string) bool {
	for _, e := range evs {
		if e.Source+"/"+e.Event == name && (id == "" || e.Properties["id"] == id) {
			return true
		}
	}
	return false
}

// children lists the pids of pid's child processes.
func children(pid int) []int {
	var out []int
	tasks, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/children", pid))
	for _, f := range tasks {
		data, _ := os.ReadFile(f)
		for _, s := range strings.Fields(string(data)) {
			if n, err := strconv.Atoi(s); err == nil {
				out = append(out, n)
			}
		}
	}
	return out
}

// waitEventsFor is waitEvents with a deadline fit for a real guest.
func (p *simProc) waitEventsFor(d time.Duration, want ...string) []chclient.Event {
	p.t.Helper()
	deadline := time.Now().Add(d)
	for {
		evs := p.eventsSoFar()
		if containsSeq(evs, want) {
			return evs
		}
		if time.Now().After(deadline) {
			p.t.Fatalf("events = %v, want subsequence %v", evs, want)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func processGone(pid int) bool {
	return syscall.Kill(pid, 0) == syscall.ESRCH
}

type qemuGuest struct {
	p      *simProc
	serial *serialReader
	qemu   int // qemu's pid
}

// bootTinyGuest creates and boots the tiny guest through the API: disk 0 a raw image of
// 2 MiB, disk 1 a read-only one of 1 MiB (as a classic VM's root and seed), serial on a
// socket, console off, pvpanic.
func bootTinyGuest(t *testing.T, mode string) *qemuGuest {
	kernel, modules := laneKernel(t)
	needQemu(t)
	busybox := staticBusybox(t)
	p := startSim(t, "--sim-backend", "qemu")
	initrd := buildInitramfs(t, p.dir, busybox, modules)
	var disks []string
	for i, size := range []int64{2 << 20, 1 << 20} {
		path := filepath.Join(p.dir, fmt.Sprintf("disk%d.img", i))
		if err := os.WriteFile(path, nil, 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Truncate(path, size); err != nil {
			t.Fatal(err)
		}
		disks = append(disks, path)
	}
	serial := filepath.Join(p.dir, "console.sock")
	cfg := map[string]any{
		"cpus":    map[string]any{"boot_vcpus": 2, "max_vcpus": 2},
		"memory":  map[string]any{"size": 256 << 20, "shared": true},
		"payload": map[string]any{"kernel": kernel, "initramfs": initrd, "cmdline": "console=ttyS0 quiet panic=0 tinyguest=" + mode},
		"disks": []any{map[string]any{"path": disks[0], "image_type": "Raw"},
			map[string]any{"path": disks[1], "image_type": "Raw", "readonly": true}},
		"serial":  map[string]any{"mode": "Socket", "socket": serial},
		"console": map[string]any{"mode": "Off"},
		"pvpanic": true,
	}
	body, _ := json.Marshal(cfg)
	p.wantStatus("PUT", "/api/v1/vm.create", string(body), 204)
	// vmhost reads the console from vm.create on; the stand-in buffers until then anyway.
	g := &qemuGuest{p: p, serial: readSerial(t, serial)}
	start := time.Now()
	p.wantStatus("PUT", "/api/v1/vm.boot", "", 204)
	t.Logf("vm.boot answered in %v", time.Since(start))
	if st := p.state(); st != "Running" {
		t.Fatalf("state after boot = %s", st)
	}
	kids := children(p.cmd.Process.Pid)
	if len(kids) != 1 {
		t.Fatalf("the stand-in has children %v, want qemu alone", kids)
	}
	g.qemu = kids[0]
	return g
}

// TestQemuBackendRealGuest boots the tiny guest in qemu through the CH API: its console
// reaches the serial socket, disk activation is reported only once the guest's virtio_blk
// driver has taken the disk, the disks keep CH's order, and the ACPI power button leads to
// the guest's poweroff, CH's shutdown events, the process's exit and qemu's.
func TestQemuBackendRealGuest(t *testing.T) {
	start := time.Now()
	g := bootTinyGuest(t, "button")
	p := g.p

	g.serial.wait(t, "tinyguest: loading virtio_blk", 60*time.Second)
	t.Logf("the guest's init ran after %v", time.Since(start))
	// The guest waits 2 s before loading virtio_blk: an activation reported now did not
	// come from its driver (a timer, or the firmware's driver, would show here).
	if evs := p.eventsSoFar(); hasEvent(evs, "virtio-device/activated", "_disk0") {
		t.Fatalf("_disk0 reported activated before the guest loaded virtio_blk: %v", evs)
	}
	p.waitEventsFor(30*time.Second, "vm/booting", "vm/booted", "virtio-device/activated map[id:_disk0]")
	// CH's disk order is the guest's: vda is disk 0 (2 MiB), vdb disk 1 (1 MiB).
	g.serial.wait(t, "tinyguest: disks vda=4096 vdb=2048", 30*time.Second)
	g.serial.wait(t, "tinyguest: waiting for the power button", 30*time.Second)
	t.Logf("the guest was up after %v", time.Since(start))

	var info struct {
		State      string
		DeviceTree map[string]json.RawMessage `json:"device_tree"`
	}
	json.Unmarshal(p.wantStatus("GET", "/api/v1/vm.info", "", 200), &info)
	if info.State != "Running" || info.DeviceTree["_disk0"] == nil || info.DeviceTree["_disk1"] == nil {
		t.Errorf("vm.info = %+v", info)
	}
	// The simulator's guest controls do not exist here.
	if resp, _ := p.do("PUT", "/sim/v1/poweroff", ""); resp.StatusCode != 404 {
		t.Errorf("/sim/v1/poweroff = %d, want 404 with the qemu backend", resp.StatusCode)
	}
	p.wantStatus("PUT", "/api/v1/vm.pause", "", 204)
	if st := p.state(); st != "Paused" {
		t.Fatalf("state after pause = %s", st)
	}
	p.wantStatus("PUT", "/api/v1/vm.resume", "", 204)
	p.wantStatus("PUT", "/api/v1/vm.power-button", "", 204)
	g.serial.wait(t, "tinyguest: power button pressed", 30*time.Second)
	st := p.wait(t)
	if !st.Success() {
		t.Fatalf("the stand-in exited %v after the guest's poweroff, want 0", st)
	}
	evs := p.eventsSoFar()
	if !containsSeq(evs, []string{"vm/pausing", "vm/paused", "vm/resuming", "vm/resumed", "vm/shutdown", "vm/deleted", "vmm/shutdown"}) {
		t.Fatalf("events = %v", evs)
	}
	if last := evs[len(evs)-1].String(); last != "vmm/shutdown" {
		t.Errorf("last event = %s, want vmm shutdown", last)
	}
	if !processGone(g.qemu) {
		t.Errorf("qemu (pid %d) outlived the stand-in", g.qemu)
	}
	for _, f := range []string{p.sock, filepath.Join(p.dir, "console.sock")} {
		if _, err := os.Stat(f); err == nil {
			t.Errorf("%s left behind", f)
		}
	}
	if log, err := os.ReadFile(filepath.Join(p.dir, "ch.qemu.log")); err != nil {
		t.Errorf("qemu's log: %v", err)
	} else if len(log) > 0 {
		t.Logf("qemu's log:\n%s", log)
	}
	t.Logf("total %v", time.Since(start))
}

// TestQemuBackendGuestPanic: the guest's pvpanic write is CH's guest panic event; the VM
// stays Running (panic=0 hangs the guest), and vmm.shutdown ends qemu.
func TestQemuBackendGuestPanic(t *testing.T) {
	g := bootTinyGuest(t, "panic")
	p := g.p
	g.serial.wait(t, "tinyguest: panicking", 60*time.Second)
	p.waitEventsFor(30*time.Second, "guest/panic map[event:panic]")
	if st := p.state(); st != "Running" {
		t.Errorf("state after the panic = %s, want Running (CH changes nothing)", st)
	}
	p.wantStatus("PUT", "/api/v1/vmm.shutdown", "", 200)
	if st := p.wait(t); !st.Success() {
		t.Fatalf("exit after vmm.shutdown = %v", st)
	}
	if !processGone(g.qemu) {
		t.Errorf("qemu (pid %d) outlived the stand-in", g.qemu)
	}
}
