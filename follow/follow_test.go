package follow

import (
	"bytes"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"testing"
	"time"

	"vmhost/internal/rotlog"
)

// readAvailable reads r until io.EOF.
func readAvailable(t *testing.T, r *Reader) []byte {
	t.Helper()
	var out []byte
	buf := make([]byte, 7) // small, so reads cross generations
	for {
		n, err := r.Read(buf)
		out = append(out, buf[:n]...)
		if err == io.EOF {
			return out
		}
		if err != nil {
			t.Fatal(err)
		}
	}
}

// waitChanged waits for r's Changed, failing after a while.
func waitChanged(t *testing.T, r *Reader) {
	t.Helper()
	select {
	case <-r.Changed():
	case <-time.After(10 * time.Second):
		t.Fatal("Changed did not fire")
	}
}

func needInotify(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("inotify is Linux's")
	}
}

func TestReadsThePairAndFollowsRotations(t *testing.T) {
	needInotify(t)
	path := filepath.Join(t.TempDir(), "console.log")
	l, err := rotlog.Open(path, rotlog.Options{MaxBytes: 10, Split: true})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	var written bytes.Buffer
	write := func(s string) {
		written.WriteString(s)
		if _, err := l.Write([]byte(s)); err != nil {
			t.Fatal(err)
		}
	}
	write("0123456789abcde") // path.1 holds 10 bytes, path 5
	w := NewWatcher()
	defer w.Close()
	r, err := w.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if r.Size() != 15 {
		t.Fatalf("Size = %d, want 15", r.Size())
	}
	got := make([]byte, 6)
	if n, _ := r.ReadAt(got, 7); string(got[:n]) != "789abc" {
		t.Errorf("ReadAt across the generations = %q", got[:n])
	}
	r.SetPos(12)
	if b := readAvailable(t, r); string(b) != "cde" {
		t.Errorf("after SetPos(12): %q", b)
	}
	var read []byte
	read = append(read, []byte("0123456789abcde")...)
	for i := range 12 {
		write(fmt.Sprintf("<%d>", i)) // rotates every few writes
		waitChanged(t, r)
		read = append(read, readAvailable(t, r)...)
	}
	if !bytes.Equal(read, written.Bytes()) {
		t.Errorf("followed %q,\nwritten  %q", read, written.Bytes())
	}
}

func TestFollowRecordsAcrossRotation(t *testing.T) {
	needInotify(t)
	path := filepath.Join(t.TempDir(), "workload.log")
	l, err := rotlog.Open(path, rotlog.Options{MaxBytes: 64})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	w := NewWatcher()
	defer w.Close()
	r, err := w.Open(path) // nothing there yet
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	var want, got []byte
	for i := range 40 {
		line := fmt.Appendf(nil, "line %d\n", i)
		want = append(want, line...)
		l.Write(line)
		if i%3 == 0 { // the reader lags a little, never a whole generation
			got = append(got, readAvailable(t, r)...)
		}
	}
	got = append(got, readAvailable(t, r)...)
	if !bytes.Equal(got, want) {
		t.Errorf("followed %q,\nwritten  %q", got, want)
	}
}

// TestSlowReaderGoesOnWithTheOldestKept: a reader that falls several
// rotations behind reads the rest of its generation, then what the log
// still keeps; the writer never waited for it.
func TestSlowReaderGoesOnWithTheOldestKept(t *testing.T) {
	path := filepath.Join(t.TempDir(), "workload.log")
	l, err := rotlog.Open(path, rotlog.Options{MaxBytes: 20})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	l.Write([]byte("first generation\n"))
	w := NewWatcher()
	defer w.Close()
	r, err := w.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	buf := make([]byte, 6)
	if n, _ := r.Read(buf); string(buf[:n]) != "first " {
		t.Fatalf("first read %q", buf[:n])
	}
	for i := range 10 {
		l.Write(fmt.Appendf(nil, "generation %02d\n", i)) // each write its own file
	}
	got := string(readAvailable(t, r))
	if want := "generation\ngeneration 08\ngeneration 09\n"; got != want {
		t.Errorf("slow reader read %q, want %q", got, want)
	}
}

func TestRewatchAfterTheDirectoryAppears(t *testing.T) {
	needInotify(t)
	dir := filepath.Join(t.TempDir(), "later")
	path := filepath.Join(dir, "console.log")
	w := NewWatcher()
	defer w.Close()
	r, err := w.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if b := readAvailable(t, r); len(b) != 0 {
		t.Fatalf("read %q from nothing", b)
	}
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	r.Rewatch()
	if err := os.WriteFile(path, []byte("hello\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	waitChanged(t, r)
	if b := readAvailable(t, r); string(b) != "hello\n" {
		t.Errorf("read %q", b)
	}
}

// TestOneWatchPerDirectory: readers of files in one directory share its
// watch, which goes with the last of them; readers elsewhere are not
// woken by it.
func TestOneWatchPerDirectory(t *testing.T) {
	needInotify(t)
	dir, other := t.TempDir(), t.TempDir()
	w := NewWatcher()
	defer w.Close()
	var rs []*Reader
	for i := range 50 {
		r, err := w.Open(filepath.Join(dir, fmt.Sprintf("log%d", i%2)))
		if err != nil {
			t.Fatal(err)
		}
		rs = append(rs, r)
	}
	elsewhere, err := w.Open(filepath.Join(other, "log0"))
	if err != nil {
		t.Fatal(err)
	}
	defer elsewhere.Close()
	w.mu.Lock()
	dirs, wds := len(w.dirs), len(w.byWD)
	w.mu.Unlock()
	if dirs != 2 || wds != 2 {
		// The files do not exist yet: only the directories are watched.
		t.Fatalf("%d directories, %d watches for 51 readers of 3 missing files in 2 directories", dirs, wds)
	}
	os.WriteFile(filepath.Join(dir, "log1"), []byte("x"), 0o600)
	os.WriteFile(filepath.Join(dir, "disk.img"), []byte("not followed"), 0o600)
	for i, r := range rs {
		if i%2 == 1 {
			waitChanged(t, r)
		}
	}
	select {
	case <-rs[0].Changed():
		t.Error("a reader of log0 was woken by a write to log1")
	case <-elsewhere.Changed():
		t.Error("a reader in another directory was woken")
	case <-time.After(100 * time.Millisecond):
	}
	for _, r := range rs {
		r.Close()
	}
	w.mu.Lock()
	dirs, wds = len(w.dirs), len(w.byWD)
	w.mu.Unlock()
	if dirs != 1 || wds != 1 {
		t.Errorf("%d directories, %d watches after the readers of one closed, want 1 and 1", dirs, wds)
	}
}

// TestLinksNotFollowed: a log in a directory a confined VM owns (its
// console log) may be replaced by a link to a file the VM could not read
// itself; the reader never reads through one.
func TestLinksNotFollowed(t *testing.T) {
	dir := t.TempDir()
	secret := filepath.Join(dir, "secret")
	if err := os.WriteFile(secret, []byte("not for the VM"), 0o600); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, "console.log")
	if err := os.Symlink(secret, path); err != nil {
		t.Fatal(err)
	}
	w := NewWatcher()
	defer w.Close()
	r, err := w.Open(path)
	if err == nil {
		defer r.Close()
		b, _ := io.ReadAll(io.LimitReader(r, 64))
		if bytes.Contains(b, []byte("not for the VM")) || r.Size() != 0 {
			t.Fatalf("read %q (size %d) through a link", b, r.Size())
		}
	}
}
