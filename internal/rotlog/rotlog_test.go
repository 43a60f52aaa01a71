package rotlog

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
)

func read(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	return string(b)
}

func mustOpen(t *testing.T, path string, o Options) *File {
	t.Helper()
	f, err := Open(path, o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return f
}

// TestRecordsRotateWhole: a write that would take a non-empty file past
// the cap starts the next file whole; one generation is kept (.1, replaced
// each time); both files are 0600; the two files hold the newest records
// in order, none cut.
func TestRecordsRotateWhole(t *testing.T) {
	path := filepath.Join(t.TempDir(), "x.log")
	f := mustOpen(t, path, Options{MaxBytes: 100})
	var all []string
	for i := range 40 {
		line := fmt.Sprintf("record %02d %s\n", i, strings.Repeat("x", i%7))
		all = append(all, line)
		if n, err := f.Write([]byte(line)); err != nil || n != len(line) {
			t.Fatalf("Write = %d, %v", n, err)
		}
		if f.Size() > 100 {
			t.Fatalf("file is %d bytes after a write, past the cap", f.Size())
		}
	}
	cur, old := read(t, path), read(t, path+".1")
	if cur == "" || old == "" {
		t.Fatalf("current %q, rotated %q: want both", cur, old)
	}
	joined := strings.Join(all, "")
	if !strings.HasSuffix(joined, old+cur) {
		t.Errorf("the two generations are not the newest records in order:\n.1: %q\ncurrent: %q", old, cur)
	}
	if !strings.HasPrefix(old, "record ") || len(old) > 100 {
		t.Errorf("rotated file %q: want whole records, at most 100 bytes", old)
	}
	for _, p := range []string{path, path + ".1"} {
		if fi, _ := os.Stat(p); fi.Mode().Perm() != 0o600 {
			t.Errorf("%s mode %o, want 600", p, fi.Mode().Perm())
		}
	}
	if _, err := os.Stat(path + ".2"); !os.IsNotExist(err) {
		t.Errorf("a second generation exists: %v", err)
	}
	// A record larger than the cap still goes whole (into a file of its own).
	big := strings.Repeat("B", 250) + "\n"
	if _, err := f.Write([]byte(big)); err != nil {
		t.Fatal(err)
	}
	if got := read(t, path); got != big {
		t.Errorf("a record larger than the cap: current file %d bytes, want it alone", len(got))
	}
}

// TestStreamSplitsAtCap: in Split mode a write is cut at exactly the cap,
// across as many rotations as it takes; the two generations joined are
// the stream's last bytes.
func TestStreamSplitsAtCap(t *testing.T) {
	path := filepath.Join(t.TempDir(), "console.log")
	f := mustOpen(t, path, Options{MaxBytes: 64, Split: true})
	var stream bytes.Buffer
	for i := range 50 {
		p := []byte(strings.Repeat(string(rune('a'+i%26)), i*3))
		stream.Write(p)
		if n, err := f.Write(p); err != nil || n != len(p) {
			t.Fatalf("Write = %d, %v", n, err)
		}
		if f.Size() > 64 {
			t.Fatalf("file is %d bytes, past the cap", f.Size())
		}
	}
	cur, old := read(t, path), read(t, path+".1")
	if len(old) != 64 {
		t.Errorf("rotated file is %d bytes, want exactly 64", len(old))
	}
	if !strings.HasSuffix(stream.String(), old+cur) {
		t.Errorf("the generations are not the end of the stream")
	}
}

// TestOpenKeepsAndRestricts: an existing file is appended to (its size
// counts toward the cap), its mode is forced to 0600, and a path that is
// not a regular file is refused.
func TestOpenKeepsAndRestricts(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "x.log")
	os.WriteFile(path, []byte("earlier run\n"), 0o644)
	f := mustOpen(t, path, Options{MaxBytes: 20})
	if fi, _ := os.Stat(path); fi.Mode().Perm() != 0o600 {
		t.Errorf("mode of an existing log = %o, want 600", fi.Mode().Perm())
	}
	if f.Size() != 12 {
		t.Errorf("Size = %d, want 12", f.Size())
	}
	if b, ok, err := f.LastByte(); b != '\n' || !ok || err != nil {
		t.Errorf("LastByte = %q, %v, %v; want the earlier run's newline", b, ok, err)
	}
	f.Write([]byte("more"))
	if b, ok, err := f.LastByte(); b != 'e' || !ok || err != nil {
		t.Errorf("LastByte after a write = %q, %v, %v", b, ok, err)
	}
	f.Write([]byte("\n"))
	if got := read(t, path); got != "earlier run\nmore\n" {
		t.Errorf("log = %q", got)
	}
	f.Write([]byte("past the cap\n"))
	if read(t, path+".1") != "earlier run\nmore\n" || read(t, path) != "past the cap\n" {
		t.Errorf("after rotation: .1 %q, current %q", read(t, path+".1"), read(t, path))
	}
	if b, ok, err := mustOpen(t, filepath.Join(dir, "new.log"), Options{}).LastByte(); ok || err != nil {
		t.Errorf("LastByte of an empty log = %q, %v, %v", b, ok, err)
	}
	for _, bad := range []string{dir, "/dev/null"} {
		if g, err := Open(bad, Options{}); err == nil {
			g.Close()
			t.Errorf("Open(%s) succeeded, want a refusal", bad)
		}
	}
	fifo := filepath.Join(dir, "fifo")
	if err := syscall.Mkfifo(fifo, 0o600); err == nil {
		// O_RDWR on a fifo does not block.
		if g, err := Open(fifo, Options{}); err == nil {
			g.Close()
			t.Error("Open of a fifo succeeded")
		}
	}
}

// TestFailedRotationLosesNothing: when the rotation cannot rename (the
// previous generation's name is a non-empty directory), the write still
// goes to the file in hand, which grows past the cap, and reports the
// error; once the obstacle is gone the next write rotates.
func TestFailedRotationLosesNothing(t *testing.T) {
	dir := t.TempDir()
	path, prev := filepath.Join(dir, "x.log"), filepath.Join(dir, "prev")
	os.MkdirAll(filepath.Join(prev, "occupied"), 0o700)
	for _, split := range []bool{false, true} {
		os.Remove(path)
		f := mustOpen(t, path, Options{MaxBytes: 10, Previous: prev, Split: split})
		f.Write([]byte("0123456789"))
		n, err := f.Write([]byte("abcdef"))
		if err == nil || n != 6 {
			t.Errorf("split %t: Write with a failing rotation = %d, %v; want 6 and the error", split, n, err)
		}
		if got := read(t, path); got != "0123456789abcdef" {
			t.Errorf("split %t: log = %q, want every byte in the file in hand", split, got)
		}
		f.Close()
	}
	os.RemoveAll(prev)
	f := mustOpen(t, path, Options{MaxBytes: 10, Previous: prev})
	if _, err := f.Write([]byte("next")); err != nil {
		t.Fatalf("Write once the rotation can work = %v", err)
	}
	if read(t, prev) != "0123456789abcdef" || read(t, path) != "next" {
		t.Errorf("after the late rotation: prev %q, current %q", read(t, prev), read(t, path))
	}
}

// TestNoCapRotatesOnRequest: without MaxBytes only Rotate rotates, to the
// named previous generation; Truncate cuts a torn tail and writing goes on
// at the new end.
func TestNoCapRotatesOnRequest(t *testing.T) {
	dir := t.TempDir()
	path, prev := filepath.Join(dir, "events.jsonl"), filepath.Join(dir, "events.1.jsonl")
	os.WriteFile(path, []byte("{1}\n{2}\n{tor"), 0o600)
	f := mustOpen(t, path, Options{Previous: prev, Sync: true})
	if err := f.Truncate(8); err != nil {
		t.Fatal(err)
	}
	f.Write([]byte("{3}\n"))
	f.Write([]byte(strings.Repeat("{n}\n", 1000)))
	if got := read(t, path); !strings.HasPrefix(got, "{1}\n{2}\n{3}\n{n}") || len(got) != 12+4000 {
		t.Errorf("log = %q…", got[:20])
	}
	if err := f.Rotate(); err != nil {
		t.Fatal(err)
	}
	if f.Size() != 0 || read(t, path) != "" || !strings.HasPrefix(read(t, prev), "{1}\n{2}\n{3}\n") {
		t.Errorf("after Rotate: size %d, current %q, previous %.12q", f.Size(), read(t, path), read(t, prev))
	}
	if err := f.Sync(); err != nil {
		t.Error(err)
	}
	f.Close()
	if err := f.Sync(); !errors.Is(err, os.ErrClosed) {
		t.Errorf("Sync after Close = %v", err)
	}
	if _, err := f.Write([]byte("x")); !errors.Is(err, os.ErrClosed) {
		t.Errorf("Write after Close = %v", err)
	}
	if err := f.Close(); err != nil {
		t.Errorf("second Close = %v", err)
	}
}

// TestConcurrentRecords: records written at once from many goroutines
// are each whole, in one file or the other.
func TestConcurrentRecords(t *testing.T) {
	path := filepath.Join(t.TempDir(), "x.log")
	f := mustOpen(t, path, Options{MaxBytes: 1 << 16})
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 200 {
				f.Write([]byte(fmt.Sprintf("g%d-%03d %s\n", g, i, strings.Repeat("y", 40))))
			}
			f.Sync()
		}()
	}
	wg.Wait()
	lines := strings.Split(strings.TrimSuffix(read(t, path+".1")+read(t, path), "\n"), "\n")
	for _, l := range lines {
		var g, i int
		var tail string
		if n, _ := fmt.Sscanf(l, "g%d-%03d %s", &g, &i, &tail); n != 3 || tail != strings.Repeat("y", 40) {
			t.Fatalf("torn record %q", l)
		}
	}
	if len(lines) < 1000 {
		t.Errorf("%d records kept of 1600 with a 64 KiB cap; want both generations full", len(lines))
	}
}

// A log in a directory a confined VM owns may be swapped for a link to a
// file of the host: opening refuses to follow it, and a rotation moves it
// aside, so the target is neither written nor truncated.
func TestLinkIsNotFollowed(t *testing.T) {
	dir := t.TempDir()
	secret := filepath.Join(dir, "secret")
	if err := os.WriteFile(secret, []byte("keep"), 0o644); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, "console.log")
	if err := os.Symlink(secret, path); err != nil {
		t.Fatal(err)
	}
	if _, err := Open(path, Options{MaxBytes: 4}); err == nil {
		t.Error("Open followed a link")
	}
	os.Remove(path)
	l, err := Open(path, Options{MaxBytes: 4})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(secret, path); err != nil { // swapped while in use
		t.Fatal(err)
	}
	// The rotation moves the link aside (a rename does not follow it) and
	// starts a file of its own.
	if err := l.Rotate(); err != nil {
		t.Fatal(err)
	}
	if _, err := l.Write([]byte("boot")); err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Lstat(path); err != nil || !fi.Mode().IsRegular() {
		t.Errorf("after the rotation %s is %v (%v), want a regular file", path, fi, err)
	}
	if b, _ := os.ReadFile(secret); string(b) != "keep" {
		t.Errorf("the link's target holds %q", b)
	}
}
