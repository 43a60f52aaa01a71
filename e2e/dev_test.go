//go:build linux

package e2e

import (
	"bytes"
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

	"vmhost/auth"
	"vmhost/config"
)

// TestDevAppVMsLeaveNoProcess runs `vmhost serve --dev` (its simulator
// runs each AppVM's guest agent and workload as processes of the host, the
// workload chrooted in the image's own tree), creates 20 AppVMs of the
// quick start's hello image, stops them and deletes them, and then finds
// no process whose command line names the agent's run directory: no
// simulator, no guest agent, no workload (whose arguments name the run
// directory on purpose). Checked while the agent runs and after it exited.
// As root the agent runs in a network namespace of its own (its dev
// bridge goes with it); without root, as a newcomer runs it.
func TestDevAppVMsLeaveNoProcess(t *testing.T) {
	for _, tool := range []string{"qemu-img", "debugfs", "mkfs.ext4"} {
		if _, err := exec.LookPath(tool); err != nil {
			if _, serr := os.Stat("/sbin/" + tool); serr != nil {
				t.Skipf("%s not installed (dev-mode AppVMs need qemu-utils and e2fsprogs)", tool)
			}
		}
	}
	const n = 20
	cwd, err := os.MkdirTemp(shortTemp(), "vhd")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(cwd) })
	cfg := config.DevDefault()
	cfg.HostCPUs = 64 // 20 AppVMs on a small machine
	data, err := cfg.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	state := filepath.Join(cwd, "vmhost-dev", "state")
	if err := os.MkdirAll(state, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(cwd, "vmhost-dev", "config.json"), data, 0o600); err != nil {
		t.Fatal(err)
	}
	token, err := auth.Add(filepath.Join(state, "keys.json"), "e2e", auth.ScopeReadWrite, nil)
	if err != nil {
		t.Fatal(err)
	}
	// The quick start's image, imported as its README says.
	tarball := filepath.Join(cwd, "hello.tar")
	if out, err := exec.Command("../examples/hello/build.sh", tarball).CombinedOutput(); err != nil {
		t.Fatalf("examples/hello/build.sh: %v\n%s", err, out)
	}
	imp := exec.Command(vmhostBin, "image", "import", "--dev", "--ignore-owners", "--id", "hello", tarball)
	imp.Dir = cwd
	if out, err := imp.CombinedOutput(); err != nil {
		t.Fatalf("vmhost image import: %v\n%s", err, out)
	}
	sock := filepath.Join(cwd, "api.sock")
	cmd := exec.Command(vmhostBin, "serve", "--dev", "--listen", "unix:"+sock)
	cmd.Dir = cwd
	logs := new(syncBuffer)
	cmd.Stdout, cmd.Stderr = logs, logs
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if os.Geteuid() == 0 {
		cmd.SysProcAttr.Cloneflags = syscall.CLONE_NEWNET
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{})
	go func() { cmd.Wait(); close(exited) }()
	t.Cleanup(func() {
		cmd.Process.Kill()
		<-exited
		if t.Failed() {
			t.Logf("vmhost serve --dev:\n%s", logs)
		}
	})
	hc := &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", sock)
	}}}
	do := func(method, path, body string) (int, []byte) {
		req, _ := http.NewRequest(method, "http://vmhost"+path, strings.NewReader(body))
		req.Header.Set("Authorization", "Bearer "+token)
		resp, err := hc.Do(req)
		if err != nil {
			return 0, []byte(err.Error())
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, b
	}
	runDirLine := regexp.MustCompile(`msg=serving .* run_dir=(\S+)`)
	var runDir string
	for deadline := time.Now().Add(30 * time.Second); runDir == ""; {
		if m := runDirLine.FindStringSubmatch(logs.String()); m != nil {
			runDir = m[1]
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("vmhost serve --dev did not start:\n%s", logs)
		}
		time.Sleep(20 * time.Millisecond)
	}
	if !filepath.IsAbs(runDir) {
		runDir = filepath.Join(cwd, runDir)
	}
	ids := make([]string, n)
	for i := range ids {
		ids[i] = fmt.Sprintf("dev%02d", i)
		// Without a network (dev mode's default); the workload's
		// arguments name the run directory, so that one left running is
		// found.
		body := fmt.Sprintf(`{"vm_id":%q,"image_id":"hello","vcpus":1,"memory_mb":64,"disk_gib":1,"command":["/hello",%q]}`, ids[i], runDir)
		if st, b := do("POST", "/api/appvm/vms", body); st != http.StatusCreated {
			t.Fatalf("create %s = %d %s", ids[i], st, b)
		}
	}
	view := func(id string) (state, display string) {
		st, b := do("GET", "/api/appvm/vms/"+id, "")
		var v struct {
			State        string `json:"state"`
			DisplayState string `json:"display_state"`
		}
		if st != http.StatusOK || json.Unmarshal(b, &v) != nil {
			t.Fatalf("GET %s = %d %s", id, st, b)
		}
		return v.State, v.DisplayState
	}
	wait := func(id, what string, cond func(state, display string) bool) {
		deadline := time.Now().Add(60 * time.Second)
		for {
			if st, d := view(id); cond(st, d) {
				return
			}
			if time.Now().After(deadline) {
				st, d := view(id)
				t.Fatalf("AppVM %s: %s did not happen (%s/%s)", id, what, st, d)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	for _, id := range ids {
		wait(id, "running", func(s, d string) bool { return s == "running" && d == "running" })
	}
	if got := processesNaming(runDir); len(got) < 3*n {
		t.Fatalf("with %d AppVMs up, %d processes name the run directory; want at least the simulators, guest agents and workloads of each:\n%s", n, len(got), strings.Join(got, "\n"))
	}
	for i, id := range ids {
		action := "stop"
		if i%2 == 0 {
			action = "shutdown" // the graceful one: the workload gets its stop grace
		}
		if st, b := do("POST", "/api/appvm/vms/"+id+"/"+action, ""); st != http.StatusNoContent {
			t.Fatalf("%s %s = %d %s", action, id, st, b)
		}
	}
	for _, id := range ids {
		// Stopped; or failed, as a loaded machine can make the monitor
		// blame the socket a simulator unlinks just before it exits
		// (exitGrace): either way nothing of the VM may run.
		wait(id, "stopped", func(s, d string) bool { return s == "stopped" || s == "failed" })
		if st, b := do("DELETE", "/api/appvm/vms/"+id, ""); st != http.StatusNoContent {
			t.Fatalf("DELETE %s = %d %s", id, st, b)
		}
	}
	if left := waitNoProcessNaming(runDir, 10*time.Second); len(left) > 0 {
		t.Errorf("after %d AppVMs were created, stopped and deleted, processes name the run directory:\n%s", n, strings.Join(left, "\n"))
	}
	cmd.Process.Signal(syscall.SIGTERM)
	<-exited
	if left := processesNaming(runDir); len(left) > 0 {
		t.Errorf("after the agent exited, processes name the run directory:\n%s", strings.Join(left, "\n"))
	}
}

// processesNaming lists "<pid> <command line>" of the live processes
// (zombies aside) whose command line names dir.
func processesNaming(dir string) []string {
	var out []string
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		var pid int
		if _, err := fmt.Sscanf(e.Name(), "%d", &pid); err != nil {
			continue
		}
		cmd, err := os.ReadFile("/proc/" + e.Name() + "/cmdline")
		if err != nil || !bytes.Contains(cmd, []byte(dir)) {
			continue
		}
		if st, err := os.ReadFile("/proc/" + e.Name() + "/stat"); err == nil {
			if f := strings.Fields(string(st[bytes.LastIndexByte(st, ')')+1:])); len(f) > 0 && f[0] == "Z" {
				continue
			}
		}
		out = append(out, fmt.Sprintf("%d %s", pid, bytes.ReplaceAll(cmd, []byte{0}, []byte{' '})))
	}
	return out
}

// waitNoProcessNaming waits up to d for processesNaming(dir) to be empty
// (processes end a moment after the VM's end is recorded), and returns
// what is left.
func waitNoProcessNaming(dir string, d time.Duration) []string {
	deadline := time.Now().Add(d)
	for {
		left := processesNaming(dir)
		if len(left) == 0 || time.Now().After(deadline) {
			return left
		}
		time.Sleep(50 * time.Millisecond)
	}
}
