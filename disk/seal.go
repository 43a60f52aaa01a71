package disk

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
)

// A build (an AppVM image's root file system, rootfs-<digest>.qcow2) is
// the backing file of every overlay made on it, so once imported it must
// never change: SealBuild makes it read-only and, where it can, immutable;
// UnsealBuild undoes that so the build can be deleted.

// Seal is what SealBuild achieved. The mode is always 0444 after a
// successful SealBuild; the immutable flag only where the file system
// supports FS_IMMUTABLE_FL and the agent holds CAP_LINUX_IMMUTABLE.
type Seal struct {
	Immutable bool // FS_IMMUTABLE_FL is set: not even root can write, rename or unlink it
	// NotImmutable says why Immutable is false: an error wrapping
	// ErrImmutableUnsupported or ErrNoImmutableCapability.
	NotImmutable error
}

var (
	// ErrImmutableUnsupported: the file system (or the OS) has no
	// immutable flag, e.g. ramfs, vfat, some FUSE file systems.
	ErrImmutableUnsupported = errors.New("the file system does not support the immutable flag")
	// ErrNoImmutableCapability: setting or clearing the flag needs
	// CAP_LINUX_IMMUTABLE, which the agent lacks (it runs without root).
	ErrNoImmutableCapability = errors.New("the agent lacks CAP_LINUX_IMMUTABLE")
)

// Modes of a sealed build and of one made deletable again.
const (
	sealedMode   = 0o444
	unsealedMode = 0o600
)

// RemoveAll removes path and everything under it, as os.RemoveAll does,
// after unsealing (UnsealBuild) every regular file under it: an immutable
// build, and so every directory above it, cannot be removed otherwise.
// Symlinks are not followed.
func RemoveAll(path string) error {
	var unsealErrs []error
	filepath.WalkDir(path, func(p string, d fs.DirEntry, err error) error {
		if err == nil && d.Type().IsRegular() {
			if err := UnsealBuild(p); err != nil && !errors.Is(err, fs.ErrNotExist) {
				unsealErrs = append(unsealErrs, err)
			}
		}
		return nil
	})
	if err := os.RemoveAll(path); err != nil {
		return errors.Join(append(unsealErrs, err)...)
	}
	return nil
}
