package qcow2

import (
	"errors"
	"fmt"
	"path/filepath"
	"strings"
)

// backingFormat is the only backing format an overlay written here names:
// builds are qcow2 base images.
const backingFormat = "qcow2"

// maxBackingName is the longest backing file name qcow2 allows (qemu-img
// refuses 1024 bytes with "Could not assign backing file").
const maxBackingName = 1023

// CreateOverlay writes a new qcow2 v3 image at path whose backing file is
// build, with the given virtual size: no cluster is allocated, so every
// read falls through to build until the guest writes. The result is
// byte-identical to `qemu-img create -f qcow2 -b BUILD -F qcow2 path size`
// (size rounded up to a multiple of 512): the header names build with the
// backing-format extension "qcow2", and nothing else of build is copied.
//
// build must be an absolute, clean path (QEMU resolves a relative name
// against the overlay's directory, and a name with a colon before any slash
// as a protocol) of at most 1023 bytes, and a base image CheckBase accepts;
// size must be at least build's virtual size. Those checks read only
// build's header, so the cost does not depend on build's size.
//
// Like Create, it never replaces a file (errors.Is(err, fs.ErrExist)): the
// image is written to a temp file beside path (atomicfile's
// .<name>.tmp-<hex>, which atomicfile.IsTemp recognises for startup
// sweeps), fsynced, published with a no-replace rename, and the directory
// is fsynced; on failure nothing is left at path.
func CreateOverlay(path, build string, size uint64) error {
	if err := checkBackingName(build); err != nil {
		return fmt.Errorf("creating qcow2 overlay %s: %w", path, err)
	}
	h, err := ReadHeaderFile(build)
	if err != nil {
		return fmt.Errorf("creating qcow2 overlay %s: reading backing file: %w", path, err)
	}
	if err := h.CheckBase(); err != nil {
		return fmt.Errorf("creating qcow2 overlay %s: backing file %s: %w", path, build, err)
	}
	size, err = checkSize(size)
	if err != nil {
		return fmt.Errorf("creating qcow2 overlay %s: %w", path, err)
	}
	if size < h.Size {
		return fmt.Errorf("creating qcow2 overlay %s: virtual size %d is smaller than backing file %s's %d", path, size, build, h.Size)
	}
	return writeEmpty(path, size, build)
}

// checkBackingName refuses a backing file name QEMU would not read as the
// plain absolute path it is.
func checkBackingName(name string) error {
	switch {
	case !filepath.IsAbs(name) || filepath.Clean(name) != name:
		return fmt.Errorf("backing file %q is not a clean absolute path", name)
	case len(name) > maxBackingName:
		return fmt.Errorf("backing file name of %d bytes exceeds %d", len(name), maxBackingName)
	case strings.IndexByte(name, 0) >= 0:
		return errors.New("backing file name contains a NUL byte")
	}
	return nil
}

// CheckOverlay reports why an image may not be opened as a root disk that
// is an overlay of build, or nil when it may: its header names exactly
// build as the backing file, with the backing format "qcow2", and it
// passes every other check of CheckBase (no external data file, no
// encryption, not corrupt or dirty, no unknown incompatible features, sane
// cluster_bits, a virtual size).
//
// CheckBase and CheckOverlay split the images with a backing file in two:
// CheckBase refuses every one (a user's base image, a download, a build),
// while CheckOverlay accepts only the one chain the caller recorded, so an
// image cannot point the storage daemon at a file the agent did not choose.
func (h *Header) CheckOverlay(build string) error {
	switch {
	case h.BackingFileOffset == 0:
		return fmt.Errorf("qcow2 image has no backing file (want %q)", build)
	case h.BackingFile != build:
		return fmt.Errorf("qcow2 image's backing file is %q, want %q", h.BackingFile, build)
	case h.BackingFormat != backingFormat:
		return fmt.Errorf("qcow2 image's backing format is %q, want %q", h.BackingFormat, backingFormat)
	}
	rest := *h
	rest.BackingFileOffset, rest.BackingFileSize, rest.BackingFile = 0, 0, ""
	rest.HasBackingFormat, rest.BackingFormat = false, ""
	return rest.CheckBase()
}
