package jail

import (
	"errors"
	"fmt"
	"path/filepath"

	"golang.org/x/sys/unix"
)

// Own gives each of paths to uid:gid: the files a jailed VM opens (its root
// disk, data volumes, seed) and the directories it creates sockets in (its
// run directory). A symbolic link is changed itself, never followed. The
// directories above each path must be ones the VM cannot change (the
// agent's own), as they are resolved by name.
func Own(uid, gid uint32, paths ...string) error {
	for _, p := range paths {
		if err := unix.Fchownat(unix.AT_FDCWD, p, int(uid), int(gid), unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return fmt.Errorf("jail: giving %s to %d:%d: %w", p, uid, gid, err)
		}
	}
	return nil
}

// Disown gives each of paths back to root (what Own did, undone: a volume
// detached from a VM, a file that outlives it).
func Disown(paths ...string) error { return Own(0, 0, paths...) }

// OwnTree gives dir and everything below it to uid:gid. It walks with
// directory descriptors opened without following links, so a process of
// the VM that swaps a directory for a link while the walk runs cannot lead
// it out of dir.
func OwnTree(uid, gid uint32, dir string) error {
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("jail: giving %s to %d:%d: %w", dir, uid, gid, err)
	}
	defer unix.Close(fd)
	if err := unix.Fchown(fd, int(uid), int(gid)); err != nil {
		return fmt.Errorf("jail: giving %s to %d:%d: %w", dir, uid, gid, err)
	}
	if err := ownBelow(fd, dir, int(uid), int(gid), 0); err != nil {
		return fmt.Errorf("jail: giving %s to %d:%d: %w", dir, uid, gid, err)
	}
	return nil
}

// ownBelow changes the owner of every entry of the directory open as fd
// (named name, for errors) and of what is below its subdirectories.
func ownBelow(fd int, name string, uid, gid, depth int) error {
	if depth > 64 {
		return fmt.Errorf("%s: too deep", name)
	}
	names, err := readDirNames(fd)
	if err != nil {
		return fmt.Errorf("%s: %w", name, err)
	}
	for _, n := range names {
		sub, err := unix.Openat(fd, n, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		switch {
		case err == nil:
			err = unix.Fchown(sub, uid, gid)
			if err == nil {
				err = ownBelow(sub, filepath.Join(name, n), uid, gid, depth+1)
			}
			unix.Close(sub)
			if err != nil {
				return err
			}
		case errors.Is(err, unix.ENOTDIR) || errors.Is(err, unix.ELOOP):
			// A file, a socket, a link: changed where it is.
			if err := unix.Fchownat(fd, n, uid, gid, unix.AT_SYMLINK_NOFOLLOW); err != nil && !errors.Is(err, unix.ENOENT) {
				return fmt.Errorf("%s: %w", filepath.Join(name, n), err)
			}
		case errors.Is(err, unix.ENOENT):
			// Removed meanwhile.
		default:
			return fmt.Errorf("%s: %w", filepath.Join(name, n), err)
		}
	}
	return nil
}

// readDirNames lists a directory's entries from its descriptor.
func readDirNames(fd int) ([]string, error) {
	var names []string
	buf := make([]byte, 8192)
	for {
		n, err := unix.Getdents(fd, buf)
		if err != nil {
			return nil, err
		}
		if n <= 0 {
			return names, nil
		}
		_, _, names = unix.ParseDirent(buf[:n], -1, names)
	}
}
