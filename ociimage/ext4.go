package ociimage

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
)

// Sizing of the ext4 file system; see the package doc.
const (
	blockSize      = 4096
	headroomBytes  = 64 << 20
	inodeBytes     = 256
	minSpareInodes = 4096
)

// treeUsage is what a staging tree needs on ext4.
type treeUsage struct {
	bytes   int64 // data blocks, in bytes
	entries int64 // inodes
}

// measureTree adds up the blocks and inodes the tree at dir needs, each
// hard-linked inode once. It also holds the tree to the path limits: entry
// names are checked as layers are applied, but a path created through a
// symlinked directory can still end up deeper than its name.
func measureTree(ctx context.Context, dir string) (treeUsage, error) {
	var u treeUsage
	seen := make(map[uint64]bool)
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		if p != dir {
			if err := checkPathLimits(p[len(dir)+1:]); err != nil {
				return fmt.Errorf("unpacked tree: %w", err)
			}
		}
		fi, err := d.Info()
		if err != nil {
			return err
		}
		st, _ := fi.Sys().(*syscall.Stat_t)
		if st != nil && st.Nlink > 1 && !fi.IsDir() {
			if seen[st.Ino] {
				return nil
			}
			seen[st.Ino] = true
		}
		u.entries++
		switch {
		case fi.IsDir():
			u.bytes += blockSize
		case fi.Mode().IsRegular(), fi.Mode()&fs.ModeSymlink != 0:
			u.bytes += (fi.Size() + blockSize - 1) / blockSize * blockSize
		}
		return nil
	})
	if errors.Is(err, ErrLimit) || errors.Is(err, context.Canceled) {
		return u, err
	}
	if err != nil {
		return u, fmt.Errorf("measuring staging rootfs: %w", err)
	}
	return u, nil
}

// ext4Geometry returns the file system size in bytes and its inode count
// for a tree of usage u.
func ext4Geometry(u treeUsage) (size, inodes int64) {
	inodes = u.entries + max(u.entries/4, minSpareInodes)
	need := u.bytes + inodes*inodeBytes
	size = need + need/5 + headroomBytes
	size = (size + 1<<20 - 1) &^ (1<<20 - 1)
	return size, inodes
}

// makeExt4 writes an ext4 image of rootfs at img and returns its size.
func makeExt4(ctx context.Context, mkfs, rootfs, img string) (int64, error) {
	u, err := measureTree(ctx, rootfs)
	if err != nil {
		return 0, err
	}
	size, inodes := ext4Geometry(u)
	f, err := os.Create(img)
	if err != nil {
		return 0, fmt.Errorf("creating ext4 image: %w", err)
	}
	err = f.Truncate(size)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return 0, fmt.Errorf("creating ext4 image: %w", err)
	}
	// The size is given by the file; -N keeps many small files from
	// running out of inodes; root_owner because mkfs would otherwise use
	// the caller's ids for the root directory.
	cmd := exec.CommandContext(ctx, mkfs, "-q", "-F", "-t", "ext4",
		"-b", strconv.Itoa(blockSize), "-N", strconv.FormatInt(inodes, 10),
		"-E", "root_owner=0:0", "-d", rootfs, img)
	var stderr bytes.Buffer
	cmd.Stdout = &stderr
	cmd.Stderr = &stderr
	if err := cmd.Run(); err != nil {
		if ctx.Err() != nil {
			return 0, ctx.Err()
		}
		if errors.Is(err, exec.ErrNotFound) {
			return 0, fmt.Errorf("building ext4 file system: %w (install e2fsprogs)", err)
		}
		return 0, fmt.Errorf("building ext4 file system of %d bytes: %w: %s", size, err, strings.TrimSpace(lastLines(stderr.String(), 5)))
	}
	return size, nil
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
