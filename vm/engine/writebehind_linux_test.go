package engine

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestWriteBehindStartsWriteOut writes a file the way CH writes a saved
// state (buffered, never synced) into a directory writeBehind watches:
// the kernel has its pages written out while nothing syncs it, as
// cachestat(2) shows, long before the kernel's own flusher would (it
// writes dirty pages once they are dirty_expire_centisecs old, or when
// the host holds more dirty pages than its background threshold, which
// 32 MiB stays below on any host this runs on).
func TestWriteBehindStartsWriteOut(t *testing.T) {
	dir := t.TempDir()
	var fs unix.Statfs_t
	if err := unix.Statfs(dir, &fs); err != nil {
		t.Fatal(err)
	}
	if fs.Type == unix.TMPFS_MAGIC {
		t.Skip(dir + " is on tmpfs, which writes nothing out")
	}
	b, err := os.ReadFile("/proc/sys/vm/dirty_expire_centisecs")
	if err != nil {
		t.Skip("no /proc/sys/vm/dirty_expire_centisecs: ", err)
	}
	expire, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		t.Fatal(err)
	}
	stop := writeBehind(dir)
	defer stop()
	f, err := os.Create(filepath.Join(dir, "memory-ranges"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	chunk := bytes.Repeat([]byte("guest memory"), 1<<20/12+1)[:1<<20]
	const size = 32 << 20
	written := time.Now()
	for range size / len(chunk) {
		if _, err := f.Write(chunk); err != nil {
			t.Fatal(err)
		}
	}
	// Half the flusher's age: what is written out by then was not its work.
	deadline := written.Add(time.Duration(expire) * 10 * time.Millisecond / 2)
	for {
		var st unix.Cachestat_t
		err := unix.Cachestat(uint(f.Fd()), &unix.CachestatRange{Off: 0, Len: size}, &st, 0)
		if errors.Is(err, unix.ENOSYS) {
			t.Skip("no cachestat(2) in this kernel (Linux 6.5 has it)")
		}
		if err != nil {
			t.Fatal(err)
		}
		if st.Dirty == 0 && st.Writeback == 0 {
			t.Logf("%d pages cached, all written out %v after the write", st.Cache, time.Since(written))
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%v after the write, %d of %d cached pages are still dirty and %d under write-out", time.Since(written), st.Dirty, st.Cache, st.Writeback)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
