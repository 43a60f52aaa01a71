package guest

import (
	"archive/tar"
	"bytes"
	"context"
	"debug/elf"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"

	"vmhost/appvm"
	"vmhost/appvm/guest/proto"
	"vmhost/chclient"
	"vmhost/chclient/chsim"
	"vmhost/initramfs"
	"vmhost/kmod"
)

// laneCache holds what e2e/realguest/prepare.sh builds: Debian's cloud kernel
// and its modules, and vhost-device-vsock.
const laneCache = "/var/cache/vmhost-lane"

// needLane skips (or, with VMHOST_REAL_GUESTS=1, fails) without root, qemu,
// the lane's artifacts or a static busybox.
func needLane(t *testing.T, ok bool, reason string) {
	t.Helper()
	if ok {
		return
	}
	if os.Getenv("VMHOST_REAL_GUESTS") == "1" {
		t.Fatalf("real guests required (VMHOST_REAL_GUESTS=1) but %s", reason)
	}
	t.Skip(reason)
}

func isStatic(path string) bool {
	f, err := elf.Open(path)
	if err != nil {
		return false
	}
	defer f.Close()
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			return false
		}
	}
	return true
}

// TestQemuOperations boots the agent as the init of a real guest: Debian's
// cloud kernel under qemu (vmhost sim-ch --sim-backend qemu, Cloud
// Hypervisor's API), a busybox root disk, and the hybrid vsock through
// vhost-device-vsock. The host end is this test: it answers the Hello, then
// CONNECTs to the agent's AF_VSOCK operation port for an exec on a real
// pseudo-terminal, an exec with input, files in and out, and a signal.
func TestQemuOperations(t *testing.T) {
	if os.Getenv("VMHOST_REAL_GUESTS") == "0" {
		t.Skip("real guests disabled by VMHOST_REAL_GUESTS=0")
	}
	needLane(t, os.Geteuid() == 0, "needs root (vhost-user, /dev/kvm or TCG as root)")
	_, err := exec.LookPath("qemu-system-x86_64")
	needLane(t, err == nil, "qemu-system-x86_64 is not installed")
	_, err = exec.LookPath("mkfs.ext4")
	needLane(t, err == nil, "mkfs.ext4 is not installed")
	kernel := filepath.Join(laneCache, "current", "cloud-kernel", "vmlinuz")
	mods, _ := filepath.Glob(filepath.Join(laneCache, "current", "cloud-kernel", "lib", "modules", "*"))
	_, err = os.Stat(kernel)
	needLane(t, err == nil && len(mods) == 1, "no cloud kernel in "+laneCache+" (run e2e/realguest/prepare.sh)")
	_, err = os.Stat(chsim.DefaultVsockBackend)
	needLane(t, err == nil, "no vhost-device-vsock (run e2e/realguest/prepare.sh)")
	needLane(t, isStatic("/bin/busybox"), "no static busybox (busybox-static)")

	dir, err := os.MkdirTemp("", "guest-qemu-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	// vmhost itself, static: the guest's /init and the stand-in for Cloud
	// Hypervisor.
	bin := filepath.Join(dir, "vmhost")
	goBin, err := exec.LookPath("go")
	if err != nil {
		goBin = filepath.Join(runtime.GOROOT(), "bin", "go")
	}
	build := exec.Command(goBin, "build", "-o", bin, "vmhost")
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("building vmhost: %v\n%s", err, out)
	}

	// The initramfs as vmhost makes it: the agent and its modules.
	tree, err := kmod.Open(mods[0])
	if err != nil {
		t.Fatal(err)
	}
	resolved, err := tree.Resolve(appvm.AgentModules, []string{"crc32c_generic", "button", "evdev"})
	if err != nil {
		t.Fatal(err)
	}
	var ms []initramfs.Module
	for _, m := range resolved {
		ms = append(ms, initramfs.Module{Name: m.Name, Data: m.Data})
	}
	initrd := filepath.Join(dir, "initramfs")
	f, err := os.Create(initrd)
	if err != nil {
		t.Fatal(err)
	}
	if err := initramfs.ForGuestAgent(f, bin, ms); err != nil {
		t.Fatal(err)
	}
	f.Close()

	// The root disk: busybox and a few of its applets.
	image := filepath.Join(dir, "image")
	os.MkdirAll(filepath.Join(image, "bin"), 0o755)
	os.MkdirAll(filepath.Join(image, "etc"), 0o755)
	copyFiles(t, image, []string{"/bin/busybox"})
	for _, applet := range []string{"sh", "tty", "stty", "cat", "sleep", "echo", "id"} {
		os.Symlink("busybox", filepath.Join(image, "bin", applet))
	}
	os.WriteFile(filepath.Join(image, "etc/passwd"), []byte("root:x:0:0::/root:/bin/sh\n"), 0o644)
	root := filepath.Join(dir, "root.img")
	run(t, "mkfs.ext4", "-q", "-d", image, root, "32M")

	sock := filepath.Join(dir, "ch.sock")
	sim := exec.Command(bin, "sim-ch", "--api-socket", "path="+sock, "--log-file", filepath.Join(dir, "ch.log"), "-v",
		"--sim-backend", "qemu", "--sim-accel", "tcg", "--sim-vsock-backend", chsim.DefaultVsockBackend)
	sim.Stderr = os.Stderr
	if err := sim.Start(); err != nil {
		t.Fatal(err)
	}
	simDone := make(chan struct{})
	go func() { sim.Wait(); close(simDone) }()
	t.Cleanup(func() {
		sim.Process.Signal(syscall.SIGTERM)
		select {
		case <-simDone:
		case <-time.After(20 * time.Second):
			sim.Process.Kill()
			<-simDone
		}
		if t.Failed() {
			for _, log := range []string{"ch.log", "ch.qemu.log", "serial.log"} {
				b, _ := os.ReadFile(filepath.Join(dir, log))
				t.Logf("%s:\n%s", log, b)
			}
		}
	})
	hc := &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", sock)
	}}}
	defer hc.CloseIdleConnections()
	api := func(path string, body any, want int) {
		t.Helper()
		var r io.Reader
		if body != nil {
			b, _ := json.Marshal(body)
			r = bytes.NewReader(b)
		}
		deadline := time.Now().Add(10 * time.Second)
		for {
			req, _ := http.NewRequest("PUT", "http://localhost/api/v1/"+path, r)
			req.Header.Set("Content-Type", "application/json")
			resp, err := hc.Do(req)
			if err != nil && time.Now().Before(deadline) && body == nil {
				time.Sleep(50 * time.Millisecond)
				continue
			}
			if err != nil {
				t.Fatalf("%s: %v", path, err)
			}
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != want {
				t.Fatalf("%s = %d %s, want %d", path, resp.StatusCode, b, want)
			}
			return
		}
	}
	vsock := filepath.Join(dir, "vsock.sock")
	l, err := chclient.ListenVsock(vsock, proto.Port)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	deadline := time.Now().Add(10 * time.Second)
	for _, err := os.Stat(sock); err != nil; _, err = os.Stat(sock) {
		if time.Now().After(deadline) {
			t.Fatal("the stand-in's API socket did not appear")
		}
		time.Sleep(20 * time.Millisecond)
	}
	api("vm.create", map[string]any{
		"cpus":    map[string]any{"boot_vcpus": 1, "max_vcpus": 1},
		"memory":  map[string]any{"size": 256 << 20, "shared": true},
		"payload": map[string]any{"kernel": kernel, "initramfs": initrd, "cmdline": "console=ttyS0 panic=-1"},
		"disks":   []any{map[string]any{"path": root, "image_type": "Raw"}},
		"serial":  map[string]any{"mode": "File", "file": filepath.Join(dir, "serial.log")},
		"console": map[string]any{"mode": "Off"},
		"vsock":   map[string]any{"cid": 3, "socket": vsock},
	}, 204)
	start := time.Now()
	api("vm.boot", nil, 204)

	l.SetDeadline(time.Now().Add(180 * time.Second))
	c, err := l.Accept()
	if err != nil {
		t.Fatalf("the agent did not dial the host: %v", err)
	}
	defer c.Close()
	t.Logf("the agent dialled after %v", time.Since(start))
	conn := proto.NewConn(c)
	m, err := conn.Recv()
	if hello, ok := m.(*proto.Hello); err != nil || !ok || hello.V != proto.Version {
		t.Fatalf("hello: %#v, %v", m, err)
	}
	if err := conn.Send(&proto.Spec{V: proto.Version, Hostname: "qemuguest", Network: proto.Network{Mode: proto.NetworkNone},
		Command:   []string{"/bin/sh", "-c", `trap 'exit 6' USR1; echo ready; while :; do sleep 1; done`},
		SecretEnv: []proto.SecretEnv{{Key: "TOKEN", Value: proto.NewSecret("qemu-secret")}}, Keepalive: true}); err != nil {
		t.Fatal(err)
	}
	msgs := make(chan proto.Message, 100)
	go func() {
		defer close(msgs)
		for {
			m, err := conn.Recv()
			if err != nil {
				return
			}
			if _, ok := m.(*proto.Exit); ok {
				conn.Send(&proto.ExitAck{})
			}
			msgs <- m
		}
	}()
	waitFor := func(what string, ok func(proto.Message) bool) {
		t.Helper()
		timeout := time.After(60 * time.Second)
		for {
			select {
			case m, open := <-msgs:
				if !open {
					t.Fatalf("the session ended before %s", what)
				}
				if f, isFatal := m.(*proto.Fatal); isFatal {
					t.Fatalf("fatal: %s", f.Message)
				}
				if ok(m) {
					return
				}
			case <-timeout:
				t.Fatalf("no %s", what)
			}
		}
	}
	waitFor("ready", func(m proto.Message) bool {
		l, ok := m.(*proto.Log)
		return ok && strings.Contains(string(l.Data), "ready")
	})
	t.Logf("the workload ran after %v", time.Since(start))

	ctx, cancel := context.WithTimeout(context.Background(), 120*time.Second)
	defer cancel()
	dial := func() net.Conn {
		t.Helper()
		c, err := chclient.DialVsock(ctx, vsock, proto.OpPort)
		if err != nil {
			t.Fatalf("CONNECT %d: %v", proto.OpPort, err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	var out, errOut bytes.Buffer
	exit, err := proto.Exec(ctx, dial(), &proto.ExecRequest{Command: []string{"/bin/sh", "-c", `tty; stty size; echo "$TOKEN"; cat /etc/hostname`},
		TTY: true, Cols: 91, Rows: 33, TimeoutSecs: 60}, nil, &out, &errOut)
	if err != nil || exitCode(exit) != "code 0" || !regexp.MustCompile(`^/dev/pts/\d+\r\n33 91\r\nqemu-secret\r\nqemuguest\r\n$`).MatchString(out.String()) {
		t.Errorf("exec on a terminal: %s, %v, output %q", exitCode(exit), err, out.String())
	}
	out.Reset()
	exit, err = proto.Exec(ctx, dial(), &proto.ExecRequest{Command: []string{"cat"}, TimeoutSecs: 60}, strings.NewReader("through vsock\n"), &out, &errOut)
	if err != nil || exitCode(exit) != "code 0" || out.String() != "through vsock\n" {
		t.Errorf("exec with input: %s, %v, output %q", exitCode(exit), err, out.String())
	}

	var archive bytes.Buffer
	tw := tar.NewWriter(&archive)
	payload := bytes.Repeat([]byte("0123456789"), 100000)
	tw.WriteHeader(&tar.Header{Name: "in.bin", Typeflag: tar.TypeReg, Mode: 0o644, Size: int64(len(payload))})
	tw.Write(payload)
	tw.Close()
	if _, err := proto.PutFiles(ctx, dial(), "/", 16<<20, &archive); err != nil {
		t.Fatalf("put: %v", err)
	}
	var got bytes.Buffer
	if err := proto.GetFiles(ctx, dial(), "/in.bin", &got); err != nil {
		t.Fatalf("get: %v", err)
	}
	if ms := readTar(t, got.Bytes()); len(ms) != 1 || ms[0].body != string(payload) {
		t.Errorf("the file copied in and out again differs")
	}

	if err := proto.Signal(ctx, dial(), int(syscall.SIGUSR1)); err != nil {
		t.Fatal(err)
	}
	waitFor("the workload's exit", func(m proto.Message) bool {
		e, ok := m.(*proto.Exit)
		if ok && (e.Code == nil || *e.Code != 6) {
			t.Errorf("exit %+v, want code 6 from the trap", e)
		}
		return ok
	})
	if err := conn.Send(&proto.Stop{}); err != nil {
		t.Fatal(err)
	}
	select {
	case <-simDone:
	case <-time.After(60 * time.Second):
		t.Fatal("the guest did not power off")
	}
	t.Logf("total %v", time.Since(start))
}
