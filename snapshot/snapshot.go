// Package snapshot keeps the VM snapshots (docs/api.md, Suspend and
// snapshots): one directory per snapshot under <state>/snapshots/, holding
// snapshot.json (its metadata), disks/<id>.qcow2 (a copy of each disk the
// VM owned: "root", "data0", …) and, for a snapshot with memory, memory/
// (Cloud Hypervisor's saved state, opaque here).
//
// A snapshot is made in a staging directory (.new-<id>) and becomes one by
// a rename once everything in it, snapshot.json last, is on disk; a delete
// renames it away (.del-<id>) before removing it. Either rename is the
// commit point: a crash leaves a whole snapshot or none, and Open removes
// what interrupted creates and deletes left.
package snapshot

import (
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"vmhost/internal/atomicfile"
	"vmhost/internal/crashhook"
	"vmhost/internal/nofollow"
)

// MetaFile is the metadata of a snapshot, written last.
const MetaFile = "snapshot.json"

// Names inside a snapshot's directory.
const (
	DisksDir  = "disks"
	MemoryDir = "memory"
)

// Prefixes of the directories of creates and deletes in progress.
const (
	stagingPrefix  = ".new-"
	deletingPrefix = ".del-"
)

// Snapshot is a snapshot's metadata, as snapshot.json holds it, and
// SizeBytes, which Get and List measure.
type Snapshot struct {
	ID        string    `json:"id"`
	VMID      string    `json:"vm_id"`
	Mode      string    `json:"mode"` // the VM's family: "vm" or "appvm"
	CreatedAt time.Time `json:"created_at"`
	// Memory is set when the snapshot holds the VM's memory and device
	// state (memory/).
	Memory bool `json:"memory"`
	// Disks are the copies of the disks the VM owned, the root disk first.
	Disks []Disk `json:"disks"`
	// Volumes are the first-class volumes the VM had attached: named,
	// not copied.
	Volumes []NamedVolume `json:"volumes,omitempty"`
	// SizeBytes is the space the snapshot takes on the host (measured, not
	// stored).
	SizeBytes uint64 `json:"size_bytes"`
	// Source is what a new VM made from the snapshot, or a restore, needs
	// of the VM as it was; not part of the API's view.
	Source Source `json:"source"`
}

// Disk is the copy of one disk.
type Disk struct {
	ID               string `json:"id"` // "root", or the volume's per-VM id
	Path             string `json:"path"`
	VirtualSizeBytes uint64 `json:"virtual_size_bytes"`
	// Backing is the build the copy is an overlay of (an AppVM's overlay
	// root disk), which must stay while the snapshot does; empty when the
	// copy stands alone.
	Backing string `json:"backing,omitempty"`
}

// NamedVolume is a first-class volume attached to the VM at the snapshot.
type NamedVolume struct {
	ID       string `json:"id"`        // its per-VM id on the VM
	VolumeID string `json:"volume_id"` // the first-class volume
}

// Source is the VM at the time of the snapshot, as far as a new VM from
// it, or a restore onto it, needs to know.
type Source struct {
	// VMCreatedAt tells the VM from another made later with its id.
	VMCreatedAt time.Time `json:"vm_created_at"`
	// Volumes are the VM's volumes in disk order, as its record had them
	// (VM-owned ones copied into Disks; first-class ones only named).
	Volumes json.RawMessage `json:"volumes,omitempty"`
	// ImageID and Workload are an AppVM's image and workload defaults.
	ImageID  string          `json:"image_id,omitempty"`
	Workload json.RawMessage `json:"workload,omitempty"`
	// Base is the base image the VM's root disk was made from.
	Base json.RawMessage `json:"base,omitempty"`
}

// Errors of the store's operations, for errors.Is.
var (
	ErrExists   = errors.New("snapshot already exists")
	ErrNotFound = errors.New("no such snapshot")
	ErrInUse    = errors.New("snapshot in use")
)

// Store is the snapshot directory. Its methods are safe for concurrent use.
type Store struct {
	dir string
	log *slog.Logger

	mu sync.Mutex
	// reserved are the ids of creates in progress; pins count the users
	// of each snapshot (a create from it, a restore), which a delete must
	// wait for.
	reserved map[string]bool
	pins     map[string]int
}

// Open makes dir (0700) if needed and removes what interrupted creates and
// deletes left: staging and deleting directories and temp files.
func Open(dir string, log *slog.Logger) (*Store, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("opening snapshot directory: %w", err)
	}
	s := &Store{dir: dir, log: log, reserved: map[string]bool{}, pins: map[string]int{}}
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("opening snapshot directory: %w", err)
	}
	for _, e := range ents {
		name := e.Name()
		if !strings.HasPrefix(name, ".") {
			if _, err := os.Stat(filepath.Join(dir, name, MetaFile)); err != nil {
				// Never made by a commit (a rename of a staging directory
				// that holds its metadata): nothing names it.
				log.Warn("snapshot directory without metadata; left in place", "dir", filepath.Join(dir, name))
			}
			continue
		}
		p := filepath.Join(dir, name)
		if err := os.RemoveAll(p); err != nil {
			log.Warn("removing what an interrupted snapshot create or delete left", "path", p, "err", err)
			continue
		}
		log.Info("removed what an interrupted snapshot create or delete left", "path", p)
	}
	return s, nil
}

// Dir is snapshot id's directory.
func (s *Store) Dir(id string) string { return filepath.Join(s.dir, id) }

// Staging is where the create of snapshot id writes its files.
func (s *Store) Staging(id string) string { return filepath.Join(s.dir, stagingPrefix+id) }

// Reserve claims id for a create and makes its empty staging directory
// with disks/ in it. ErrExists when a snapshot or a create in progress has
// it. release ends the reservation, removing the staging directory unless
// Commit published it.
func (s *Store) Reserve(id string) (release func(), err error) {
	if !ValidID(id) {
		return nil, fmt.Errorf("snapshot id %q: not a file name", id)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.reserved[id] || exists(s.Dir(id)) {
		return nil, fmt.Errorf("snapshot %s: %w", id, ErrExists)
	}
	staging := s.Staging(id)
	if err := os.RemoveAll(staging); err != nil {
		return nil, fmt.Errorf("snapshot %s: clearing its staging directory: %w", id, err)
	}
	if err := os.MkdirAll(filepath.Join(staging, DisksDir), 0o700); err != nil {
		return nil, fmt.Errorf("snapshot %s: %w", id, err)
	}
	s.reserved[id] = true
	return func() {
		s.mu.Lock()
		delete(s.reserved, id)
		s.mu.Unlock()
		if err := os.RemoveAll(staging); err != nil {
			s.log.Warn("removing the staging directory of a snapshot", "id", id, "err", err)
		}
	}, nil
}

// Commit publishes the reserved snapshot sn.ID: its files in the staging
// directory are synced, snapshot.json written last, and the directory
// renamed into place. The paths in sn.Disks must be the final ones.
func (s *Store) Commit(sn *Snapshot) error {
	staging := s.Staging(sn.ID)
	if err := syncTree(staging); err != nil {
		return fmt.Errorf("committing snapshot %s: %w", sn.ID, err)
	}
	meta := *sn
	meta.SizeBytes = 0
	data, err := json.MarshalIndent(&meta, "", "\t")
	if err != nil {
		return err
	}
	if err := atomicfile.WriteFile(filepath.Join(staging, MetaFile), append(data, '\n'), 0o600); err != nil {
		return fmt.Errorf("committing snapshot %s: %w", sn.ID, err)
	}
	if err := atomicfile.Rename(staging, s.Dir(sn.ID)); err != nil {
		return fmt.Errorf("committing snapshot %s: %w", sn.ID, err)
	}
	return nil
}

// Get reads snapshot id, with its size measured.
func (s *Store) Get(id string) (*Snapshot, error) {
	if !ValidID(id) {
		return nil, fmt.Errorf("snapshot %q: %w", id, ErrNotFound)
	}
	data, err := os.ReadFile(filepath.Join(s.Dir(id), MetaFile))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("snapshot %q: %w", id, ErrNotFound)
	}
	if err != nil {
		return nil, fmt.Errorf("reading snapshot %s: %w", id, err)
	}
	var sn Snapshot
	if err := json.Unmarshal(data, &sn); err != nil {
		return nil, fmt.Errorf("reading snapshot %s: %w", id, err)
	}
	if sn.ID != id {
		return nil, fmt.Errorf("reading snapshot %s: its metadata names %q", id, sn.ID)
	}
	sn.SizeBytes = allocated(s.Dir(id))
	return &sn, nil
}

// List reads every snapshot, sorted by id; one that cannot be read is
// logged and left out.
func (s *Store) List() ([]*Snapshot, error) {
	ents, err := os.ReadDir(s.dir)
	if err != nil {
		return nil, fmt.Errorf("listing snapshots: %w", err)
	}
	var out []*Snapshot
	for _, e := range ents {
		if !e.IsDir() || strings.HasPrefix(e.Name(), ".") {
			continue
		}
		sn, err := s.Get(e.Name())
		if err != nil {
			if !errors.Is(err, ErrNotFound) {
				s.log.Warn("unreadable snapshot", "id", e.Name(), "err", err)
			}
			continue
		}
		out = append(out, sn)
	}
	slices.SortFunc(out, func(a, b *Snapshot) int { return strings.Compare(a.ID, b.ID) })
	return out, nil
}

// Pin keeps snapshot id from being deleted until release is called (a
// create from it or a restore reading its files). ErrNotFound when it does
// not exist.
func (s *Store) Pin(id string) (release func(), err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !ValidID(id) || !exists(filepath.Join(s.Dir(id), MetaFile)) {
		return nil, fmt.Errorf("snapshot %q: %w", id, ErrNotFound)
	}
	s.pins[id]++
	var once sync.Once
	return func() {
		once.Do(func() {
			s.mu.Lock()
			if s.pins[id]--; s.pins[id] <= 0 {
				delete(s.pins, id)
			}
			s.mu.Unlock()
		})
	}, nil
}

// Delete removes snapshot id: a rename out of the way first (the commit
// point), then its files. ErrInUse while it is pinned.
func (s *Store) Delete(id string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !ValidID(id) || !exists(filepath.Join(s.Dir(id), MetaFile)) {
		return fmt.Errorf("snapshot %q: %w", id, ErrNotFound)
	}
	if s.pins[id] > 0 {
		return fmt.Errorf("snapshot %s: %w: a create from it or a restore of it is in progress", id, ErrInUse)
	}
	gone := filepath.Join(s.dir, deletingPrefix+id+"-"+randomHex())
	if err := atomicfile.Rename(s.Dir(id), gone); err != nil {
		return fmt.Errorf("deleting snapshot %s: %w", id, err)
	}
	crashhook.StopAt("snapshot-delete:renamed") // crash tests: gone, its files not yet
	if err := os.RemoveAll(gone); err != nil {
		s.log.Warn("removing a deleted snapshot's files; the next start removes them", "id", id, "err", err)
	}
	return nil
}

// ValidID reports whether id can name a snapshot's directory (the API
// checks the id pattern with its own message first).
func ValidID(id string) bool {
	return id != "" && id != "." && id != ".." && !strings.HasPrefix(id, ".") && !strings.ContainsAny(id, "/\x00")
}

func exists(path string) bool {
	_, err := os.Lstat(path)
	return err == nil
}

func randomHex() string {
	b := make([]byte, 4)
	rand.Read(b)
	return hex.EncodeToString(b)
}

// allocated is the space the files under dir take (st_blocks), each
// inode once.
func allocated(dir string) uint64 {
	var n uint64
	seen := map[uint64]bool{}
	filepath.WalkDir(dir, func(_ string, d fs.DirEntry, err error) error {
		if err != nil {
			return nil
		}
		fi, err := d.Info()
		if err != nil {
			return nil
		}
		if st, ok := fi.Sys().(*syscall.Stat_t); ok && !seen[uint64(st.Ino)] {
			seen[uint64(st.Ino)] = true
			n += uint64(st.Blocks) * 512
		}
		return nil
	})
	return n
}

// syncTree fsyncs every file and directory under dir, dir last.
func syncTree(dir string) error {
	var dirs []string
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			dirs = append(dirs, p)
			return nil
		}
		if !d.Type().IsRegular() {
			return nil
		}
		return SyncFile(p)
	})
	if err != nil {
		return err
	}
	for i := len(dirs) - 1; i >= 0; i-- {
		if err := atomicfile.SyncDir(dirs[i]); err != nil {
			return err
		}
	}
	return nil
}

// SyncFile fsyncs the regular file at path. A saved state's directory is
// the VM's to write while its Cloud Hypervisor writes it: a name there
// that became a link or a FIFO is refused, never followed or waited on.
func SyncFile(path string) error {
	f, err := nofollow.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	if err := f.Sync(); err != nil {
		return fmt.Errorf("syncing %s: %w", path, err)
	}
	return nil
}

// SyncTree fsyncs every file and directory under dir (Cloud Hypervisor
// writes a VM's saved state without syncing it).
func SyncTree(dir string) error { return syncTree(dir) }
