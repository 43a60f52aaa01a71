// Package volume keeps the first-class data volumes (docs/api.md, Volumes):
// qcow2 images with a lifetime of their own, in one directory of the state
// dir. Volume <id> is two files there: <id>.qcow2 (0600), the image, and
// <id>.json, its metadata. The metadata file is the commit point: it is
// written after the image is complete and removed before the image, so a
// crash leaves either a whole volume or an image without metadata, which
// Open removes. Which VM a volume is attached to is not kept here: the VM
// records say it (package vm), so the two can never disagree.
package volume

import (
	"context"
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
	"time"

	"vmhost/internal/atomicfile"
	"vmhost/qcow2"
)

// Formats of a volume's content.
const (
	// FormatRaw is a blank disk: the guest sees zeros.
	FormatRaw = "raw"
	// FormatExt4 holds an empty ext4 file system, as AppVM data volumes do.
	FormatExt4 = "ext4"
)

// Volume is a first-class volume's metadata.
type Volume struct {
	ID        string    `json:"id"`
	Format    string    `json:"format"`
	SizeGiB   uint32    `json:"size_gib"`
	CreatedAt time.Time `json:"created_at"`
}

// Errors of the store's operations, for errors.Is.
var (
	ErrExists   = errors.New("volume already exists")
	ErrNotFound = errors.New("no such volume")
)

// Store is the volume directory. Its methods are safe for concurrent use;
// a create, adopt or delete of one id excludes the others.
type Store struct {
	dir string
	log *slog.Logger

	mu sync.Mutex
}

// Open makes dir (0700) if needed and removes what interrupted operations
// left: temporary files, and images without metadata (a create or delete
// cut short). Metadata without its image is kept and logged: the image may
// have been removed by hand, and a view saying so is better than silence.
func Open(dir string, log *slog.Logger) (*Store, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("opening volume directory: %w", err)
	}
	s := &Store{dir: dir, log: log}
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("opening volume directory: %w", err)
	}
	for _, e := range ents {
		name := e.Name()
		switch {
		case atomicfile.IsTemp(name) || strings.HasPrefix(name, "."):
			s.remove(filepath.Join(dir, name), "temporary file of an interrupted write")
		case strings.HasSuffix(name, ".qcow2"):
			id := strings.TrimSuffix(name, ".qcow2")
			if _, err := os.Stat(s.metaPath(id)); errors.Is(err, fs.ErrNotExist) {
				s.remove(filepath.Join(dir, name), "image of an interrupted create or delete")
			}
		case strings.HasSuffix(name, ".json"):
			id := strings.TrimSuffix(name, ".json")
			if _, err := os.Stat(s.Path(id)); errors.Is(err, fs.ErrNotExist) {
				log.Warn("volume metadata without its image", "volume_id", id, "path", s.Path(id))
			}
		}
	}
	return s, nil
}

func (s *Store) remove(path, why string) {
	if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		s.log.Warn("removing leftover volume file", "path", path, "err", err)
		return
	}
	s.log.Info("removed leftover volume file", "path", path, "why", why)
}

// Path is volume id's image.
func (s *Store) Path(id string) string { return filepath.Join(s.dir, id+".qcow2") }

func (s *Store) metaPath(id string) string { return filepath.Join(s.dir, id+".json") }

// Create makes volume v: a blank qcow2 of v.SizeGiB, or for FormatExt4 one
// holding an empty ext4 file system. An existing id is ErrExists. On any
// failure (a full disk included) nothing of v is left.
func (s *Store) Create(ctx context.Context, v Volume) error {
	if err := check(v); err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.exists(v.ID) {
		return fmt.Errorf("creating volume %s: %w", v.ID, ErrExists)
	}
	path := s.Path(v.ID)
	os.Remove(path) // an image without metadata is a leftover (see Open)
	size := uint64(v.SizeGiB) << 30
	var err error
	if v.Format == FormatExt4 {
		err = qcow2.CreateExt4(ctx, path, size, label(v.ID))
	} else {
		err = qcow2.Create(path, size)
	}
	if err == nil {
		err = os.Chmod(path, 0o600)
	}
	if err == nil {
		err = s.writeMeta(v)
	}
	if err != nil {
		os.Remove(path)
		return fmt.Errorf("creating volume %s: %w", v.ID, err)
	}
	return nil
}

// Adopt makes the image at src, a VM-owned volume being detached, the
// first-class volume v without copying: src is hard-linked as v's image,
// then v's metadata is written. The caller removes src once its own record
// no longer names it; until then both names hold the same data.
func (s *Store) Adopt(v Volume, src string) error {
	if err := check(v); err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.exists(v.ID) {
		return fmt.Errorf("keeping volume %s: %w", v.ID, ErrExists)
	}
	path := s.Path(v.ID)
	os.Remove(path) // a leftover, as in Create
	if err := os.Link(src, path); err != nil {
		return fmt.Errorf("keeping volume %s: %w", v.ID, err)
	}
	if err := atomicfile.SyncDir(s.dir); err != nil {
		os.Remove(path)
		return fmt.Errorf("keeping volume %s: %w", v.ID, err)
	}
	if err := s.writeMeta(v); err != nil {
		os.Remove(path)
		return fmt.Errorf("keeping volume %s: %w", v.ID, err)
	}
	return nil
}

// Get reads volume id's metadata (ErrNotFound when there is none).
func (s *Store) Get(id string) (Volume, error) {
	if !validID(id) {
		return Volume{}, fmt.Errorf("volume %s: %w", id, ErrNotFound)
	}
	data, err := os.ReadFile(s.metaPath(id))
	if errors.Is(err, fs.ErrNotExist) {
		return Volume{}, fmt.Errorf("volume %s: %w", id, ErrNotFound)
	}
	if err != nil {
		return Volume{}, fmt.Errorf("reading volume %s: %w", id, err)
	}
	var v Volume
	if err := json.Unmarshal(data, &v); err != nil {
		return Volume{}, fmt.Errorf("reading volume %s: %w", id, err)
	}
	if v.ID != id {
		return Volume{}, fmt.Errorf("reading volume %s: its metadata names %q", id, v.ID)
	}
	return v, nil
}

// List reads every volume, sorted by id. A metadata file that cannot be
// read is logged and left out.
func (s *Store) List() ([]Volume, error) {
	ents, err := os.ReadDir(s.dir)
	if err != nil {
		return nil, fmt.Errorf("listing volumes: %w", err)
	}
	var out []Volume
	for _, e := range ents {
		id, ok := strings.CutSuffix(e.Name(), ".json")
		if !ok || strings.HasPrefix(id, ".") {
			continue
		}
		v, err := s.Get(id)
		if err != nil {
			s.log.Warn("unreadable volume metadata", "volume_id", id, "err", err)
			continue
		}
		out = append(out, v)
	}
	slices.SortFunc(out, func(a, b Volume) int { return strings.Compare(a.ID, b.ID) })
	return out, nil
}

// Delete erases volume id: its metadata first (the commit point), then
// its image. The caller has checked that no VM uses it.
func (s *Store) Delete(id string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.exists(id) {
		return fmt.Errorf("deleting volume %s: %w", id, ErrNotFound)
	}
	if err := os.Remove(s.metaPath(id)); err != nil {
		return fmt.Errorf("deleting volume %s: %w", id, err)
	}
	if err := atomicfile.SyncDir(s.dir); err != nil {
		return fmt.Errorf("deleting volume %s: %w", id, err)
	}
	if err := os.Remove(s.Path(id)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		s.log.Warn("removing a deleted volume's image", "volume_id", id, "err", err)
	}
	return nil
}

func (s *Store) exists(id string) bool {
	if !validID(id) {
		return false
	}
	_, err := os.Lstat(s.metaPath(id))
	return err == nil
}

func (s *Store) writeMeta(v Volume) error {
	data, err := json.Marshal(v)
	if err != nil {
		return err
	}
	return atomicfile.WriteFile(s.metaPath(v.ID), append(data, '\n'), 0o600)
}

// check refuses what no caller should pass: the API validates ids and
// sizes with its own messages first.
func check(v Volume) error {
	if !validID(v.ID) {
		return fmt.Errorf("volume id %q: not a file name", v.ID)
	}
	if v.Format != FormatRaw && v.Format != FormatExt4 {
		return fmt.Errorf("volume %s: format %q is neither raw nor ext4", v.ID, v.Format)
	}
	if v.SizeGiB == 0 {
		return fmt.Errorf("volume %s: size 0", v.ID)
	}
	return nil
}

func validID(id string) bool {
	return id != "" && id != "." && id != ".." && !strings.HasPrefix(id, ".") && !strings.ContainsAny(id, "/\x00")
}

// label is the ext4 label: at most 16 bytes.
func label(id string) string {
	if len(id) > 16 {
		return id[:16]
	}
	return id
}
