// Package disk makes VM root disks, seals AppVM builds and keeps the
// verified image cache.
//
// Copy turns a base image into a VM's own root.qcow2: a reflink (FICLONE)
// where the file system can share extents, else a sparse-aware copy that
// walks SEEK_DATA/SEEK_HOLE and moves only the data ranges with
// copy_file_range, so holes stay holes (a plain io.Copy, and
// copy_file_range over a whole file on ext4, fill them in). Base images with
// a backing file, and other images qcow2.Header.CheckBase refuses, are not
// copied.
//
// SealBuild makes an imported build read-only (0444) and immutable
// (FS_IMMUTABLE_FL, where the file system and CAP_LINUX_IMMUTABLE allow),
// since overlays read it for as long as they live; UnsealBuild undoes it
// before the build is deleted.
//
// Cache holds downloaded images as <dir>/sha256-<hex>.qcow2, one download
// per digest however many creates ask for it at once. A body is hashed
// while it streams to a temp file in the same directory, then verified,
// checked to be a qcow2 base image, fsynced and renamed into place; any
// failure leaves nothing behind. Knobs: CacheOptions.MaxBytes (size cap),
// MaxRedirects, IdleTimeout (a download that receives nothing that long
// fails), Deny (networks no connection may reach, redirects included), and
// the http.Client.
package disk

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"

	"golang.org/x/sys/unix"

	"vmhost/internal/atomicfile"
	"vmhost/qcow2"
)

// copyChunk bounds one copy_file_range call, so ctx is checked between
// chunks of a large data range.
const copyChunk = 64 << 20

// Copy copies the qcow2 base image src to dst, which must not exist (the
// error then satisfies errors.Is(err, fs.ErrExist)). The copy is written
// to a temp file beside dst, fsynced, renamed into place without
// replacing anything, and the directory fsynced; on failure or when ctx
// ends nothing is left at dst. It refuses a src that is not a usable base
// image (backing file, encryption, dirty or corrupt flags).
func Copy(ctx context.Context, src, dst string) error {
	h, err := qcow2.ReadHeaderFile(src)
	if err != nil {
		return fmt.Errorf("copying base image %s: %w", src, err)
	}
	if err := h.CheckBase(); err != nil {
		return fmt.Errorf("copying base image %s: %w", src, err)
	}
	in, err := os.Open(src)
	if err != nil {
		return fmt.Errorf("copying base image: %w", err)
	}
	defer in.Close()
	err = atomicfile.Create(dst, 0o600, func(out *os.File) error {
		return cloneOrCopy(ctx, in, out)
	})
	if err != nil {
		return fmt.Errorf("copying base image %s to %s: %w", src, dst, err)
	}
	return nil
}

// CopyImage copies the qcow2 image of a VM's disk, src, to dst as Copy
// does (dst must not exist; temp file, fsync, no-replace rename, directory
// fsync; nothing left at dst on failure), for snapshots and restores. Its
// header is kept as it is: an overlay stays an overlay of the same backing
// file. It refuses what is not a qcow2 image, or is marked corrupt or
// encrypted. The caller keeps the image from changing meanwhile.
func CopyImage(ctx context.Context, src, dst string) error {
	h, err := qcow2.ReadHeaderFile(src)
	if err != nil {
		return fmt.Errorf("copying disk image %s: %w", src, err)
	}
	switch {
	case h.IncompatibleFeatures&qcow2.IncompatCorrupt != 0:
		return fmt.Errorf("copying disk image %s: qcow2 image is marked corrupt", src)
	case h.CryptMethod != 0 || h.HasEncryption:
		return fmt.Errorf("copying disk image %s: qcow2 image is encrypted", src)
	case h.HasDataFile || h.IncompatibleFeatures&qcow2.IncompatExternalData != 0:
		return fmt.Errorf("copying disk image %s: qcow2 image uses an external data file", src)
	}
	in, err := os.Open(src)
	if err != nil {
		return fmt.Errorf("copying disk image: %w", err)
	}
	defer in.Close()
	if err := atomicfile.Create(dst, 0o600, func(out *os.File) error { return cloneOrCopy(ctx, in, out) }); err != nil {
		return fmt.Errorf("copying disk image %s to %s: %w", src, dst, err)
	}
	return nil
}

// cloneOrCopy shares src's extents with dst where the file system can
// (btrfs, xfs with reflink), and otherwise copies the data ranges.
func cloneOrCopy(ctx context.Context, src, dst *os.File) error {
	cloned, err := reflink(dst, src)
	if err != nil || cloned {
		return err
	}
	return sparseCopy(ctx, src, dst)
}

// sparseCopy copies the data ranges of src into dst at the same offsets
// and sizes dst like src, leaving holes where src has them.
func sparseCopy(ctx context.Context, src, dst *os.File) error {
	st, err := src.Stat()
	if err != nil {
		return err
	}
	size := st.Size()
	if err := dst.Truncate(size); err != nil {
		return err
	}
	return dataRanges(src, size, func(start, end int64) error {
		for off := start; off < end; {
			if err := ctx.Err(); err != nil {
				return err
			}
			n, err := copyRange(src, dst, off, min(end-off, copyChunk))
			if err != nil {
				return err
			}
			off += n
		}
		return nil
	})
}

// dataRanges calls fn for each data range of f in increasing order, found
// with SEEK_DATA/SEEK_HOLE; where those are unsupported the whole file is
// one range.
func dataRanges(f *os.File, size int64, fn func(start, end int64) error) error {
	for off := int64(0); off < size; {
		start, err := f.Seek(off, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) {
			return nil // the rest is a hole
		}
		if errors.Is(err, unix.EINVAL) && off == 0 {
			return fn(0, size)
		}
		if err != nil {
			return fmt.Errorf("SEEK_DATA at %d: %w", off, err)
		}
		end, err := f.Seek(start, unix.SEEK_HOLE)
		if err != nil {
			return fmt.Errorf("SEEK_HOLE at %d: %w", start, err)
		}
		end = min(end, size)
		if end > start {
			if err := fn(start, end); err != nil {
				return err
			}
		}
		off = end
	}
	return nil
}

// copyRange copies up to n bytes at off from src to dst at the same
// offset, with copy_file_range where the kernel allows it between the two
// files and read/write otherwise. It returns how many bytes it copied.
func copyRange(src, dst *os.File, off, n int64) (int64, error) {
	if done, err := kernelCopy(src, dst, off, n); err != nil || done > 0 {
		return done, err
	}
	buf := make([]byte, min(n, 1<<20))
	r, rerr := src.ReadAt(buf, off)
	if r == 0 {
		if rerr == nil || errors.Is(rerr, io.EOF) {
			rerr = io.ErrUnexpectedEOF
		}
		return 0, fmt.Errorf("reading at %d: %w", off, rerr)
	}
	if _, err := dst.WriteAt(buf[:r], off); err != nil {
		return 0, err
	}
	return int64(r), nil
}
