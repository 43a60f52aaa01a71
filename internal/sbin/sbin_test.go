package sbin

import (
	"os"
	"path/filepath"
	"testing"
)

// TestPath: PATH first; a program only in a system directory is found
// there when PATH leaves it out; one found nowhere comes back as its name.
func TestPath(t *testing.T) {
	dir := t.TempDir()
	prog := filepath.Join(dir, "vmhost-sbin-test")
	if err := os.WriteFile(prog, []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	t.Setenv("PATH", dir)
	if got := Path("vmhost-sbin-test"); got != prog {
		t.Errorf("Path in PATH = %q, want %q", got, prog)
	}
	if got := Path("vmhost-no-such-program"); got != "vmhost-no-such-program" {
		t.Errorf("Path of a missing program = %q, want its name", got)
	}
	old := dirs
	t.Cleanup(func() { dirs = old })
	sys := t.TempDir()
	dirs = []string{filepath.Join(sys, "none"), sys}
	if err := os.WriteFile(filepath.Join(sys, "mkfs.test"), []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(sys, "notexec"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	if got := Path("mkfs.test"); got != filepath.Join(sys, "mkfs.test") {
		t.Errorf("Path outside PATH = %q, want the system directory's", got)
	}
	if got := Path("notexec"); got != "notexec" {
		t.Errorf("Path of a file that is not executable = %q, want its name", got)
	}
}
