package appvm

import (
	"errors"
	"os"
	"strings"
	"testing"
	"time"

	"vmhost/qcow2"
	"vmhost/vm"
	"vmhost/vm/vmtest"
)

// TestPinnedBuildSurvivesSweeps: a build a create has pinned (read from
// image.json, record not stored yet) is kept by a sweep even once it is no
// longer the current build, and it blocks the image's delete (409 saying
// a create is in progress); unpinned and unused, the next sweep removes
// it. A sweep never removes the current build, nor anything while an
// import has staged work.
func TestPinnedBuildSurvivesSweeps(t *testing.T) {
	e := vmtest.NewEnv(t)
	vms := e.Service(t)
	s := New(Config{VMs: vms, Records: e.Records, Guests: NewGuests(GuestOptions{Records: e.Records, Config: e.Config,
		Layout: vms.Layout(), Now: func() time.Time { return e.Now }, Logger: e.Logger}), RootDisks: e.Host})
	put := func(digest string) string {
		t.Helper()
		img := &Image{ID: "web", Status: StatusReady, CreatedAt: e.Now, Workload: vm.Workload{BuildDigest: digest, SizeBytes: 1 << 20}}
		if err := s.catalog.Put(img); err != nil {
			t.Fatal(err)
		}
		p := s.catalog.RootFS(img)
		if _, err := os.Stat(p); err != nil {
			if err := qcow2.Create(p, 1<<20); err != nil {
				t.Fatal(err)
			}
		}
		return p
	}
	b1 := put("sha256:1")
	img, unpin, err := s.pinBuild("web")
	if err != nil || img.BuildDigest != "sha256:1" {
		t.Fatalf("pinBuild = %+v, %v", img, err)
	}
	b2 := put("sha256:2") // a re-import committed meanwhile
	if got, _ := s.sweepBuilds("web"); len(got) != 0 {
		t.Errorf("a sweep removed %q while the old build was pinned", got)
	}
	var ce *ConflictError
	if err := s.DeleteImage(NewImporter(s.catalog, ImportOptions{}), "web"); !errors.As(err, &ce) || !strings.Contains(err.Error(), "being created") {
		t.Errorf("deleting an image a create is using = %v, want a conflict", err)
	}
	unpin()
	unpin() // twice is once
	if err := os.MkdirAll(s.catalog.Dir+"/web/"+nextDir, 0o700); err != nil {
		t.Fatal(err)
	}
	if got, _ := s.sweepBuilds("web"); len(got) != 0 {
		t.Errorf("a sweep removed %q while an import had staged work", got)
	}
	os.Remove(s.catalog.Dir + "/web/" + nextDir)
	if got, _ := s.sweepBuilds("web"); len(got) != 1 || got[0] != b1 {
		t.Errorf("sweep after unpin removed %q, want [%s]", got, b1)
	}
	if _, err := os.Stat(b2); err != nil {
		t.Errorf("the current build went: %v", err)
	}
	// A ready image whose build is missing cannot be created from.
	os.Remove(b2)
	if _, _, err := s.pinBuild("web"); err == nil || !strings.Contains(err.Error(), "build is missing") {
		t.Errorf("pinBuild of an image without its build = %v", err)
	}
}

// TestSweepWaitsForTheLock: a sweep that finds the image's lock taken for
// a moment (an import's recovery at start; a process the agent forks
// holds a copy of the lock until it execs) tries again, and removes the
// unused build once the lock is free, instead of giving up until the next
// sweep someone asks for.
func TestSweepWaitsForTheLock(t *testing.T) {
	e := vmtest.NewEnv(t)
	vms := e.Service(t)
	s := New(Config{VMs: vms, Records: e.Records, Guests: NewGuests(GuestOptions{Records: e.Records, Config: e.Config,
		Layout: vms.Layout(), Now: func() time.Time { return e.Now }, Logger: e.Logger}), RootDisks: e.Host})
	var builds []string
	for _, digest := range []string{"sha256:1", "sha256:2"} {
		img := &Image{ID: "web", Status: StatusReady, CreatedAt: e.Now, Workload: vm.Workload{BuildDigest: digest, SizeBytes: 1 << 20}}
		if err := s.catalog.Put(img); err != nil {
			t.Fatal(err)
		}
		builds = append(builds, s.catalog.RootFS(img))
		if err := qcow2.Create(builds[len(builds)-1], 1<<20); err != nil {
			t.Fatal(err)
		}
	}
	lock, err := s.catalog.lock("web")
	if err != nil {
		t.Fatal(err)
	}
	if _, locked := s.sweepBuilds("web"); !locked {
		t.Fatal("a sweep did not see the image's lock taken")
	}
	s.requestSweep("web")
	time.Sleep(3 * sweepLockWait)
	if _, err := os.Stat(builds[0]); err != nil {
		t.Fatalf("the unused build went while the lock was held: %v", err)
	}
	lock.Close()
	s.WaitSweeps()
	if _, err := os.Stat(builds[0]); err == nil {
		t.Error("the unused build is still there once the lock was free")
	}
	if _, err := os.Stat(builds[1]); err != nil {
		t.Errorf("the current build went: %v", err)
	}
}
