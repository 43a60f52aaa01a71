package store

import (
	"errors"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"sync"
	"syscall"
	"testing"
)

func openTemp(t *testing.T) (*Store, string) {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "vms")
	s, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s, dir
}

func dirNames(t *testing.T, dir string) []string {
	t.Helper()
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range entries {
		names = append(names, e.Name())
	}
	return names
}

func TestValidID(t *testing.T) {
	tests := []struct {
		id   string
		want bool
	}{
		{"a", true},
		{"vm-1", true},
		{"0_x.y-z", true},
		{"3f0c6a1e-8d6e-4d0f-9d51-7d1f3c0f2a11", true},
		{strings.Repeat("a", 64), true},
		{strings.Repeat("a", 65), false},
		{"", false},
		{"-a", false},
		{".a", false},
		{"_a", false},
		{"a/b", false},
		{"..", false},
		{"a b", false},
		{"a\n", false},
		{"é", false},
	}
	for _, tt := range tests {
		if got := ValidID(tt.id); got != tt.want {
			t.Errorf("ValidID(%q) = %v, want %v", tt.id, got, tt.want)
		}
	}
}

func TestOpenCreatesDir0700(t *testing.T) {
	_, dir := openTemp(t)
	fi, err := os.Stat(dir)
	if err != nil {
		t.Fatal(err)
	}
	if got := fi.Mode().Perm(); got != 0o700 {
		t.Errorf("store dir mode = %o, want 700", got)
	}
}

func TestPutGetDelete(t *testing.T) {
	s, dir := openTemp(t)
	if err := s.Put("vm1", []byte(`{"a":1}`)); err != nil {
		t.Fatal(err)
	}
	if err := s.Put("vm1", []byte(`{"a":2}`)); err != nil {
		t.Fatal(err)
	}
	got, err := s.Get("vm1")
	if err != nil {
		t.Fatal(err)
	}
	if string(got) != `{"a":2}` {
		t.Errorf("Get = %s, want {\"a\":2}", got)
	}
	fi, err := os.Stat(filepath.Join(dir, "vm1.json"))
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o600 {
		t.Errorf("record mode = %o, want 600", fi.Mode().Perm())
	}
	if names := dirNames(t, dir); !reflect.DeepEqual(names, []string{"vm1.json"}) {
		t.Errorf("directory after two Puts = %q, want only vm1.json (no temp left)", names)
	}

	if err := s.Delete("vm1"); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Get("vm1"); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("Get after Delete: err = %v, want fs.ErrNotExist", err)
	}
	if err := s.Delete("vm1"); err != nil {
		t.Errorf("second Delete = %v, want nil (idempotent)", err)
	}
}

func TestPutModeIgnoresUmask(t *testing.T) {
	s, dir := openTemp(t)
	// A umask that would leave the owner unable to read: Put must still
	// produce exactly 0600.
	old := syscall.Umask(0o277)
	defer syscall.Umask(old)
	if err := s.Put("vm1", []byte(`{}`)); err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(filepath.Join(dir, "vm1.json"))
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o600 {
		t.Errorf("record mode = %o, want 600", fi.Mode().Perm())
	}
}

func TestPutRejectsInvalidID(t *testing.T) {
	s, dir := openTemp(t)
	for _, id := range []string{"", "../x", "a/b", ".tmp-x", "-x", strings.Repeat("a", 65)} {
		if err := s.Put(id, []byte(`{}`)); err == nil {
			t.Errorf("Put(%q) = nil, want an error", id)
		}
	}
	if names := dirNames(t, dir); len(names) != 0 {
		t.Errorf("directory after rejected Puts = %q, want empty", names)
	}
	if _, err := os.Stat(filepath.Join(filepath.Dir(dir), "x.json")); err == nil {
		t.Error("Put(\"../x\") wrote outside the store")
	}
}

func TestPutRefusesNonRegularTarget(t *testing.T) {
	s, dir := openTemp(t)
	sock := filepath.Join(dir, "vm1.json")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()

	err = s.Put("vm1", []byte(`{}`))
	if err == nil {
		t.Fatal("Put over a unix socket = nil, want an error")
	}
	if !strings.Contains(err.Error(), "not a regular file") {
		t.Errorf("Put over a unix socket: err = %v, want it to say not a regular file", err)
	}
	fi, err := os.Lstat(sock)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Type() != fs.ModeSocket {
		t.Errorf("socket replaced: mode = %v", fi.Mode())
	}
	if names := dirNames(t, dir); !reflect.DeepEqual(names, []string{"vm1.json"}) {
		t.Errorf("directory = %q, want only the socket (temp removed)", names)
	}
}

func TestPutRefusesSymlinkAndDir(t *testing.T) {
	s, dir := openTemp(t)
	outside := filepath.Join(t.TempDir(), "outside.json")
	if err := os.WriteFile(outside, []byte(`{"keep":true}`), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(outside, filepath.Join(dir, "link.json")); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(filepath.Join(dir, "d.json"), 0o700); err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"link", "d"} {
		if err := s.Put(id, []byte(`{}`)); err == nil {
			t.Errorf("Put(%q) over a non-regular file = nil, want an error", id)
		}
	}
	if got, _ := os.ReadFile(outside); string(got) != `{"keep":true}` {
		t.Errorf("symlink target changed to %s", got)
	}
}

func TestPutCleansTempOnError(t *testing.T) {
	s, dir := openTemp(t)
	// Something puts a socket at the record path after the temp file is
	// written: the re-check before the rename refuses, and the temp goes.
	var l net.Listener
	s.beforeRename = func() {
		var err error
		l, err = net.Listen("unix", filepath.Join(dir, "vm1.json"))
		if err != nil {
			t.Error(err)
		}
	}
	err := s.Put("vm1", []byte(`{}`))
	if l != nil {
		defer l.Close()
	}
	if err == nil || !strings.Contains(err.Error(), "not a regular file") {
		t.Fatalf("Put = %v, want a not-a-regular-file error", err)
	}
	if names := dirNames(t, dir); !reflect.DeepEqual(names, []string{"vm1.json"}) {
		t.Errorf("directory after failed Put = %q, want only the socket", names)
	}
}

func TestConcurrentPuts(t *testing.T) {
	s, dir := openTemp(t)
	var wg sync.WaitGroup
	for i := range 8 {
		wg.Go(func() {
			for j := range 20 {
				id := []string{"a", "b"}[(i+j)%2]
				if err := s.Put(id, []byte(`{"w":1}`)); err != nil {
					t.Error(err)
				}
			}
		})
	}
	wg.Go(func() {
		for range 5 {
			if _, err := s.Load(); err != nil {
				t.Error(err)
			}
		}
	})
	wg.Wait()
	if names := dirNames(t, dir); !reflect.DeepEqual(names, []string{"a.json", "b.json"}) {
		t.Errorf("directory = %q, want a.json b.json", names)
	}
}

func TestLoad(t *testing.T) {
	s, dir := openTemp(t)
	write := func(name, data string) {
		t.Helper()
		if err := os.WriteFile(filepath.Join(dir, name), []byte(data), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write("good.json", `{"id":"good"}`)
	write("also-good.json", " {\"x\":[1,2]}\n")
	write("bad id.json", `{"id":"bad id"}`)
	write(".hidden.json", `{}`)
	write("empty.json", ``)
	write("blank.json", " \n\t")
	write("torn.json", `{"id":"torn","spec":{"vcp`)
	write("array.json", `[1,2]`)
	write("trailing.json", `{"a":1} {"b":2}`)
	write(".good.json.tmp-0123", `{"id":"good","new":tr`)
	// The temp naming of versions before atomicfile.
	write(".tmp-good-0123", `{"id":"good","new":tr`)
	write("notes.txt", `hello`)
	write("old.json.damaged", `xx`)
	if err := os.Mkdir(filepath.Join(dir, "good"), 0o700); err != nil {
		t.Fatal(err)
	}
	write("good/root.qcow2", `disk`)

	got, err := s.Load()
	if err != nil {
		t.Fatal(err)
	}
	wantRecords := []Record{
		{ID: "also-good", Data: []byte(" {\"x\":[1,2]}\n")},
		{ID: "good", Data: []byte(`{"id":"good"}`)},
	}
	if !reflect.DeepEqual(got.Records, wantRecords) {
		t.Errorf("Records = %q\nwant %q", got.Records, wantRecords)
	}
	wantInvalid := []Record{
		{ID: ".hidden", Data: []byte(`{}`)},
		{ID: "bad id", Data: []byte(`{"id":"bad id"}`)},
	}
	if !reflect.DeepEqual(got.Invalid, wantInvalid) {
		t.Errorf("Invalid = %q\nwant %q", got.Invalid, wantInvalid)
	}
	var damagedIDs []string
	for _, d := range got.Damaged {
		damagedIDs = append(damagedIDs, d.ID)
		if d.Err == nil {
			t.Errorf("Damaged %q has no error", d.ID)
		}
		if d.MovedTo != d.ID+".json.damaged" {
			t.Errorf("Damaged %q moved to %q, want %q", d.ID, d.MovedTo, d.ID+".json.damaged")
		}
		if _, err := os.Stat(filepath.Join(dir, d.MovedTo)); err != nil {
			t.Errorf("damaged copy of %q: %v", d.ID, err)
		}
		if _, err := os.Stat(filepath.Join(dir, d.ID+".json")); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("damaged record %q still in place (err %v)", d.ID, err)
		}
	}
	wantDamaged := []string{"array", "blank", "empty", "torn", "trailing"}
	if !reflect.DeepEqual(damagedIDs, wantDamaged) {
		t.Errorf("Damaged ids = %q, want %q", damagedIDs, wantDamaged)
	}
	if want := []string{".good.json.tmp-0123", ".tmp-good-0123"}; !reflect.DeepEqual(got.RemovedTemps, want) {
		t.Errorf("RemovedTemps = %q, want %q", got.RemovedTemps, want)
	}
	torn, err := os.ReadFile(filepath.Join(dir, "torn.json.damaged"))
	if err != nil || string(torn) != `{"id":"torn","spec":{"vcp` {
		t.Errorf("torn.json.damaged = %q, %v; want the original bytes", torn, err)
	}
	for _, keep := range []string{"notes.txt", "old.json.damaged", "good/root.qcow2"} {
		if _, err := os.Stat(filepath.Join(dir, keep)); err != nil {
			t.Errorf("Load touched %s: %v", keep, err)
		}
	}

	// A second Load finds the same good records and nothing else to fix.
	again, err := s.Load()
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(again.Records, wantRecords) || len(again.Damaged) != 0 || len(again.RemovedTemps) != 0 {
		t.Errorf("second Load = %+v, want only the same records and invalid ones", again)
	}
}

// TestLoadTornTempNeverReplacesRecord is the restart case of the issue: a
// crash in the middle of a Put leaves a half-written temp file beside the
// good record; after restart the good record is what loads.
func TestLoadTornTempNeverReplacesRecord(t *testing.T) {
	s, dir := openTemp(t)
	good := []byte(`{"id":"vm1","state":"running"}`)
	if err := s.Put("vm1", good); err != nil {
		t.Fatal(err)
	}
	// What a crash between write and rename leaves: a temp with the same
	// naming as Put's, holding a prefix of the next version.
	torn := filepath.Join(dir, ".vm1.json.tmp-deadbeefdeadbeef")
	if err := os.WriteFile(torn, []byte(`{"id":"vm1","state":"sto`), 0o600); err != nil {
		t.Fatal(err)
	}
	s.Close()

	s2, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer s2.Close()
	got, err := s2.Load()
	if err != nil {
		t.Fatal(err)
	}
	if want := []Record{{ID: "vm1", Data: good}}; !reflect.DeepEqual(got.Records, want) {
		t.Errorf("Records = %q, want %q", got.Records, want)
	}
	if len(got.Damaged) != 0 || len(got.Invalid) != 0 {
		t.Errorf("Damaged = %v, Invalid = %v; want none", got.Damaged, got.Invalid)
	}
	if want := []string{filepath.Base(torn)}; !reflect.DeepEqual(got.RemovedTemps, want) {
		t.Errorf("RemovedTemps = %q, want %q", got.RemovedTemps, want)
	}
	if names := dirNames(t, dir); !reflect.DeepEqual(names, []string{"vm1.json"}) {
		t.Errorf("directory = %q, want only vm1.json", names)
	}
}

func TestLoadDamagedKeepsEarlierCopies(t *testing.T) {
	s, dir := openTemp(t)
	for i, content := range []string{"first", "second", "third"} {
		if err := os.WriteFile(filepath.Join(dir, "vm.json"), []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		got, err := s.Load()
		if err != nil {
			t.Fatal(err)
		}
		want := []string{"vm.json.damaged", "vm.json.damaged.1", "vm.json.damaged.2"}[i]
		if len(got.Damaged) != 1 || got.Damaged[0].MovedTo != want {
			t.Fatalf("load %d: Damaged = %+v, want one moved to %s", i, got.Damaged, want)
		}
		if b, _ := os.ReadFile(filepath.Join(dir, want)); string(b) != content {
			t.Errorf("%s = %q, want %q", want, b, content)
		}
	}
}

func TestLoadNonRegularRecordMovedAside(t *testing.T) {
	s, dir := openTemp(t)
	l, err := net.Listen("unix", filepath.Join(dir, "sock.json"))
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	got, err := s.Load()
	if err != nil {
		t.Fatal(err)
	}
	if len(got.Damaged) != 1 || got.Damaged[0].ID != "sock" || !strings.Contains(got.Damaged[0].Err.Error(), "not a regular file") {
		t.Errorf("Damaged = %+v, want sock as not a regular file", got.Damaged)
	}
}

func TestDeleteInvalidIDRecord(t *testing.T) {
	s, dir := openTemp(t)
	if err := os.WriteFile(filepath.Join(dir, "bad id.json"), []byte(`{}`), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := s.Delete("bad id"); err != nil {
		t.Fatal(err)
	}
	if names := dirNames(t, dir); len(names) != 0 {
		t.Errorf("directory = %q, want empty", names)
	}
	for _, id := range []string{"", ".", "..", "a/b", "../x"} {
		if err := s.Delete(id); err == nil {
			t.Errorf("Delete(%q) = nil, want an error", id)
		}
	}
}
