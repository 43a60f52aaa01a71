package fat

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"strings"
	"unicode/utf16"
)

// ErrCorrupt reports an image Read cannot make sense of.
var ErrCorrupt = errors.New("corrupt fat image")

// Volume is what Read found in an image.
type Volume struct {
	// Label is the root-directory volume-label entry without trailing
	// spaces (blkid's LABEL); empty when there is none.
	Label string
	// BootLabel is the boot-sector label at 0x2B without trailing spaces
	// (blkid's LABEL_FATBOOT).
	BootLabel string
	VolumeID  uint32
	// Clusters is the number of data clusters; it decides the FAT type.
	Clusters int
	// Files are the root directory's regular files in directory order.
	Files []File
}

// Read parses a FAT12 or FAT16 image of size bytes and returns its root
// directory's files. It is strict, since tests use it to check the writer:
// FAT copies that differ, a long name whose sequence, checksum or padding is
// wrong, a chain that loops, leaves the volume, is shared by two files or
// does not match the file size all give an error wrapping ErrCorrupt.
// Subdirectories are skipped.
func Read(r io.ReaderAt, size int64) (*Volume, error) {
	bs := make([]byte, SectorSize)
	if _, err := r.ReadAt(bs, 0); err != nil {
		return nil, fmt.Errorf("reading fat boot sector: %w", err)
	}
	le := binary.LittleEndian
	if bs[0x1FE] != 0x55 || bs[0x1FF] != 0xAA {
		return nil, fmt.Errorf("%w: no 55 AA boot signature", ErrCorrupt)
	}
	bps := int(le.Uint16(bs[0x0B:]))
	spc := int(bs[0x0D])
	reserved := int(le.Uint16(bs[0x0E:]))
	nfats := int(bs[0x10])
	rootEntries := int(le.Uint16(bs[0x11:]))
	total := int(le.Uint16(bs[0x13:]))
	if total == 0 {
		total = int(le.Uint32(bs[0x20:]))
	}
	fatSz := int(le.Uint16(bs[0x16:]))
	switch {
	case bps < 512 || bps > 4096 || bps&(bps-1) != 0:
		return nil, fmt.Errorf("%w: %d bytes per sector", ErrCorrupt, bps)
	case spc == 0 || spc&(spc-1) != 0:
		return nil, fmt.Errorf("%w: %d sectors per cluster", ErrCorrupt, spc)
	case reserved == 0 || nfats == 0:
		return nil, fmt.Errorf("%w: %d reserved sectors, %d FATs", ErrCorrupt, reserved, nfats)
	case fatSz == 0:
		return nil, fmt.Errorf("%w: FAT32 is not supported", ErrCorrupt)
	case rootEntries == 0 || rootEntries*dirEntrySize%bps != 0:
		return nil, fmt.Errorf("%w: %d root entries", ErrCorrupt, rootEntries)
	case int64(total)*int64(bps) > size:
		return nil, fmt.Errorf("%w: %d sectors of %d bytes do not fit in %d bytes", ErrCorrupt, total, bps, size)
	}
	rootSecs := rootEntries * dirEntrySize / bps
	dataSec := reserved + nfats*fatSz + rootSecs
	if dataSec >= total {
		return nil, fmt.Errorf("%w: no data area", ErrCorrupt)
	}
	v := &Volume{
		VolumeID:  le.Uint32(bs[0x27:]),
		BootLabel: strings.TrimRight(string(bs[0x2B:0x36]), " "),
		Clusters:  (total - dataSec) / spc,
	}
	fat16 := v.Clusters >= 4085
	if v.Clusters >= 65525 {
		return nil, fmt.Errorf("%w: %d clusters is FAT32", ErrCorrupt, v.Clusters)
	}

	fats := make([]byte, nfats*fatSz*bps)
	if _, err := r.ReadAt(fats, int64(reserved*bps)); err != nil {
		return nil, fmt.Errorf("reading fat: %w", err)
	}
	fat := fats[:fatSz*bps]
	for i := 1; i < nfats; i++ {
		if string(fats[i*fatSz*bps:(i+1)*fatSz*bps]) != string(fat) {
			return nil, fmt.Errorf("%w: FAT copy %d differs from FAT 1", ErrCorrupt, i+1)
		}
	}
	if need := v.Clusters + 2; fat16 && need*2 > len(fat) || !fat16 && (need*3+1)/2 > len(fat) {
		return nil, fmt.Errorf("%w: FAT of %d bytes too small for %d clusters", ErrCorrupt, len(fat), v.Clusters)
	}
	entry := func(n int) int {
		if fat16 {
			return int(le.Uint16(fat[2*n:]))
		}
		x := int(le.Uint16(fat[n+n/2:]))
		if n%2 == 1 {
			return x >> 4
		}
		return x & 0xFFF
	}
	eoc := 0xFF8
	if fat16 {
		eoc = 0xFFF8
	}

	dir := make([]byte, rootSecs*bps)
	if _, err := r.ReadAt(dir, int64((reserved+nfats*fatSz)*bps)); err != nil {
		return nil, fmt.Errorf("reading root directory: %w", err)
	}
	clusterBytes := spc * bps
	owner := make(map[int]string) // cluster -> file using it
	var lfn []uint16              // long name collected so far, in order
	var lfnSum byte
	lfnNext := 0 // sequence number the next LFN entry must carry; 0 = none pending
	for off := 0; off < len(dir); off += dirEntrySize {
		e := dir[off : off+dirEntrySize]
		if e[0] == 0x00 {
			break
		}
		if e[0] == 0xE5 {
			lfn, lfnNext = nil, 0
			continue
		}
		attr := e[11]
		if attr&0x3F == attrLFN {
			seq := int(e[0] &^ 0x40)
			if e[0]&0x40 != 0 {
				if lfn != nil {
					return nil, fmt.Errorf("%w: long name before entry %d has no short entry", ErrCorrupt, off/dirEntrySize)
				}
				if seq < 1 || seq > 20 {
					return nil, fmt.Errorf("%w: long name sequence %d at entry %d", ErrCorrupt, seq, off/dirEntrySize)
				}
				lfn = make([]uint16, 13*seq)
				lfnSum = e[13]
			} else if seq != lfnNext || lfnNext == 0 {
				return nil, fmt.Errorf("%w: long name sequence %d at entry %d, want %d", ErrCorrupt, seq, off/dirEntrySize, lfnNext)
			} else if e[13] != lfnSum {
				return nil, fmt.Errorf("%w: long name checksums differ at entry %d", ErrCorrupt, off/dirEntrySize)
			}
			if e[12] != 0 || le.Uint16(e[26:]) != 0 {
				return nil, fmt.Errorf("%w: long name entry %d has type or cluster set", ErrCorrupt, off/dirEntrySize)
			}
			for j, o := range lfnSlots {
				lfn[(seq-1)*13+j] = le.Uint16(e[o:])
			}
			lfnNext = seq - 1
			continue
		}
		var short [11]byte
		copy(short[:], e[0:11])
		name := ""
		if lfn != nil {
			if lfnNext != 0 {
				return nil, fmt.Errorf("%w: long name ends at sequence %d before entry %d", ErrCorrupt, lfnNext+1, off/dirEntrySize)
			}
			if lfnSum != checksum(short) {
				return nil, fmt.Errorf("%w: long name checksum 0x%02X, short name %q sums to 0x%02X", ErrCorrupt, lfnSum, short[:], checksum(short))
			}
			var err error
			if name, err = decodeLFN(lfn); err != nil {
				return nil, fmt.Errorf("%w: entry %d: %v", ErrCorrupt, off/dirEntrySize, err)
			}
		}
		lfn, lfnNext = nil, 0
		if attr&attrVolumeID != 0 {
			if attr&attrDirectory == 0 && le.Uint16(e[26:]) == 0 && v.Label == "" && name == "" {
				v.Label = strings.TrimRight(string(short[:]), " ")
			}
			continue
		}
		if attr&attrDirectory != 0 {
			continue
		}
		if name == "" {
			name = shortDisplay(short, e[12])
		}
		first := int(le.Uint16(e[26:]))
		fsize := int(le.Uint32(e[28:]))
		if int64(fsize) > int64(v.Clusters)*int64(clusterBytes) {
			return nil, fmt.Errorf("%w: %q claims %d bytes", ErrCorrupt, name, fsize)
		}
		data := make([]byte, 0, fsize)
		want := (fsize + clusterBytes - 1) / clusterBytes
		if (fsize == 0) != (first == 0) {
			return nil, fmt.Errorf("%w: %q has size %d and first cluster %d", ErrCorrupt, name, fsize, first)
		}
		for c, n := first, 0; fsize > 0; n++ {
			if c < 2 || c >= v.Clusters+2 {
				return nil, fmt.Errorf("%w: %q chain reaches cluster %d", ErrCorrupt, name, c)
			}
			if prev, ok := owner[c]; ok {
				return nil, fmt.Errorf("%w: cluster %d used by %q and %q", ErrCorrupt, c, prev, name)
			}
			owner[c] = name
			if n == want {
				return nil, fmt.Errorf("%w: %q chain longer than its %d bytes", ErrCorrupt, name, fsize)
			}
			chunk := min(clusterBytes, fsize-len(data))
			buf := make([]byte, chunk)
			if _, err := r.ReadAt(buf, int64(dataSec*bps+(c-2)*clusterBytes)); err != nil {
				return nil, fmt.Errorf("reading %q: %w", name, err)
			}
			data = append(data, buf...)
			next := entry(c)
			if next >= eoc {
				if n+1 != want {
					return nil, fmt.Errorf("%w: %q chain has %d clusters, size %d needs %d", ErrCorrupt, name, n+1, fsize, want)
				}
				break
			}
			c = next
		}
		v.Files = append(v.Files, File{Name: name, Data: data})
	}
	return v, nil
}

// decodeLFN turns collected UTF-16 units into a name: units up to a 0x0000
// terminator (or the end), then only 0xFFFF padding.
func decodeLFN(units []uint16) (string, error) {
	end := len(units)
	for i, u := range units {
		if u == 0 {
			end = i
			break
		}
	}
	for i := end + 1; i < len(units); i++ {
		if units[i] != 0xFFFF {
			return "", fmt.Errorf("long name padding 0x%04X at unit %d", units[i], i)
		}
	}
	if end == 0 {
		return "", errors.New("empty long name")
	}
	return string(utf16.Decode(units[:end])), nil
}

// shortDisplay renders an 8.3 entry as NAME.EXT, honouring the NT
// lower-case flags (0x08 base, 0x10 extension).
func shortDisplay(s [11]byte, nt byte) string {
	if s[0] == 0x05 {
		s[0] = 0xE5
	}
	base := strings.TrimRight(string(s[:8]), " ")
	ext := strings.TrimRight(string(s[8:]), " ")
	if nt&0x08 != 0 {
		base = strings.ToLower(base)
	}
	if nt&0x10 != 0 {
		ext = strings.ToLower(ext)
	}
	if ext == "" {
		return base
	}
	return base + "." + ext
}
