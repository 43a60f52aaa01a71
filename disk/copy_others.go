//go:build !linux

package disk

import "os"

// reflink reports false: FICLONE is Linux-only, so Copy copies the data
// ranges instead.
func reflink(dst, src *os.File) (bool, error) { return false, nil }

// kernelCopy returns 0: copy_file_range is Linux-only, so copyRange reads
// and writes instead.
func kernelCopy(src, dst *os.File, off, n int64) (int64, error) { return 0, nil }
