package chsim_test

import (
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"

	"vmhost/appvm/guest/proto"
	"vmhost/chclient"
)

// staticHello builds the quick start's workload (examples/hello, a static Go
// program) into dir/hello.
func staticHello(t *testing.T, dir string) {
	t.Helper()
	build := exec.Command(filepath.Join(runtime.GOROOT(), "bin", "go"), "build", "-o", filepath.Join(dir, "hello"), "../../examples/hello")
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("building examples/hello: %v\n%s", err, out)
	}
}

// TestGuestAgentChroot: with --sim-guest-chroot the agent runs the workload chrooted into
// the guest root the host filled (an image's tree holding only a static /hello): the
// image's entrypoint is found there, not on the host; the files the agent writes land in
// the tree.
func TestGuestAgentChroot(t *testing.T) {
	p := startSim(t, "--sim-guest-chroot")
	cfg, vsock := appVMConfig(t, p.dir)
	root := vsock + ".root"
	if err := os.MkdirAll(root, 0o755); err != nil {
		t.Fatal(err)
	}
	staticHello(t, root)
	l, err := chclient.ListenVsock(vsock, proto.Port)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	p.wantStatus("PUT", "/api/v1/vm.create", cfg, 204)
	p.wantStatus("PUT", "/api/v1/vm.boot", "", 204)
	conn, _ := guestSession(t, l)
	spec := &proto.Spec{V: proto.Version, Entrypoint: []string{"/hello"}, Command: []string{"a1"}, Env: []string{"GREETING=chrooted"},
		Hostname: "app1", Network: proto.Network{Mode: proto.NetworkNone}, Workdir: "/srv"}
	if err := conn.Send(spec); err != nil {
		t.Fatal(err)
	}
	var out string
	for !strings.Contains(out, "\n") {
		m, before := recvUntil(t, conn, "log")
		for _, b := range before {
			if f, ok := b.(*proto.Fatal); ok {
				t.Fatalf("the workload did not start: %s", f.Message)
			}
		}
		out += string(m.(*proto.Log).Data)
	}
	if !strings.HasPrefix(out, `chrooted from `) || !strings.Contains(out, `(args "a1"`) {
		t.Errorf("workload said %q, want the greeting of /hello from the image's tree", out)
	}
	if b, err := os.ReadFile(filepath.Join(root, "etc/hosts")); err != nil || !strings.Contains(string(b), "app1") {
		t.Errorf("etc/hosts in the tree: %q, %v", b, err)
	}
	if fi, err := os.Stat(filepath.Join(root, "srv")); err != nil || !fi.IsDir() {
		t.Errorf("the working directory was not made in the tree: %v", err)
	}
	if err := conn.Send(&proto.Stop{}); err != nil {
		t.Fatal(err)
	}
	m, _ := recvUntil(t, conn, "exit")
	if ex := m.(*proto.Exit); ex.Code == nil || *ex.Code != 0 {
		t.Errorf("exit = %+v, want 0 (hello says goodbye on SIGTERM)", ex)
	}
}
