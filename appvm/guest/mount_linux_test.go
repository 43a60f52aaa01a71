package guest

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

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
	requireRoot(t)
	for _, tool := range []string{"unshare", "mkfs.ext4", "losetup", "debugfs"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("%s not installed", tool)
		}
	}
	dir := t.TempDir()
	img := filepath.Join(dir, "data.img")
	if err := os.WriteFile(img, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(img, 16<<20); err != nil {
		t.Fatal(err)
	}
	run(t, "mkfs.ext4", "-q", "-F", img)
	dev := attachLoop(t, img)

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
