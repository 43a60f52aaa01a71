package fat

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/fnv"
	"io"
	"os"
	"strconv"
	"strings"
	"time"
	"unicode/utf16"
	"unicode/utf8"
)

// Geometry shared by every image this package writes.
const (
	SectorSize        = 512
	sectorsPerCluster = 4
	ClusterSize       = SectorSize * sectorsPerCluster
	reservedSectors   = 1
	numFATs           = 2
	// RootEntries is the number of 32-byte root-directory entries; the
	// volume label takes one, each file one per 13 name characters plus one.
	RootEntries     = 512
	rootSectors     = RootEntries * dirEntrySize / SectorSize
	dirEntrySize    = 32
	media           = 0xF8
	sectorsPerTrack = 16
	heads           = 2
	driveNumber     = 0x80
	extBootSig      = 0x29

	// maxClusters keeps the volume well inside FAT12 on every reader
	// (the kernel says FAT12 up to 4084 clusters, blkid only below 4084).
	maxClusters = 4000
)

// Image sizes.
const (
	// DefaultSize is the 1 MiB layout the reference recommends: 2048
	// sectors, 2 sectors per FAT, 502 data clusters.
	DefaultSize = 1 << 20
	MinSize     = 128 << 10
	MaxSize     = 4 << 20
)

// DefaultLabel is the volume label cloud-init's NoCloud datasource looks for.
const DefaultLabel = "CIDATA"

// MaxNameLen is the longest file name in UTF-16 code units (VFAT limit).
const MaxNameLen = 255

// DefaultModTime is stamped on every directory entry when Options.ModTime is
// zero: the FAT epoch, so images carry no build time.
var DefaultModTime = time.Date(1980, time.January, 1, 0, 0, 0, 0, time.UTC)

// ErrNoSpace reports files that need more root-directory entries or data
// clusters than the image has.
var ErrNoSpace = errors.New("not enough space in fat image")

// ErrInvalidName reports a file name the writer refuses (see the package doc).
var ErrInvalidName = errors.New("invalid fat file name")

// File is one file in the root directory.
type File struct {
	Name string
	Data []byte
}

// Options tune an image. The zero value gives a DefaultSize image labelled
// DefaultLabel, stamped with DefaultModTime, whose volume ID is derived from
// the files.
type Options struct {
	// Size of the image in bytes: a multiple of ClusterSize between MinSize
	// and MaxSize; 0 means DefaultSize.
	Size int64
	// Label is stored in the boot sector and in the root-directory label
	// entry: 1 to 11 characters of A-Z, a-z, 0-9, space (not first) and
	// ! # $ % & ' ( ) - @ ^ _ ` { } ~. Empty means DefaultLabel.
	Label string
	// VolumeID is the serial number blkid shows as UUID XXXX-XXXX. Zero
	// means a hash of the label, names and contents, so identical input
	// gives identical bytes.
	VolumeID uint32
	// ModTime is stamped on every entry, using its wall-clock fields in its
	// own location (FAT stores local time without a zone). It must lie in
	// 1980..2107. Zero means DefaultModTime.
	ModTime time.Time
}

// layout is where each region of an image of a given size lives.
type layout struct {
	size         int64
	totalSectors int
	fatSectors   int
	clusters     int // data clusters, numbered 2..clusters+1
	fatStart     int // byte offsets
	rootStart    int
	dataStart    int
}

func newLayout(size int64) (layout, error) {
	if size < MinSize || size > MaxSize || size%ClusterSize != 0 {
		return layout{}, fmt.Errorf("image size %d: must be a multiple of %d between %d and %d", size, ClusterSize, MinSize, MaxSize)
	}
	l := layout{size: size, totalSectors: int(size / SectorSize), fatSectors: 1}
	// The cluster count depends on the FAT size and the FAT size on the
	// cluster count: grow the FAT until it holds every entry.
	for {
		l.clusters = (l.totalSectors - reservedSectors - numFATs*l.fatSectors - rootSectors) / sectorsPerCluster
		fatBytes := ((l.clusters+2)*3 + 1) / 2
		need := (fatBytes + SectorSize - 1) / SectorSize
		if need <= l.fatSectors {
			break
		}
		l.fatSectors = need
	}
	l.fatStart = reservedSectors * SectorSize
	l.rootStart = l.fatStart + numFATs*l.fatSectors*SectorSize
	l.dataStart = l.rootStart + rootSectors*SectorSize
	if l.clusters > maxClusters {
		return layout{}, fmt.Errorf("image size %d gives %d clusters, more than %d", size, l.clusters, maxClusters)
	}
	return l, nil
}

// image is a checked plan for one image: everything Build and Write need.
type image struct {
	l        layout
	label    string
	volID    uint32
	date, tm uint16
	files    []File
	shorts   [][11]byte
	dataEnd  int // end of the last used cluster; every byte after it is zero
}

// plan validates the files and options and lays the image out.
func plan(files []File, opts Options) (*image, error) {
	size := opts.Size
	if size == 0 {
		size = DefaultSize
	}
	l, err := newLayout(size)
	if err != nil {
		return nil, err
	}
	im := &image{l: l, label: opts.Label, volID: opts.VolumeID, files: files}
	if im.label == "" {
		im.label = DefaultLabel
	}
	if err := checkLabel(im.label); err != nil {
		return nil, err
	}
	mtime := opts.ModTime
	if mtime.IsZero() {
		mtime = DefaultModTime
	}
	if im.date, im.tm, err = dosDateTime(mtime); err != nil {
		return nil, err
	}
	if im.shorts, err = shortNames(files); err != nil {
		return nil, err
	}
	entries := 1 // the volume label
	clusters := 0
	for _, f := range files {
		entries += lfnEntries(f.Name) + 1
		clusters += (len(f.Data) + ClusterSize - 1) / ClusterSize
	}
	if entries > RootEntries {
		return nil, fmt.Errorf("%d files need %d root directory entries, image has %d: %w", len(files), entries, RootEntries, ErrNoSpace)
	}
	if clusters > l.clusters {
		return nil, fmt.Errorf("files need %d clusters of %d bytes, image has %d: %w", clusters, ClusterSize, l.clusters, ErrNoSpace)
	}
	im.dataEnd = l.dataStart + clusters*ClusterSize
	if im.volID == 0 {
		im.volID = deriveVolumeID(im.label, files)
	}
	return im, nil
}

// fill writes the image into img, which must be zeroed and at least
// dataEnd bytes long.
func (im *image) fill(img []byte) {
	l := im.l
	writeBootSector(img[:SectorSize], l, im.label, im.volID)

	fat := img[l.fatStart : l.fatStart+l.fatSectors*SectorSize]
	setFAT12(fat, 0, 0xF00|media)
	setFAT12(fat, 1, 0xFFF)

	dir := img[l.rootStart:l.dataStart]
	var labelName [11]byte
	copy(labelName[:], fmt.Sprintf("%-11s", im.label))
	writeShortEntry(dir[0:dirEntrySize], labelName, attrVolumeID, im.date, im.tm, 0, 0)
	pos := dirEntrySize

	next := 2 // next free cluster
	for i, f := range im.files {
		sum := checksum(im.shorts[i])
		for _, e := range lfnChunks(f.Name) {
			writeLFNEntry(dir[pos:pos+dirEntrySize], e, sum)
			pos += dirEntrySize
		}
		first := 0
		if n := (len(f.Data) + ClusterSize - 1) / ClusterSize; n > 0 {
			first = next
			for c := first; c < first+n-1; c++ {
				setFAT12(fat, c, c+1)
			}
			setFAT12(fat, first+n-1, 0xFFF)
			copy(img[l.dataStart+(first-2)*ClusterSize:], f.Data)
			next += n
		}
		writeShortEntry(dir[pos:pos+dirEntrySize], im.shorts[i], attrArchive, im.date, im.tm, first, len(f.Data))
		pos += dirEntrySize
	}
	copy(img[l.fatStart+l.fatSectors*SectorSize:l.rootStart], fat)
}

// Build returns the bytes of an image holding files in the given order.
// Files are stored contiguously from cluster 2 in that order. An empty file
// takes no cluster. Build rejects invalid names, duplicate names (ignoring
// case) and files that do not fit (ErrNoSpace); it never truncates.
func Build(files []File, opts Options) ([]byte, error) {
	im, err := plan(files, opts)
	if err != nil {
		return nil, err
	}
	img := make([]byte, im.l.size)
	im.fill(img)
	return img, nil
}

// zeros is the source of the all-zero tail Write streams.
var zeros [64 << 10]byte

// Write writes the image Build would return to w, without holding all of
// it in memory: the used part is built in a buffer, the zero tail is
// streamed. It returns the number of bytes written.
func Write(w io.Writer, files []File, opts Options) (int64, error) {
	im, err := plan(files, opts)
	if err != nil {
		return 0, err
	}
	head := make([]byte, im.dataEnd)
	im.fill(head)
	n, err := w.Write(head)
	total := int64(n)
	for err == nil && total < im.l.size {
		n, err = w.Write(zeros[:min(int64(len(zeros)), im.l.size-total)])
		total += int64(n)
	}
	if err != nil {
		return total, fmt.Errorf("writing fat image: %w", err)
	}
	return total, nil
}

// WriteSparse writes the image into f from offset 0 and sets f's size to
// the image size. Only the used part (boot sector, FATs, root directory and
// the files' clusters) is written; the rest is a hole that reads as zeros,
// so a 1 MiB seed costs a few kilobytes of writes. Whatever f held before
// is discarded. f's offset is left unspecified.
func WriteSparse(f *os.File, files []File, opts Options) (int64, error) {
	im, err := plan(files, opts)
	if err != nil {
		return 0, err
	}
	head := make([]byte, im.dataEnd)
	im.fill(head)
	// Empty a file that has content first, so old bytes cannot survive in
	// the hole. A new file skips that journalled metadata update.
	fi, err := f.Stat()
	if err != nil {
		return 0, fmt.Errorf("writing fat image: %w", err)
	}
	if fi.Size() != 0 {
		if err := f.Truncate(0); err != nil {
			return 0, fmt.Errorf("writing fat image %s: %w", f.Name(), err)
		}
	}
	if _, err := f.WriteAt(head, 0); err != nil {
		return 0, fmt.Errorf("writing fat image %s: %w", f.Name(), err)
	}
	if err := f.Truncate(im.l.size); err != nil {
		return 0, fmt.Errorf("writing fat image %s: %w", f.Name(), err)
	}
	return im.l.size, nil
}

// Directory entry attributes.
const (
	attrReadOnly  = 0x01
	attrHidden    = 0x02
	attrSystem    = 0x04
	attrVolumeID  = 0x08
	attrDirectory = 0x10
	attrArchive   = 0x20
	attrLFN       = attrReadOnly | attrHidden | attrSystem | attrVolumeID
)

func writeBootSector(b []byte, l layout, label string, volID uint32) {
	copy(b[0:3], []byte{0xEB, 0x3C, 0x90})
	copy(b[3:11], "MSWIN4.1")
	le := binary.LittleEndian
	le.PutUint16(b[0x0B:], SectorSize)
	b[0x0D] = sectorsPerCluster
	le.PutUint16(b[0x0E:], reservedSectors)
	b[0x10] = numFATs
	le.PutUint16(b[0x11:], RootEntries)
	le.PutUint16(b[0x13:], uint16(l.totalSectors)) // MaxSize keeps it below 65536
	b[0x15] = media
	le.PutUint16(b[0x16:], uint16(l.fatSectors))
	le.PutUint16(b[0x18:], sectorsPerTrack)
	le.PutUint16(b[0x1A:], heads)
	b[0x24] = driveNumber
	b[0x26] = extBootSig
	le.PutUint32(b[0x27:], volID)
	copy(b[0x2B:0x36], fmt.Sprintf("%-11s", label))
	copy(b[0x36:0x3E], "FAT12   ")
	// Boot code stays zero: the seed is never booted from.
	b[0x1FE], b[0x1FF] = 0x55, 0xAA
}

// setFAT12 stores value v for cluster n: entry n occupies 12 bits starting
// at byte n + n/2, low nibble first for even n, high nibble for odd n.
func setFAT12(fat []byte, n, v int) {
	off := n + n/2
	if n%2 == 0 {
		fat[off] = byte(v)
		fat[off+1] = fat[off+1]&0xF0 | byte(v>>8)&0x0F
	} else {
		fat[off] = fat[off]&0x0F | byte(v<<4)
		fat[off+1] = byte(v >> 4)
	}
}

func writeShortEntry(e []byte, name [11]byte, attr byte, date, tm uint16, cluster, size int) {
	le := binary.LittleEndian
	copy(e[0:11], name[:])
	e[11] = attr
	le.PutUint16(e[14:], tm)   // creation time
	le.PutUint16(e[16:], date) // creation date
	le.PutUint16(e[18:], date) // last access date
	le.PutUint16(e[22:], tm)   // write time
	le.PutUint16(e[24:], date) // write date
	le.PutUint16(e[26:], uint16(cluster))
	le.PutUint32(e[28:], uint32(size))
}

// lfnEntry is one 13-unit chunk of a long name with its sequence byte.
type lfnEntry struct {
	seq   byte
	units [13]uint16
}

// lfnEntries is the number of long-name entries a name needs.
func lfnEntries(name string) int {
	return (utf16Len(name) + 12) / 13
}

// lfnChunks returns the long-name entries in on-disk order: highest
// sequence (flagged 0x40) first, sequence 1 last. After the last character
// comes one 0x0000 terminator when the chunk is not full, then 0xFFFF.
func lfnChunks(name string) []lfnEntry {
	units := utf16.Encode([]rune(name))
	n := (len(units) + 12) / 13
	out := make([]lfnEntry, n)
	for k := 0; k < n; k++ {
		e := &out[n-1-k]
		e.seq = byte(k + 1)
		if k == n-1 {
			e.seq |= 0x40
		}
		for j := 0; j < 13; j++ {
			switch i := k*13 + j; {
			case i < len(units):
				e.units[j] = units[i]
			case i == len(units):
				e.units[j] = 0x0000
			default:
				e.units[j] = 0xFFFF
			}
		}
	}
	return out
}

// lfnSlots are the byte offsets of the 13 UTF-16 units in an LFN entry.
var lfnSlots = [13]int{1, 3, 5, 7, 9, 14, 16, 18, 20, 22, 24, 28, 30}

func writeLFNEntry(b []byte, e lfnEntry, sum byte) {
	b[0] = e.seq
	b[11] = attrLFN
	b[12] = 0
	b[13] = sum
	for j, off := range lfnSlots {
		binary.LittleEndian.PutUint16(b[off:], e.units[j])
	}
	// b[26:28], the first cluster, stays 0.
}

// checksum is the VFAT short-name checksum: rotate right by one bit, then
// add the next byte, over the 11 stored name bytes.
func checksum(name [11]byte) byte {
	var sum byte
	for _, c := range name {
		sum = (sum>>1 | sum<<7) + c
	}
	return sum
}

// dosDateTime encodes t's wall clock as FAT date and time (2 s resolution).
func dosDateTime(t time.Time) (date, tm uint16, err error) {
	if y := t.Year(); y < 1980 || y > 2107 {
		return 0, 0, fmt.Errorf("timestamp %s outside the fat range 1980-2107", t.Format(time.RFC3339))
	}
	date = uint16((t.Year()-1980)<<9 | int(t.Month())<<5 | t.Day())
	tm = uint16(t.Hour()<<11 | t.Minute()<<5 | t.Second()/2)
	return date, tm, nil
}

func deriveVolumeID(label string, files []File) uint32 {
	h := fnv.New32a()
	var n [8]byte
	h.Write([]byte(label))
	for _, f := range files {
		binary.LittleEndian.PutUint64(n[:], uint64(len(f.Name)))
		h.Write(n[:])
		h.Write([]byte(f.Name))
		binary.LittleEndian.PutUint64(n[:], uint64(len(f.Data)))
		h.Write(n[:])
		h.Write(f.Data)
	}
	return h.Sum32()
}

// shortSpecial are the punctuation characters legal in 8.3 names.
const shortSpecial = "!#$%&'()-@^_`{}~"

func checkLabel(label string) error {
	if len(label) > 11 || label[0] == ' ' {
		return fmt.Errorf("volume label %q: 1 to 11 characters, not starting with a space", label)
	}
	for i := 0; i < len(label); i++ {
		c := label[i]
		if !(c >= 'A' && c <= 'Z' || c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == ' ' || strings.IndexByte(shortSpecial, c) >= 0) {
			return fmt.Errorf("volume label %q: character %q not allowed", label, c)
		}
	}
	return nil
}

func utf16Len(s string) int {
	n := 0
	for _, r := range s {
		n += utf16.RuneLen(r)
	}
	return n
}

// CheckName reports why name cannot be a file name in an image, or nil.
func CheckName(name string) error {
	if name == "" {
		return fmt.Errorf("%w: empty", ErrInvalidName)
	}
	if !utf8.ValidString(name) {
		return fmt.Errorf("%w %q: not valid UTF-8", ErrInvalidName, name)
	}
	if n := utf16Len(name); n > MaxNameLen {
		return fmt.Errorf("%w %q: %d UTF-16 units, at most %d", ErrInvalidName, name, n, MaxNameLen)
	}
	for _, r := range name {
		if r < 0x20 || r == 0x7F || strings.ContainsRune(`*?<>|":/\`, r) {
			return fmt.Errorf("%w %q: character %q not allowed", ErrInvalidName, name, r)
		}
	}
	// The Linux vfat driver strips trailing dots and spaces on lookup, so
	// such a name could never be opened as written.
	if last := name[len(name)-1]; last == '.' || last == ' ' {
		return fmt.Errorf("%w %q: ends with %q", ErrInvalidName, name, last)
	}
	return nil
}

// shortNames checks every name and returns a unique 8.3 alias for each.
func shortNames(files []File) ([][11]byte, error) {
	used := make(map[[11]byte]bool, len(files))
	out := make([][11]byte, len(files))
	for i, f := range files {
		if err := CheckName(f.Name); err != nil {
			return nil, err
		}
		for j := 0; j < i; j++ {
			if strings.EqualFold(files[j].Name, f.Name) {
				return nil, fmt.Errorf("%w %q: same name as %q (fat names ignore case)", ErrInvalidName, f.Name, files[j].Name)
			}
		}
		base, ext := basisName(f.Name)
		for n := 1; ; n++ {
			tail := "~" + strconv.Itoa(n)
			b := base
			if len(b) > 8-len(tail) {
				b = b[:8-len(tail)]
			}
			var s [11]byte
			copy(s[:], fmt.Sprintf("%-8s%-3s", b+tail, ext))
			if !used[s] {
				used[s] = true
				out[i] = s
				break
			}
		}
	}
	return out, nil
}

// basisName derives the upper-case 8.3 basis of a long name the way mtools
// and Windows do: drop spaces and leading dots, split at the last dot,
// replace characters that are illegal in short names (and all non-ASCII)
// with '_', and keep at most 8 and 3 characters.
func basisName(name string) (base, ext string) {
	name = strings.ReplaceAll(name, " ", "")
	name = strings.TrimLeft(name, ".")
	stem, suffix := name, ""
	if i := strings.LastIndexByte(name, '.'); i >= 0 {
		stem, suffix = name[:i], name[i+1:]
	}
	base = shortChars(strings.ReplaceAll(stem, ".", ""), 8)
	ext = shortChars(suffix, 3)
	if base == "" {
		base = "_"
	}
	return base, ext
}

func shortChars(s string, max int) string {
	var b strings.Builder
	for _, r := range s {
		if b.Len() == max {
			break
		}
		switch {
		case r >= 'a' && r <= 'z':
			b.WriteRune(r - 'a' + 'A')
		case r >= 'A' && r <= 'Z', r >= '0' && r <= '9', r < utf8.RuneSelf && strings.ContainsRune(shortSpecial, r):
			b.WriteRune(r)
		default:
			b.WriteByte('_')
		}
	}
	return b.String()
}
