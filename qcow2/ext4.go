package qcow2

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"vmhost/internal/atomicfile"
	"vmhost/internal/sbin"
)

// CreateExt4 writes an ext4 file system of size bytes (labelled label) as
// the qcow2 image dst, replacing dst: mkfs.ext4 on a sparse raw temp file beside it,
// then ConvertRaw, then a rename.
func CreateExt4(ctx context.Context, dst string, size uint64, label string) error {
	dir := filepath.Dir(dst)
	raw, err := os.CreateTemp(dir, ".format-*.raw")
	if err != nil {
		return err
	}
	defer os.Remove(raw.Name())
	defer raw.Close()
	if err := raw.Truncate(int64(size)); err != nil {
		return fmt.Errorf("sizing raw volume: %w", err)
	}
	// lazy_itable_init keeps the image sparse; the guest kernel zeroes the
	// inode tables in the background on first mount.
	cmd := exec.CommandContext(ctx, sbin.Path("mkfs.ext4"), "-q", "-F", "-L", label,
		"-E", "lazy_itable_init=1,lazy_journal_init=1", raw.Name())
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("mkfs.ext4: %w: %s", err, strings.TrimSpace(string(out)))
	}
	tmp := filepath.Join(dir, "."+filepath.Base(dst)+".new")
	os.Remove(tmp)
	if err := ConvertRaw(tmp, raw); err != nil {
		return err
	}
	if err := os.Rename(tmp, dst); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("placing data volume: %w", err)
	}
	// The caller records the volume formatted next: the rename must be
	// durable first, or a crash could leave that record over a blank disk.
	if err := atomicfile.SyncDir(dir); err != nil {
		return fmt.Errorf("placing data volume: %w", err)
	}
	return nil
}
