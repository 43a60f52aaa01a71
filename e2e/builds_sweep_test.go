//go:build linux

package e2e

import (
	"fmt"
	"net/http"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"vmhost/appvm"
	"vmhost/config"
	"vmhost/internal/netnstest"
)

// TestAgentSweepsUnusedBuilds checks the builds `vmhost serve` keeps: at
// its start it removes the builds of an image nothing uses (here one that
// `vmhost image import` beside it committed and replaced at once), keeps
// the build a running AppVM's overlay reads through to and the image's
// current one, and removes the former once that AppVM is deleted.
func TestAgentSweepsUnusedBuilds(t *testing.T) {
	netnstest.RequireRoot(t) // an AppVM always has an interface
	f := newFixture(t)
	s := startServer(t, serverOpts{netns: true, edit: func(c *config.Config) { c.AppVMKernel = f.kernel }})
	cat := appvm.Catalog{Dir: s.stateDir + "/appvm-images"}
	build := func(n int) string { return cat.BuildFile("img", fmt.Sprintf("sha256:%064x", n)) }
	commit := func(n int) { commitBuild(t, cat, "img", fmt.Sprintf("sha256:%064x", n)) }
	commit(1)
	body := `{"vm_id":"sw","image_id":"img","vcpus":1,"memory_mb":128,"disk_gib":1,"ip":"10.81.0.2","prefix":16,"gateway":"10.81.0.1"}`
	if st, b := s.do("POST", "/api/appvm/vms", body); st != http.StatusCreated {
		t.Fatalf("create = %d %s", st, b)
	}
	s.appvmWait("sw", "display running", 30*time.Second, func(v appvmView) bool { return v.DisplayState == "running" })
	commit(2) // replaced at once: nothing uses it
	commit(3)
	s.kill()
	s.restart()
	waitBuilds(t, cat, "img", build(1), build(3))
	if st, b := s.do("DELETE", "/api/appvm/vms/sw?force=true", ""); st != http.StatusNoContent {
		t.Fatalf("DELETE = %d %s", st, b)
	}
	waitBuilds(t, cat, "img", build(3))
}

// waitBuilds waits up to 10 s for image id's builds to be exactly want.
func waitBuilds(t *testing.T, cat appvm.Catalog, id string, want ...string) {
	t.Helper()
	slices.Sort(want)
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		got, _ := filepath.Glob(filepath.Join(cat.Dir, id, "rootfs*.qcow2"))
		slices.Sort(got)
		if slices.Equal(got, want) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("builds of %s: %q, want %q", id, got, want)
		}
	}
}
