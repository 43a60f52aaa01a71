// Package appvm adds AppVMs to the vm package's machinery: the AppVM image
// catalog, the create request and its rules (docs/api.md, POST /api/appvm/vms), the AppVM
// view (docs/api.md, GET /api/appvm/vms), spec edits, redeploys and the restart policy (Service), and
// the host end of the guest agents (Guests). An AppVM is a vm.Record of
// mode appvm: it shares the records' owner (vm/records), the id namespace,
// admission and the host (vm/engine) with classic VMs.
//
// # Layering
//
// appvm calls down only: into vm for the rules, and into vm/records to
// write its parts of a record. It imports neither vm/engine nor chclient.
// The engine drives Guests at the edges of a boot through its own
// interface (engine.Guest: a listener on the agent's vsock port handed
// over before CH starts, the initramfs handed back, Stop, Settle, Mount,
// Unmount, End), wired once; Service follows the records' changes
// (records.Registry.Watch) to learn that a workload ended, and rebuilds
// root disks for redeploys through RootDisks (the engine).
//
// # Image catalog
//
// Each imported AppVM image is a directory <state>/appvm-images/<id>/ with
// an image.json (see Image for its fields) and, once ready, the root file
// system that AppVM root disks are overlays (or copies) of: one file per
// build, rootfs-<build digest>.qcow2 (images imported before builds were
// named so have rootfs.qcow2), sealed read-only once imported. The id
// follows the VM id pattern. Only images whose status is ready can be
// used: an unknown or failed image is a 400, an image still importing a
// 409 CONFLICT.
//
// # Imports
//
// Importer fills the catalog from OCI layouts and docker save tarballs
// (package ociimage), in the background for the API and in the foreground
// for `vmhost image import`. Both take the lock file
// <state>/appvm-images/<id>.lock (flock), so one import per id runs at a
// time across processes. A first import shows status importing, then ready
// or failed with the reason. A re-import of a ready image keeps serving the
// current build as ready (AppVMs may still be created from it) and reports
// its progress in reimport; on success the new build becomes the current
// one in one step, on failure the old build stays and reimport says why. A
// re-import adds a build and never touches existing AppVMs: a build stays
// while any AppVM's root disk reads through to it (builds.go), and their
// view shows update_available once the catalog's build differs from
// theirs (a redeploy moves them to it).
package appvm

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"time"

	"vmhost/internal/atomicfile"
	"vmhost/store"
	"vmhost/vm"
)

// Image statuses.
const (
	StatusImporting = "importing"
	StatusReady     = "ready"
	StatusFailed    = "failed"
)

// Image is one entry of the AppVM image catalog, stored as
// <state>/appvm-images/<id>/image.json:
//
//	{
//	  "id": "nginx",                  // the directory name; VM id pattern
//	  "status": "ready",              // importing | ready | failed
//	  "build_digest": "sha256:1a2b3c",// short digest of the build (optional)
//	  "size_bytes": 1073741824,       // virtual size of rootfs.qcow2
//	  "created_at": "2026-01-02T03:04:05Z",
//	  "entrypoint": ["/docker-entrypoint.sh"],  // optional
//	  "cmd": ["nginx", "-g", "daemon off;"],    // optional
//	  "env": ["PATH=/usr/bin:/bin"],            // optional KEY=VALUE
//	  "workdir": "/",                           // optional
//	  "user": "www-data",                       // optional
//	  "healthcheck": {                          // optional
//	    "test": ["CMD", "curl", "-f", "http://localhost/"],
//	    "interval_secs": 30, "timeout_secs": 5,
//	    "start_period_secs": 10, "retries": 3
//	  },
//	  "failure": "why the import failed",       // only with status failed
//	  "source": "/srv/images/nginx.tar",        // what was imported
//	  "reimport": {                             // optional, see Reimport
//	    "status": "importing", "started_at": "2026-01-03T00:00:00Z",
//	    "source": "/srv/images/nginx-1.27.tar"
//	  }
//	}
//
// The workload fields are the image defaults an AppVM starts from; each
// AppVM record keeps a snapshot of them taken at create time.
type Image struct {
	ID     string `json:"id"`
	Status string `json:"status"`
	// CreatedAt is when the import of the current build (or of the first
	// build, while status is importing) started.
	CreatedAt time.Time `json:"created_at"`
	Failure   string    `json:"failure,omitempty"`
	// Source is the host path the current build was imported from.
	Source string `json:"source,omitempty"`
	// Reimport is the latest import over a ready image: running, or failed
	// (the current build stays in service either way). Nil once an import
	// has replaced the build, and on images that were never re-imported.
	Reimport *Reimport `json:"reimport,omitempty"`
	vm.Workload
}

// Reimport is an import over an image that is ready.
type Reimport struct {
	Status    string    `json:"status"` // importing or failed
	StartedAt time.Time `json:"started_at"`
	Source    string    `json:"source"`
	Failure   string    `json:"failure,omitempty"`
}

// Catalog reads the AppVM image catalog under <state>/appvm-images.
type Catalog struct {
	Dir string
}

// legacyRootFS is the one root file system of an image imported before
// builds had files of their own.
const legacyRootFS = "rootfs.qcow2"

// buildName is the file name of the build with digest (a digest such as
// "sha256:1a2b" becomes rootfs-sha256-1a2b.qcow2).
func buildName(digest string) string {
	if digest == "" {
		return legacyRootFS
	}
	return "rootfs-" + strings.NewReplacer(":", "-", "/", "-").Replace(digest) + ".qcow2"
}

// isBuildName reports whether name is a build file's.
func isBuildName(name string) bool {
	return strings.HasPrefix(name, "rootfs") && strings.HasSuffix(name, ".qcow2")
}

// BuildFile is the root file system of build digest of image id; an image
// imported before builds had files of their own has only rootfs.qcow2.
func (c Catalog) BuildFile(id, digest string) string {
	p := filepath.Join(c.Dir, id, buildName(digest))
	if _, err := os.Stat(p); err != nil {
		if legacy := filepath.Join(c.Dir, id, legacyRootFS); exists(legacy) {
			return legacy
		}
	}
	return p
}

// RootFS is the root file system of img's current build.
func (c Catalog) RootFS(img *Image) string { return c.BuildFile(img.ID, img.BuildDigest) }

func exists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}

// Get reads the catalog entry id. A missing entry (or an id that cannot
// name one) gives an error satisfying errors.Is(err, fs.ErrNotExist).
func (c Catalog) Get(id string) (*Image, error) {
	if !store.ValidID(id) {
		return nil, fmt.Errorf("AppVM image %q: %w", id, fs.ErrNotExist)
	}
	root, err := os.OpenRoot(c.Dir)
	if err != nil {
		return nil, fmt.Errorf("opening AppVM image catalog: %w", err)
	}
	defer root.Close()
	data, err := root.ReadFile(filepath.Join(id, "image.json"))
	if err != nil {
		return nil, fmt.Errorf("reading AppVM image %q: %w", id, err)
	}
	var im Image
	if err := json.Unmarshal(data, &im); err != nil {
		return nil, fmt.Errorf("reading AppVM image %q: %w", id, err)
	}
	if im.ID != id {
		return nil, fmt.Errorf("reading AppVM image %q: image.json names id %q", id, im.ID)
	}
	switch im.Status {
	case StatusImporting, StatusReady, StatusFailed:
	default:
		return nil, fmt.Errorf("reading AppVM image %q: unknown status %q", id, im.Status)
	}
	return &im, nil
}

// Put writes a catalog entry (creating its directory), for the image
// import and for tests. The write is atomic and durable.
func (c Catalog) Put(im *Image) error {
	if !store.ValidID(im.ID) {
		return errors.New("AppVM image id must match the VM id pattern")
	}
	dir := filepath.Join(c.Dir, im.ID)
	if _, err := os.Stat(dir); errors.Is(err, fs.ErrNotExist) {
		// A new entry: its directory must survive a crash as its
		// image.json does.
		err = os.MkdirAll(dir, 0o700)
		if err == nil {
			err = atomicfile.SyncDir(c.Dir)
		}
		if err != nil {
			return fmt.Errorf("writing AppVM image %q: %w", im.ID, err)
		}
	}
	if err := writeImageJSON(dir, im); err != nil {
		return fmt.Errorf("writing AppVM image %q: %w", im.ID, err)
	}
	return nil
}

// writeImageJSON replaces dir/image.json atomically and durably.
func writeImageJSON(dir string, im *Image) error {
	data, err := json.MarshalIndent(im, "", "\t")
	if err != nil {
		return err
	}
	return atomicfile.WriteFile(filepath.Join(dir, "image.json"), append(data, '\n'), 0o600)
}

// List reads every catalog entry, sorted by id. Entries that cannot be read
// are left out and reported in the joined error, so a caller can serve the
// rest; a missing catalog directory is an empty catalog.
func (c Catalog) List() ([]*Image, error) {
	ents, err := os.ReadDir(c.Dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("listing AppVM images: %w", err)
	}
	var out []*Image
	var errs []error
	for _, e := range ents {
		// Lock files and hidden work dirs are not entries.
		if !e.IsDir() || !store.ValidID(e.Name()) {
			continue
		}
		im, err := c.Get(e.Name())
		if err != nil {
			errs = append(errs, err)
			continue
		}
		out = append(out, im)
	}
	return out, errors.Join(errs...)
}
