package audit

import (
	"bufio"
	"encoding/json"
	"os"
	"path/filepath"
	"testing"
	"time"
)

func readEntries(t *testing.T, path string) []Entry {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var out []Entry
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		var e Entry
		if err := json.Unmarshal(sc.Bytes(), &e); err != nil {
			t.Fatalf("%s: line %q: %v", path, sc.Text(), err)
		}
		out = append(out, e)
	}
	return out
}

// TestAppendAndRotate: entries are JSON lines in a 0600 file that survives
// a reopen; past MaxBytes the file moves to .1 and a new one starts, so
// the newest entries are always in the log and nothing in between is lost.
func TestAppendAndRotate(t *testing.T) {
	path := filepath.Join(t.TempDir(), "audit.log")
	l, err := Open(path, 4096)
	if err != nil {
		t.Fatal(err)
	}
	e := Entry{Time: time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC), Method: "DELETE", Route: "DELETE /api/vms/{id}",
		Path: "/api/vms/a", VMID: "a", Key: "ops", Status: 204, DurationMS: 1.5, Remote: "127.0.0.1:5000"}
	if err := l.Write(e); err != nil {
		t.Fatal(err)
	}
	l.Close()
	if fi, err := os.Stat(path); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("audit.log: %v, %v; want mode 0600", fi, err)
	}
	l, err = Open(path, 4096)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	for i := range 60 {
		e.Status = 200 + i
		if err := l.Write(e); err != nil {
			t.Fatal(err)
		}
	}
	cur, old := readEntries(t, path), readEntries(t, path+".1")
	if len(cur) == 0 || len(old) == 0 {
		t.Fatalf("after 61 entries of ~200 bytes with MaxBytes 4096: %d current, %d rotated; want both", len(cur), len(old))
	}
	if fi, _ := os.Stat(path); fi.Size() > 4096 {
		t.Errorf("audit.log is %d bytes, past MaxBytes", fi.Size())
	}
	if last := cur[len(cur)-1]; last.Status != 259 || last.Key != "ops" || last.VMID != "a" || last.Route != e.Route {
		t.Errorf("newest entry = %+v", last)
	}
	// Consecutive: the rotated file ends where the current one begins.
	if old[len(old)-1].Status+1 != cur[0].Status {
		t.Errorf("rotation lost entries: .1 ends at %d, current starts at %d", old[len(old)-1].Status, cur[0].Status)
	}
}
