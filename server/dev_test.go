package server

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestDevFallbackRunDirPerStateDir(t *testing.T) {
	a, b := DevFallbackRunDir("/x/state"), DevFallbackRunDir("/y/state")
	if a == b {
		t.Errorf("two state directories share the fallback run dir %s", a)
	}
	if a != DevFallbackRunDir("/x/state") {
		t.Error("the fallback run dir is not stable for one state directory")
	}
}

// TestAPIURL: what VMHOST_API is set to for each kind of listener.
func TestAPIURL(t *testing.T) {
	cwd, _ := os.Getwd()
	for _, tt := range []struct{ scheme, addr, want string }{
		{"http", "127.0.0.1:8080", "http://127.0.0.1:8080"},
		{"https", "192.0.2.1:443", "https://192.0.2.1:443"},
		{"http", "0.0.0.0:8080", "http://127.0.0.1:8080"},
		{"http", "[::]:8080", "http://[::1]:8080"},
		{"http", "[2001:db8::1]:8080", "http://[2001:db8::1]:8080"},
		{"http", ":8080", "http://127.0.0.1:8080"},
		{"http", "unix:/run/vmhost/api.sock", "unix:/run/vmhost/api.sock"},
		{"http", "unix:api.sock", "unix:" + filepath.Join(cwd, "api.sock")},
	} {
		if got := apiURL(tt.scheme, tt.addr); got != tt.want {
			t.Errorf("apiURL(%s, %s) = %q, want %q", tt.scheme, tt.addr, got, tt.want)
		}
	}
}

func TestShellQuote(t *testing.T) {
	for in, want := range map[string]string{
		"http://127.0.0.1:8080":    "http://127.0.0.1:8080",
		"unix:/tmp/a b/api.sock":   "'unix:/tmp/a b/api.sock'",
		"unix:/tmp/it's/api.sock":  `'unix:/tmp/it'\''s/api.sock'`,
		"unix:/tmp/$(reboot)/sock": "'unix:/tmp/$(reboot)/sock'",
		"":                         "''",
	} {
		if got := shellQuote(in); got != want {
			t.Errorf("shellQuote(%q) = %s, want %s", in, got, want)
		}
	}
}

// TestDevShellLines: the first start prints both lines, a later one the
// API and where the key is; outside --dev nothing is printed.
func TestDevShellLines(t *testing.T) {
	var b strings.Builder
	(&devRun{token: "vmh_TOKEN"}).printShellLines(&b, "http", "127.0.0.1:8080")
	if want := "export VMHOST_API=http://127.0.0.1:8080\nexport VMHOST_TOKEN=vmh_TOKEN\n"; !strings.HasSuffix(b.String(), want) || !strings.HasPrefix(b.String(), "# ") {
		t.Errorf("first start printed:\n%s\nwant a comment and then:\n%s", b.String(), want)
	}
	b.Reset()
	(&devRun{}).printShellLines(&b, "http", "127.0.0.1:8080")
	if out := b.String(); !strings.Contains(out, "\nexport VMHOST_API=http://127.0.0.1:8080\n") || strings.Contains(out, "export VMHOST_TOKEN") {
		t.Errorf("later start printed:\n%s", out)
	}
	for _, line := range strings.Split(strings.TrimSpace(b.String()), "\n") {
		if !strings.HasPrefix(line, "#") && !strings.HasPrefix(line, "export ") {
			t.Errorf("line %q is neither a comment nor an export: a shell could not take the block", line)
		}
	}
	b.Reset()
	(*devRun)(nil).printShellLines(&b, "http", "127.0.0.1:8080")
	if b.Len() != 0 {
		t.Errorf("outside dev mode printed %q", b.String())
	}
}
