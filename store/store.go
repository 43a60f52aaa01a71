// Package store keeps one JSON record per VM in a directory: <dir>/<id>.json.
//
// Every write is atomic and durable, through internal/atomicfile: the data
// goes to a temp file in the same directory, which is chmod 0600, fsynced and closed, then renamed over the
// record, and the directory is fsynced so the rename itself survives a power
// cut. A crash leaves either the old record or the new one, plus perhaps a
// temp file that Load removes; a temp file never replaces a record.
//
// All access goes through an os.Root, so no id, however spelled, reaches a
// file outside the directory. Put refuses to replace anything but a regular
// file (a socket, a directory or a symlink at the record's path is an error).
//
// Load is meant for start-up. It sorts the directory into good records,
// records whose file name is not a valid id (the caller reports them as
// failed VMs), and damaged records (empty, not JSON, or not a JSON object),
// which are moved aside to <id>.json.damaged and reported, never dropped.
// Files that are not records (per-VM subdirectories, *.damaged) are ignored.
//
// The package does not interpret record contents beyond "a JSON object".
// A Store is safe for concurrent use; Load waits for in-flight Puts.
package store

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"

	"vmhost/internal/atomicfile"
)

// Temp files are atomicfile's .<id>.json.tmp-<random> (and .tmp-<id>-<random>
// from older versions): they start with a dot, so no temp name is ever a
// valid id or a record name, since ids start with a letter or digit.
const (
	recordSuffix  = ".json"
	damagedSuffix = ".damaged"
)

var idPattern = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$`)

// ValidID reports whether id matches ^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$, the
// contract's vm_id pattern.
func ValidID(id string) bool { return idPattern.MatchString(id) }

// Store is a directory of VM records. Create it with Open; Close releases
// the directory handle.
type Store struct {
	dir  string
	root *os.Root
	// mu is held shared by writers and exclusively by Load, so Load never
	// mistakes an in-flight temp file for a leftover one.
	mu sync.RWMutex
	// beforeRename, when set, runs in Put once the data is in the temp
	// file, before the final check and rename. It exists only for tests, to
	// change the directory at that moment.
	beforeRename func()
}

// Record is one stored record: the id (the file name minus .json) and the
// file's contents.
type Record struct {
	ID   string
	Data []byte
}

// Damaged is a record that could not be used. MovedTo is the file name,
// relative to the store directory, it was moved to; Err says what is wrong.
type Damaged struct {
	ID      string
	MovedTo string
	Err     error
}

// Loaded is what Load found.
type Loaded struct {
	// Records have a valid id and a JSON object as content, sorted by id.
	Records []Record
	// Invalid records have a JSON object as content but a file name that is
	// not a valid id; ID is the file name minus .json.
	Invalid []Record
	// Damaged records were empty, unparsable, not a JSON object or not a
	// regular file; each has been moved aside.
	Damaged []Damaged
	// RemovedTemps lists leftover temp files (from writes interrupted by a
	// crash) that Load removed.
	RemovedTemps []string
}

// Open opens the store in dir, creating the directory with mode 0700 if it
// does not exist. The caller must Close the store.
func Open(dir string) (*Store, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("creating store directory %q: %w", dir, err)
	}
	root, err := os.OpenRoot(dir)
	if err != nil {
		return nil, fmt.Errorf("opening store directory %q: %w", dir, err)
	}
	return &Store{dir: dir, root: root}, nil
}

// Dir returns the directory the store was opened on.
func (s *Store) Dir() string { return s.dir }

// Close releases the directory handle. The store must not be used after.
func (s *Store) Close() error { return s.root.Close() }

// Put atomically replaces the record of id with data. It writes a temp file
// in the store directory (mode 0600), fsyncs and closes it, renames it over
// <id>.json and fsyncs the directory. The temp file is removed on any error.
// Put refuses an invalid id and a record path that holds anything but a
// regular file. It does not check that data is JSON.
func (s *Store) Put(id string, data []byte) error {
	if !ValidID(id) {
		return fmt.Errorf("storing record %q: invalid id", id)
	}
	s.mu.RLock()
	defer s.mu.RUnlock()
	err := atomicfile.FillIn(s.root, id+recordSuffix, 0o600, func(f *os.File) error {
		if _, err := f.Write(data); err != nil {
			return err
		}
		if s.beforeRename != nil {
			s.beforeRename()
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("storing record %q: %w", id, err)
	}
	return nil
}

// Get returns the contents of the record of id. A missing record gives an
// error that satisfies errors.Is(err, fs.ErrNotExist).
func (s *Store) Get(id string) ([]byte, error) {
	if !ValidID(id) {
		return nil, fmt.Errorf("reading record %q: invalid id: %w", id, fs.ErrNotExist)
	}
	data, err := s.root.ReadFile(id + recordSuffix)
	if err != nil {
		return nil, fmt.Errorf("reading record %q: %w", id, err)
	}
	return data, nil
}

// Delete removes the record of id and fsyncs the directory. A missing record
// is success. Unlike Put, Delete accepts any single file-name component as
// id, so that records Load reported as Invalid can be removed too.
func (s *Store) Delete(id string) error {
	if id == "" || id == "." || id == ".." || strings.ContainsAny(id, "/\x00") {
		return fmt.Errorf("deleting record %q: invalid id", id)
	}
	s.mu.RLock()
	defer s.mu.RUnlock()
	err := s.root.Remove(id + recordSuffix)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("deleting record %q: %w", id, err)
	}
	if err := atomicfile.SyncRoot(s.root); err != nil {
		return fmt.Errorf("deleting record %q: %w", id, err)
	}
	return nil
}

// Load reads every record in the directory. Leftover temp files are removed
// and listed; damaged records are moved aside and listed. Load fails only
// when the directory cannot be read or a damaged record cannot be moved.
func (s *Store) Load() (*Loaded, error) {
	s.mu.Lock()
	defer s.mu.Unlock()

	d, err := s.root.Open(".")
	if err != nil {
		return nil, fmt.Errorf("loading records: %w", err)
	}
	entries, err := d.ReadDir(-1)
	d.Close()
	if err != nil {
		return nil, fmt.Errorf("loading records: %w", err)
	}
	slices.SortFunc(entries, func(a, b fs.DirEntry) int { return strings.Compare(a.Name(), b.Name()) })

	out := &Loaded{}
	changed := false
	for _, e := range entries {
		name := e.Name()
		switch {
		case atomicfile.IsTemp(name):
			if err := s.root.RemoveAll(name); err != nil {
				return nil, fmt.Errorf("removing leftover temp file %q: %w", name, err)
			}
			out.RemovedTemps = append(out.RemovedTemps, name)
			changed = true
			continue
		case !strings.HasSuffix(name, recordSuffix):
			continue // per-VM directories, *.json.damaged, foreign files
		}
		id := strings.TrimSuffix(name, recordSuffix)
		data, problem := s.readRecord(name, e)
		if problem == nil {
			if ValidID(id) {
				out.Records = append(out.Records, Record{ID: id, Data: data})
			} else {
				out.Invalid = append(out.Invalid, Record{ID: id, Data: data})
			}
			continue
		}
		movedTo, err := s.moveAside(name)
		if err != nil {
			return nil, fmt.Errorf("moving damaged record %q aside: %w", name, err)
		}
		out.Damaged = append(out.Damaged, Damaged{ID: id, MovedTo: movedTo, Err: problem})
		changed = true
	}
	if changed {
		if err := atomicfile.SyncRoot(s.root); err != nil {
			return nil, fmt.Errorf("loading records: %w", err)
		}
	}
	return out, nil
}

// readRecord reads a record file and reports why it is damaged, if it is.
// An error reading a regular file (EIO, EACCES) is reported as damage too:
// the file is moved aside and kept for the operator rather than dropped.
func (s *Store) readRecord(name string, e fs.DirEntry) ([]byte, error) {
	if !e.Type().IsRegular() {
		return nil, fmt.Errorf("not a regular file (%v)", e.Type())
	}
	data, err := s.root.ReadFile(name)
	if err != nil {
		return nil, err
	}
	if problem := checkObject(data); problem != nil {
		return nil, problem
	}
	return data, nil
}

// checkObject reports why data is not a single JSON object, or nil.
func checkObject(data []byte) error {
	// JSON's own whitespace only: bytes.TrimSpace would also take a
	// vertical tab or a form feed, which JSON refuses.
	trimmed := bytes.Trim(data, " \t\r\n")
	if len(trimmed) == 0 {
		// An empty file is what a crash leaves when a writer skipped fsync;
		// it holds no record, so it counts as damaged, not as missing.
		return errors.New("empty record")
	}
	if trimmed[0] != '{' {
		return errors.New("record is not a JSON object")
	}
	if !json.Valid(trimmed) {
		// json.Unmarshal gives the offset of the problem.
		var v any
		if err := json.Unmarshal(trimmed, &v); err != nil {
			return fmt.Errorf("record is not valid JSON: %w", err)
		}
		return errors.New("record is not valid JSON")
	}
	return nil
}

// moveAside renames name to the first free name among name.damaged,
// name.damaged.1, name.damaged.2, ..., so an earlier damaged copy is kept.
func (s *Store) moveAside(name string) (string, error) {
	for i := 0; ; i++ {
		target := name + damagedSuffix
		if i > 0 {
			target += "." + strconv.Itoa(i)
		}
		if _, err := s.root.Lstat(target); err == nil {
			continue
		} else if !errors.Is(err, fs.ErrNotExist) {
			return "", err
		}
		if err := s.root.Rename(name, target); err != nil {
			return "", err
		}
		return target, nil
	}
}
