package qcow2

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"

	"golang.org/x/sys/unix"
)

// convertChunk is how much of the source ConvertRaw reads at a time.
const convertChunk = 32 * clusterSize

// ConvertRaw writes a qcow2 v3 image (64 KiB clusters, 16-bit refcounts, no
// backing file) at dstPath holding the raw disk image src, like
// `qemu-img convert -f raw -O qcow2`. Only clusters that hold data are
// allocated: src is walked with SEEK_DATA/SEEK_HOLE, and clusters that read
// as all zeros are left unallocated, so they read back as zeros. The virtual
// size is src's size rounded up to 512 bytes.
//
// dstPath must not exist (errors.Is(err, fs.ErrExist) otherwise); on failure
// it is removed. The result is fsynced, and so is its directory. src is read
// with ReadAt and Seek; its offset is left unspecified.
func ConvertRaw(dstPath string, src *os.File) error {
	st, err := src.Stat()
	if err != nil {
		return fmt.Errorf("converting raw image to %s: %w", dstPath, err)
	}
	size, err := checkSize(uint64(st.Size()))
	if err != nil {
		return fmt.Errorf("converting raw image to %s: %w", dstPath, err)
	}
	ranges, err := dataClusterRanges(src, st.Size())
	if err != nil {
		return fmt.Errorf("converting raw image to %s: finding data in %s: %w", dstPath, src.Name(), err)
	}
	lay := planLayout(size, ranges)
	return writeNew(dstPath, func(dst *os.File) error {
		return lay.write(dst, src, ranges)
	})
}

// clusterRange is a half-open range of guest cluster indices.
type clusterRange struct{ first, end uint64 }

// dataClusterRanges lists the guest clusters that overlap data extents of
// src, in increasing order. Where the file system cannot report holes,
// the whole file counts as data.
func dataClusterRanges(src *os.File, size int64) ([]clusterRange, error) {
	var out []clusterRange
	add := func(start, end int64) {
		r := clusterRange{uint64(start) / clusterSize, roundUp(uint64(end), clusterSize) / clusterSize}
		if n := len(out); n > 0 && out[n-1].end >= r.first {
			out[n-1].end = max(out[n-1].end, r.end)
			return
		}
		out = append(out, r)
	}
	for off := int64(0); off < size; {
		start, err := src.Seek(off, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) {
			break // only a hole is left
		}
		if errors.Is(err, unix.EINVAL) && off == 0 {
			add(0, size) // no SEEK_DATA support
			break
		}
		if err != nil {
			return nil, err
		}
		end, err := src.Seek(start, unix.SEEK_HOLE)
		if err != nil {
			return nil, err
		}
		end = min(end, size)
		if end > start {
			add(start, end)
		}
		off = end
	}
	return out, nil
}

// layout places the metadata of a converted image: cluster 0 header, then
// the refcount table, the refcount blocks, the L1 table, one reserved L2
// table per 512 MiB stretch that has data, and the data clusters. Sizes are
// upper bounds computed before reading: clusters that turn out to be zero
// are never written, and their reserved space stays a hole of refcount 0.
type layout struct {
	size              uint64 // virtual size
	l1Size            uint64 // L1 entries
	rtOff, rtClusters uint64 // refcount table
	rbOff, refBlocks  uint64 // refcount blocks
	l1Off, l1Clusters uint64
	l2Off, l2Clusters uint64            // reserved L2 area
	l2Slot            map[uint64]uint64 // L2 index → slot in the L2 area
	l2Used            []bool            // by slot: the table was written
	dataOff           uint64            // first data cluster
	dataClusters      uint64            // upper bound of data clusters
	dataEnd           uint64            // host offset after the last data cluster written
	l1                []byte            // the L1 table, filled as L2 tables are written
}

func planLayout(size uint64, ranges []clusterRange) *layout {
	lay := &layout{size: size, l1Size: l1SizeFor(size), l2Slot: map[uint64]uint64{}}
	for _, r := range ranges {
		lay.dataClusters += r.end - r.first
		for i := r.first / l2Entries; i <= (r.end-1)/l2Entries; i++ {
			if _, ok := lay.l2Slot[i]; !ok {
				lay.l2Slot[i] = uint64(len(lay.l2Slot))
			}
		}
	}
	lay.l2Clusters = uint64(len(lay.l2Slot))
	lay.l2Used = make([]bool, lay.l2Clusters)
	lay.l1Clusters = roundUp(lay.l1Size*8, clusterSize) / clusterSize
	// The refcount blocks count themselves and the table that points at
	// them: iterate to the fixed point.
	lay.rtClusters, lay.refBlocks = 1, 1
	for {
		total := 1 + lay.rtClusters + lay.refBlocks + lay.l1Clusters + lay.l2Clusters + lay.dataClusters
		rb := (total + refsPerBlock - 1) / refsPerBlock
		rt := roundUp(rb*8, clusterSize) / clusterSize
		if rb == lay.refBlocks && rt == lay.rtClusters {
			break
		}
		lay.refBlocks, lay.rtClusters = rb, rt
	}
	lay.rtOff = clusterSize
	lay.rbOff = lay.rtOff + lay.rtClusters*clusterSize
	lay.l1Off = lay.rbOff + lay.refBlocks*clusterSize
	lay.l2Off = lay.l1Off + lay.l1Clusters*clusterSize
	lay.dataOff = lay.l2Off + lay.l2Clusters*clusterSize
	lay.dataEnd = lay.dataOff
	lay.l1 = make([]byte, lay.l1Size*8)
	return lay
}

// write copies the non-zero clusters of src into dst and then writes the
// tables, the header last.
func (lay *layout) write(dst, src *os.File, ranges []clusterRange) error {
	be := binary.BigEndian
	buf := make([]byte, convertChunk)
	zero := make([]byte, clusterSize)
	l2 := make([]byte, clusterSize)
	curL2 := ^uint64(0) // L2 index whose table is in l2
	dirty := false
	flushL2 := func() error {
		if !dirty {
			return nil
		}
		slot := lay.l2Slot[curL2]
		off := lay.l2Off + slot*clusterSize
		if _, err := dst.WriteAt(l2, int64(off)); err != nil {
			return err
		}
		lay.l2Used[slot] = true
		be.PutUint64(lay.l1[curL2*8:], off|copiedFlag)
		clear(l2)
		dirty = false
		return nil
	}
	for _, r := range ranges {
		for c := r.first; c < r.end; {
			n := min(r.end-c, convertChunk/clusterSize)
			chunk := buf[:n*clusterSize]
			got, err := src.ReadAt(chunk, int64(c*clusterSize))
			if err != nil && !errors.Is(err, io.EOF) {
				return fmt.Errorf("reading %s: %w", src.Name(), err)
			}
			clear(chunk[got:]) // the tail of the last cluster reads as zeros
			runStart, runLen := uint64(0), uint64(0)
			writeRun := func() error {
				if runLen == 0 {
					return nil
				}
				p := chunk[runStart*clusterSize : (runStart+runLen)*clusterSize]
				if _, err := dst.WriteAt(p, int64(lay.dataEnd)); err != nil {
					return err
				}
				lay.dataEnd += runLen * clusterSize
				runLen = 0
				return nil
			}
			for i := range n {
				guest := c + i
				if bytes.Equal(chunk[i*clusterSize:(i+1)*clusterSize], zero) {
					if err := writeRun(); err != nil {
						return err
					}
					continue
				}
				if idx := guest / l2Entries; idx != curL2 {
					if err := flushL2(); err != nil {
						return err
					}
					curL2 = idx
				}
				if runLen == 0 {
					runStart = i
				}
				host := lay.dataEnd + runLen*clusterSize
				be.PutUint64(l2[(guest%l2Entries)*8:], host|copiedFlag)
				dirty = true
				runLen++
			}
			if err := writeRun(); err != nil {
				return err
			}
			c += n
		}
	}
	if err := flushL2(); err != nil {
		return err
	}
	if len(lay.l1) > 0 {
		if _, err := dst.WriteAt(lay.l1, int64(lay.l1Off)); err != nil {
			return err
		}
	}
	if err := lay.writeRefcounts(dst); err != nil {
		return err
	}
	hdr := make([]byte, clusterSize)
	l1Off := lay.l1Off
	if lay.l1Size == 0 {
		l1Off = 0
	}
	encodeHeader(hdr, lay.size, lay.l1Size, l1Off, lay.rtOff, lay.rtClusters, "")
	if _, err := dst.WriteAt(hdr, 0); err != nil {
		return err
	}
	return dst.Truncate(int64(lay.dataEnd))
}

// used reports whether host cluster i holds metadata or data.
func (lay *layout) used(i uint64) bool {
	switch {
	case i < lay.l2Off/clusterSize:
		return true
	case i < lay.dataOff/clusterSize:
		return lay.l2Used[i-lay.l2Off/clusterSize]
	default:
		return i < lay.dataEnd/clusterSize
	}
}

// writeRefcounts writes every refcount block (refcount 1 for each used
// cluster) and the refcount table pointing at them.
func (lay *layout) writeRefcounts(dst *os.File) error {
	be := binary.BigEndian
	total := lay.dataEnd / clusterSize
	rt := make([]byte, lay.rtClusters*clusterSize)
	rb := make([]byte, clusterSize)
	for b := range lay.refBlocks {
		clear(rb)
		for j := range uint64(refsPerBlock) {
			i := b*refsPerBlock + j
			if i >= total {
				break
			}
			if lay.used(i) {
				be.PutUint16(rb[j*2:], 1)
			}
		}
		off := lay.rbOff + b*clusterSize
		if _, err := dst.WriteAt(rb, int64(off)); err != nil {
			return err
		}
		be.PutUint64(rt[b*8:], off)
	}
	_, err := dst.WriteAt(rt, int64(lay.rtOff))
	return err
}
