package atomicfile

import (
	"errors"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
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

// TestRemoveTemps removes the temp files (and a temp directory) of a
// directory, and nothing else.
func TestRemoveTemps(t *testing.T) {
	dir := t.TempDir()
	keep := []string{"root.qcow2", ".hidden", "x.tmp-1"}
	temps := []string{".root.qcow2.tmp-0123", ".data0.qcow2.tmp-raw-99"}
	for _, n := range append(keep, temps...) {
		if err := os.WriteFile(filepath.Join(dir, n), nil, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.MkdirAll(filepath.Join(dir, ".tree.tmp-7", "sub"), 0o700); err != nil {
		t.Fatal(err)
	}
	removed, err := RemoveTemps(dir)
	if err != nil || len(removed) != 3 {
		t.Fatalf("RemoveTemps = %v, %v; want the 3 temps", removed, err)
	}
	ents, _ := os.ReadDir(dir)
	var left []string
	for _, e := range ents {
		left = append(left, e.Name())
	}
	if !slices.Equal(left, []string{".hidden", "root.qcow2", "x.tmp-1"}) {
		t.Errorf("left %v", left)
	}
	if removed, err := RemoveTemps(filepath.Join(dir, "missing")); err != nil || removed != nil {
		t.Errorf("RemoveTemps of a missing dir = %v, %v", removed, err)
	}
}

func TestFillGivesTheFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "img")
	err := Fill(path, 0o600, func(f *os.File) error {
		if _, err := f.WriteAt([]byte("head"), 0); err != nil {
			return err
		}
		return f.Truncate(1 << 20)
	})
	if err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(path)
	if err != nil || fi.Size() != 1<<20 {
		t.Fatalf("stat = %v, %v; want a 1 MiB file", fi, err)
	}
}

// A non-regular file that appears at the target while the temporary file is
// being written is caught by the check right before the rename.
func TestFillRechecksTargetBeforeRename(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "f")
	err := Fill(path, 0o600, func(*os.File) error { return os.Mkdir(path, 0o700) })
	if err == nil || !strings.Contains(err.Error(), "not a regular file") {
		t.Fatalf("Fill = %v, want a refusal", err)
	}
	if fi, err := os.Lstat(path); err != nil || !fi.IsDir() {
		t.Errorf("target = %v, %v; want the directory kept", fi, err)
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 1 {
		t.Errorf("directory holds %d entries, want 1 (temp removed)", len(ents))
	}
}

func TestCreateNeverReplaces(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "disk")
	fill := func(f *os.File) error { _, err := f.Write([]byte("new")); return err }
	if err := Create(path, 0o640, fill); err != nil {
		t.Fatal(err)
	}
	if fi, _ := os.Stat(path); fi.Mode().Perm() != 0o640 {
		t.Errorf("mode = %v, want 0640", fi.Mode().Perm())
	}
	// Existing before: refused at once.
	if err := Create(path, 0o600, fill); !errors.Is(err, fs.ErrExist) {
		t.Errorf("Create over an existing file = %v, want fs.ErrExist", err)
	}
	// Appearing while the new one is written: refused when publishing.
	other := filepath.Join(dir, "other")
	err := Create(other, 0o600, func(f *os.File) error {
		return os.WriteFile(other, []byte("keep"), 0o600)
	})
	if !errors.Is(err, fs.ErrExist) {
		t.Errorf("Create racing a writer = %v, want fs.ErrExist", err)
	}
	if got, _ := os.ReadFile(other); string(got) != "keep" {
		t.Errorf("racing file = %q, want it kept", got)
	}
	ents, _ := os.ReadDir(dir)
	if len(ents) != 2 {
		t.Errorf("directory holds %d entries, want 2 (no temp left)", len(ents))
	}
}

// linkNoReplace is what Create uses where RENAME_NOREPLACE is missing
// (other systems, some Linux file systems).
func TestLinkNoReplace(t *testing.T) {
	dir := t.TempDir()
	root, err := os.OpenRoot(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer root.Close()
	os.WriteFile(filepath.Join(dir, ".a.tmp-1"), []byte("a"), 0o600)
	os.WriteFile(filepath.Join(dir, "taken"), []byte("keep"), 0o600)
	if err := linkNoReplace(root, ".a.tmp-1", "taken"); !errors.Is(err, fs.ErrExist) {
		t.Errorf("linkNoReplace over a file = %v, want fs.ErrExist", err)
	}
	if err := linkNoReplace(root, ".a.tmp-1", "a"); err != nil {
		t.Fatal(err)
	}
	if got, _ := os.ReadFile(filepath.Join(dir, "a")); string(got) != "a" {
		t.Errorf("a = %q", got)
	}
	if _, err := os.Lstat(filepath.Join(dir, ".a.tmp-1")); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("temp still there: %v", err)
	}
}

func TestFillInStaysInsideRoot(t *testing.T) {
	parent := t.TempDir()
	dir := filepath.Join(parent, "store")
	os.Mkdir(dir, 0o700)
	root, err := os.OpenRoot(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer root.Close()
	write := func(f *os.File) error { _, err := f.Write([]byte("x")); return err }
	for _, name := range []string{"../escape", "/etc/escape"} {
		if err := FillIn(root, name, 0o600, write); err == nil {
			t.Errorf("FillIn(%q) succeeded, want an escape refused", name)
		}
	}
	// A symlink in the root pointing out is refused as a target too.
	os.Symlink(filepath.Join(parent, "out"), filepath.Join(dir, "link"))
	if err := FillIn(root, "link", 0o600, write); err == nil || !strings.Contains(err.Error(), "not a regular file") {
		t.Errorf("FillIn over a symlink = %v, want a refusal", err)
	}
	if ents, _ := os.ReadDir(parent); len(ents) != 1 {
		t.Errorf("parent holds %d entries, want only the store", len(ents))
	}
	if err := FillIn(root, "rec", 0o600, write); err != nil {
		t.Fatal(err)
	}
	if got, _ := os.ReadFile(filepath.Join(dir, "rec")); string(got) != "x" {
		t.Errorf("rec = %q, want x", got)
	}
	if err := SyncRoot(root); err != nil {
		t.Errorf("SyncRoot = %v", err)
	}
}

func TestRename(t *testing.T) {
	dir := t.TempDir()
	from := filepath.Join(dir, "staged")
	os.WriteFile(from, []byte("img"), 0o600)
	sub := filepath.Join(dir, "sub")
	os.Mkdir(sub, 0o700)
	if err := Rename(from, sub); err == nil || !strings.Contains(err.Error(), "not a regular file") {
		t.Errorf("Rename over a directory = %v, want a refusal", err)
	}
	to := filepath.Join(dir, "final")
	os.WriteFile(to, []byte("old"), 0o600)
	if err := Rename(from, to); err != nil {
		t.Fatal(err)
	}
	if got, _ := os.ReadFile(to); string(got) != "img" {
		t.Errorf("final = %q, want img", got)
	}
}

func TestDirSyncResultToleratesEINVAL(t *testing.T) {
	einval := &os.PathError{Op: "sync", Path: "/d", Err: syscall.EINVAL}
	if err := dirSyncResult(einval); err != nil {
		t.Errorf("dirSyncResult(EINVAL) = %v, want nil", err)
	}
	eio := &os.PathError{Op: "sync", Path: "/d", Err: syscall.EIO}
	if err := dirSyncResult(eio); !errors.Is(err, syscall.EIO) {
		t.Errorf("dirSyncResult(EIO) = %v, want EIO", err)
	}
}
