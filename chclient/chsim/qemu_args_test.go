package chsim

import (
	"encoding/json"
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

var update = flag.Bool("update", false, "rewrite the qemu argv golden files")

// The vm.create bodies vmhost sends (vm.CHConfig): a classic VM with a cloud-init seed and a
// data volume, and an AppVM. The argv each maps to is kept as a transcript in testdata.
const classicConfig = `{
  "cpus": {"boot_vcpus": 2, "max_vcpus": 2},
  "memory": {"size": 536870912, "shared": true, "hotplug_size": 536870912},
  "payload": {"kernel": "/var/lib/vmhost/kernels/vmlinuz", "initramfs": "/var/lib/vmhost/kernels/initrd.img",
    "cmdline": "console=ttyS0 root=/dev/vda1 rw"},
  "disks": [
    {"vhost_user": true, "vhost_socket": "/run/vmhost/vms/web1/root.vhost"},
    {"path": "/run/vmhost/vms/web1/seed.img", "readonly": true, "image_type": "Raw"},
    {"vhost_user": true, "vhost_socket": "/run/vmhost/vms/web1/data0.vhost"}
  ],
  "net": [{"tap": "vmt-web1-0", "mac": "52:54:00:12:34:56", "mtu": 1500}],
  "serial": {"mode": "Socket", "socket": "/run/vmhost/vms/web1/console.sock"},
  "console": {"mode": "Off"},
  "vsock": {"cid": 3, "socket": "/run/vmhost/vms/web1/vsock.sock"},
  "pvpanic": true,
  "platform": {"serial_number": "ds=nocloud;i=web1"}
}`

const appVMConfig = `{
  "cpus": {"boot_vcpus": 1, "max_vcpus": 2},
  "memory": {"size": 268435456, "shared": true},
  "payload": {"kernel": "/var/cache/vmhost-lane/linux-image-cloud/boot/vmlinuz-6.1.0-50-cloud-amd64",
    "initramfs": "/var/lib/vmhost/initramfs/abc.cpio.gz", "cmdline": "console=ttyS0 quiet"},
  "disks": [
    {"vhost_user": true, "vhost_socket": "/run/vmhost/vms/app1/root.vhost"},
    {"vhost_user": true, "vhost_socket": "/run/vmhost/vms/app1/data0.vhost", "num_queues": 1, "queue_size": 256}
  ],
  "net": [{"tap": "vmt-app1-0", "mac": "52:54:00:ab:cd:ef"}],
  "serial": {"mode": "Socket", "socket": "/run/vmhost/vms/app1/console.sock"},
  "console": {"mode": "Off"},
  "vsock": {"cid": 4, "socket": "/run/vmhost/vms/app1/vsock.sock"},
  "pvpanic": true
}`

// argvFor runs a vm.create body through what vm.boot does before qemu starts: decode,
// validate, CH's device ids and PCI addresses, then the qemu mapping.
func argvFor(t testing.TB, body string, l qemuLaunch) ([]string, []qemuDevice, error) {
	t.Helper()
	var c vmConfig
	if err := json.Unmarshal([]byte(body), &c); err != nil {
		t.Fatal(err)
	}
	if err := validate(&c); err != nil {
		t.Fatal(err)
	}
	s := &sim{vm: &c}
	s.assignDevicesLocked()
	return qemuArgs(s.vm, s.bdfs, l)
}

func TestQemuArgsGolden(t *testing.T) {
	for _, tc := range []struct {
		name, body string
		launch     qemuLaunch
		// CH id → qemu id of the devices whose activation is watched, in PCI order.
		watched string
	}{
		{"classic", classicConfig, qemuLaunch{Accel: "tcg", QMPFD: 3, SerialFD: 4,
			VsockBackend: "/run/vmhost/vms/web1/vsock.sock.vhost-user"},
			"_disk0=ch_disk0 _disk1=ch_disk1 _disk2=ch_disk2 _net3=ch_net3 __rng=ch__rng _vsock4=ch_vsock4"},
		// A classic VM booted by its firmware (OVMF loads the guest's own
		// boot loader): -bios, no -kernel, no -append.
		{"classic-firmware", strings.Replace(classicConfig,
			`"kernel": "/var/lib/vmhost/kernels/vmlinuz", "initramfs": "/var/lib/vmhost/kernels/initrd.img",`,
			`"firmware": "/usr/share/OVMF/OVMF_CODE.fd",`, 1),
			qemuLaunch{Accel: "tcg", QMPFD: 3, SerialFD: 4, VsockBackend: "/run/vmhost/vms/web1/vsock.sock.vhost-user"},
			"_disk0=ch_disk0 _disk1=ch_disk1 _disk2=ch_disk2 _net3=ch_net3 __rng=ch__rng _vsock4=ch_vsock4"},
		// Its net has no mtu (as the engine sends it): the tap's MTU is
		// advertised, as CH does.
		{"appvm", appVMConfig, qemuLaunch{Accel: "kvm", QMPFD: 3, SerialFD: 4,
			VsockBackend: "/run/vmhost/vms/app1/vsock.sock.vhost-user", TapMTU: map[string]int{"vmt-app1-0": 9000}},
			"_disk0=ch_disk0 _disk1=ch_disk1 _net2=ch_net2 __rng=ch__rng _vsock3=ch_vsock3"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			args, devs, err := argvFor(t, tc.body, tc.launch)
			if err != nil {
				t.Fatal(err)
			}
			var watched []string
			for _, d := range devs {
				if d.virtio {
					watched = append(watched, d.chID+"="+d.qemuID)
				}
			}
			if got := strings.Join(watched, " "); got != tc.watched {
				t.Errorf("watched devices = %s\nwant %s", got, tc.watched)
			}
			got := transcript(args)
			golden := filepath.Join("testdata", "qemu-argv-"+tc.name+".golden")
			if *update {
				if err := os.MkdirAll("testdata", 0o755); err != nil {
					t.Fatal(err)
				}
				if err := os.WriteFile(golden, []byte(got), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			want, err := os.ReadFile(golden)
			if err != nil {
				t.Fatalf("%v (run with -update to create it)", err)
			}
			if got != string(want) {
				t.Errorf("qemu argv differs from %s (-update rewrites it):\n%s", golden, got)
			}
		})
	}
}

// transcript renders an argv one option per line, each flag with its value.
func transcript(args []string) string {
	var b strings.Builder
	b.WriteString("qemu-system-x86_64")
	for _, a := range args {
		if strings.HasPrefix(a, "-") {
			b.WriteString(" \\\n  ")
		} else {
			b.WriteString(" ")
		}
		b.WriteString(a)
	}
	b.WriteString("\n")
	return b.String()
}

// TestQemuArgsRefuses: what qemu cannot honour fails the boot with a reason, never a
// guest that silently differs from its config.
func TestQemuArgsRefuses(t *testing.T) {
	launch := qemuLaunch{Accel: "tcg", QMPFD: 3, SerialFD: 4, VsockBackend: "/x.vhost-user"}
	edit := func(body, old, new string) string {
		t.Helper()
		if !strings.Contains(body, old) {
			t.Fatalf("%q not in the config", old)
		}
		return strings.Replace(body, old, new, 1)
	}
	for _, tc := range []struct{ name, body, want string }{
		{"firmware and initramfs", edit(appVMConfig, `"kernel":`, `"firmware": "/fw", "x":`), "needs a kernel payload"},
		{"console tty", edit(appVMConfig, `"console": {"mode": "Off"}`, `"console": {"mode": "Tty"}`), "no console mode Tty"},
		{"serial pty", edit(appVMConfig, `"serial": {"mode": "Socket", "socket": "/run/vmhost/vms/app1/console.sock"}`, `"serial": {"mode": "Pty"}`), "no serial mode Pty"},
		{"tap-less net", edit(appVMConfig, `"tap": "vmt-app1-0", `, ``), "existing taps only"},
		{"disk rate limit", edit(appVMConfig, `"queue_size": 256`, `"queue_size": 256, "rate_limit_group": "g"`), "rate limits"},
		{"net rate limit", edit(appVMConfig, `"mac": "52:54:00:ab:cd:ef"`, `"mac": "52:54:00:ab:cd:ef", "rate_limiter_config": {"bandwidth": {"size": 1250000, "refill_time": 100}}`), "rate limits"},
		{"watchdog", edit(appVMConfig, `"pvpanic": true`, `"pvpanic": true, "watchdog": true`), "virtio-watchdog"},
		{"vsock without backend", appVMConfig, "vhost-device-vsock"},
		{"vhost-user disk serial", edit(appVMConfig, `"queue_size": 256`, `"queue_size": 256, "serial": "data0"`), "cannot give a vhost-user disk a serial"},
		// The cold devices' CH-style slots would reach the hot-plug ports' slot.
		{"too many devices", edit(appVMConfig, `"disks": [`, `"disks": [`+strings.Repeat(`{"path": "/x.img"},`, 24)), "hot-plug ports' slot 0x1e"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := launch
			if tc.name == "vsock without backend" {
				l.VsockBackend = ""
			}
			var c vmConfig
			if err := json.Unmarshal([]byte(tc.body), &c); err != nil {
				t.Fatal(err)
			}
			s := &sim{vm: &c}
			s.assignDevicesLocked()
			_, _, err := qemuArgs(s.vm, s.bdfs, l)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("qemuArgs error = %v, want one containing %q", err, tc.want)
			}
		})
	}
}

func TestQemuID(t *testing.T) {
	for in, want := range map[string]string{"_disk0": "ch_disk0", "__rng": "ch__rng", "my disk": "chmy-20-disk", "a,b": "cha-2c-b"} {
		if got := qemuID(in); got != want {
			t.Errorf("qemuID(%q) = %q, want %q", in, got, want)
		}
	}
}

func TestParseBackendFlags(t *testing.T) {
	cfg, err := parseArgs([]string{"--api-socket", "/x", "--sim-backend", "qemu", "--sim-accel", "tcg",
		"--sim-qemu", "/opt/qemu", "--sim-vsock-backend=/opt/vdv"})
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Backend != BackendQemu || cfg.Accel != "tcg" || cfg.Qemu != "/opt/qemu" || cfg.VsockBackend != "/opt/vdv" {
		t.Errorf("parsed %+v", cfg)
	}
	if cfg, err := parseArgs([]string{"--api-socket", "/x"}); err != nil || cfg.Backend != BackendSim {
		t.Errorf("default backend = %q, %v", cfg.Backend, err)
	}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--sim-backend", "xen"}, "want sim or qemu"},
		{[]string{"--sim-backend", "qemu", "--sim-accel", "hvf"}, "want auto, kvm or tcg"},
		{[]string{"--sim-accel", "tcg"}, "needs --sim-backend qemu"},
		{[]string{"--sim-backend", "qemu", "--sim-poweroff-at-boot"}, "drives the simulated guest"},
		{[]string{"--sim-backend", "qemu", "--sim-activate-delay", "1s"}, "drives the simulated guest"},
	} {
		_, err := parseArgs(append([]string{"--api-socket", "/x"}, tc.args...))
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("parseArgs(%v) error = %v, want %q", tc.args, err, tc.want)
		}
	}
}
