//go:build linux

package e2e

import (
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// TestStartupSweepsTemps plants, in a killed agent's directories, a temp
// file of every kind its steps write through one (each named as its
// writer names it: "." + the final name + ".tmp-" + random), and checks
// that the next start removes every one and nothing else: records,
// root disk copies and overlays, a redeploy's staged disk, seeds, VM-owned
// data volumes (qcow2 and the raw image an ext4 one is made from),
// first-class volumes and their metadata, an AppVM files put's spooled
// archive, and the AppVM initramfs in the run directory.
func TestStartupSweepsTemps(t *testing.T) {
	s := startServer(t, serverOpts{})
	f := newFixture(t)
	s.create(f.body("sw", true, ""), http.StatusCreated)
	s.waitDisplay("sw", "running", "running")
	if st, b := s.do("POST", "/api/volumes", `{"volume_id":"fc","size_gib":1}`); st != http.StatusCreated {
		t.Fatalf("POST /api/volumes = %d %s", st, b)
	}
	s.kill()
	vmDir := s.stateDir + "/vms/sw"
	temps := []string{
		s.stateDir + "/vms/.sw.json.tmp-1a2b3c4d5e6f7081",             // a record
		vmDir + "/.root.qcow2.tmp-1a2b3c4d5e6f7081",                   // a root disk copy or overlay
		vmDir + "/.root.qcow2.next.tmp-1a2b3c4d5e6f7081",              // a redeploy's staged root disk
		vmDir + "/.seed.img.tmp-1a2b3c4d5e6f7081",                     // a seed
		vmDir + "/.data1.qcow2.tmp-1a2b3c4d5e6f7081",                  // a VM-owned data volume
		vmDir + "/.data1.qcow2.tmp-raw-123456789",                     // the raw image an ext4 volume is made from
		s.stateDir + "/volumes/.fc2.qcow2.tmp-1a2b3c4d5e6f7081",       // a first-class volume
		s.stateDir + "/volumes/.fc2.json.tmp-1a2b3c4d5e6f7081",        // its metadata
		s.runDir + "/.appvm-initramfs-0123.cpio.tmp-1a2b3c4d5e6f7081", // an AppVM initramfs
		s.stateDir + "/spool/.put.tar.tmp-123456789",                  // an AppVM files put's spooled archive
	}
	for _, p := range temps {
		os.MkdirAll(filepath.Dir(p), 0o700)
		if err := os.WriteFile(p, []byte("partial"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	before := tree(t, s.stateDir, s.runDir)
	s.restart()
	s.waitDisplay("sw", "running", "running")
	after := tree(t, s.stateDir, s.runDir)
	for _, p := range temps {
		if _, err := os.Lstat(p); err == nil {
			t.Errorf("%s survived the start", p)
		}
	}
	for p := range before {
		if !after[p] && !slices.Contains(temps, p) && !strings.HasPrefix(p, s.runDir+"/vms/") && !strings.HasPrefix(p, s.stateDir+"/events") {
			t.Errorf("%s was removed at the start, but is no temp file", p)
		}
	}
}

// tree lists the regular files under dirs.
func tree(t *testing.T, dirs ...string) map[string]bool {
	t.Helper()
	out := map[string]bool{}
	for _, d := range dirs {
		filepath.WalkDir(d, func(p string, e os.DirEntry, err error) error {
			if err == nil && e.Type().IsRegular() {
				out[p] = true
			}
			return nil
		})
	}
	return out
}
