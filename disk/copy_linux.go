package disk

import (
	"errors"
	"fmt"
	"io"
	"os"

	"golang.org/x/sys/unix"
)

// reflink shares src's extents with dst (FICLONE). It reports false, with
// no error, where the file system or the pair of files cannot.
func reflink(dst, src *os.File) (bool, error) {
	err := unix.IoctlFileClone(int(dst.Fd()), int(src.Fd()))
	if err == nil {
		return true, nil
	}
	// ext4 and tmpfs answer EOPNOTSUPP; other file systems and
	// cross-device pairs answer EXDEV, EINVAL or ENOTTY.
	if errors.Is(err, unix.EOPNOTSUPP) || errors.Is(err, unix.EXDEV) || errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOTTY) {
		return false, nil
	}
	return false, fmt.Errorf("FICLONE: %w", err)
}

// kernelCopy copies up to n bytes at off from src to dst at the same
// offset with copy_file_range. It returns 0, with no error, where the
// kernel cannot copy between the two files, so the caller reads and writes.
func kernelCopy(src, dst *os.File, off, n int64) (int64, error) {
	roff, woff := off, off
	done, err := unix.CopyFileRange(int(src.Fd()), &roff, int(dst.Fd()), &woff, int(n), 0)
	if err == nil && done > 0 {
		return int64(done), nil
	}
	if err != nil && !errors.Is(err, unix.EXDEV) && !errors.Is(err, unix.ENOSYS) && !errors.Is(err, unix.EOPNOTSUPP) && !errors.Is(err, unix.EINVAL) {
		return 0, fmt.Errorf("copy_file_range at %d: %w", off, err)
	}
	if err == nil && done == 0 {
		return 0, fmt.Errorf("copy_file_range at %d: %w", off, io.ErrUnexpectedEOF)
	}
	return 0, nil
}
