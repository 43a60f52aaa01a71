// Package appvm adds AppVMs to the vm package's machinery: the AppVM image
// catalog, the create request and its rules (contract §4.3), and the AppVM
// view (§2.3). An AppVM is a vm.Record of mode appvm: it shares the
// registry, the id namespace, admission and the Host seam with classic VMs.
//
// # Image catalog
//
// Each imported AppVM image is a directory <state>/appvm-images/<id>/ with
// an image.json (see Image for its fields) and, once ready, the root file
// system rootfs.qcow2 that AppVM root disks copy. The id follows the VM id
// pattern. Only images whose status is ready can be used: an unknown or
// failed image is a 400, an image still importing a 409 CONFLICT.
package appvm

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"time"

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
//	  "failure": "why the import failed"        // only with status failed
//	}
//
// The workload fields are the image defaults an AppVM starts from; each
// AppVM record keeps a snapshot of them taken at create time.
type Image struct {
	ID        string    `json:"id"`
	Status    string    `json:"status"`
	CreatedAt time.Time `json:"created_at"`
	Failure   string    `json:"failure,omitempty"`
	vm.Workload
}

// Catalog reads the AppVM image catalog under <state>/appvm-images.
type Catalog struct {
	Dir string
}

// RootFS is the root file system image of a catalog entry.
func (c Catalog) RootFS(id string) string { return filepath.Join(c.Dir, id, "rootfs.qcow2") }

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
// import and for tests.
func (c Catalog) Put(im *Image) error {
	if !store.ValidID(im.ID) {
		return errors.New("AppVM image id must match the VM id pattern")
	}
	dir := filepath.Join(c.Dir, im.ID)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("writing AppVM image %q: %w", im.ID, err)
	}
	data, err := json.MarshalIndent(im, "", "\t")
	if err != nil {
		return fmt.Errorf("writing AppVM image %q: %w", im.ID, err)
	}
	tmp := filepath.Join(dir, ".image.json.tmp")
	if err := os.WriteFile(tmp, append(data, '\n'), 0o600); err != nil {
		return fmt.Errorf("writing AppVM image %q: %w", im.ID, err)
	}
	if err := os.Rename(tmp, filepath.Join(dir, "image.json")); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("writing AppVM image %q: %w", im.ID, err)
	}
	return nil
}
