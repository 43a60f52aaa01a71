// Package qcow2 reads and writes the parts of the qcow2 image format that
// vmhost needs: the header (to validate base images and overlays and learn
// their virtual size) and, elsewhere in this package, blank images, raw
// conversions and overlays on a backing file.
//
// All header fields are big-endian; offsets follow QEMU's
// docs/interop/qcow2.txt (see docs/ref/qcow2-overlays.md for what qemu-img
// 7.2 writes). The package imports none of vmhost's own packages.
package qcow2

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
)

// Magic is the first four bytes of every qcow2 image ("QFI\xfb").
const Magic uint32 = 0x514649fb

// Header extension types.
const (
	extEnd           uint32 = 0x00000000
	extBackingFormat uint32 = 0xe2792aca
	extFeatureNames  uint32 = 0x6803f857
	extBitmaps       uint32 = 0x23852875
	extEncryption    uint32 = 0x0537be77
	extDataFile      uint32 = 0x44415441
)

// Incompatible feature bits (v3).
const (
	IncompatDirty        = 1 << 0
	IncompatCorrupt      = 1 << 1
	IncompatExternalData = 1 << 2
	IncompatCompression  = 1 << 3
	IncompatExtendedL2   = 1 << 4
)

// ErrNotQcow2 reports that a file does not start with the qcow2 magic or is
// too short to hold a header.
var ErrNotQcow2 = errors.New("not a qcow2 image")

// Header is the decoded qcow2 header plus what its extensions say.
type Header struct {
	Version               uint32
	BackingFileOffset     uint64
	BackingFileSize       uint32
	BackingFile           string // empty when there is none
	ClusterBits           uint32
	Size                  uint64 // virtual size in bytes
	CryptMethod           uint32
	L1Size                uint32
	L1TableOffset         uint64
	RefcountTableOffset   uint64
	RefcountTableClusters uint32
	NbSnapshots           uint32
	SnapshotsOffset       uint64
	IncompatibleFeatures  uint64
	CompatibleFeatures    uint64
	AutoclearFeatures     uint64
	RefcountOrder         uint32
	HeaderLength          uint32

	// Extensions found after the header, by type.
	HasBackingFormat bool
	BackingFormat    string // the backing-format extension's text, e.g. "qcow2"
	HasDataFile      bool
	HasEncryption    bool
}

// ClusterSize is 1<<ClusterBits.
func (h *Header) ClusterSize() uint64 { return 1 << h.ClusterBits }

// ReadHeader decodes the header at the start of r. It fails with an error
// wrapping ErrNotQcow2 when the magic is wrong or the file is too short.
func ReadHeader(r io.ReaderAt) (*Header, error) {
	var b [104]byte
	n, err := r.ReadAt(b[:], 0)
	if n < 72 {
		if err == nil || errors.Is(err, io.EOF) {
			return nil, fmt.Errorf("%w: %d-byte file is shorter than a header", ErrNotQcow2, n)
		}
		return nil, fmt.Errorf("reading qcow2 header: %w", err)
	}
	be := binary.BigEndian
	if be.Uint32(b[0:4]) != Magic {
		return nil, fmt.Errorf("%w: bad magic %#08x", ErrNotQcow2, be.Uint32(b[0:4]))
	}
	h := &Header{
		Version:               be.Uint32(b[4:8]),
		BackingFileOffset:     be.Uint64(b[8:16]),
		BackingFileSize:       be.Uint32(b[16:20]),
		ClusterBits:           be.Uint32(b[20:24]),
		Size:                  be.Uint64(b[24:32]),
		CryptMethod:           be.Uint32(b[32:36]),
		L1Size:                be.Uint32(b[36:40]),
		L1TableOffset:         be.Uint64(b[40:48]),
		RefcountTableOffset:   be.Uint64(b[48:56]),
		RefcountTableClusters: be.Uint32(b[56:60]),
		NbSnapshots:           be.Uint32(b[60:64]),
		SnapshotsOffset:       be.Uint64(b[64:72]),
		RefcountOrder:         4,
		HeaderLength:          72,
	}
	switch h.Version {
	case 2:
	case 3:
		if n < 104 {
			return nil, fmt.Errorf("%w: v3 header truncated at %d bytes", ErrNotQcow2, n)
		}
		h.IncompatibleFeatures = be.Uint64(b[72:80])
		h.CompatibleFeatures = be.Uint64(b[80:88])
		h.AutoclearFeatures = be.Uint64(b[88:96])
		h.RefcountOrder = be.Uint32(b[96:100])
		h.HeaderLength = be.Uint32(b[100:104])
		if h.HeaderLength < 104 || h.HeaderLength%8 != 0 {
			return nil, fmt.Errorf("qcow2 header length %d is not a multiple of 8 of at least 104", h.HeaderLength)
		}
	default:
		return nil, fmt.Errorf("unsupported qcow2 version %d", h.Version)
	}
	if h.BackingFileOffset != 0 {
		if h.BackingFileSize > 1023 {
			return nil, fmt.Errorf("qcow2 backing file name of %d bytes exceeds 1023", h.BackingFileSize)
		}
		name := make([]byte, h.BackingFileSize)
		if _, err := r.ReadAt(name, int64(h.BackingFileOffset)); err != nil {
			return nil, fmt.Errorf("reading qcow2 backing file name: %w", err)
		}
		h.BackingFile = string(name)
	}
	if err := h.readExtensions(r); err != nil {
		return nil, err
	}
	return h, nil
}

// readExtensions walks the header extensions that follow the header, up to
// the end marker or the end of cluster 0.
func (h *Header) readExtensions(r io.ReaderAt) error {
	if h.ClusterBits < 9 || h.ClusterBits > 21 {
		return nil // Validate reports this; there is no sane bound to walk.
	}
	off := uint64(h.HeaderLength)
	end := h.ClusterSize()
	if h.BackingFileOffset != 0 && h.BackingFileOffset < end {
		end = h.BackingFileOffset
	}
	var hdr [8]byte
	for off+8 <= end {
		if _, err := r.ReadAt(hdr[:], int64(off)); err != nil {
			if errors.Is(err, io.EOF) {
				return nil // a v2 image may end right after its header
			}
			return fmt.Errorf("reading qcow2 header extension at %#x: %w", off, err)
		}
		typ := binary.BigEndian.Uint32(hdr[0:4])
		length := uint64(binary.BigEndian.Uint32(hdr[4:8]))
		switch typ {
		case extEnd:
			return nil
		case extBackingFormat:
			h.HasBackingFormat = true
			if length <= maxBackingName {
				name := make([]byte, length)
				if _, err := r.ReadAt(name, int64(off+8)); err != nil {
					return fmt.Errorf("reading qcow2 backing format at %#x: %w", off+8, err)
				}
				h.BackingFormat = string(name)
			}
		case extDataFile:
			h.HasDataFile = true
		case extEncryption:
			h.HasEncryption = true
		}
		off += 8 + (length+7)/8*8
	}
	return nil
}

// ReadHeaderFile opens path and decodes its qcow2 header.
func ReadHeaderFile(path string) (*Header, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return ReadHeader(f)
}

// CheckBase reports why an image may not serve as a base image to copy from,
// or nil when it may: version 2 or 3, no backing file (nor backing-format or
// external data file extension), no encryption, not corrupt, no unknown
// incompatible features, and cluster_bits within 9..21. A dirty image is
// refused too, since vmhost does not run qemu-img check at run time.
func (h *Header) CheckBase() error {
	switch {
	case h.BackingFileOffset != 0:
		if h.BackingFile != "" {
			return fmt.Errorf("qcow2 image has a backing file %q", h.BackingFile)
		}
		return errors.New("qcow2 image has a backing file")
	case h.HasBackingFormat:
		return errors.New("qcow2 image has a backing-format extension")
	case h.HasDataFile || h.IncompatibleFeatures&IncompatExternalData != 0:
		return errors.New("qcow2 image uses an external data file")
	case h.CryptMethod != 0 || h.HasEncryption:
		return fmt.Errorf("qcow2 image is encrypted (method %d)", h.CryptMethod)
	case h.IncompatibleFeatures&IncompatCorrupt != 0:
		return errors.New("qcow2 image is marked corrupt")
	case h.IncompatibleFeatures&IncompatDirty != 0:
		return errors.New("qcow2 image is marked dirty (run qemu-img check -r all)")
	case h.IncompatibleFeatures>>5 != 0:
		return fmt.Errorf("qcow2 image has unknown incompatible features %#x", h.IncompatibleFeatures)
	case h.ClusterBits < 9 || h.ClusterBits > 21:
		return fmt.Errorf("qcow2 cluster_bits %d outside 9..21", h.ClusterBits)
	case h.Size == 0:
		return errors.New("qcow2 image has a virtual size of 0")
	}
	return nil
}
