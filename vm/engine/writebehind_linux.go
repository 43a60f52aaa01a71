package engine

import (
	"os"

	"golang.org/x/sys/unix"
)

// startWriteOut has the kernel start writing f's dirty pages out, without
// waiting for them (sync_file_range(2) SYNC_FILE_RANGE_WRITE: pages
// already under write-out are left alone; it makes nothing durable). A
// failure is not reported: the sync after it finds what is left.
func startWriteOut(f *os.File) {
	unix.SyncFileRange(int(f.Fd()), 0, 0, unix.SYNC_FILE_RANGE_WRITE)
}
