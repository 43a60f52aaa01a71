package inotify

import (
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// next reads events until one of wd matching mask (and name, when given)
// arrives.
func next(t *testing.T, w *Watcher, wd int, mask uint32, name string) {
	t.Helper()
	buf := make([]byte, 4096)
	done := make(chan bool, 1)
	go func() {
		for {
			evs, err := w.Read(buf)
			if err != nil {
				done <- false
				return
			}
			for _, e := range evs {
				if e.WD == wd && e.Mask&mask != 0 && (name == "" || e.Name == name) {
					done <- true
					return
				}
			}
		}
	}()
	select {
	case ok := <-done:
		if !ok {
			t.Fatalf("read failed before event %#x %q", mask, name)
		}
	case <-time.After(5 * time.Second):
		t.Fatalf("no event %#x %q", mask, name)
	}
}

// TestDirectoryAndFileEvents: a watched directory reports its entries'
// creation, modification and removal by name; a watched file that is
// unlinked while held open reports the link count change (IN_ATTRIB),
// which is how a root disk held by qemu-storage-daemon goes.
func TestDirectoryAndFileEvents(t *testing.T) {
	w, err := New()
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	dir := t.TempDir()
	dwd, err := w.Add(dir, Create|Delete|Modify|OnlyDir)
	if err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(dir, "events")
	f, err := os.Create(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	next(t, w, dwd, Create, "events")
	f.WriteString("x")
	next(t, w, dwd, Modify, "events")

	disk := filepath.Join(dir, "root.qcow2")
	os.WriteFile(disk, nil, 0o600)
	next(t, w, dwd, Create, "root.qcow2")
	held, _ := os.Open(disk)
	defer held.Close()
	fwd, err := w.Add(disk, Attrib|DeleteSelf|MoveSelf)
	if err != nil {
		t.Fatal(err)
	}
	os.Remove(disk)
	next(t, w, fwd, Attrib, "")
	if err := w.Remove(fwd); err != nil {
		t.Fatal(err)
	}
	if _, err := w.Add(filepath.Join(dir, "missing"), Attrib); !errors.Is(err, unix.ENOENT) {
		t.Errorf("watching a missing file = %v, want ENOENT", err)
	}
}

// TestCloseWakesReader: Close ends a blocked Read.
func TestCloseWakesReader(t *testing.T) {
	w, err := New()
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan error, 1)
	go func() {
		_, err := w.Read(make([]byte, 4096))
		got <- err
	}()
	time.Sleep(20 * time.Millisecond)
	w.Close()
	select {
	case err := <-got:
		if !errors.Is(err, os.ErrClosed) {
			t.Errorf("Read after Close = %v, want os.ErrClosed", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Close did not wake a blocked Read")
	}
}
