package snapshot

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"syscall"
	"testing"
	"time"
)

func newSnapshot(s *Store, id string, size int) *Snapshot {
	return &Snapshot{ID: id, VMID: "vm1", Mode: "vm", CreatedAt: time.Unix(1700000000, 0).UTC(),
		Disks: []Disk{{ID: "root", Path: filepath.Join(s.Dir(id), DisksDir, "root.qcow2"), VirtualSizeBytes: uint64(size)}}}
}

func TestCreateGetListDelete(t *testing.T) {
	dir := t.TempDir()
	s, err := Open(dir, nil)
	if err != nil {
		t.Fatal(err)
	}
	release, err := s.Reserve("s1")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Reserve("s1"); !errors.Is(err, ErrExists) {
		t.Errorf("second reserve of s1: %v, want ErrExists", err)
	}
	if _, err := s.Get("s1"); !errors.Is(err, ErrNotFound) {
		t.Errorf("Get of a snapshot being made: %v, want ErrNotFound", err)
	}
	if err := os.WriteFile(filepath.Join(s.Staging("s1"), DisksDir, "root.qcow2"), make([]byte, 8192), 0o600); err != nil {
		t.Fatal(err)
	}
	sn := newSnapshot(s, "s1", 1<<30)
	if err := s.Commit(sn); err != nil {
		t.Fatal(err)
	}
	release()
	if _, err := os.Stat(s.Staging("s1")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("staging directory left after the commit: %v", err)
	}
	got, err := s.Get("s1")
	if err != nil {
		t.Fatal(err)
	}
	if got.SizeBytes < 8192 || got.Disks[0].Path != filepath.Join(dir, "s1", "disks", "root.qcow2") || !got.CreatedAt.Equal(sn.CreatedAt) {
		t.Errorf("Get: %+v", got)
	}
	if _, err := s.Reserve("s1"); !errors.Is(err, ErrExists) {
		t.Errorf("reserve of an existing snapshot: %v, want ErrExists", err)
	}
	for _, id := range []string{"s0", "s2"} {
		r, err := s.Reserve(id)
		if err != nil {
			t.Fatal(err)
		}
		if err := s.Commit(newSnapshot(s, id, 1)); err != nil {
			t.Fatal(err)
		}
		r()
	}
	list, err := s.List()
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, sn := range list {
		ids = append(ids, sn.ID)
	}
	if !slices.Equal(ids, []string{"s0", "s1", "s2"}) {
		t.Errorf("List: %v", ids)
	}
	unpin, err := s.Pin("s1")
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Delete("s1"); !errors.Is(err, ErrInUse) {
		t.Errorf("Delete of a pinned snapshot: %v, want ErrInUse", err)
	}
	unpin()
	unpin() // twice is once
	if err := s.Delete("s1"); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Get("s1"); !errors.Is(err, ErrNotFound) {
		t.Errorf("Get after Delete: %v", err)
	}
	if err := s.Delete("s1"); !errors.Is(err, ErrNotFound) {
		t.Errorf("second Delete: %v", err)
	}
	if _, err := s.Pin("s1"); !errors.Is(err, ErrNotFound) {
		t.Errorf("Pin of a deleted snapshot: %v", err)
	}
	ents, _ := os.ReadDir(dir)
	var names []string
	for _, e := range ents {
		names = append(names, e.Name())
	}
	if !slices.Equal(names, []string{"s0", "s2"}) {
		t.Errorf("directory holds %v", names)
	}
}

// TestOpenSweeps: what a create or delete cut short left is removed at
// Open; whole snapshots stay.
func TestOpenSweeps(t *testing.T) {
	dir := t.TempDir()
	s, _ := Open(dir, nil)
	r, _ := s.Reserve("keep")
	if err := s.Commit(newSnapshot(s, "keep", 1)); err != nil {
		t.Fatal(err)
	}
	r()
	if _, err := s.Reserve("cut"); err != nil { // never released: the agent died
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Join(dir, ".del-gone-1234", "disks"), 0o700); err != nil {
		t.Fatal(err)
	}
	s2, err := Open(dir, nil)
	if err != nil {
		t.Fatal(err)
	}
	ents, _ := os.ReadDir(dir)
	if len(ents) != 1 || ents[0].Name() != "keep" {
		t.Errorf("after Open the directory holds %v", ents)
	}
	if _, err := s2.Get("keep"); err != nil {
		t.Error(err)
	}
	if _, err := s2.Reserve("cut"); err != nil {
		t.Errorf("the id of a create cut short is free again: %v", err)
	}
}

func TestInvalidIDs(t *testing.T) {
	s, _ := Open(t.TempDir(), nil)
	for _, id := range []string{"", ".", "..", ".new-x", "a/b"} {
		if _, err := s.Reserve(id); err == nil {
			t.Errorf("Reserve(%q) succeeded", id)
		}
		if _, err := s.Get(id); !errors.Is(err, ErrNotFound) {
			t.Errorf("Get(%q): %v", id, err)
		}
	}
}

// SyncFile syncs a regular file, and refuses at once what a VM could have
// put in its place in its saved state's directory: a link (to a host file
// or a device) is not followed, a FIFO is not waited on.
func TestSyncFileRefusesLinksAndFIFOs(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "memory-ranges")
	if err := os.WriteFile(file, []byte("state"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := SyncFile(file); err != nil {
		t.Fatalf("SyncFile of a regular file: %v", err)
	}
	link := filepath.Join(dir, "state.json")
	if err := os.Symlink(file, link); err != nil {
		t.Fatal(err)
	}
	if err := SyncFile(link); err == nil {
		t.Error("SyncFile followed a symbolic link")
	}
	fifo := filepath.Join(dir, "config.json")
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- SyncFile(fifo) }()
	select {
	case err := <-done:
		if err == nil {
			t.Error("SyncFile accepted a FIFO")
		}
	case <-time.After(5 * time.Second):
		t.Fatal("SyncFile blocked opening a FIFO")
	}
}
