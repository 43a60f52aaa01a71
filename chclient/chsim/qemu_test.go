package chsim_test

import (
	"bytes"
	"compress/gzip"
	"context"
	"debug/elf"
	"encoding/json"
	"fmt"
	"io"
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
	"vmhost/chclient/chsim"
	"vmhost/kmod"
)

// The qemu backend boots a real tiny guest: Debian's cloud kernel (a stock bzImage whose
// virtio drivers are modules) with an initramfs built here whose /init is a busybox script
// that prints on the serial port, loads the modules, and then waits for the ACPI power
// button or panics. It runs where qemu-system-x86_64, a static busybox and the kernel are
// present; under TCG on 2 cores each boot takes 5-15 s.

// laneKernel finds the guest kernel: $VMHOST_LANE_KERNEL, the cloud kernel
// e2e/realguest/prepare.sh keeps under /var/cache/vmhost-lane/current, or a kernel package
// unpacked under /var/cache/vmhost-lane (chclient/chsim/testdata/fetch-lane-kernel.sh),
// and the module tree beside it.
func laneKernel(t testing.TB) (kernel, modules string) {
	t.Helper()
	kernel = os.Getenv("VMHOST_LANE_KERNEL")
	const lane = "/var/cache/vmhost-lane/current"
	if version, err := os.ReadFile(filepath.Join(lane, "kernel-version")); kernel == "" && err == nil {
		kernel = filepath.Join(lane, "cloud-kernel", "vmlinuz")
		modules = os.Getenv("VMHOST_LANE_MODULES")
		if modules == "" {
			modules = filepath.Join(lane, "cloud-kernel", "lib", "modules", strings.TrimSpace(string(version)))
		}
		if _, err := os.Stat(kernel); err != nil {
			t.Skipf("guest kernel: %v", err)
		}
		return kernel, modules
	}
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

func needQemu(t testing.TB) {
	t.Helper()
	if _, err := exec.LookPath("qemu-system-x86_64"); err != nil {
		t.Skip("qemu-system-x86_64 is not installed")
	}
}

// staticBusybox returns a busybox that runs without a dynamic loader.
func staticBusybox(t testing.TB) string {
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

// guestModules are the modules the tiny guest loads (kmod puts each group in dependency
// order); the first group before virtio_blk so that its driver loads at a moment the test
// can see.
var (
	busModules   = []string{"virtio", "virtio_ring", "virtio_pci_modern_dev", "virtio_pci_legacy_dev", "virtio_pci"}
	laterModules = []string{"virtio_blk", "virtio_net", "button", "evdev", "pvpanic", "pvpanic-pci",
		"vsock", "vmw_vsock_virtio_transport_common", "vmw_vsock_virtio_transport"}
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
*tinyguest=vsock*)
	# First boot: the vsock exchange, a mark on vda, and a reboot by the guest itself;
	# second boot: a kernel panic.
	if [ "$(dd if=/dev/vda bs=1 count=1 2>/dev/null)" = M ]; then
		echo "tinyguest: second boot, panicking"
		# Let the UART send the line first: the panic's printk would cut into it.
		sleep 1
		echo c >/proc/sysrq-trigger
	fi
	/bin/vsockguest 1024 5000
	printf M | dd of=/dev/vda bs=1 count=1 conv=notrunc 2>/dev/null
	sync
	echo "tinyguest: rebooting"
	reboot -f
	;;
*tinyguest=hotplug*)
	# Say whenever the virtio disks change: name, size in sectors, PCI address, and the
	# first bytes' letters and digits.
	echo "tinyguest: watching disks"
	last=
	while :; do
		now=
		for b in /sys/block/vd*; do
			[ -e $b ] || continue
			n=${b##*/}
			pci=$(readlink -f $b/device)
			pci=${pci%/*}
			now="$now $n:$(cat $b/size):${pci##*/}:$(head -c 8 /dev/$n | tr -cd A-Za-z0-9)"
		done
		if [ "$now" != "$last" ]; then
			echo "tinyguest: disks now$now."
			last=$now
		fi
		sleep 0.2
	done
	;;
*tinyguest=counter*)
	# A workload whose state lives only in memory: a counter, printed with the uptime and
	# whether the host end of the network answers (eth0 gets the address the command line
	# gives, tinyguest.ip=ADDR/LEN,PEER).
	net=none
	for a in $(cat /proc/cmdline); do
		case $a in tinyguest.ip=*)
			v=${a#tinyguest.ip=}
			ip addr add ${v%,*} dev eth0
			ip link set eth0 up
			peer=${v#*,}
			;;
		esac
	done
	# tinyguest.fill=MiB: the workload also holds that much random data in memory.
	for a in $(cat /proc/cmdline); do
		case $a in tinyguest.fill=*)
			mkdir -p /tmp && mount -t tmpfs -o size=4g tmpfs /tmp
			dd if=/dev/urandom of=/tmp/fill bs=1M count=${a#tinyguest.fill=} 2>/dev/null
			echo "tinyguest: filled $(du -m /tmp/fill | cut -f1) MiB"
			;;
		esac
	done
	i=0
	while :; do
		i=$((i+1))
		if [ -n "$peer" ]; then
			ping -c 1 -W 1 $peer >/dev/null 2>&1 && net=ok || net=down
		fi
		# What vda holds now, read from the device (not the guest's cache).
		echo 3 >/proc/sys/vm/drop_caches
		disk=$(head -c 8 /dev/vda | tr -cd A-Za-z0-9)
		echo "tinyguest: tick $i up $(cut -d' ' -f1 /proc/uptime) net $net disk ${disk:-none}"
		sleep 0.2
	done
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
func buildInitramfs(t testing.TB, dir, busybox, modules string, extra map[string][]byte) string {
	t.Helper()
	files := map[string][]byte{}
	for n, data := range extra {
		files[n] = data
	}
	var names []string
	bb, err := os.ReadFile(busybox)
	if err != nil {
		t.Fatal(err)
	}
	files["bin/busybox"] = bb
	// kmod orders each group after what its modules depend on: the order
	// changes between kernel builds (6.1.0-56's virtio needs virtio_ring).
	tree, err := kmod.Open(modules)
	if err != nil {
		t.Skipf("no module tree at %s (set VMHOST_LANE_MODULES): %v", modules, err)
	}
	loaded := map[string]bool{}
	group := func(names []string) []string {
		mods, err := tree.Resolve(nil, names)
		if err != nil {
			t.Fatal(err)
		}
		var order []string
		for _, m := range mods {
			if loaded[m.Name] {
				continue
			}
			loaded[m.Name] = true
			files["lib/"+m.Name+".ko"] = m.Data
			order = append(order, m.Name)
		}
		return order
	}
	bus, later := group(busModules), group(laterModules)
	if len(bus) == 0 && len(later) == 0 {
		t.Skipf("no modules under %s (set VMHOST_LANE_MODULES)", modules)
	}
	init := strings.NewReplacer("load BUS", "load "+strings.Join(bus, " "),
		"load LATER", "load "+strings.Join(later, " ")).Replace(tinyInit)
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

func readSerial(t testing.TB, path string) *serialReader {
	t.Helper()
	c, err := net.Dial("unix", path)
	if err != nil {
		t.Fatalf("connecting to the serial socket: %v", err)
	}
	return readConn(t, c)
}

// readConn collects what the guest prints on c.
func readConn(t testing.TB, c net.Conn) *serialReader {
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

func (r *serialReader) wait(t testing.TB, want string, timeout time.Duration) {
	t.Helper()
	r.waitCount(t, want, 1, timeout)
}

// waitSince waits until want has been printed after the first mark bytes
// of the output (a line printed before, for an earlier event, does not
// count).
func (r *serialReader) waitSince(t testing.TB, mark int, want string, timeout time.Duration) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for out := r.String(); !strings.Contains(out[mark:], want); out = r.String() {
		if time.Now().After(deadline) {
			t.Fatalf("the guest did not print %q in %v; serial:\n%s", want, timeout, out[max(0, len(out)-3000):])
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// waitCount waits until want has been printed n times.
func (r *serialReader) waitCount(t testing.TB, want string, n int, timeout time.Duration) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for strings.Count(r.String(), want) < n {
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
	p            *simProc
	serial       *serialReader
	qemu         int         // qemu's pid
	vsockBackend int         // vhost-device-vsock's pid, 0 when none
	fromGuest    chan string // what the guest sent to host port 1024
	qsd          *exec.Cmd   // the qemu-storage-daemon serving disk 0, nil when none
}

// tinyGuestOpts are what differs between the test guests.
type tinyGuestOpts struct {
	mode       string            // tinyguest=<mode> on the command line
	vhostDisk0 bool              // disk 0 is a qemu-storage-daemon vhost-user-blk export
	vsock      bool              // a hybrid vsock device (vhost-device-vsock)
	files      map[string][]byte // extra initramfs files
	memory     int64             // guest RAM in bytes; 0 means 256 MiB
	tap        string            // a net device on this existing tap
	cmdline    string            // more kernel command line
	// start, when set, runs the function that starts the simulator (in a network
	// namespace, for one).
	start func(func() error) error
}

func rawImage(t testing.TB, path string, size int64) {
	t.Helper()
	if err := os.WriteFile(path, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(path, size); err != nil {
		t.Fatal(err)
	}
}

// startQSD exports image as vhost-user-blk on socket, as vmhost's qemu-storage-daemon does.
func startQSD(t testing.TB, image, socket string) *exec.Cmd {
	t.Helper()
	return startQSDFormat(t, image, "raw", socket)
}

// startQSDFormat is startQSD for an image of format raw or qcow2.
func startQSDFormat(t testing.TB, image, format, socket string) *exec.Cmd {
	t.Helper()
	bin, err := exec.LookPath("qemu-storage-daemon")
	if err != nil {
		t.Skip("qemu-storage-daemon is not installed")
	}
	args := []string{"--blockdev", "driver=file,node-name=file0,filename=" + image}
	node := "file0"
	if format == "qcow2" {
		args = append(args, "--blockdev", "driver=qcow2,node-name=fmt0,file=file0")
		node = "fmt0"
	}
	args = append(args, "--export", "type=vhost-user-blk,id=exp0,node-name="+node+",writable=on,addr.type=unix,addr.path="+socket)
	cmd := exec.Command(bin, args...)
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	deadline := time.Now().Add(10 * time.Second)
	for {
		if _, err := os.Stat(socket); err == nil {
			return cmd
		}
		if time.Now().After(deadline) {
			t.Fatal("qemu-storage-daemon did not create its export socket")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// tinyGuestConfig is the tiny guest's CH config with its files in dir: disk 0 of 2 MiB (a
// raw image, or a vhost-user export of 64 MiB, whose qemu-storage-daemon it returns), disk 1
// a read-only raw image of 1 MiB (as a classic VM's root and seed), serial on
// dir/console.sock, console off, pvpanic, vsock on dir/vsock.sock if asked, a tap if asked.
func tinyGuestConfig(t testing.TB, dir, kernel, initrd string, o tinyGuestOpts) (map[string]any, *exec.Cmd) {
	disk0 := map[string]any{"path": filepath.Join(dir, "disk0.img"), "image_type": "Raw"}
	var qsd *exec.Cmd
	if o.vhostDisk0 {
		rawImage(t, filepath.Join(dir, "disk0.img"), 64<<20)
		qsd = startQSD(t, filepath.Join(dir, "disk0.img"), filepath.Join(dir, "disk0.vhost"))
		disk0 = map[string]any{"vhost_user": true, "vhost_socket": filepath.Join(dir, "disk0.vhost")}
	} else {
		rawImage(t, filepath.Join(dir, "disk0.img"), 2<<20)
	}
	rawImage(t, filepath.Join(dir, "disk1.img"), 1<<20)
	memory := o.memory
	if memory == 0 {
		memory = 256 << 20
	}
	cfg := map[string]any{
		"cpus":   map[string]any{"boot_vcpus": 2, "max_vcpus": 2},
		"memory": map[string]any{"size": memory, "shared": true},
		"payload": map[string]any{"kernel": kernel, "initramfs": initrd,
			"cmdline": strings.TrimSpace("console=ttyS0 quiet panic=0 tinyguest=" + o.mode + " " + o.cmdline)},
		"disks": []any{disk0,
			map[string]any{"path": filepath.Join(dir, "disk1.img"), "image_type": "Raw", "readonly": true}},
		"serial":  map[string]any{"mode": "Socket", "socket": filepath.Join(dir, "console.sock")},
		"console": map[string]any{"mode": "Off"},
		"pvpanic": true,
	}
	if o.vsock {
		cfg["vsock"] = map[string]any{"cid": 42, "socket": filepath.Join(dir, "vsock.sock")}
	}
	if o.tap != "" {
		cfg["net"] = []any{map[string]any{"tap": o.tap, "mac": "02:00:00:00:00:2a"}}
	}
	return cfg, qsd
}

// bootTinyGuest creates the tiny guest (tinyGuestConfig) and boots it through the API.
func bootTinyGuest(t testing.TB, o tinyGuestOpts, simArgs ...string) *qemuGuest {
	kernel, modules := laneKernel(t)
	needQemu(t)
	busybox := staticBusybox(t)
	var p *simProc
	if o.start != nil {
		if err := o.start(func() error {
			p = startSimNoFatal(t, append([]string{"--sim-backend", "qemu"}, simArgs...)...)
			return nil
		}); err != nil || p == nil {
			t.Fatalf("starting the simulator: %v", err)
		}
	} else {
		p = startSim(t, append([]string{"--sim-backend", "qemu"}, simArgs...)...)
	}
	initrd := buildInitramfs(t, p.dir, busybox, modules, o.files)
	cfg, qsd := tinyGuestConfig(t, p.dir, kernel, initrd, o)
	serial := filepath.Join(p.dir, "console.sock")
	vsock := filepath.Join(p.dir, "vsock.sock")
	body, _ := json.Marshal(cfg)
	p.wantStatus("PUT", "/api/v1/vm.create", string(body), 204)
	// vmhost reads the console from vm.create on; the stand-in buffers until then anyway.
	g := &qemuGuest{p: p, serial: readSerial(t, serial), fromGuest: make(chan string, 1), qsd: qsd}
	if o.vsock {
		// The host listens for the guest's port 1024 before the guest can dial it.
		l, err := chclient.ListenVsock(vsock, 1024)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { l.Close() })
		go func() {
			c, err := l.Accept()
			if err != nil {
				return
			}
			defer c.Close()
			c.SetDeadline(time.Now().Add(30 * time.Second))
			data, _ := io.ReadAll(c)
			g.fromGuest <- string(data)
		}()
	}
	start := time.Now()
	p.wantStatus("PUT", "/api/v1/vm.boot", "", 204)
	t.Logf("vm.boot answered in %v", time.Since(start))
	if st := p.state(); st != "Running" {
		t.Fatalf("state after boot = %s", st)
	}
	g.findChildren(t, o.vsock)
	return g
}

// findChildren records the pids of qemu and vhost-device-vsock, the stand-in's only
// children.
func (g *qemuGuest) findChildren(t testing.TB, vsock bool) {
	t.Helper()
	g.qemu, g.vsockBackend = 0, 0
	for _, pid := range children(g.p.cmd.Process.Pid) {
		cmdline, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
		name := filepath.Base(string(bytes.SplitN(cmdline, []byte{0}, 2)[0]))
		switch name {
		case "qemu-system-x86_64":
			g.qemu = pid
		case "vhost-device-vsock":
			g.vsockBackend = pid
		default:
			t.Errorf("unexpected child %d of the stand-in: %s", pid, name)
		}
	}
	if g.qemu == 0 || vsock != (g.vsockBackend != 0) {
		t.Fatalf("children of the stand-in: qemu %d, vhost-device-vsock %d", g.qemu, g.vsockBackend)
	}
}

// TestQemuBackendRealGuest boots the tiny guest in qemu through the CH API: its console
// reaches the serial socket, disk activation is reported only once the guest's virtio_blk
// driver has taken the disk, the disks keep CH's order, and the ACPI power button leads to
// the guest's poweroff, CH's shutdown events, the process's exit and qemu's.
func TestQemuBackendRealGuest(t *testing.T) {
	t.Parallel()
	start := time.Now()
	g := bootTinyGuest(t, tinyGuestOpts{mode: "button"})
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

	// vm.reboot resets the guest in the same qemu: its drivers let go of the disk (reset)
	// and take it again when the kernel's init runs once more.
	p.wantStatus("PUT", "/api/v1/vm.reboot", "", 204)
	p.waitEventsFor(60*time.Second, "virtio-device/activated map[id:_disk0]", "vm/rebooting", "vm/rebooted",
		"virtio-device/reset map[id:_disk0]", "virtio-device/activated map[id:_disk0]")
	g.serial.waitCount(t, "tinyguest: waiting for the power button", 2, 60*time.Second)
	if pids := children(p.cmd.Process.Pid); len(pids) != 1 || pids[0] != g.qemu {
		t.Errorf("after vm.reboot the stand-in's children are %v, want the same qemu %d", pids, g.qemu)
	}

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

// vsockBackend returns vhost-device-vsock's path, or skips.
func vsockBackend(t testing.TB) string {
	t.Helper()
	if p, err := exec.LookPath("vhost-device-vsock"); err == nil {
		return p
	}
	if _, err := os.Stat(chsim.DefaultVsockBackend); err == nil {
		return chsim.DefaultVsockBackend
	}
	t.Skip("no vhost-device-vsock: run e2e/realguest/fetch-vhost-device-vsock.sh")
	return ""
}

// buildVsockGuest builds testdata/vsockguest as a static binary for the guest.
func buildVsockGuest(t testing.TB) []byte {
	t.Helper()
	goBin, err := exec.LookPath("go")
	if err != nil {
		t.Skip("no go toolchain to build the guest's vsock program")
	}
	out := filepath.Join(t.TempDir(), "vsockguest")
	cmd := exec.Command(goBin, "build", "-o", out, "./testdata/vsockguest")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if msg, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("building vsockguest: %v\n%s", err, msg)
	}
	data, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	return data
}

// TestQemuBackendAppVMDevices boots the tiny guest with an AppVM's devices: the root disk a
// vhost-user-blk export of qemu-storage-daemon (shared memory), and CH's hybrid vsock
// through vhost-device-vsock. As under CH, the root disk's activation is not announced
// (vhost-user), the raw disk's and vsock's are. The guest dials host port 1024 (reaching <socket>_1024, as
// vmhost's guest agent does) and serves port 5000 (reached by CONNECT 5000 on <socket>).
// Then it reboots itself (CH's reboot events in the same process) and panics: pvpanic is
// CH's guest panic event, the VM stays Running (panic=0 hangs the guest), and vmm.shutdown
// ends qemu and vhost-device-vsock and removes the vsock sockets.
func TestQemuBackendAppVMDevices(t *testing.T) {
	t.Parallel()
	laneKernel(t)
	needQemu(t)
	backend := vsockBackend(t)
	vsg := buildVsockGuest(t)
	g := bootTinyGuest(t, tinyGuestOpts{mode: "vsock", vhostDisk0: true, vsock: true,
		files: map[string][]byte{"bin/vsockguest": vsg}}, "--sim-vsock-backend", backend)
	p := g.p
	vsock := filepath.Join(p.dir, "vsock.sock")

	// vm.shutdown ends qemu and vhost-device-vsock and removes the sockets CH would; the
	// config stays and boots again with new ones (before this guest's kernel is up).
	p.wantStatus("PUT", "/api/v1/vm.shutdown", "", 204)
	if st := p.state(); st != "Created" {
		t.Fatalf("state after vm.shutdown = %s", st)
	}
	if !processGone(g.qemu) || !processGone(g.vsockBackend) {
		t.Fatalf("vm.shutdown left qemu %d or vhost-device-vsock %d running", g.qemu, g.vsockBackend)
	}
	for _, f := range []string{vsock, vsock + ".vhost-user", filepath.Join(p.dir, "console.sock")} {
		if _, err := os.Lstat(f); err == nil {
			t.Errorf("%s left behind by vm.shutdown", f)
		}
	}
	first := g.qemu
	p.wantStatus("PUT", "/api/v1/vm.boot", "", 204)
	g.findChildren(t, true)
	if g.qemu == first {
		t.Fatalf("vm.boot after vm.shutdown kept qemu %d", first)
	}
	g.serial = readSerial(t, filepath.Join(p.dir, "console.sock"))

	g.serial.wait(t, "tinyguest: disks vda=131072 vdb=2048", 60*time.Second)
	// The raw disk's activation is announced; the vhost-user root disk's is not (CH v53).
	p.waitEventsFor(30*time.Second, "virtio-device/activated map[id:_disk1]")
	g.serial.wait(t, "vsockguest: listening", 30*time.Second)
	select {
	case line := <-g.fromGuest:
		if line != "hello from the guest\n" {
			t.Errorf("host port 1024 got %q", line)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("nothing reached the host's listener on port 1024")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := chclient.DialVsock(ctx, vsock, 5000)
	if err != nil {
		t.Fatalf("CONNECT 5000: %v", err)
	}
	conn.SetDeadline(time.Now().Add(10 * time.Second))
	conn.Write([]byte("ping"))
	got, _ := io.ReadAll(conn)
	conn.Close()
	if string(got) != "echo:ping" {
		t.Errorf("guest port 5000 answered %q, want echo:ping", got)
	}
	if !hasEvent(p.eventsSoFar(), "virtio-device/activated", "_vsock2") {
		t.Errorf("no activation of the vsock device: %v", p.eventsSoFar())
	}
	// The guest reboots itself (qemu's RESET): CH's reboot events, same process; the
	// second boot panics.
	// The events first: they are the stand-in's, the serial line is only the guest's word.
	p.waitEventsFor(90*time.Second, "vm/rebooting", "vm/rebooted", "virtio-device/activated map[id:_disk1]",
		"guest/panic map[event:panic]")
	g.serial.wait(t, "tinyguest: second boot, panicking", 10*time.Second)
	if st := p.state(); st != "Running" {
		t.Errorf("state after the panic = %s, want Running (CH changes nothing)", st)
	}
	p.wantStatus("PUT", "/api/v1/vmm.shutdown", "", 200)
	if st := p.wait(t); !st.Success() {
		t.Fatalf("exit after vmm.shutdown = %v", st)
	}
	if !processGone(g.qemu) || !processGone(g.vsockBackend) {
		t.Errorf("children outlived the stand-in: qemu %d gone %v, vhost-device-vsock %d gone %v",
			g.qemu, processGone(g.qemu), g.vsockBackend, processGone(g.vsockBackend))
	}
	evs := p.eventsSoFar()
	if !containsSeq(evs, []string{"vm/rebooting", "vm/rebooted",
		"guest/panic map[event:panic]", "vm/shutdown", "vm/deleted", "vmm/shutdown"}) {
		t.Errorf("events = %v", evs)
	}
	if hasEvent(evs, "virtio-device/activated", "_disk0") {
		t.Errorf("the vhost-user root disk's activation was announced, which CH v53 never does: %v", evs)
	}
	for _, f := range []string{vsock, vsock + ".vhost-user"} {
		if _, err := os.Lstat(f); err == nil {
			t.Errorf("%s left behind", f)
		}
	}
}

// TestQemuBackendBootFailure: when qemu cannot start the VM, vm.boot answers 500 with what
// qemu said, the VM stays Created and nothing is left running.
func TestQemuBackendBootFailure(t *testing.T) {
	t.Parallel()
	needQemu(t)
	p := startSim(t, "--sim-backend", "qemu")
	kernel := filepath.Join(p.dir, "kernel") // never run: qemu fails before
	rawImage(t, kernel, 4096)
	for _, tc := range []struct {
		name, disk, want string
	}{
		{"vhost-user socket missing", fmt.Sprintf(`{"vhost_user":true,"vhost_socket":%q}`, filepath.Join(p.dir, "nothing.vhost")), "nothing.vhost"},
		{"disk image missing", fmt.Sprintf(`{"path":%q,"image_type":"Raw"}`, filepath.Join(p.dir, "nothing.img")), "nothing.img"},
	} {
		body := fmt.Sprintf(`{"cpus":{"boot_vcpus":1,"max_vcpus":1},"memory":{"size":134217728,"shared":true},`+
			`"payload":{"kernel":%q},"disks":[%s],"console":{"mode":"Off"},"serial":{"mode":"Null"}}`, kernel, tc.disk)
		p.wantStatus("PUT", "/api/v1/vm.create", body, 204)
		chain := errorChain(t, p.wantStatus("PUT", "/api/v1/vm.boot", "", 500))
		if chain[1] != "The VM could not boot" || !strings.Contains(lastOf(chain), tc.want) {
			t.Errorf("%s: vm.boot error chain = %q, want qemu's reason mentioning %q", tc.name, chain, tc.want)
		}
		t.Logf("%s: %q", tc.name, chain)
		if st := p.state(); st != "Created" {
			t.Errorf("%s: state after the failed boot = %s", tc.name, st)
		}
		if kids := children(p.cmd.Process.Pid); len(kids) != 0 {
			t.Errorf("%s: children left after the failed boot: %v", tc.name, kids)
		}
		p.wantStatus("PUT", "/api/v1/vm.delete", "", 204)
	}
}

// TestQemuBackendQemuDies: qemu dying on its own is a VMM crash: the process exits 1
// without CH's shutdown events.
func TestQemuBackendQemuDies(t *testing.T) {
	t.Parallel()
	g := bootTinyGuest(t, tinyGuestOpts{mode: "button"})
	if err := syscall.Kill(g.qemu, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	st := g.p.wait(t)
	if st.ExitCode() != 1 {
		t.Fatalf("the stand-in exited %v after qemu died, want exit status 1", st)
	}
	if evs := g.p.eventsSoFar(); hasEvent(evs, "vm/shutdown", "") || hasEvent(evs, "vmm/shutdown", "") {
		t.Errorf("shutdown events after a crash: %v", evs)
	}
	log, _ := os.ReadFile(g.p.log)
	if !strings.Contains(string(log), "qemu exited unexpectedly") {
		t.Errorf("the log does not say qemu died:\n%s", log)
	}
}
