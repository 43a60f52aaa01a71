package qcow2

import (
	"encoding/binary"
	"fmt"
	"os"

	"vmhost/internal/atomicfile"
)

// Layout constants of the images this package writes: qcow2 v3, 64 KiB
// clusters, 16-bit refcounts, the same choices as `qemu-img create -f qcow2`.
const (
	clusterBits     = 16
	clusterSize     = 1 << clusterBits
	l2Entries       = clusterSize / 8 // entries per L2 table
	refcountOrder   = 4
	refsPerBlock    = clusterSize * 8 / (1 << refcountOrder)
	headerLength    = 112
	maxL1Bytes      = 32 << 20 // qemu's QCOW_MAX_L1_SIZE
	l2CoveredBytes  = uint64(clusterSize) * l2Entries
	copiedFlag      = uint64(1) << 63 // QCOW_OFLAG_COPIED: refcount is exactly 1
	offsetMask      = 0x00fffffffffffe00
	featureNameSize = 48
)

// MaxSize is the largest virtual size Create and ConvertRaw accept: what an
// L1 table of qemu's 32 MiB limit covers with 64 KiB clusters (2 PiB).
const MaxSize = uint64(maxL1Bytes/8) * l2CoveredBytes

// featureNames is the feature-name table qemu-img writes, in its order.
var featureNames = []struct {
	typ, bit byte
	name     string
}{
	{0, 0, "dirty bit"},
	{0, 1, "corrupt bit"},
	{0, 2, "external data file"},
	{0, 3, "compression type"},
	{0, 4, "extended L2 entries"},
	{1, 0, "lazy refcounts"},
	{2, 0, "bitmaps"},
	{2, 1, "raw external data"},
}

// roundUp rounds n up to a multiple of m.
func roundUp(n, m uint64) uint64 { return (n + m - 1) / m * m }

// l1SizeFor is the number of L1 entries a virtual size needs.
func l1SizeFor(size uint64) uint64 { return (size + l2CoveredBytes - 1) / l2CoveredBytes }

// checkSize rounds size up to a sector, as qemu-img does, and refuses sizes
// beyond MaxSize.
func checkSize(size uint64) (uint64, error) {
	if size > MaxSize {
		return 0, fmt.Errorf("qcow2 virtual size %d exceeds the maximum %d", size, MaxSize)
	}
	return roundUp(size, 512), nil
}

// encodeHeader fills cluster 0: the v3 header, then the header extensions
// and the end marker, exactly as qemu-img 7.2 lays them out. With a backing
// file, the backing-format extension ("qcow2") comes first and the file's
// name follows the end marker, not NUL-terminated.
func encodeHeader(c []byte, size, l1Size, l1Off, rtOff, rtClusters uint64, backing string) {
	be := binary.BigEndian
	be.PutUint32(c[0:], Magic)
	be.PutUint32(c[4:], 3)
	be.PutUint32(c[20:], clusterBits)
	be.PutUint64(c[24:], size)
	be.PutUint32(c[36:], uint32(l1Size))
	be.PutUint64(c[40:], l1Off)
	be.PutUint64(c[48:], rtOff)
	be.PutUint32(c[56:], uint32(rtClusters))
	be.PutUint32(c[96:], refcountOrder)
	be.PutUint32(c[100:], headerLength)
	// Byte 104 is compression_type 0 (zlib), then padding up to 112.
	off := headerLength
	if backing != "" {
		be.PutUint32(c[off:], extBackingFormat)
		be.PutUint32(c[off+4:], uint32(len(backingFormat)))
		copy(c[off+8:], backingFormat)
		off += 8 + int(roundUp(uint64(len(backingFormat)), 8))
	}
	be.PutUint32(c[off:], extFeatureNames)
	be.PutUint32(c[off+4:], uint32(len(featureNames)*featureNameSize))
	off += 8
	for _, f := range featureNames {
		c[off] = f.typ
		c[off+1] = f.bit
		copy(c[off+2:off+featureNameSize], f.name)
		off += featureNameSize
	}
	// The end marker (type 0, length 0) is already zero.
	off += 8
	if backing != "" {
		be.PutUint64(c[8:], uint64(off))
		be.PutUint32(c[16:], uint32(len(backing)))
		copy(c[off:], backing)
	}
}

// Create writes a blank qcow2 v3 image of the given virtual size at path,
// byte-identical to `qemu-img create -f qcow2 path size` (size rounded up to
// a multiple of 512). The file must not exist yet: Create fails with an
// error satisfying errors.Is(err, fs.ErrExist) rather than clobber a disk.
// The image is fsynced, and so is its directory; on failure nothing is left.
func Create(path string, size uint64) error {
	size, err := checkSize(size)
	if err != nil {
		return fmt.Errorf("creating qcow2 image %s: %w", path, err)
	}
	return writeEmpty(path, size, "")
}

// writeEmpty writes an image with no cluster allocated: cluster 0 the
// header, 1 the refcount table, 2 the refcount block, 3.. the L1 table,
// which is all zeros and ends the file (qemu-img's layout).
func writeEmpty(path string, size uint64, backing string) error {
	l1Size := l1SizeFor(size)
	var l1Off uint64
	metaClusters := uint64(3)
	if l1Size > 0 {
		l1Off = 3 * clusterSize
		metaClusters += roundUp(l1Size*8, clusterSize) / clusterSize
	}
	buf := make([]byte, 3*clusterSize)
	encodeHeader(buf, size, l1Size, l1Off, clusterSize, 1, backing)
	binary.BigEndian.PutUint64(buf[clusterSize:], 2*clusterSize)
	for i := range metaClusters {
		binary.BigEndian.PutUint16(buf[2*clusterSize+2*i:], 1)
	}
	fileSize := uint64(3 * clusterSize)
	if l1Size > 0 {
		fileSize = l1Off + l1Size*8
	}
	return writeNew(path, func(f *os.File) error {
		if _, err := f.WriteAt(buf, 0); err != nil {
			return err
		}
		// The L1 table is all zeros: extending the file leaves it sparse.
		return f.Truncate(int64(fileSize))
	})
}

// writeNew writes a new image at path through atomicfile.Create: a temp
// file beside path is filled, fsynced and published without replacing
// anything, and the directory is fsynced; on failure nothing is left.
func writeNew(path string, fill func(*os.File) error) error {
	if err := atomicfile.Create(path, 0o600, fill); err != nil {
		return fmt.Errorf("writing qcow2 image %s: %w", path, err)
	}
	return nil
}
