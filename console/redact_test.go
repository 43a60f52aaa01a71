package console_test

import (
	"fmt"
	"path/filepath"
	"strings"
	"testing"

	"vmhost/console"
	"vmhost/internal/redact"
)

// TestRedactsSecretsFromTheLog: the VM's secret values never reach the
// log, also when the serial output splits one between two reads; the
// start of a secret that never completes is written at the stop.
func TestRedactsSecretsFromTheLog(t *testing.T) {
	dir := shortDir(t)
	sock, logPath := filepath.Join(dir, "serial.sock"), filepath.Join(dir, "console.log")
	srv := listen(t, sock)
	k := start(t, console.Config{Socket: sock, Path: logPath, Redact: redact.New("ci-Passw0rd-1", "key-line-xyz")})
	c := srv.accept(t)
	fmt.Fprint(c, "login: ci-Pass")
	waitFor(t, "the line start in the log", func() bool { return strings.HasSuffix(output(t, logPath), "login: ") })
	fmt.Fprint(c, "w0rd-1\nkey-line-xyz ok\nend ci-")
	waitFor(t, "the rest in the log", func() bool { return strings.Contains(output(t, logPath), " ok\nend ") })
	if got, want := output(t, logPath), "login: [redacted]\n[redacted] ok\nend "; got != want {
		t.Errorf("log = %q, want %q", got, want)
	}
	c.Close()
	k.Stop()
	if got, want := output(t, logPath), "login: [redacted]\n[redacted] ok\nend ci-"; got != want {
		t.Errorf("log after the stop = %q, want %q", got, want)
	}
}
