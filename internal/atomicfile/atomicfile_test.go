package atomicfile

import (
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
)

func TestWriteFileReplacesAndLeavesNoTemp(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "rec.json")
	if err := WriteFile(path, []byte("old"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := WriteFile(path, []byte("new"), 0o600); err != nil {
		t.Fatal(err)
	}
	got, err := os.ReadFile(path)
	if err != nil || string(got) != "new" {
		t.Fatalf("content = %q, %v; want new", got, err)
	}
	fi, _ := os.Stat(path)
	if fi.Mode().Perm() != 0o600 {
		t.Errorf("mode = %v, want 0600", fi.Mode().Perm())
	}
	ents, _ := os.ReadDir(dir)
	if len(ents) != 1 {
		t.Errorf("directory holds %d entries, want only the target", len(ents))
	}
}

func TestWriteFileModeIgnoresUmask(t *testing.T) {
	old := syscall.Umask(0o077)
	defer syscall.Umask(old)
	path := filepath.Join(t.TempDir(), "f")
	if err := WriteFile(path, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	fi, _ := os.Stat(path)
	if fi.Mode().Perm() != 0o644 {
		t.Errorf("mode = %v, want 0644", fi.Mode().Perm())
	}
}

func TestWriteRefusesNonRegularTarget(t *testing.T) {
	dir := t.TempDir()
	other := filepath.Join(dir, "other")
	os.WriteFile(other, []byte("keep"), 0o600)
	link := filepath.Join(dir, "link")
	os.Symlink(other, link)
	sub := filepath.Join(dir, "sub")
	os.Mkdir(sub, 0o700)
	for _, target := range []string{link, sub} {
		err := WriteFile(target, []byte("x"), 0o600)
		if err == nil || !strings.Contains(err.Error(), "not a regular file") {
			t.Errorf("WriteFile(%s) = %v, want a refusal", target, err)
		}
	}
	if got, _ := os.ReadFile(other); string(got) != "keep" {
		t.Errorf("symlink target changed to %q", got)
	}
	ents, _ := os.ReadDir(dir)
	if len(ents) != 3 {
		t.Errorf("directory holds %d entries, want 3 (no temp left)", len(ents))
	}
}

func TestWriteFailureKeepsOldContentAndRemovesTemp(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "f")
	WriteFile(path, []byte("old"), 0o600)
	boom := errors.New("boom")
	err := Write(path, 0o600, func(w io.Writer) error {
		w.Write([]byte("partial"))
		return boom
	})
	if !errors.Is(err, boom) {
		t.Fatalf("err = %v, want boom", err)
	}
	if got, _ := os.ReadFile(path); string(got) != "old" {
		t.Errorf("content = %q, want old", got)
	}
	ents, _ := os.ReadDir(dir)
	if len(ents) != 1 {
		t.Errorf("directory holds %d entries, want 1", len(ents))
	}
}

func TestSyncDirMissing(t *testing.T) {
	if err := SyncDir(filepath.Join(t.TempDir(), "nope")); err == nil {
		t.Fatal("SyncDir of a missing directory succeeded")
	}
}

func TestIsTemp(t *testing.T) {
	for name, want := range map[string]bool{
		".rec.json.tmp-123": true,
		"rec.json":          false,
		".tmp-":             true,
		"x.tmp-1":           false,
		".hidden":           false,
	} {
		if IsTemp(name) != want {
			t.Errorf("IsTemp(%q) = %v, want %v", name, !want, want)
		}
	}
}
