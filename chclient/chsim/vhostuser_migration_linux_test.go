package chsim_test

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestVhostUserVsockMigrationBlockedInQemu pins why the qemu backend cannot save an
// AppVM: QEMU gives two reasons for not migrating a VM with vhost-user-vsock, and only
// the first is the backend's. Straight to vhost-device-vsock, QEMU lists both: the
// backend lacks VHOST_USER_PROTOCOL_F_LOG_SHMFD (vhost-user.c, at vhost init) and the
// device is non-migratable (vhost-user-vsock.c marks its VMState unmigratable).
// Through vhostUserProxy, which offers the dirty-log features, the first reason is
// gone and the device still works (QEMU realized it against the backend), yet QEMU
// still refuses a migration of the stopped VM because of the second. Should a QEMU
// ever migrate vhost-user-vsock, this test fails and says so.
func TestVhostUserVsockMigrationBlockedInQemu(t *testing.T) {
	t.Parallel()
	needQemu(t)
	backend := vsockBackend(t)
	dir := shortDir(t)
	vu := filepath.Join(dir, "vsock.vu")
	cmd := exec.Command(backend, "--guest-cid", "3", "--socket", vu, "--uds-path", filepath.Join(dir, "vsock"))
	cmd.Stderr = os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	start := func() {
		t.Helper()
		os.Remove(vu)
		c := *cmd
		if err := c.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Process.Kill(); c.Wait() })
		for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
			if fi, err := os.Stat(vu); err == nil && fi.Mode()&os.ModeSocket != 0 {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s did not create %s", backend, vu)
			}
		}
	}
	const shmfd = "Migration disabled: vhost-user backend lacks VHOST_USER_PROTOCOL_F_LOG_SHMFD feature."
	// One qemu, stopped from the start (-S), with its vsock on socket; it returns QEMU's
	// blocked reasons and what its migrate to a file answers.
	run := func(socket string) (reasons []string, migrate string) {
		t.Helper()
		h := startHandQemu(t, []string{
			"-nodefaults", "-no-user-config", "-display", "none", "-S",
			"-machine", "q35,accel=tcg,memory-backend=mem", "-m", "128M",
			"-object", "memory-backend-memfd,id=mem,size=128M,share=on",
			"-chardev", "socket,id=mon,fd=3", "-mon", "chardev=mon,mode=control",
			"-chardev", "socket,id=ser,fd=4", "-serial", "chardev:ser",
			"-chardev", "socket,id=vs,path=" + socket,
			"-device", "vhost-user-vsock-pci,id=vsock,chardev=vs",
		})
		defer h.quit(t)
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		var st struct {
			BlockedReasons []string `json:"blocked-reasons"`
		}
		if err := h.qmp.Execute(ctx, "query-migrate", nil, &st); err != nil {
			t.Fatal(err)
		}
		err := h.qmp.Execute(ctx, "migrate", map[string]string{"uri": "exec:cat >" + filepath.Join(dir, "stream")}, nil)
		if err == nil {
			h.waitMigration(t)
			return st.BlockedReasons, ""
		}
		return st.BlockedReasons, err.Error()
	}

	start()
	direct, directErr := run(vu)
	t.Logf("straight to vhost-device-vsock: blocked reasons %q; migrate: %s", direct, directErr)
	if len(direct) != 2 || direct[0] != shmfd || !strings.Contains(direct[1], "non-migratable device") ||
		!strings.HasSuffix(direct[1], "/vhost-user-vsock") || directErr == "" {
		t.Errorf("without the proxy: reasons %q, migrate %q; want the LOG_SHMFD reason and the non-migratable device, refused", direct, directErr)
	}

	start() // vhost-device-vsock 0.3.0 serves one connection: a fresh one
	p := &vhostUserProxy{refused: make(chan uint32, 4)}
	l, err := p.listen(filepath.Join(dir, "proxy.vu"), vu)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	proxied, proxiedErr := run(filepath.Join(dir, "proxy.vu"))
	t.Logf("through the proxy: blocked reasons %q; migrate: %s", proxied, proxiedErr)
	for _, r := range proxied {
		if strings.Contains(r, "LOG_SHMFD") || strings.Contains(r, "LOG_ALL") {
			t.Errorf("through the proxy QEMU still lacks the dirty log: %q", r)
		}
	}
	if len(proxied) != 1 || !strings.Contains(proxied[0], "non-migratable device") {
		t.Errorf("through the proxy: reasons %q, want only the non-migratable device", proxied)
	}
	if proxiedErr == "" {
		t.Errorf("QEMU migrated a VM with vhost-user-vsock: the simulator could save AppVMs through vhostUserProxy now")
	}
	select {
	case r := <-p.refused:
		t.Errorf("QEMU asked the stopped device for a dirty log (request %d)", r)
	default:
	}
}
