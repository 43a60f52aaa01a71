package appvm

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"vmhost/disk"
	"vmhost/snapshot"
	"vmhost/vm"
	"vmhost/vm/record"
	"vmhost/vm/records"
)

// Builds and what uses them.
//
// An AppVM's root disk is a qcow2 overlay whose backing file is a build of
// its image (appvm_root_disk "overlay"), or a copy of one ("copy"). A
// build is sealed once imported (disk.SealBuild: 0444, and immutable where
// the file system and the agent's capabilities allow) and never changes.
// The agent keeps a build while anything may still read it:
//
//   - it is its image's current build (image.json);
//   - a record names it (buildsInUse): an overlay's backing file
//     (record.Record.RootBacking), the base of a root disk not made yet
//     (a copy or an overlay still to be provisioned), the target of a
//     redeploy in progress;
//   - a create holds a pin on it (pinBuild), from reading image.json until
//     its record is stored (the record names it from then on);
//   - a snapshot's disk is an overlay of it (snapshot.Disk.Backing: the
//     copy of an overlay root disk), until the snapshot is deleted. An
//     AppVM made from such a snapshot is an overlay of the build too, and
//     its record names it as any overlay's does.
//
// Every reference is stored in a record before the file that needs the
// build is made (the create's record, the redeploy's intent), so an agent
// killed at any point restarts with the references that protect its
// overlays. Only the agent removes builds (sweepBuilds): after an import
// commits (the build it replaced may be unused), when a record drops a
// reference (an AppVM deleted or redeployed), after a snapshot's delete,
// and at start. A sweep reads the records before the snapshots: a
// snapshot is taken while its VM's record exists (under the VM's lock),
// so a build is named by one or the other whenever the sweep reads. A sweep holds
// the image's lock file (no import commits meanwhile) and the keeper's
// mutex (no create pins meanwhile); `vmhost image import` run beside the
// agent adds builds and never removes one.
//
// An image is deleted only when no AppVM and no snapshot uses it
// (DeleteImage: 409 CONFLICT naming them), so its builds go with it.

// buildKeeper is the Service's part of the above.
type buildKeeper struct {
	mu   sync.Mutex
	pins map[string]int // build path → creates holding it

	// The sweeps asked for, run one at a time by one goroutine.
	sweepMu  sync.Mutex
	pending  map[string]bool // image ids
	sweeping bool
	idle     *sync.Cond // broadcast when sweeping ends
}

// pinBuild reads image id and, when it is ready, pins its current build
// until unpin is called: no sweep removes it meanwhile. The image is read
// under the keeper's mutex, so the build it names is on disk (else an
// error) and stays there. A missing or unreadable image is Catalog.Get's
// error; an image that is not ready is returned unpinned.
func (s *Service) pinBuild(id string) (img *Image, unpin func(), err error) {
	k := &s.builds
	k.mu.Lock()
	defer k.mu.Unlock()
	img, err = s.catalog.Get(id)
	if err != nil || img.Status != StatusReady {
		return img, func() {}, err
	}
	build := s.catalog.RootFS(img)
	if _, err := os.Stat(build); err != nil {
		return nil, nil, &vm.HostError{Kind: vm.HostStorage, Op: "reading AppVM image " + id,
			Err: fmt.Errorf("the image is ready but its build is missing: %w", err)}
	}
	if k.pins == nil {
		k.pins = map[string]int{}
	}
	k.pins[build]++
	var once sync.Once
	return img, func() {
		once.Do(func() {
			k.mu.Lock()
			defer k.mu.Unlock()
			if k.pins[build]--; k.pins[build] <= 0 {
				delete(k.pins, build)
			}
		})
	}, nil
}

// buildsInUse lists the builds rec needs kept (see above): the backing
// file of its overlay, the base of a root disk not made yet, the build a
// redeploy in progress installs.
func (s *Service) buildsInUse(rec *vm.Record) []string {
	var out []string
	if b := rec.RootBacking(); b != "" {
		out = append(out, b)
	} else if rec.Base != nil && !rec.Runtime.Done(record.StepRootDisk) {
		out = append(out, rec.Base.Path)
	}
	if a := rec.AppVM; a != nil && a.Redeploy != nil {
		out = append(out, s.catalog.BuildFile(a.ImageID, a.Redeploy.To.BuildDigest))
	}
	return out
}

// imageOf is the id of the catalog image holding build, or "".
func (s *Service) imageOf(build string) string {
	dir := filepath.Dir(build)
	if filepath.Dir(dir) != s.catalog.Dir || !isBuildName(filepath.Base(build)) {
		return ""
	}
	return filepath.Base(dir)
}

// followBuilds asks for a sweep of each image whose build a change of a
// record stopped using (a watcher of the records: it only notes the ids).
func (s *Service) followBuilds(c records.Change) {
	if c.Old == nil {
		return
	}
	var now []string
	if c.New != nil {
		now = s.buildsInUse(c.New)
	}
	for _, b := range s.buildsInUse(c.Old) {
		if !contains(now, b) {
			if id := s.imageOf(b); id != "" {
				s.requestSweep(id)
			}
		}
	}
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// requestSweep has image id's unused builds removed in the background.
func (s *Service) requestSweep(id string) {
	k := &s.builds
	k.sweepMu.Lock()
	defer k.sweepMu.Unlock()
	if k.pending == nil {
		k.pending = map[string]bool{}
		k.idle = sync.NewCond(&k.sweepMu)
	}
	k.pending[id] = true
	if !k.sweeping {
		k.sweeping = true
		go s.runSweeps()
	}
}

func (s *Service) runSweeps() {
	k := &s.builds
	for {
		k.sweepMu.Lock()
		var id string
		for id = range k.pending {
			break
		}
		if id == "" {
			k.sweeping = false
			k.idle.Broadcast()
			k.sweepMu.Unlock()
			return
		}
		delete(k.pending, id)
		k.sweepMu.Unlock()
		for try := 1; ; try++ {
			if _, locked := s.sweepBuilds(id); !locked || try == sweepLockTries {
				break
			}
			time.Sleep(sweepLockWait)
		}
	}
}

// A sweep that finds the image's lock taken tries again, sweepLockTries
// times sweepLockWait apart: the lock is often held for a moment only (an
// import's recovery at start, or a process the agent forks, which holds a
// copy of the lock until it execs). An import that holds it longer asks
// for a sweep when it commits.
const (
	sweepLockTries = 20
	sweepLockWait  = 100 * time.Millisecond
)

// WaitSweeps waits until no sweep of builds is pending or running.
func (s *Service) WaitSweeps() {
	k := &s.builds
	k.sweepMu.Lock()
	defer k.sweepMu.Unlock()
	for k.sweeping {
		k.idle.Wait()
	}
}

// sweepBuilds removes the builds of image id that nothing uses (see
// above). It gives up, removing nothing, when the image's lock is taken
// (locked: an import runs, or holds it for a moment), while an import has
// staged work a restart must finish first, and when image.json cannot be
// read.
func (s *Service) sweepBuilds(id string) (removed []string, locked bool) {
	log := s.guests.log.With("image", id)
	k := &s.builds
	k.mu.Lock() // before the lock file, as DeleteImage
	defer k.mu.Unlock()
	dir := filepath.Join(s.catalog.Dir, id)
	if _, err := os.Stat(dir); err != nil {
		return nil, false // deleted
	}
	lock, err := s.catalog.lock(id)
	if err != nil {
		if errors.As(err, new(*ConflictError)) {
			return nil, true
		}
		log.Error("removing the unused builds of an AppVM image", "err", err)
		return nil, false
	}
	defer lock.Close()
	if _, err := os.Lstat(filepath.Join(dir, nextDir)); !errors.Is(err, fs.ErrNotExist) {
		return nil, false
	}
	img, err := s.catalog.Get(id)
	if err != nil {
		if !errors.Is(err, fs.ErrNotExist) {
			log.Error("removing the unused builds of an AppVM image", "err", err)
		}
		return nil, false
	}
	keep := map[string]bool{}
	if img.Status == StatusReady {
		keep[s.catalog.RootFS(img)] = true
	}
	for b := range k.pins {
		keep[b] = true
	}
	for _, rec := range s.recs.All() {
		for _, b := range s.buildsInUse(rec) {
			keep[b] = true
		}
	}
	snaps, err := s.snapshotBuilds()
	if err != nil {
		log.Error("removing the unused builds of an AppVM image", "err", err)
		return nil, false
	}
	for b := range snaps {
		keep[b] = true
	}
	ents, err := os.ReadDir(dir)
	if err != nil {
		log.Error("removing the unused builds of an AppVM image", "err", err)
		return nil, false
	}
	for _, e := range ents {
		p := filepath.Join(dir, e.Name())
		if !e.Type().IsRegular() || !isBuildName(e.Name()) || keep[p] {
			continue
		}
		if err := removeBuild(p); err != nil {
			log.Error("removing an unused build of an AppVM image", "build", p, "err", err)
			continue
		}
		log.Info("removed a build no AppVM uses", "build", p)
		removed = append(removed, p)
	}
	return removed, false
}

// snapshotBuilds maps each build a snapshot's disk is an overlay of to
// the ids of those snapshots.
func (s *Service) snapshotBuilds() (map[string][]string, error) {
	out := map[string][]string{}
	st := s.vms.Snapshots()
	if st == nil {
		return out, nil
	}
	snaps, err := st.List()
	if err != nil {
		return nil, err
	}
	for _, sn := range snaps {
		for _, d := range sn.Disks {
			if d.Backing != "" && !contains(out[d.Backing], sn.ID) {
				out[d.Backing] = append(out[d.Backing], sn.ID)
			}
		}
	}
	return out, nil
}

// followSnapshotDelete asks for a sweep of each image whose build a
// deleted snapshot's disks were overlays of.
func (s *Service) followSnapshotDelete(sn *snapshot.Snapshot) {
	for _, d := range sn.Disks {
		if id := s.imageOf(d.Backing); d.Backing != "" && id != "" {
			s.requestSweep(id)
		}
	}
}

// removeBuild unseals a build and removes it.
func removeBuild(p string) error {
	if err := disk.UnsealBuild(p); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	if err := os.Remove(p); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	return nil
}

// removeImageDir removes an image directory taken out of the catalog (a
// delete), unsealing its builds first: an immutable file, and so its
// directory, cannot be removed.
func removeImageDir(dir string) error { return disk.RemoveAll(dir) }

// NewImporter returns the agent's Importer of the catalog: it finishes
// what imports cut short (Importer.Recover) and removes the builds nothing
// uses, now and after each import it commits.
func (s *Service) NewImporter(o ImportOptions) (*Importer, error) {
	o.Committed = s.requestSweep
	im := NewImporter(s.catalog, o)
	err := im.Recover()
	imgs, lerr := s.catalog.List()
	for _, img := range imgs {
		s.requestSweep(img.ID)
	}
	return im, errors.Join(err, lerr)
}

// DeleteImage deletes image id from the catalog unless an AppVM uses it
// (any of its builds, whatever its root disk's kind) or a snapshot's disk
// is an overlay of one of its builds: a *ConflictError names them, or
// says that creates of it are in progress. Unknown id → fs.ErrNotExist.
func (s *Service) DeleteImage(im *Importer, id string) error {
	k := &s.builds
	k.mu.Lock()
	defer k.mu.Unlock()
	return im.Delete(id, func(id string) (users ImageUsers, err error) {
		for _, rec := range s.List() {
			if rec.AppVM != nil && rec.AppVM.ImageID == id {
				users.AppVMs = append(users.AppVMs, rec.ID)
			}
		}
		prefix := filepath.Join(s.catalog.Dir, id) + "/"
		for b, n := range k.pins {
			if strings.HasPrefix(b, prefix) {
				users.AppVMs = append(users.AppVMs, fmt.Sprintf("(%d being created)", n))
			}
		}
		snaps, err := s.snapshotBuilds()
		if err != nil {
			return users, err
		}
		for b, ids := range snaps {
			if strings.HasPrefix(b, prefix) {
				for _, sid := range ids {
					if !contains(users.Snapshots, sid) {
						users.Snapshots = append(users.Snapshots, sid)
					}
				}
			}
		}
		return users, nil
	})
}
