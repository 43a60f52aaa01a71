package guest

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"vmhost/appvm/guest/proto"
)

// privateMountNS runs the agent in a mount namespace of its own with private
// propagation, so its mounts never reach the host.
var privateMountNS = []string{"unshare", "--mount", "--propagation", "private"}

// requireRoot skips unless the test runs as root in a place that allows
// new namespaces (not an unprivileged container).
func requireRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root (run the tests as root)")
	}
	if out, err := exec.Command("unshare", "--pid", "--fork", "--mount", "--uts", "--net", "true").CombinedOutput(); err != nil {
		t.Skipf("cannot create namespaces here: %v: %s", err, out)
	}
}

// TestIntegrationMounts checks tmpfs and ext4 data mounts inside the
// workload root, done by the agent with --mounts in a private namespace.
func TestIntegrationMounts(t *testing.T) {
	img, dev := ext4Loop(t)

	root := t.TempDir()
	script := fmt.Sprintf(`grep -E " %[1]s/(scratch|data) " /proc/self/mounts | cut -d" " -f2-4 | sed "s,%[1]s,,; s/,relatime//; s/,seclabel//"; echo persisted > %[1]s/data/hello`, root)
	h := startAgent(t, &proto.Spec{
		Command:     sh(script),
		TmpfsMounts: []proto.TmpfsMount{{Path: "/scratch", SizeBytes: 1 << 20, Mode: 0o700}},
		DataMounts:  []proto.DataMount{{Device: dev, Mountpoint: "/data"}},
	}, agentOpts{root: root, args: []string{"--mounts"}, wrap: privateMountNS})
	exit, out, errOut := h.waitExit()
	if exit.Code == nil || *exit.Code != 0 {
		t.Fatalf("exit %+v, stderr %q", exit, errOut)
	}
	want := "/scratch tmpfs rw,nosuid,nodev,size=1024k,mode=700\n/data ext4 rw\n"
	if out != want {
		t.Errorf("mounts seen by the workload:\n%s\nwant\n%s", out, want)
	}
	h.waitAgent()
	if b, _ := os.ReadFile("/proc/self/mounts"); strings.Contains(string(b), root) {
		t.Errorf("the agent's mounts leaked into the test's namespace")
	}
	if got := run(t, "debugfs", "-R", "cat /hello", img); !strings.Contains(got, "persisted") {
		t.Errorf("data volume content: %q", got)
	}
}

// TestIntegrationChroot runs the workload chrooted into a minimal root
// holding /bin/sh and its libraries, the way VM mode runs it in the image.
func TestIntegrationChroot(t *testing.T) {
	requireRoot(t)
	root, err := os.MkdirTemp("", "guest-chroot-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(root) })
	os.Chmod(root, 0o755)
	for _, f := range append([]string{"/bin/sh"}, libsOf(t, "/bin/sh")...) {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		dst := filepath.Join(root, f)
		os.MkdirAll(filepath.Dir(dst), 0o755)
		if err := os.WriteFile(dst, b, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	os.MkdirAll(filepath.Join(root, "etc"), 0o755)
	os.WriteFile(filepath.Join(root, "etc/passwd"), []byte("root:x:0:0::/root:/bin/sh\nsvc:x:1500:1500::/home/svc:/bin/sh\n"), 0o644)
	h := startAgent(t, &proto.Spec{
		Entrypoint:  []string{"sh", "-c"},
		Command:     []string{`echo "$HOME $(pwd)"; read s < /run/token; echo "$s"; read h < /etc/hostname; echo "$h"; test -e ` + root + ` || echo "host hidden"`},
		User:        "svc",
		Workdir:     "/app",
		Hostname:    "chrooted",
		SecretFiles: []proto.SecretFile{{Path: "/run/token", Mode: 0o400, Content: proto.NewSecret("tok")}},
		Keepalive:   true,
	}, agentOpts{root: root, args: []string{"--chroot"}})
	exit, out, errOut := h.waitExit()
	if exit.Code == nil || *exit.Code != 0 {
		t.Fatalf("exit %+v, stderr %q", exit, errOut)
	}
	if want := "/home/svc /app\ntok\nchrooted\nhost hidden\n"; out != want {
		t.Errorf("stdout = %q, want %q", out, want)
	}
	h.conn.Send(&proto.Stop{})
	h.waitAgent()
}

// libsOf lists the shared libraries of a binary from ldd.
func libsOf(t *testing.T, bin string) []string {
	out, err := exec.Command("ldd", bin).Output()
	if err != nil {
		t.Skipf("ldd %s: %v", bin, err)
	}
	var libs []string
	for _, f := range strings.Fields(string(out)) {
		if strings.HasPrefix(f, "/") {
			libs = append(libs, f)
		}
	}
	return libs
}

// attachLoop attaches img to a free loop device, or skips where loop
// devices are unavailable (a container).
// ext4Loop needs root and the tools, and returns a fresh 16 MiB ext4 image
// and the loop device it is attached to (detached at cleanup).
func ext4Loop(t *testing.T) (img, dev string) {
	t.Helper()
	requireRoot(t)
	for _, tool := range []string{"unshare", "mkfs.ext4", "losetup", "debugfs"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("%s not installed", tool)
		}
	}
	img = filepath.Join(t.TempDir(), "ext4.img")
	if err := os.WriteFile(img, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(img, 16<<20); err != nil {
		t.Fatal(err)
	}
	run(t, "mkfs.ext4", "-q", "-F", img)
	return img, attachLoop(t, img)
}

func attachLoop(t *testing.T, img string) string {
	t.Helper()
	out, err := exec.Command("losetup", "-f", "--show", img).CombinedOutput()
	if err != nil {
		t.Skipf("no loop device: losetup: %v: %s", err, out)
	}
	dev := strings.TrimSpace(string(out))
	t.Cleanup(func() { exec.Command("losetup", "-d", dev).Run() })
	return dev
}

// TestIntegrationSecretFileOnTmpfs checks that injected files are written
// after the mounts: a secret file under a tmpfs mount lives in the tmpfs,
// where the workload sees it, and never reaches the root disk below.
func TestIntegrationSecretFileOnTmpfs(t *testing.T) {
	requireRoot(t)
	root := t.TempDir()
	h := startAgent(t, &proto.Spec{
		Command:     sh(fmt.Sprintf(`cat %s/run/secrets/key`, root)),
		TmpfsMounts: []proto.TmpfsMount{{Path: "/run/secrets", Mode: 0o700}},
		SecretFiles: []proto.SecretFile{{Path: "/run/secrets/key", Content: proto.NewSecret("on-tmpfs-only")}},
	}, agentOpts{root: root, args: []string{"--mounts"}, wrap: privateMountNS})
	exit, out, errOut := h.waitExit()
	if exit.Code == nil || *exit.Code != 0 || out != "on-tmpfs-only" {
		t.Fatalf("exit %+v, stdout %q, stderr %q; want the secret read from the tmpfs", exit, out, errOut)
	}
	h.waitAgent()
	if _, err := os.Lstat(filepath.Join(root, "run/secrets/key")); !os.IsNotExist(err) {
		t.Errorf("the secret file reached the root below the tmpfs (%v)", err)
	}
}

// TestIntegrationHotMount drives Mount and Unmount against a loop device
// standing in for a hot-plugged virtio disk (a sysfs tree of the test's
// maps its PCI address to it): the mount appears while the workload runs,
// a retried Mount succeeds, a busy unmount answers busy and keeps the
// mount, and once the workload lets go the unmount succeeds and what it
// wrote is on the volume.
func TestIntegrationHotMount(t *testing.T) {
	img, dev := ext4Loop(t)
	dir := t.TempDir()
	const bdf = "0000:01:00.0"
	sysfs := filepath.Join(dir, "sys")
	if err := os.MkdirAll(filepath.Join(sysfs, "bus/pci/devices", bdf, "virtio3/block", filepath.Base(dev)), 0o755); err != nil {
		t.Fatal(err)
	}

	root := t.TempDir()
	// The workload waits for the volume, writes to it, then holds it busy
	// (its working directory) until killed.
	script := fmt.Sprintf(`until [ -d %[1]s/hot/lost+found ]; do sleep 0.05; done; echo hot-data > %[1]s/hot/file; cd %[1]s/hot && echo holding && exec sleep 60`, root)
	h := startAgent(t, &proto.Spec{Command: sh(script), Keepalive: true},
		agentOpts{root: root, args: []string{"--mounts", "--sysfs", sysfs, "--device-wait", "300ms"}, wrap: privateMountNS})
	agentMounts := func() string {
		b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/mounts", h.cmd.Process.Pid))
		var lines []string
		for _, l := range strings.Split(string(b), "\n") {
			if f := strings.Fields(l); len(f) > 3 && strings.HasPrefix(f[1], root+"/") {
				lines = append(lines, strings.TrimPrefix(f[1], root)+" "+f[0]+" "+strings.Split(f[3], ",")[0])
			}
		}
		return strings.Join(lines, "\n")
	}

	h.send(&proto.Mount{Seq: 1, BDF: bdf, Mountpoint: "/hot"})
	if r := h.mountResult(1); r.Error != "" {
		t.Fatalf("mount: %+v", r)
	}
	if got, want := agentMounts(), "/hot "+dev+" rw"; got != want {
		t.Errorf("mounts after Mount: %q, want %q", got, want)
	}
	h.send(&proto.Mount{Seq: 2, BDF: bdf, Mountpoint: "/hot"})
	if r := h.mountResult(2); r.Error != "" {
		t.Errorf("retried mount: %+v, want success", r)
	}
	h.send(&proto.Mount{Seq: 3, BDF: "0000:02:00.0", Mountpoint: "/other"})
	if r := h.mountResult(3); !strings.Contains(r.Error, "no virtio block device at PCI address 0000:02:00.0") || r.Busy {
		t.Errorf("mount of a missing device: %+v", r)
	}
	// Messages skipped while waiting for results are in h.messages().
	pid := 0
	h.eventually("the workload holding the volume", func(all []proto.Message) bool {
		var out strings.Builder
		for _, m := range all {
			switch m := m.(type) {
			case *proto.Started:
				pid = m.PID
			case *proto.Log:
				out.Write(m.Data)
			}
		}
		return pid != 0 && strings.Contains(out.String(), "holding")
	})

	h.send(&proto.Unmount{Seq: 4, Mountpoint: "/hot"})
	if r := h.mountResult(4); !r.Busy || !strings.Contains(r.Error, "unmounting /hot") {
		t.Errorf("unmount of a busy volume: %+v, want busy", r)
	}
	if got := agentMounts(); !strings.Contains(got, "/hot ") {
		t.Errorf("a busy unmount took the mount away: %q", got)
	}
	syscall.Kill(pid, syscall.SIGKILL)
	h.eventually("the workload's exit", func(all []proto.Message) bool {
		return slices.ContainsFunc(all, func(m proto.Message) bool { _, ok := m.(*proto.Exit); return ok })
	})
	h.send(&proto.Unmount{Seq: 5, Mountpoint: "/hot"})
	if r := h.mountResult(5); r.Error != "" {
		t.Errorf("unmount after the workload let go: %+v", r)
	}
	if got := agentMounts(); got != "" {
		t.Errorf("mounts after Unmount: %q, want none", got)
	}
	h.send(&proto.Unmount{Seq: 6, Mountpoint: "/hot"})
	if r := h.mountResult(6); r.Error != "" {
		t.Errorf("retried unmount: %+v, want success", r)
	}
	if got := run(t, "debugfs", "-R", "cat /file", img); !strings.Contains(got, "hot-data") {
		t.Errorf("volume content: %q", got)
	}
}

// TestHotMountProcessMode checks the simulator's case: without --mounts
// the agent creates the mountpoint in the root and answers success.
func TestHotMountProcessMode(t *testing.T) {
	root := t.TempDir()
	h := startAgent(t, &proto.Spec{Command: sh("exec sleep 60"), Keepalive: true}, agentOpts{root: root})
	h.send(&proto.Mount{Seq: 7, BDF: "0000:00:0a.0", Mountpoint: "/srv/data", ReadOnly: true})
	if r := h.mountResult(7); r.Error != "" {
		t.Fatalf("mount: %+v", r)
	}
	if fi, err := os.Stat(filepath.Join(root, "srv/data")); err != nil || !fi.IsDir() {
		t.Errorf("mountpoint in the root: %v", err)
	}
	h.send(&proto.Unmount{Seq: 8, Mountpoint: "/srv/data"})
	if r := h.mountResult(8); r.Error != "" {
		t.Errorf("unmount: %+v", r)
	}
}

func (h *fakeHost) send(m proto.Message) {
	h.t.Helper()
	if err := h.conn.Send(m); err != nil {
		h.t.Fatalf("sending %s: %v", m.Type(), err)
	}
}

// mountResult skips messages until the MountResult with seq.
func (h *fakeHost) mountResult(seq uint64) *proto.MountResult {
	h.t.Helper()
	for {
		if r, ok := h.next().(*proto.MountResult); ok && r.Seq == seq {
			return r
		}
	}
}

// eventually waits up to 10 s for ok to hold of every message received so far.
func (h *fakeHost) eventually(what string, ok func([]proto.Message) bool) {
	h.t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !ok(h.messages()) {
		if time.Now().After(deadline) {
			h.t.Fatalf("no %s within 10s; agent stderr:\n%s", what, h.stderr.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
}
