package volume_test

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"

	"vmhost/volume"
)

// TestCreateOnFullDisk: on a file system with no room (a 512 KiB tmpfs),
// both formats fail and leave no file behind.
func TestCreateOnFullDisk(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("mounting a small tmpfs needs root")
	}
	if _, err := exec.LookPath("mkfs.ext4"); err != nil {
		t.Skip("mkfs.ext4 not installed")
	}
	dir := t.TempDir()
	if err := syscall.Mount("tmpfs", dir, "tmpfs", 0, "size=512k"); err != nil {
		t.Skipf("mounting tmpfs: %v", err)
	}
	t.Cleanup(func() { syscall.Unmount(dir, syscall.MNT_DETACH) })
	s := open(t, dir)
	// A blank image is small: fill the disk first so that it too fails.
	ext4 := s.Create(context.Background(), volume.Volume{ID: "big", Format: volume.FormatExt4, SizeGiB: 64})
	if ext4 == nil || !strings.Contains(ext4.Error(), "No space left on device") {
		t.Fatalf("ext4 create on a full disk = %v, want mkfs.ext4's ENOSPC", ext4)
	}
	if got := names(t, dir); len(got) != 0 {
		t.Fatalf("files left after a failed ext4 create: %v", got)
	}
	filler, err := os.Create(filepath.Join(dir, "filler"))
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 64<<10)
	for {
		if _, err := filler.Write(buf); err != nil {
			break
		}
	}
	filler.Close()
	if err := s.Create(context.Background(), volume.Volume{ID: "blank", Format: volume.FormatRaw, SizeGiB: 1}); !errors.Is(err, syscall.ENOSPC) {
		t.Fatalf("raw create on a full disk = %v, want ENOSPC", err)
	}
	if got := names(t, dir); !slices.Equal(got, []string{"filler"}) {
		t.Fatalf("files left after a failed raw create: %v", got)
	}
}
