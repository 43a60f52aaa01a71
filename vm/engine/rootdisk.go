package engine

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"

	"vmhost/disk"
	"vmhost/qcow2"
	"vmhost/vm/record"
)

// Root disks: a VM's own copy of its base image, or (an AppVM's, with
// appvm_root_disk "overlay") a qcow2 overlay whose backing file is its
// image's build (record.Record.RootBacking). An overlay is made in
// constant time whatever the build's size, and the storage daemon opens
// the chain: the build read-only, the overlay above it (qmp.RootDisk).

// rootDiskSize is the virtual size of rec's root disk: disk.size_gib, but
// never below the base image's virtual size (or base, when given: a
// redeploy's new build), rounded up to whole sectors.
func rootDiskSize(rec *record.Record, base uint64) uint64 {
	if rec.Base != nil && base == 0 {
		base = rec.Base.VirtualSizeBytes
	}
	var size uint64
	if d := rec.Spec.Disk; d != nil && d.SizeGiB != nil {
		size = uint64(*d.SizeGiB) << 30
	}
	return max(size, (base+511)/512*512)
}

// makeRootDisk makes rec's root disk at path from base: an overlay of it
// at the disk's full virtual size when rec's root disk is an overlay, else
// a copy (which the storage daemon grows at launch). Neither replaces a
// file at path.
func (e *Engine) makeRootDisk(ctx context.Context, rec *record.Record, base, path string) error {
	if rec.RootBacking() == "" {
		if err := disk.Copy(ctx, base, path); err != nil {
			return &record.HostError{Kind: record.HostStorage, Op: "copying base image " + base, Err: err}
		}
		return nil
	}
	h, err := qcow2.ReadHeaderFile(base)
	if err == nil {
		err = qcow2.CreateOverlay(path, base, rootDiskSize(rec, h.Size))
	}
	if err != nil {
		return &record.HostError{Kind: record.HostStorage, Op: "creating the root disk of VM " + rec.ID + " as an overlay of " + base, Err: err}
	}
	return nil
}

// errBuildGone is a root disk overlay whose backing file is gone.
var errBuildGone = errors.New("the build this root disk is an overlay of is gone")

// checkBacking refuses to serve an overlay root disk whose backing file is
// missing, or whose header names another backing file than the record
// (qcow2.Header.CheckOverlay), with an error that says which; a copy
// passes.
func (e *Engine) checkBacking(rec *record.Record) error {
	build := rec.RootBacking()
	if build == "" {
		return nil
	}
	op := "checking the root disk of VM " + rec.ID
	if _, err := os.Stat(build); errors.Is(err, fs.ErrNotExist) {
		return &record.HostError{Kind: record.HostStorage, Op: op, Err: fmt.Errorf("%w: %s", errBuildGone, build)}
	}
	root := e.layout().RootDisk(rec.ID)
	h, err := qcow2.ReadHeaderFile(root)
	if err == nil {
		err = h.CheckOverlay(build)
	}
	if err != nil {
		return &record.HostError{Kind: record.HostStorage, Op: op, Err: fmt.Errorf("%s: %w", root, err)}
	}
	return nil
}

// rootDiskGone is the file whose absence leaves rec without a root disk:
// its root disk, or the build an overlay reads through to; "" when both
// are there.
func (e *Engine) rootDiskGone(rec *record.Record) string {
	for _, p := range []string{e.layout().RootDisk(rec.ID), rec.RootBacking()} {
		if p == "" {
			continue
		}
		if _, err := os.Stat(p); errors.Is(err, fs.ErrNotExist) {
			return p
		}
	}
	return ""
}

// copySnapshotDisk makes the root disk of a VM created from a snapshot: a
// copy of the snapshot's root disk src as it is (disk.CopyImage), an
// overlay's header included, so an overlay's copy is an overlay of the
// same build (its record says so: the build is its Base, and its disk's
// mode "overlay"; checkBacking holds the two to each other).
func copySnapshotDisk(ctx context.Context, src, path string) error {
	if err := disk.CopyImage(ctx, src, path); err != nil {
		return &record.HostError{Kind: record.HostStorage, Op: "copying snapshot disk " + src, Err: err}
	}
	return nil
}
