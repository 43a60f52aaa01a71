package disk

import (
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// fsImmutableFL is FS_IMMUTABLE_FL of linux/fs.h, which x/sys/unix lacks.
const fsImmutableFL = 0x00000010

// SealBuild makes the build at path read-only (mode 0444) and sets
// FS_IMMUTABLE_FL on it (ioctl FS_IOC_SETFLAGS) where the file system and
// the agent's capabilities allow; Seal says which. Missing support or
// capability is not an error: the mode is still set, and Seal.NotImmutable
// says why the flag is not. Sealing a sealed build does nothing, so a
// caller may seal again after a crash; a build that is immutable with
// another mode has its flag cleared, its mode fixed and the flag set
// again. The inode change is fsynced. path must be a regular file
// (symlinks are not followed).
func SealBuild(path string) (Seal, error) {
	f, err := openRegular(path)
	if err != nil {
		return Seal{}, fmt.Errorf("sealing build: %w", err)
	}
	defer f.Close()
	flags, ferr := getFlags(f)
	st, err := f.Stat()
	if err != nil {
		return Seal{}, fmt.Errorf("sealing build %s: %w", path, err)
	}
	if ferr == nil && flags&fsImmutableFL != 0 {
		if st.Mode().Perm() == sealedMode {
			return Seal{Immutable: true}, nil
		}
		// The mode of an immutable file cannot change: lift the flag first.
		if err := setFlags(f, flags&^fsImmutableFL); err != nil {
			return Seal{}, fmt.Errorf("sealing build %s: clearing the immutable flag to fix its mode %v: %w", path, st.Mode().Perm(), err)
		}
		flags &^= fsImmutableFL
	}
	if err := f.Chmod(sealedMode); err != nil {
		return Seal{}, fmt.Errorf("sealing build %s: %w", path, err)
	}
	s := Seal{}
	if ferr == nil {
		ferr = setFlags(f, flags|fsImmutableFL)
	}
	if ferr != nil {
		s.NotImmutable = fmt.Errorf("immutable flag on %s: %w", path, ferr)
		if !errors.Is(ferr, ErrImmutableUnsupported) && !errors.Is(ferr, ErrNoImmutableCapability) {
			return Seal{}, fmt.Errorf("sealing build: %w", s.NotImmutable)
		}
	} else {
		s.Immutable = true
	}
	if err := f.Sync(); err != nil {
		return Seal{}, fmt.Errorf("sealing build %s: %w", path, err)
	}
	return s, nil
}

// UnsealBuild reverses SealBuild so the build can be deleted: it clears
// FS_IMMUTABLE_FL when set (which needs CAP_LINUX_IMMUTABLE: without it
// the error wraps ErrNoImmutableCapability) and sets the mode to 0600. The
// inode change is fsynced. A missing path gives an error satisfying
// errors.Is(err, fs.ErrNotExist).
func UnsealBuild(path string) error {
	f, err := openRegular(path)
	if err != nil {
		return fmt.Errorf("unsealing build: %w", err)
	}
	defer f.Close()
	flags, err := getFlags(f)
	switch {
	case err == nil && flags&fsImmutableFL != 0:
		if err := setFlags(f, flags&^fsImmutableFL); err != nil {
			return fmt.Errorf("unsealing build %s: clearing the immutable flag: %w", path, err)
		}
	case err != nil && !errors.Is(err, ErrImmutableUnsupported):
		return fmt.Errorf("unsealing build %s: %w", path, err)
	}
	if err := f.Chmod(unsealedMode); err != nil {
		return fmt.Errorf("unsealing build %s: %w", path, err)
	}
	if err := f.Sync(); err != nil {
		return fmt.Errorf("unsealing build %s: %w", path, err)
	}
	return nil
}

// openRegular opens path read-only without following a symlink and
// refuses anything but a regular file. An immutable file opens read-only.
func openRegular(path string) (*os.File, error) {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: path, Err: err}
	}
	f := os.NewFile(uintptr(fd), path)
	st, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, err
	}
	if !st.Mode().IsRegular() {
		f.Close()
		return nil, fmt.Errorf("%s is not a regular file (%v)", path, st.Mode().Type())
	}
	return f, nil
}

// getFlags reads the inode flags (FS_IOC_GETFLAGS, an int despite the
// ioctl's name).
func getFlags(f *os.File) (uint32, error) {
	flags, err := unix.IoctlGetUint32(int(f.Fd()), unix.FS_IOC_GETFLAGS)
	if err != nil {
		return 0, flagError("FS_IOC_GETFLAGS", err)
	}
	return flags, nil
}

func setFlags(f *os.File, flags uint32) error {
	if err := unix.IoctlSetPointerInt(int(f.Fd()), unix.FS_IOC_SETFLAGS, int(int32(flags))); err != nil {
		return flagError("FS_IOC_SETFLAGS", err)
	}
	return nil
}

// flagError names the two expected failures: ENOTTY or EOPNOTSUPP where
// the file system has no inode flags (ramfs, vfat), EPERM without
// CAP_LINUX_IMMUTABLE.
func flagError(op string, err error) error {
	switch {
	case errors.Is(err, unix.ENOTTY) || errors.Is(err, unix.EOPNOTSUPP):
		return fmt.Errorf("%s: %w (%w)", op, ErrImmutableUnsupported, err)
	case errors.Is(err, unix.EPERM):
		return fmt.Errorf("%s: %w (%w)", op, ErrNoImmutableCapability, err)
	}
	return fmt.Errorf("%s: %w", op, err)
}
