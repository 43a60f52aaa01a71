// Package atomicfile replaces files so that a crash at any moment leaves
// either the old content or the new one, never a mix: the data goes to a
// temporary file in the target's directory, is fsynced, renamed over the
// target, and the directory is fsynced so the rename itself is durable.
// Every writer of durable agent state uses it, so durability does not depend
// on which package wrote a file.
//
// Two rules hold for every function here: a target that exists and is not a
// regular file (a directory, a symlink, a device, a FIFO, a socket) is
// refused, because replacing it would silently change what some other path
// points at; and a directory fsync answered with EINVAL is not an error (see
// SyncDir).
//
// WriteFile and Write cover plain content; Fill hands the callback the
// temporary *os.File itself (for WriteAt, Truncate, ReadAt or the
// descriptor); Create publishes a new file without ever replacing one;
// FillIn works inside an os.Root, so a name can never reach a file outside
// it; Rename installs a file that is already durable.
package atomicfile

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"
)

// WriteFile replaces path with data, created with mode perm.
func WriteFile(path string, data []byte, perm os.FileMode) error {
	return Write(path, perm, func(w io.Writer) error {
		_, err := w.Write(data)
		return err
	})
}

// Write replaces path with what write writes, created with mode perm. The
// temporary file is named .<base>.tmp-<random> in the same directory and is
// removed on any failure. A target that is not a regular file is refused,
// both before the temporary file is made and again right before the rename.
func Write(path string, perm os.FileMode, write func(io.Writer) error) error {
	return Fill(path, perm, func(f *os.File) error { return write(f) })
}

// Fill replaces path like Write, but hands fill the temporary file itself
// (opened read-write), for writers that need WriteAt, Truncate, ReadAt or
// the descriptor. fill must not close it.
func Fill(path string, perm os.FileMode, fill func(*os.File) error) error {
	return inDir(path, func(root *os.Root, name string) error {
		return replace(root, path, name, perm, false, fill)
	})
}

// Create writes a new file at path like Fill but never replaces anything:
// if path exists, before or at the moment of publishing, the error satisfies
// errors.Is(err, fs.ErrExist) and nothing is left behind. A crash leaves no
// partial file at path, only a temporary one that IsTemp recognises.
func Create(path string, perm os.FileMode, fill func(*os.File) error) error {
	return inDir(path, func(root *os.Root, name string) error {
		return replace(root, path, name, perm, true, fill)
	})
}

// FillIn replaces the file name inside root like Fill. Every operation goes
// through root, so no name, however spelled, reaches a file outside it.
func FillIn(root *os.Root, name string, perm os.FileMode, fill func(*os.File) error) error {
	return replace(root, name, name, perm, false, fill)
}

// Rename moves from, a complete file that is already fsynced (written by
// Create, for instance, in a staging directory on the same file system),
// over to, and fsyncs the directory of to. A to that is not a regular file
// is refused.
func Rename(from, to string) error {
	if err := checkTarget(os.Lstat, to, to); err != nil {
		return err
	}
	if err := os.Rename(from, to); err != nil {
		return err
	}
	return SyncDir(filepath.Dir(to))
}

// inDir opens the directory of path as a root and runs do with the base name.
func inDir(path string, do func(root *os.Root, name string) error) error {
	root, err := os.OpenRoot(filepath.Dir(path))
	if err != nil {
		return err
	}
	defer root.Close()
	return do(root, filepath.Base(path))
}

// replace is the one implementation behind every writer: checked target,
// temporary file, fill, chmod, fsync, close, checked again, rename (or
// publish without replacing), fsync of the directory. display names the
// target in errors.
func replace(root *os.Root, display, name string, perm os.FileMode, noReplace bool, fill func(*os.File) error) (err error) {
	if noReplace {
		if _, err := root.Lstat(name); err == nil {
			return fmt.Errorf("creating %s: %w", display, fs.ErrExist)
		}
	} else if err := checkTarget(root.Lstat, display, name); err != nil {
		return err
	}
	dir, err := root.Open(".")
	if err != nil {
		return err
	}
	defer dir.Close()
	tmp, f, err := createTemp(root, name)
	if err != nil {
		return err
	}
	defer func() {
		if err != nil {
			f.Close() // may already be closed; that error is irrelevant then
			root.Remove(tmp)
		}
	}()
	// The temporary file is made 0600; Chmod is not subject to the umask.
	if err := f.Chmod(perm); err != nil {
		return err
	}
	if err := fill(f); err != nil {
		return err
	}
	// Without fsync before rename, a crash can leave a renamed but empty
	// file on ext4 with delalloc and on other file systems.
	if err := f.Sync(); err != nil {
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	if noReplace {
		if err := renameNoReplace(root, dir, tmp, name); err != nil {
			if errors.Is(err, fs.ErrExist) {
				return fmt.Errorf("creating %s: %w", display, fs.ErrExist)
			}
			return fmt.Errorf("creating %s: %w", display, err)
		}
	} else {
		// Checked again right before the rename, so the window in which
		// something else can put a non-regular file there is small.
		if err := checkTarget(root.Lstat, display, name); err != nil {
			return err
		}
		if err := root.Rename(tmp, name); err != nil {
			return err
		}
	}
	return syncOpenDir(dir, filepath.Dir(display))
}

// checkTarget refuses a name that exists and is not a regular file.
func checkTarget(lstat func(string) (os.FileInfo, error), display, name string) error {
	fi, err := lstat(name)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	if !fi.Mode().IsRegular() {
		return fmt.Errorf("%s is not a regular file (%v); refusing to replace it", display, fi.Mode().Type())
	}
	return nil
}

// createTemp creates .<name>.tmp-<random> in root, empty, mode 0600.
func createTemp(root *os.Root, name string) (string, *os.File, error) {
	for range 10 {
		tmp := "." + name + ".tmp-" + randomHex()
		f, err := root.OpenFile(tmp, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
		if errors.Is(err, fs.ErrExist) {
			continue
		}
		if err != nil {
			return "", nil, err
		}
		return tmp, f, nil
	}
	return "", nil, errors.New("creating temporary file: too many name collisions")
}

func randomHex() string {
	var b [8]byte
	rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// SyncDir fsyncs a directory so that entries created, renamed or removed in
// it survive a power loss. A file system that cannot fsync directories
// (EINVAL: some FUSE and network file systems) is not an error: nothing more
// can be done there, and refusing would make the agent unusable on them.
func SyncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("syncing directory: %w", err)
	}
	defer d.Close()
	return syncOpenDir(d, dir)
}

// SyncRoot fsyncs the directory of root, with SyncDir's EINVAL rule.
func SyncRoot(root *os.Root) error {
	d, err := root.Open(".")
	if err != nil {
		return fmt.Errorf("syncing directory %s: %w", root.Name(), err)
	}
	defer d.Close()
	return syncOpenDir(d, root.Name())
}

func syncOpenDir(d *os.File, name string) error {
	if err := dirSyncResult(d.Sync()); err != nil {
		return fmt.Errorf("syncing directory %s: %w", name, err)
	}
	return nil
}

// dirSyncResult drops EINVAL, with which some file systems refuse fsync on a
// directory. EINVAL must be matched as such; os.ErrInvalid does not match.
func dirSyncResult(err error) error {
	if errors.Is(err, syscall.EINVAL) {
		return nil
	}
	return err
}

// IsTemp reports whether name (a base name) is a temporary file left by an
// interrupted write, so that startup cleanups can remove it. It is the one
// rule for the agent's temp files: every step that writes a file through a
// temporary one names it "." + <final name> + ".tmp-" + <anything> (this
// package's writers, and those that make their own: qcow2.CreateExt4's
// raw image), and RemoveTemps sweeps them.
func IsTemp(name string) bool {
	return strings.HasPrefix(name, ".") && strings.Contains(name, ".tmp-")
}

// RemoveTemps removes the entries of dir whose names IsTemp accepts (temp
// directories with what they hold) and returns their paths. Call it only
// while no write in dir is in flight, such as when the agent starts with
// its state directory locked. A missing dir is nothing to do.
func RemoveTemps(dir string) ([]string, error) {
	ents, err := os.ReadDir(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var removed []string
	var errs []error
	for _, e := range ents {
		if !IsTemp(e.Name()) {
			continue
		}
		p := filepath.Join(dir, e.Name())
		if err := os.RemoveAll(p); err != nil {
			errs = append(errs, err)
			continue
		}
		removed = append(removed, p)
	}
	return removed, errors.Join(errs...)
}

// linkNoReplace publishes tmp as name with a hard link, which fails rather
// than replace an existing name, then removes tmp.
func linkNoReplace(root *os.Root, tmp, name string) error {
	if err := root.Link(tmp, name); err != nil {
		return err
	}
	return root.Remove(tmp)
}
