package console_test

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"vmhost/chclient/chsim"
	"vmhost/console"
)

// The simulator runs as a separate process, as in chsim's own tests: the
// test binary re-executes itself with CHSIM_TEST_MAIN set.
func TestMain(m *testing.M) {
	if os.Getenv("CHSIM_TEST_MAIN") == "1" {
		os.Exit(chsim.Main(os.Args[1:]))
	}
	os.Exit(m.Run())
}

// TestKeepsChsimSerialConsole keeps the console of a simulated Cloud
// Hypervisor VM whose serial port is in Socket mode: the keeper starts
// between vm.create (which binds the socket) and vm.boot, gets the boot
// line and what the guest prints later, and outlives the VMM's exit.
func TestKeepsChsimSerialConsole(t *testing.T) {
	dir := shortDir(t)
	api, serial, logPath := filepath.Join(dir, "ch.sock"), filepath.Join(dir, "serial.sock"), filepath.Join(dir, "console.log")
	cmd := exec.Command(os.Args[0], "--api-socket", "path="+api, "--log-file", filepath.Join(dir, "ch.log"))
	cmd.Env = append(os.Environ(), "CHSIM_TEST_MAIN=1")
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{})
	go func() { cmd.Wait(); close(exited) }()
	t.Cleanup(func() { cmd.Process.Kill(); <-exited })
	waitFor(t, "the simulator's API socket", func() bool {
		c, err := net.Dial("unix", api)
		if err == nil {
			c.Close()
		}
		return err == nil
	})
	hc := &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", api)
	}}}
	t.Cleanup(hc.CloseIdleConnections)
	put := func(path, body string) {
		t.Helper()
		req, _ := http.NewRequest(http.MethodPut, "http://localhost"+path, strings.NewReader(body))
		if body != "" {
			req.Header.Set("Content-Type", "application/json")
		}
		resp, err := hc.Do(req)
		if err != nil {
			t.Fatalf("PUT %s: %v", path, err)
		}
		data, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusNoContent {
			t.Fatalf("PUT %s = %d %s", path, resp.StatusCode, data)
		}
	}
	kernel, disk := filepath.Join(dir, "vmlinux"), filepath.Join(dir, "root.img")
	for _, f := range []string{kernel, disk} {
		if err := os.WriteFile(f, []byte("x"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	put("/api/v1/vm.create", fmt.Sprintf(`{"cpus":{"boot_vcpus":1,"max_vcpus":1},"memory":{"size":1073741824},`+
		`"payload":{"kernel":%q,"cmdline":"console=ttyS0"},"disks":[{"path":%q,"image_type":"Raw"}],`+
		`"console":{"mode":"Off"},"serial":{"mode":"Socket","socket":%q}}`, kernel, disk, serial))

	k := start(t, console.Config{Socket: serial, Path: logPath})
	put("/api/v1/vm.boot", "")
	put("/sim/v1/serial", `{"data":"\u001b[1mmounting ext4 on /mnt/root: no such device\u001b[0m\r\n"}`)
	waitFor(t, "the guest's output in console.log", func() bool {
		out := output(t, logPath)
		return strings.Contains(out, "chsim: Linux version 6.1.0-chsim booting\r\n") && strings.Contains(out, "no such device")
	})
	if got, err := console.Tail(logPath, 2); err != nil || !strings.HasSuffix(got, "| mounting ext4 on /mnt/root: no such device") {
		t.Errorf("Tail = %q, %v", got, err)
	}

	// The guest powers off: the VMM exits and removes the socket; the
	// keeper waits for a socket again until it is stopped.
	put("/sim/v1/poweroff", "")
	select {
	case <-exited:
	case <-time.After(10 * time.Second):
		t.Fatal("the simulator did not exit at guest poweroff")
	}
	select {
	case <-k.Done():
		t.Fatal("the keeper stopped when the VMM exited; only its owner stops it")
	case <-time.After(100 * time.Millisecond):
	}
	k.Stop()
	if err := k.Err(); err != nil {
		t.Errorf("Err = %v", err)
	}
}
