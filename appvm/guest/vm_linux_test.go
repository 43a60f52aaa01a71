package guest

import (
	"archive/tar"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"vmhost/appvm/guest/proto"
	"vmhost/initramfs"
)

// vmFixture is an unpacked initramfs holding this test binary as /init,
// and an ext4 root disk on a loop device.
type vmFixture struct {
	initrd, disk, dev string
}

// newVMFixture makes the initramfs and a root disk holding /bin/sh and
// tools (host binaries, with their libraries).
func newVMFixture(t *testing.T, tools ...string) *vmFixture {
	t.Helper()
	requireRoot(t)
	for _, tool := range []string{"unshare", "chroot", "cpio", "mkfs.ext4", "losetup", "debugfs", "ldd"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("%s not installed", tool)
		}
	}
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	work, err := os.MkdirTemp("", "guest-vm-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(work) })

	// The initramfs, unpacked, plus the shared libraries of this (test,
	// not static) binary.
	cpioPath := filepath.Join(work, "initramfs.cpio")
	f, err := os.Create(cpioPath)
	if err != nil {
		t.Fatal(err)
	}
	if err := initramfs.ForGuestAgent(f, exe, nil); err != nil {
		t.Fatal(err)
	}
	f.Close()
	vm := &vmFixture{initrd: filepath.Join(work, "initrd"), disk: filepath.Join(work, "root.img")}
	os.Mkdir(vm.initrd, 0o755)
	unpack := exec.Command("cpio", "-idm", "--quiet", "-F", cpioPath)
	unpack.Dir = vm.initrd
	if out, err := unpack.CombinedOutput(); err != nil {
		t.Fatalf("cpio -i: %v\n%s", err, out)
	}
	copyFiles(t, vm.initrd, libsOf(t, exe))

	// The image root: /bin/sh and its libraries, on an ext4 disk.
	image := filepath.Join(work, "image")
	for _, bin := range append([]string{"/bin/sh"}, tools...) {
		copyFiles(t, image, append([]string{bin}, libsOf(t, bin)...))
	}
	os.MkdirAll(filepath.Join(image, "etc"), 0o755)
	os.WriteFile(filepath.Join(image, "etc/passwd"), []byte("root:x:0:0::/root:/bin/sh\n"), 0o644)
	run(t, "mkfs.ext4", "-q", "-d", image, vm.disk, "32M")
	vm.dev = attachLoop(t, vm.disk)
	return vm
}

// opts runs the agent as PID 1 of new namespaces, chrooted into the
// initramfs.
func (vm *vmFixture) opts(args ...string) agentOpts {
	return agentOpts{
		root:      "/mnt/root",
		exe:       "/init",
		wrap:      []string{"unshare", "--pid", "--fork", "--kill-child", "--mount", "--propagation", "private", "--uts", "--net", "chroot", vm.initrd},
		sock:      filepath.Join(vm.initrd, "tmp", "vsock.sock_1024"),
		agentSock: "/tmp/vsock.sock_1024",
		args:      args,
	}
}

// TestIntegrationVMMode runs the agent the way a VM does: the initramfs
// (written by package initramfs with this test binary as /init, unpacked by
// cpio) is the agent's root, the agent is PID 1 of new PID, mount, UTS and
// network namespaces, mounts /proc, /sys, /dev and an ext4 root disk (a
// loop device), chroots the workload into it, and powers off with
// reboot(2), which in a PID namespace ends the namespace's init with SIGINT.
func TestIntegrationVMMode(t *testing.T) {
	vm := newVMFixture(t)
	h := startAgent(t, &proto.Spec{
		Command:     sh(`read h < /etc/hostname; echo "$h"; read s < /run/secret; echo "$s"; test -r /proc/self/status && echo proc; test -e /init || echo image-root; exit 3`),
		Hostname:    "vmguest",
		SecretFiles: []proto.SecretFile{{Path: "/run/secret", Mode: 0o400, Content: proto.NewSecret("sekrit")}},
	}, vm.opts("--root-device", vm.dev))
	if st, ok := h.next().(*proto.Started); !ok || st.PID <= 1 {
		t.Fatalf("want Started with the workload's pid in the namespace, got %#v", st)
	}
	exit, out, errOut := h.waitExit()
	if exit.Code == nil || *exit.Code != 3 {
		t.Fatalf("exit = %+v, stderr %q", exit, errOut)
	}
	if want := "vmguest\nsekrit\nproc\nimage-root\n"; out != want {
		t.Errorf("stdout = %q, want %q", out, want)
	}
	h.waitAgent()
	if !h.waitStatus.Signaled() || h.waitStatus.Signal() != syscall.SIGINT {
		t.Errorf("agent status %v, want death by SIGINT (reboot(POWER_OFF) in a PID namespace)", h.waitStatus)
	}
	if got := run(t, "debugfs", "-R", "cat /etc/hosts", vm.disk); !strings.Contains(got, "127.0.1.1\tvmguest") {
		t.Errorf("/etc/hosts on the root disk: %q", got)
	}
	if !strings.Contains(h.stderr.String(), "powering off") {
		t.Errorf("agent stderr lacks the VM-mode poweroff:\n%s", h.stderr.String())
	}
	if strings.Contains(h.stderr.String(), "sekrit") {
		t.Errorf("agent stderr leaks the secret:\n%s", h.stderr.String())
	}
}

// TestIntegrationVMModeBadRootDisk: a root disk that does not mount is
// reported as Fatal, then the guest powers off.
func TestIntegrationVMModeBadRootDisk(t *testing.T) {
	vm := newVMFixture(t)
	h := startAgent(t, &proto.Spec{Command: sh("true")}, vm.opts("--root-device", vm.dev, "--root-fstype", "xfs"))
	f, ok := h.next().(*proto.Fatal)
	if !ok || !strings.Contains(f.Message, "mounting xfs on /mnt/root") {
		t.Fatalf("want a Fatal about the root mount, got %#v", f)
	}
	h.waitAgent()
	if !h.waitStatus.Signaled() || h.waitStatus.Signal() != syscall.SIGINT {
		t.Errorf("agent status %v, want death by SIGINT (poweroff)", h.waitStatus)
	}
}

// TestIntegrationVMModeNoRootDisk: a root disk that never appears (no
// virtio_blk) is reported as Fatal with the likely cause.
func TestIntegrationVMModeNoRootDisk(t *testing.T) {
	vm := newVMFixture(t)
	h := startAgent(t, &proto.Spec{Command: sh("true")}, vm.opts("--root-device", "/dev/vdz", "--device-wait", "300ms"))
	f, ok := h.next().(*proto.Fatal)
	if !ok || !strings.Contains(f.Message, "/dev/vdz did not appear in 300ms (is virtio_blk built in or listed in appvm_modules?)") {
		t.Fatalf("want a Fatal naming the missing disk and virtio_blk, got %#v", f)
	}
	h.waitAgent()
}

// copyFiles copies host files to the same paths under dir.
func copyFiles(t *testing.T, dir string, files []string) {
	t.Helper()
	for _, src := range files {
		b, err := os.ReadFile(src)
		if err != nil {
			t.Fatal(err)
		}
		dst := filepath.Join(dir, src)
		if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(dst, b, 0o755); err != nil {
			t.Fatal(err)
		}
	}
}

// TestIntegrationVMModeOps runs the operations against an agent in VM mode
// (PID 1 of its namespaces, the workload chrooted into the root disk, /dev
// and a devpts instance of its own): exec with a terminal, files out and
// in, and a signal. The host's vsock connection is the unix socket
// --listen names, as chsim routes it.
func TestIntegrationVMModeOps(t *testing.T) {
	vm := newVMFixture(t, "/usr/bin/tty", "/usr/bin/stty", "/usr/bin/cat")
	o := vm.opts("--root-device", vm.dev)
	o.listen, o.opsSock = "/tmp/g", filepath.Join(vm.initrd, "tmp", "g_"+strconv.Itoa(proto.OpPort))
	h, _ := running(t, &proto.Spec{
		Command:   sh(`trap 'echo got-usr1; exit 6' USR1; echo ready; while :; do read -t 1 x; done`),
		SecretEnv: []proto.SecretEnv{{Key: "TOKEN", Value: proto.NewSecret("vm-secret")}},
		Hostname:  "vmguest",
	}, o)
	h.waitLog("ready")

	exit, out, _, err := h.exec(&proto.ExecRequest{Command: sh(`tty; stty size; echo "$TOKEN"; cat /etc/hostname; test -e /init || echo image-root`), TTY: true, Cols: 132, Rows: 43}, "")
	if err != nil {
		t.Fatal(err)
	}
	if !regexp.MustCompile(`^/dev/pts/\d+\r\n43 132\r\nvm-secret\r\nvmguest\r\nimage-root\r\n$`).MatchString(out) || exitCode(exit) != "code 0" {
		t.Errorf("exec in the guest: exit %s, output %q", exitCode(exit), out)
	}

	res, err := h.putFiles("/", 1<<20, makeTar(t, putMember{name: "srv/", typ: tar.TypeDir}, putMember{name: "srv/in.txt", typ: tar.TypeReg, body: "copied in"}))
	if err != nil || res.Members != 2 {
		t.Fatalf("put: %+v, %v", res, err)
	}
	exit, out, _, err = h.exec(&proto.ExecRequest{Command: sh(`cat /srv/in.txt; echo; echo made > /srv/out.txt`)}, "")
	if err != nil || out != "copied in\n" || exitCode(exit) != "code 0" {
		t.Errorf("reading the file copied in: %s, %q, %v", exitCode(exit), out, err)
	}
	b, err := h.getFiles("/srv/out.txt")
	if got := readTar(t, b); err != nil || len(got) != 1 || got[0].body != "made\n" {
		t.Errorf("the file copied out: %v, %v", got, err)
	}

	if err := proto.Signal(context.Background(), h.dialOp(), int(syscall.SIGUSR1)); err != nil {
		t.Fatal(err)
	}
	for {
		if e, ok := h.next().(*proto.Exit); ok {
			if e.Code == nil || *e.Code != 6 {
				t.Errorf("exit after the signal: %+v, want code 6", e)
			}
			break
		}
	}
	h.send(&proto.Stop{})
	h.waitAgent()
}
