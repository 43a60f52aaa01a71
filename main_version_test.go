package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"strings"
	"testing"
)

// TestVersion: `vmhost version` and `vmhost --version` print the version
// set with -ldflags -X (dev without), the commit the Go tool stamped from
// git, and the Go version.
func TestVersion(t *testing.T) {
	out, errOut, code := vmhost(t, "", "version")
	if code != 0 || !strings.HasPrefix(out, "vmhost dev\n") || !strings.Contains(out, "\ngo "+runtime.Version()+"\n") {
		t.Errorf("vmhost version = %d, %q, %q; want vmhost dev and go %s", code, out, errOut, runtime.Version())
	}
	if out2, _, code := vmhost(t, "", "--version"); code != 0 || out2 != out {
		t.Errorf("vmhost --version = %d, %q; want what version prints", code, out2)
	}
	if _, _, code := vmhost(t, "", "version", "extra"); code != 2 {
		t.Errorf("vmhost version extra = %d, want 2", code)
	}

	// As dist/build-deb.sh builds: the version and the commit set with -X
	// (go build's own vcs.revision, when it records one, wins).
	ldflags := "-X main.version=1.2.3-test"
	head, gitErr := exec.Command("git", "rev-parse", "HEAD").Output()
	if gitErr == nil {
		ldflags += " -X main.commit=" + strings.TrimSpace(string(head))
	}
	bin := filepath.Join(t.TempDir(), "vmhost")
	build := exec.Command(goTool(t), "build", "-trimpath", "-ldflags", ldflags, "-o", bin, ".")
	build.Env = append(build.Environ(), "CGO_ENABLED=0")
	if b, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, b)
	}
	b, err := exec.Command(bin, "version").Output()
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(string(b), "\n")
	if len(lines) != 4 || lines[0] != "vmhost 1.2.3-test" || lines[2] != "go "+runtime.Version() {
		t.Fatalf("version of a release build = %q", b)
	}
	if gitErr != nil {
		if !regexp.MustCompile(`^commit unknown$`).MatchString(lines[1]) {
			t.Errorf("outside git the commit line = %q, want commit unknown", lines[1])
		}
		return
	}
	want := "commit " + strings.TrimSpace(string(head))
	if lines[1] != want && lines[1] != want+" (modified)" {
		t.Errorf("commit line = %q, want %q (or with \" (modified)\")", lines[1], want)
	}
}

// TestConfigCommand: config default prints a configuration config check
// accepts; a broken one is refused naming the problem.
func TestConfigCommand(t *testing.T) {
	dir := t.TempDir()
	out, _, code := vmhost(t, dir, "config", "default")
	if code != 0 || !strings.Contains(out, `"boot_timeout_secs"`) {
		t.Fatalf("config default = %d, %q", code, out)
	}
	good := filepath.Join(dir, "config.json")
	os.WriteFile(good, []byte(out), 0o644)
	if got, errOut, code := vmhost(t, dir, "config", "check", good); code != 0 || got != good+": ok\n" {
		t.Errorf("config check of the default = %d, %q, %q", code, got, errOut)
	}
	bad := filepath.Join(dir, "bad.json")
	os.WriteFile(bad, []byte(`{"tls":{"cert":"/a.crt"}}`), 0o644)
	if _, errOut, code := vmhost(t, dir, "config", "check", bad); code != 1 || !strings.Contains(errOut, "cert and key go together") {
		t.Errorf("config check of a bad file = %d, %q", code, errOut)
	}
	if _, _, code := vmhost(t, dir, "config"); code != 2 {
		t.Errorf("config without a subcommand = %d, want 2", code)
	}
}
