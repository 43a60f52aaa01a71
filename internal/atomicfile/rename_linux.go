package atomicfile

import (
	"errors"
	"io/fs"
	"os"

	"golang.org/x/sys/unix"
)

// renameNoReplace moves tmp to name inside dir without replacing a file
// that appeared at name meanwhile (fs.ErrExist then). File systems without
// RENAME_NOREPLACE get the same guarantee from a hard link.
func renameNoReplace(root *os.Root, dir *os.File, tmp, name string) error {
	fd := int(dir.Fd())
	err := unix.Renameat2(fd, tmp, fd, name, unix.RENAME_NOREPLACE)
	if errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOSYS) {
		return linkNoReplace(root, tmp, name)
	}
	if errors.Is(err, unix.EEXIST) {
		return fs.ErrExist
	}
	return err
}
