package agentid

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestLoadMakesOnceAndKeeps: the first Load makes an id and stores it 0644
// as one line; later Loads (a restart) return the same id; another state
// directory gets another id.
func TestLoadMakesOnceAndKeeps(t *testing.T) {
	dir := t.TempDir()
	id, err := Load(dir)
	if err != nil {
		t.Fatal(err)
	}
	if !Valid(id) {
		t.Fatalf("Load made %q, not %d lowercase hex digits", id, Len)
	}
	path := filepath.Join(dir, FileName)
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o644 {
		t.Errorf("%s mode = %o, want 644", FileName, fi.Mode().Perm())
	}
	data, _ := os.ReadFile(path)
	if string(data) != id+"\n" {
		t.Errorf("%s holds %q, want %q", FileName, data, id+"\n")
	}
	for range 3 {
		again, err := Load(dir)
		if err != nil || again != id {
			t.Fatalf("Load again = %q, %v; want %q", again, err, id)
		}
	}
	other, err := Load(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	if other == id {
		t.Errorf("two state directories got the same id %q", id)
	}
}

// TestLoadRefusesDamagedFile: a file that does not hold an id is an error
// naming the file, and it is left as it was (a new id would disown the
// agent's objects).
func TestLoadRefusesDamagedFile(t *testing.T) {
	for _, content := range []string{"", "\n", "0123456789ABCDEF\n", "0123456789abcde\n", "0123456789abcdef0\n", "vmhost:x\n", "0123456789abcdeg"} {
		dir := t.TempDir()
		path := filepath.Join(dir, FileName)
		os.WriteFile(path, []byte(content), 0o644)
		id, err := Load(dir)
		if err == nil || !strings.Contains(err.Error(), path) {
			t.Errorf("Load with %q = %q, %v; want an error naming %s", content, id, err, path)
		}
		if data, _ := os.ReadFile(path); string(data) != content {
			t.Errorf("Load rewrote a damaged file: %q → %q", content, data)
		}
	}
	// Without the trailing newline a valid id is still read.
	dir := t.TempDir()
	os.WriteFile(filepath.Join(dir, FileName), []byte("0123456789abcdef"), 0o644)
	if id, err := Load(dir); err != nil || id != "0123456789abcdef" {
		t.Errorf("Load = %q, %v", id, err)
	}
}

// TestLoadRemovesInterruptedWrite: the temp file of a write a crash
// interrupted is removed when the id is made.
func TestLoadRemovesInterruptedWrite(t *testing.T) {
	dir := t.TempDir()
	tmp := filepath.Join(dir, "."+FileName+".tmp-deadbeef")
	os.WriteFile(tmp, []byte("0011"), 0o600)
	if _, err := Load(dir); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(tmp); !os.IsNotExist(err) {
		t.Errorf("the interrupted write's temp file is still there: %v", err)
	}
	ents, _ := os.ReadDir(dir)
	if len(ents) != 1 || ents[0].Name() != FileName {
		t.Errorf("state directory holds %v, want only %s", ents, FileName)
	}
}

func TestValid(t *testing.T) {
	for s, want := range map[string]bool{
		"0123456789abcdef": true, New(): true,
		"0123456789abcdeF": false, "": false, "0123456789abcde": false, "0123456789abcdef0": false, "g123456789abcdef": false,
	} {
		if Valid(s) != want {
			t.Errorf("Valid(%q) = %v, want %v", s, !want, want)
		}
	}
}
