package main

import (
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"vmhost/qcow2"
)

// TestServeNotifiesSystemd runs serve as systemd would run a Type=notify
// service: NOTIFY_SOCKET names a unixgram socket the test reads. READY=1
// comes once the API answers, RELOADING=1 then READY=1 around a SIGHUP,
// STOPPING=1 on SIGTERM; and the VMs' programs do not inherit the socket.
func TestServeNotifiesSystemd(t *testing.T) {
	cwd, err := os.MkdirTemp("", "vh") // short: the run dir holds sockets
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(cwd) })
	sock := filepath.Join(cwd, "notify")
	nc, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: sock, Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	recv := func() string {
		t.Helper()
		nc.SetReadDeadline(time.Now().Add(30 * time.Second))
		b := make([]byte, 4096)
		n, err := nc.Read(b)
		if err != nil {
			t.Fatalf("reading the notify socket: %v", err)
		}
		return string(b[:n])
	}
	t.Setenv("NOTIFY_SOCKET", sock)
	s := startServer(t, cwd, "--dev", "--listen", "127.0.0.1:0")
	if got := recv(); got != "READY=1" {
		t.Fatalf("first notification = %q, want READY=1", got)
	}
	if code, _ := s.get(t, "/api/vms/x", ""); code != http.StatusUnauthorized {
		t.Errorf("API after READY=1 = %d, want 401", code)
	}
	s.cmd.Process.Signal(syscall.SIGHUP)
	if a, b := recv(), recv(); a != "RELOADING=1" || b != "READY=1" {
		t.Errorf("notifications around SIGHUP = %q, %q; want RELOADING=1, READY=1", a, b)
	}
	// The simulators the agent starts see no NOTIFY_SOCKET: create a VM
	// and read its CH simulator's environment.
	token := devToken(t, s)
	c, base := s.client()
	req, _ := http.NewRequest("POST", base+"/api/vms", strings.NewReader(vmBody(t, cwd, "n1", true)))
	req.Header.Set("Authorization", "Bearer "+token)
	if resp, err := c.Do(req); err != nil {
		t.Fatal(err)
	} else {
		resp.Body.Close()
		if resp.StatusCode != http.StatusCreated {
			t.Fatalf("create = %d\n%s", resp.StatusCode, s.stderr)
		}
	}
	out, err := exec.Command("sh", "-c", "for p in $(pgrep -P "+strconv.Itoa(s.cmd.Process.Pid)+"); do tr '\\0' '\\n' < /proc/$p/environ; done").Output()
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(out), "PATH=") {
		t.Fatalf("found no child of the agent to read the environment of: %q", out)
	}
	if strings.Contains(string(out), "NOTIFY_SOCKET") {
		t.Errorf("a child of the agent inherited NOTIFY_SOCKET")
	}
	s.deleteVM(t, token, "n1")
	if code := s.stop(t, syscall.SIGTERM); code != 0 {
		t.Errorf("exit code = %d", code)
	}
	if got := recv(); got != "STOPPING=1" {
		t.Errorf("notification on SIGTERM = %q, want STOPPING=1", got)
	}
}

// vmBody is a classic create body for the simulator: a stand-in kernel and
// a blank qcow2 base made in dir.
func vmBody(t *testing.T, dir, id string, autoBoot bool) string {
	t.Helper()
	kernel, base := filepath.Join(dir, "vmlinux"), filepath.Join(dir, "base.qcow2")
	if _, err := os.Stat(base); err != nil {
		if err := os.WriteFile(kernel, []byte("not really a kernel"), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := qcow2.Create(base, 1<<30); err != nil {
			t.Fatal(err)
		}
	}
	return fmt.Sprintf(`{"vm_id":%q,"vcpus":1,"memory_mb":128,"kernel_path":%q,"disk":{"base_path":%q},"auto_boot":%t}`, id, kernel, base, autoBoot)
}

// deleteVM deletes a VM through the API with ?force=true: a VM's processes
// outlive the agent by design (KillMode=process), so a test that started
// one ends it while the agent still runs.
func (s *server) deleteVM(t *testing.T, token, id string) {
	t.Helper()
	if s.exited {
		return // another agent on the same directories deletes it
	}
	c, base := s.client()
	req, _ := http.NewRequest("DELETE", base+"/api/vms/"+id+"?force=true", nil)
	req.Header.Set("Authorization", "Bearer "+token)
	resp, err := c.Do(req)
	if err != nil {
		t.Errorf("deleting VM %s: %v", id, err)
		return
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusNoContent && resp.StatusCode != http.StatusNotFound {
		t.Errorf("deleting VM %s = %d", id, resp.StatusCode)
	}
}
