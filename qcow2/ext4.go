package qcow2

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"vmhost/internal/sbin"
)

// CreateExt4 writes an ext4 file system of size bytes (labelled label) as
// the qcow2 image dst, replacing dst: mkfs.ext4 on a sparse raw temp file
// beside it, then ConvertRaw into dst (through its own temp file). Both
// temp files carry names atomicfile.IsTemp knows ("."+<dst's name>+
// ".tmp-..."), so what a crash leaves is swept at the agent's next start.
func CreateExt4(ctx context.Context, dst string, size uint64, label string) error {
	dir := filepath.Dir(dst)
	raw, err := os.CreateTemp(dir, "."+filepath.Base(dst)+".tmp-raw-*")
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
	if err := os.Remove(dst); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("placing data volume: %w", err)
	}
	// ConvertRaw publishes dst complete, durably (the caller records the
	// volume formatted next: a crash must not leave that record over a
	// blank disk), or not at all.
	if err := ConvertRaw(dst, raw); err != nil {
		return fmt.Errorf("placing data volume: %w", err)
	}
	return nil
}
