// Package atomicfile replaces files so that a crash at any moment leaves
// either the old content or the new one, never a mix: the data goes to a
// temporary file in the target's directory, is fsynced, renamed over the
// target, and the directory is fsynced so the rename itself is durable.
// Every writer of durable agent state uses it, so durability does not depend
// on which package wrote a file.
package atomicfile

import (
	"errors"
	"fmt"
	"io"
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
// removed on any failure. A target that exists and is not a regular file (a
// directory, a symlink, a device, a FIFO) is refused: replacing it would
// silently change what some other path points at.
func Write(path string, perm os.FileMode, write func(io.Writer) error) (err error) {
	if fi, err := os.Lstat(path); err == nil && !fi.Mode().IsRegular() {
		return fmt.Errorf("%s is not a regular file (%v); refusing to replace it", path, fi.Mode().Type())
	}
	dir := filepath.Dir(path)
	f, err := os.CreateTemp(dir, "."+filepath.Base(path)+".tmp-*")
	if err != nil {
		return err
	}
	defer func() {
		if err != nil {
			f.Close()
			os.Remove(f.Name())
		}
	}()
	// CreateTemp makes the file 0600; Chmod is not subject to the umask.
	if err := f.Chmod(perm); err != nil {
		return err
	}
	if err := write(f); err != nil {
		return err
	}
	if err := f.Sync(); err != nil {
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	if err := os.Rename(f.Name(), path); err != nil {
		return err
	}
	return SyncDir(dir)
}

// SyncDir fsyncs a directory so that entries created, renamed or removed in
// it survive a power loss. A file system that cannot fsync directories
// (EINVAL: some FUSE and network file systems) is not an error: nothing more
// can be done there, and refusing would make the agent unusable on them.
func SyncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	if err := d.Sync(); err != nil && !errors.Is(err, syscall.EINVAL) {
		return fmt.Errorf("syncing directory %s: %w", dir, err)
	}
	return nil
}

// IsTemp reports whether name (a base name) is a temporary file left by an
// interrupted Write, so that startup cleanups can remove it.
func IsTemp(name string) bool {
	return strings.HasPrefix(name, ".") && strings.Contains(name, ".tmp-")
}
