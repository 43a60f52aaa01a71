//go:build linux

package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"vmhost/internal/netnstest"
	"vmhost/internal/sbin"
)

// nobody is the user the rootless dev agent runs as.
const nobody = 65534

// devAgent is `vmhost serve --dev` as a newcomer runs it: in a directory of
// its own (its ./vmhost-dev), with the PATH of a user's shell (no sbin), the
// key and address taken from the lines it prints.
type devAgent struct {
	t        *testing.T
	dir      string
	cmd      *exec.Cmd
	out, log *syncBuffer
	token    string
	hc       *http.Client
}

// startDevAgent starts a dev agent in a fresh directory: as root in a
// network namespace of its own (where it makes its bridge), or as nobody.
func startDevAgent(t *testing.T, asNobody bool) *devAgent {
	t.Helper()
	netnstest.RequireRoot(t) // to become nobody, or to make a namespace
	dir, err := os.MkdirTemp(shortTemp(), "vhd")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	// The agent's binary where nobody may run it; the simulators are this
	// binary too. Under -race the agent is built without it, as the other
	// tests' simulators are.
	bin := filepath.Join(dir, "vmhost")
	data, err := os.ReadFile(simBin)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(bin, data, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	a := &devAgent{t: t, dir: dir, out: new(syncBuffer), log: new(syncBuffer)}
	a.cmd = exec.Command(bin, "serve", "--dev", "--listen", "unix:"+filepath.Join(dir, "api.sock"))
	a.cmd.Dir = dir
	a.cmd.Env = []string{"PATH=/usr/local/bin:/usr/bin:/bin", "HOME=" + dir, "LANG=C.UTF-8"}
	a.cmd.Stdout, a.cmd.Stderr = a.out, a.log
	a.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if asNobody {
		if err := os.Chown(dir, nobody, nobody); err != nil {
			t.Fatal(err)
		}
		a.cmd.SysProcAttr.Credential = &syscall.Credential{Uid: nobody, Gid: nobody}
	} else {
		a.cmd.SysProcAttr.Cloneflags = syscall.CLONE_NEWNET
	}
	if err := a.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(a.stop)
	deadline := time.Now().Add(30 * time.Second)
	for {
		if m := regexp.MustCompile(`(?m)^export VMHOST_TOKEN=(\S+)$`).FindStringSubmatch(a.out.String()); m != nil {
			a.token = m[1]
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the dev agent printed no key in 30s:\n%s\n%s", a.out, a.log)
		}
		time.Sleep(20 * time.Millisecond)
	}
	if want := "export VMHOST_API=unix:" + filepath.Join(dir, "api.sock") + "\n"; !strings.Contains(a.out.String(), want) {
		t.Errorf("the dev agent printed:\n%s\nwant %q", a.out, want)
	}
	a.hc = &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", filepath.Join(dir, "api.sock"))
	}}}
	return a
}

// stop ends the agent (SIGTERM), then whatever of its VMs is left.
func (a *devAgent) stop() {
	if a.cmd.ProcessState == nil {
		a.cmd.Process.Signal(syscall.SIGTERM)
		done := make(chan struct{})
		go func() { a.cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(15 * time.Second):
			a.cmd.Process.Kill()
			<-done
		}
	}
	for _, pid := range a.children() {
		syscall.Kill(pid, syscall.SIGKILL)
	}
	if a.t.Failed() {
		a.t.Logf("the dev agent's log:\n%s", a.log)
	}
}

// children lists the processes whose command line names the agent's
// directory (its VMs' simulators and guest agents), the agent excepted.
func (a *devAgent) children() []int {
	var pids []int
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		var pid int
		if _, err := fmt.Sscan(e.Name(), &pid); err != nil || pid == a.cmd.Process.Pid {
			continue
		}
		if b, err := os.ReadFile("/proc/" + e.Name() + "/cmdline"); err == nil && strings.Contains(string(b), a.dir+"/") {
			pids = append(pids, pid)
		}
	}
	return pids
}

func (a *devAgent) do(method, path, body string) (int, []byte) {
	a.t.Helper()
	req, err := http.NewRequest(method, "http://vmhost"+path, strings.NewReader(body))
	if err != nil {
		a.t.Fatal(err)
	}
	req.Header.Set("Authorization", "Bearer "+a.token)
	resp, err := a.hc.Do(req)
	if err != nil {
		a.t.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	validateResponse(a.t, method, req.URL.Path, resp, b)
	return resp.StatusCode, b
}

// helloImage builds the quick start's image (examples/hello/build.sh) into
// dir, readable by anyone.
func helloImage(t *testing.T, dir string) string {
	t.Helper()
	tar := filepath.Join(dir, "hello.tar")
	build := exec.Command("../examples/hello/build.sh", tar)
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("examples/hello/build.sh: %v\n%s", err, out)
	}
	if err := os.Chmod(tar, 0o644); err != nil {
		t.Fatal(err)
	}
	return tar
}

// TestDevAppVM runs the dev-mode AppVM path end to end through the real
// binary, as root and as a user without root (nobody, whose PATH has no
// sbin): the image imported through the API (without root: without its
// owners), an AppVM created with nothing but the image and its size, on no
// network (without root, asking for one is refused, 400, nothing made),
// booted on the simulator without a configured kernel; its workload is the
// image's own /hello, run chrooted in the tree unpacked from its root disk
// (its /proc/<pid>/root says so), as the user it names (as root) or as the
// agent's (without root), in its working directory; a forced delete leaves
// nothing behind.
func TestDevAppVM(t *testing.T) {
	for _, tool := range [][2]string{{"qemu-img", "qemu-utils"}, {"mkfs.ext4", "e2fsprogs"}, {"debugfs", "e2fsprogs"}, {"tar", "tar"}, {"sha256sum", "coreutils"}} {
		if !filepath.IsAbs(sbin.Path(tool[0])) {
			if os.Getenv("CI") != "" {
				t.Fatalf("%s not installed (apt-get install %s), and CI is set", tool[0], tool[1])
			}
			t.Skipf("%s not installed (apt-get install %s)", tool[0], tool[1])
		}
	}
	for _, who := range []string{"root", "nobody"} {
		t.Run(who, func(t *testing.T) {
			a := startDevAgent(t, who == "nobody")
			tar := helloImage(t, a.dir)
			if st, b := a.do("POST", "/api/appvm/images", fmt.Sprintf(`{"id":"hello","path":%q}`, tar)); st != http.StatusAccepted && st != http.StatusCreated {
				t.Fatalf("import = %d %s", st, b)
			}
			deadline := time.Now().Add(60 * time.Second)
			for {
				_, b := a.do("GET", "/api/appvm/images/hello", "")
				var img struct{ Status, Failure string }
				json.Unmarshal(b, &img)
				if img.Status == "ready" {
					break
				}
				if img.Status == "failed" || time.Now().After(deadline) {
					t.Fatalf("import: %s", b)
				}
				time.Sleep(100 * time.Millisecond)
			}
			const create = `{"vm_id":"app1","image_id":"hello","vcpus":1,"memory_mb":256,"disk_gib":1,"env":["GREETING=bonjour"],` +
				`"user":"1000:1000","workdir":"/srv"%s}`
			if who == "nobody" {
				st, b := a.do("POST", "/api/appvm/vms", fmt.Sprintf(create, `,"network_id":"default"`))
				if st != http.StatusBadRequest || !strings.Contains(string(b), "network_id: creating taps needs root") {
					t.Errorf("an AppVM on a network without root = %d %s, want 400 naming network_id", st, b)
				}
				if st, _ := a.do("GET", "/api/appvm/vms/app1", ""); st != http.StatusNotFound {
					t.Errorf("the refused AppVM exists (%d)", st)
				}
			}
			if st, b := a.do("POST", "/api/appvm/vms", fmt.Sprintf(create, "")); st != http.StatusCreated {
				t.Fatalf("create = %d %s", st, b)
			}
			_, b := a.do("GET", "/api/appvm/vms/app1", "")
			var v struct {
				Nets  []json.RawMessage `json:"nets"`
				AppVM struct {
					NetworkMode string `json:"network_mode"`
					WaitingFor  string `json:"waiting_for"`
					Hostname    string `json:"hostname"`
				} `json:"appvm"`
			}
			if err := json.Unmarshal(b, &v); err != nil || len(v.Nets) != 0 || v.AppVM.NetworkMode != "none" || v.AppVM.WaitingFor != "" || v.AppVM.Hostname != "app1" {
				t.Errorf("view: %s", b)
			}
			deadline = time.Now().Add(30 * time.Second)
			for {
				_, b := a.do("GET", "/api/appvm/vms/app1/logs?stream=stdout", "")
				if chunks, _ := decodeChunks(b); strings.HasPrefix(output(chunks, "stdout"), "bonjour from ") {
					break
				}
				if time.Now().After(deadline) {
					_, view := a.do("GET", "/api/appvm/vms/app1", "")
					t.Fatalf("the workload did not greet in 30s; view %s", view)
				}
				time.Sleep(50 * time.Millisecond)
			}
			m := regexp.MustCompile(`msg="workload started" \S+ id=app1 pid=(\d+)`).FindStringSubmatch(a.log.String())
			if m == nil {
				t.Fatalf("no workload pid in the log:\n%s", a.log)
			}
			tree := filepath.Join(a.dir, "vmhost-dev/run/vms/app1/vsock.sock.root")
			if root, err := os.Readlink("/proc/" + m[1] + "/root"); err != nil || root != tree {
				t.Errorf("the workload's root is %q (%v), want the unpacked tree %s", root, err, tree)
			}
			// As root the workload runs as the user it names; without root
			// there is no other user to be, and it runs as the agent's.
			wantUID := map[string]string{"root": "1000", "nobody": "65534"}[who]
			if st, err := os.ReadFile("/proc/" + m[1] + "/status"); err != nil || !regexp.MustCompile(`(?m)^Uid:\s+`+wantUID+`\s`).Match(st) {
				t.Errorf("the workload's ids (want uid %s):\n%s", wantUID, st)
			}
			if st, b := a.do("DELETE", "/api/appvm/vms/app1?force=true", ""); st != http.StatusNoContent {
				t.Fatalf("delete = %d %s", st, b)
			}
			for _, p := range []string{"vmhost-dev/state/vms/app1", "vmhost-dev/run/vms/app1"} {
				if exists(filepath.Join(a.dir, p)) {
					t.Errorf("%s left behind", p)
				}
			}
			if pids := a.children(); len(pids) > 0 {
				t.Errorf("processes left behind: %v", pids)
			}
		})
	}
}
