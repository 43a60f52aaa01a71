package fat

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"vmhost/seed/internal/fatcheck"
)

// refTime and refVolumeID are what `mkfs.vfat --invariant` and
// `SOURCE_DATE_EPOCH=1700000000 mcopy` write (docs/ref/nocloud-seed.md §4).
var (
	refTime     = time.Date(2023, time.November, 14, 22, 13, 20, 0, time.UTC)
	refVolumeID = uint32(0x1234ABCD)
)

func readExample(t testing.TB, name string) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("..", "testdata", "fat", name))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// exampleFiles are the three seed documents of testdata/fat
// (docs/ref/nocloud-seed.md §6).
func exampleFiles(t testing.TB) []File {
	return []File{
		{Name: "meta-data", Data: readExample(t, "meta-data")},
		{Name: "user-data", Data: readExample(t, "user-data")},
		{Name: "network-config", Data: readExample(t, "network-config")},
	}
}

func writeImage(t testing.TB, files []File, opts Options) (string, []byte) {
	t.Helper()
	img, err := Build(files, opts)
	if err != nil {
		t.Fatalf("Build: %v", err)
	}
	path := filepath.Join(t.TempDir(), "seed.img")
	if err := os.WriteFile(path, img, 0o644); err != nil {
		t.Fatal(err)
	}
	return path, img
}

func TestLayout(t *testing.T) {
	// The sizes mkfs.vfat picks (docs/ref/nocloud-seed.md §4, the layout table).
	tests := []struct {
		size                           int64
		sectors, fatSectors, clusters  int
		fatStart, rootStart, dataStart int
	}{
		{128 << 10, 256, 1, 55, 0x200, 0x600, 0x4600},
		{256 << 10, 512, 1, 119, 0x200, 0x600, 0x4600},
		{512 << 10, 1024, 1, 247, 0x200, 0x600, 0x4600},
		{1 << 20, 2048, 2, 502, 0x200, 0xA00, 0x4A00},
		{2 << 20, 4096, 3, 1014, 0x200, 0xE00, 0x4E00},
		{4 << 20, 8192, 6, 2036, 0x200, 0x1A00, 0x5A00},
	}
	for _, tt := range tests {
		l, err := newLayout(tt.size)
		if err != nil {
			t.Fatalf("newLayout(%d): %v", tt.size, err)
		}
		got := []int{l.totalSectors, l.fatSectors, l.clusters, l.fatStart, l.rootStart, l.dataStart}
		want := []int{tt.sectors, tt.fatSectors, tt.clusters, tt.fatStart, tt.rootStart, tt.dataStart}
		if !slices.Equal(got, want) {
			t.Errorf("newLayout(%d) = sectors, fat sectors, clusters, offsets %v, want %v", tt.size, got, want)
		}
		if l.fatSectors*SectorSize*8/12 < l.clusters+2 {
			t.Errorf("newLayout(%d): FAT of %d sectors cannot hold %d entries", tt.size, l.fatSectors, l.clusters+2)
		}
	}
	for _, size := range []int64{0, MinSize - ClusterSize, MaxSize + ClusterSize, DefaultSize + 512} {
		if _, err := newLayout(size); err == nil {
			t.Errorf("newLayout(%d) = nil error, want one", size)
		}
	}
}

func TestChecksumAndAliases(t *testing.T) {
	tests := []struct {
		name  string
		short string
		sum   byte
	}{
		{"meta-data", "META-D~1   ", 0xD4},
		{"user-data", "USER-D~1   ", 0xB0},
		{"network-config", "NETWOR~1   ", 0x47},
		{"vendor-data", "VENDOR~1   ", 0x10},
	}
	var files []File
	for _, tt := range tests {
		files = append(files, File{Name: tt.name})
	}
	shorts, err := shortNames(files)
	if err != nil {
		t.Fatal(err)
	}
	for i, tt := range tests {
		if got := string(shorts[i][:]); got != tt.short {
			t.Errorf("alias of %q = %q, want %q", tt.name, got, tt.short)
		}
		if got := checksum(shorts[i]); got != tt.sum {
			t.Errorf("checksum(%q) = 0x%02X, want 0x%02X", tt.short, got, tt.sum)
		}
	}

	// Collisions and odd names get distinct, legal aliases.
	odd := []File{{Name: "network-config"}, {Name: "network-config.bak"}, {Name: "networ"},
		{Name: ".hidden.tar.gz"}, {Name: "über name+x=1.Text"}, {Name: "日本"}, {Name: "a.b.c.d"}}
	shorts, err = shortNames(odd)
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"NETWOR~1   ", "NETWOR~1BAK", "NETWOR~2   ", "HIDDEN~1GZ ", "_BERNA~1TEX", "__~1       ", "ABC~1   D  "}
	for i, s := range shorts {
		if string(s[:]) != want[i] {
			t.Errorf("alias of %q = %q, want %q", odd[i].Name, s[:], want[i])
		}
	}
}

func TestFAT12Chains(t *testing.T) {
	// The example of docs/ref/nocloud-seed.md §4: a 1-cluster meta-data,
	// then a 6187-byte user-data (4 clusters), then a 1-cluster
	// network-config.
	files := []File{
		{Name: "meta-data", Data: bytes.Repeat([]byte("m"), 41)},
		{Name: "user-data", Data: bytes.Repeat([]byte("u"), 6187)},
		{Name: "network-config", Data: bytes.Repeat([]byte("n"), 114)},
	}
	img, err := Build(files, Options{})
	if err != nil {
		t.Fatal(err)
	}
	want := []byte{0xF8, 0xFF, 0xFF, 0xFF, 0x4F, 0x00, 0x05, 0x60, 0x00, 0xFF, 0xFF, 0xFF, 0x00}
	for _, off := range []int{0x200, 0x600} {
		if got := img[off : off+len(want)]; !bytes.Equal(got, want) {
			t.Errorf("FAT at 0x%X = % X, want % X", off, got, want)
		}
	}
	if !bytes.Equal(img[0x200:0x600], img[0x600:0xA00]) {
		t.Error("FAT copies differ")
	}
}

func TestBootSector(t *testing.T) {
	img, err := Build(nil, Options{VolumeID: refVolumeID})
	if err != nil {
		t.Fatal(err)
	}
	if len(img) != DefaultSize {
		t.Fatalf("len = %d, want %d", len(img), DefaultSize)
	}
	want := "00 02 04 01 00 02 00 02 00 08 f8 02 00 10 00 02 00 00 00 00 00 00 00 00 00 " +
		"80 00 29 cd ab 34 12 43 49 44 41 54 41 20 20 20 20 20 46 41 54 31 32 20 20 20"
	if got := fmt.Sprintf("% x", img[0x0B:0x3E]); got != want {
		t.Errorf("boot sector 0x0B-0x3D =\n%s\nwant\n%s", got, want)
	}
	if img[0] != 0xEB || img[2] != 0x90 || img[0x1FE] != 0x55 || img[0x1FF] != 0xAA {
		t.Errorf("jump % x, signature % x", img[0:3], img[0x1FE:0x200])
	}
	if got := string(img[0xA00:0xA0C]); got != "CIDATA     \x08" {
		t.Errorf("label entry = %q", got)
	}
}

func TestRoundTripAndDeterminism(t *testing.T) {
	files := append(exampleFiles(t),
		File{Name: "vendor-data"}, // empty: cluster 0, size 0
		File{Name: "big", Data: bytes.Repeat([]byte("0123456789abcdef"), 1000)},
		File{Name: strings.Repeat("long name ÿ ", 20) + "end", Data: []byte("x")},
		File{Name: "exactly13char", Data: []byte("13")},
		File{Name: "emoji 😀.txt", Data: []byte("surrogates")},
	)
	path, img := writeImage(t, files, Options{})
	img2, err := Build(files, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(img, img2) {
		t.Error("two builds of the same input differ")
	}
	v, err := Read(bytes.NewReader(img), int64(len(img)))
	if err != nil {
		t.Fatalf("Read: %v", err)
	}
	if v.Label != DefaultLabel || v.BootLabel != DefaultLabel {
		t.Errorf("labels = %q, %q, want %q", v.Label, v.BootLabel, DefaultLabel)
	}
	if v.VolumeID != deriveVolumeID(DefaultLabel, files) {
		t.Errorf("volume ID %08X, want the derived one", v.VolumeID)
	}
	checkFiles(t, v.Files, files)

	// A different content gives a different derived volume ID.
	files[0].Data = append([]byte("x"), files[0].Data...)
	if img3, _ := Build(files, Options{}); binary.LittleEndian.Uint32(img3[0x27:]) == v.VolumeID {
		t.Error("volume ID did not change with the content")
	}

	fatcheck.Fsck(t, path)
	if got := fatcheck.Mtype(t, path, "big"); !bytes.Equal(got, files[4].Data) {
		t.Errorf("mtype big: %d bytes, want %d", len(got), len(files[4].Data))
	}
}

func checkFiles(t *testing.T, got, want []File) {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("read %d files, want %d", len(got), len(want))
	}
	for i := range want {
		if got[i].Name != want[i].Name || !bytes.Equal(got[i].Data, want[i].Data) {
			t.Errorf("file %d = %q (%d bytes), want %q (%d bytes)", i, got[i].Name, len(got[i].Data), want[i].Name, len(want[i].Data))
		}
	}
}

// TestMatchesMkfsMcopy compares the writer with the reference pipeline
// byte for byte. The ranges that may differ, and why:
//
//	0x003-0x00A  OEM name: mkfs writes "mkfs.fat", we write "MSWIN4.1".
//	0x03E-0x1FD  boot code: mkfs writes a stub that prints "not a bootable
//	             disk"; ours is zeros (the seed is never booted from).
//	0xA0E-0xA19  the label entry's timestamps: mkfs --invariant stamps
//	             2015-03-14 09:26:52; we stamp ModTime like every entry.
func TestMatchesMkfsMcopy(t *testing.T) {
	fatcheck.Need(t, "mkfs.vfat", "mcopy")
	allowed := [][2]int{{0x003, 0x00A}, {0x03E, 0x1FD}, {0xA0E, 0xA19}}
	cases := map[string][]File{
		"three example files": exampleFiles(t),
		"four files, multi-cluster user-data, empty vendor-data": {
			{Name: "meta-data", Data: readExample(t, "meta-data")},
			{Name: "user-data", Data: bytes.Repeat(readExample(t, "user-data"), 7)},
			{Name: "network-config", Data: readExample(t, "network-config")},
			{Name: "vendor-data"},
		},
	}
	for name, files := range cases {
		t.Run(name, func(t *testing.T) {
			dir := t.TempDir()
			ref := filepath.Join(dir, "ref.img")
			args := []string{"-i", ref}
			for _, f := range files {
				p := filepath.Join(dir, f.Name)
				if err := os.WriteFile(p, f.Data, 0o644); err != nil {
					t.Fatal(err)
				}
				args = append(args, p)
			}
			args = append(args, "::")
			if out, err := exec.Command("mkfs.vfat", "--invariant", "-n", "CIDATA", "-C", ref, "1024").CombinedOutput(); err != nil {
				t.Fatalf("mkfs.vfat: %v\n%s", err, out)
			}
			cmd := exec.Command("mcopy", args...)
			cmd.Env = append(os.Environ(), "TZ=UTC", "SOURCE_DATE_EPOCH=1700000000", "MTOOLSRC=/dev/null")
			if out, err := cmd.CombinedOutput(); err != nil {
				t.Fatalf("mcopy: %v\n%s", err, out)
			}
			want, err := os.ReadFile(ref)
			if err != nil {
				t.Fatal(err)
			}
			// The reader also understands the independent writer's image.
			v, err := Read(bytes.NewReader(want), int64(len(want)))
			if err != nil {
				t.Fatalf("Read of the mkfs.vfat+mcopy image: %v", err)
			}
			checkFiles(t, v.Files, files)
			if v.Label != "CIDATA" || v.VolumeID != refVolumeID {
				t.Errorf("reference image: label %q, volume ID %08X", v.Label, v.VolumeID)
			}

			got, err := Build(files, Options{VolumeID: refVolumeID, ModTime: refTime})
			if err != nil {
				t.Fatal(err)
			}
			if len(got) != len(want) {
				t.Fatalf("size %d, reference %d", len(got), len(want))
			}
			differ := 0
			for i := range got {
				if got[i] == want[i] {
					continue
				}
				differ++
				ok := false
				for _, r := range allowed {
					ok = ok || i >= r[0] && i <= r[1]
				}
				if !ok {
					t.Errorf("byte 0x%05X = %02X, reference %02X", i, got[i], want[i])
				}
			}
			if differ == 0 {
				t.Error("no byte differs at all: the documented ranges are stale")
			}
		})
	}
}

func TestExternalValidators(t *testing.T) {
	files := exampleFiles(t)
	path, _ := writeImage(t, files, Options{VolumeID: refVolumeID, ModTime: refTime})

	if got, want := fatcheck.Fsck(t, path), path+": 4 files, 3/502 clusters"; got != want {
		t.Errorf("fsck.fat summary = %q, want %q", got, want)
	}
	label, names := fatcheck.Mdir(t, path)
	if label != "CIDATA" || !slices.Equal(names, []string{"meta-data", "user-data", "network-config"}) {
		t.Errorf("mdir: label %q, long names %q", label, names)
	}
	for _, f := range files {
		if got := fatcheck.Mtype(t, path, f.Name); !bytes.Equal(got, f.Data) {
			t.Errorf("mtype ::%s = %q, want %q", f.Name, got, f.Data)
		}
	}
	kv := fatcheck.Blkid(t, path)
	for k, want := range map[string]string{"TYPE": "vfat", "LABEL": "CIDATA", "LABEL_FATBOOT": "CIDATA", "VERSION": "FAT12", "UUID": "1234-ABCD"} {
		if kv[k] != want {
			t.Errorf("blkid %s = %q, want %q (all: %v)", k, kv[k], want, kv)
		}
	}
}

func TestOtherSizesAndLabels(t *testing.T) {
	for _, size := range []int64{MinSize, 512 << 10, MaxSize} {
		files := []File{{Name: "meta-data", Data: []byte("instance-id: x\n")}, {Name: "user-data"}}
		path, img := writeImage(t, files, Options{Size: size, Label: "cidata"})
		if int64(len(img)) != size {
			t.Errorf("size %d: image has %d bytes", size, len(img))
		}
		v, err := Read(bytes.NewReader(img), size)
		if err != nil {
			t.Fatalf("size %d: Read: %v", size, err)
		}
		if v.Label != "cidata" || v.BootLabel != "cidata" {
			t.Errorf("size %d: labels %q %q", size, v.Label, v.BootLabel)
		}
		checkFiles(t, v.Files, files)
		if kv := fatcheck.Blkid(t, path); kv["LABEL"] != "cidata" || kv["TYPE"] != "vfat" || kv["VERSION"] != "FAT12" {
			t.Errorf("size %d: blkid %v", size, kv)
		}
	}
}

func TestRejects(t *testing.T) {
	many := func(n, nameLen int) []File {
		var fs []File
		for i := range n {
			fs = append(fs, File{Name: fmt.Sprintf("%0*d", nameLen, i)})
		}
		return fs
	}
	dataCap := 502 * ClusterSize
	tests := []struct {
		name  string
		files []File
		opts  Options
		is    error
	}{
		{"root entries", many(25, 255), Options{}, ErrNoSpace},         // 1 + 25*21 = 526 > 512
		{"root entries exactly", many(256, 13), Options{}, ErrNoSpace}, // 1 + 256*2 = 513,
		{"data", []File{{Name: "a", Data: make([]byte, dataCap+1)}}, Options{}, ErrNoSpace},
		{"data in clusters", []File{{Name: "a", Data: make([]byte, dataCap-1)}, {Name: "b", Data: []byte("x")}}, Options{}, ErrNoSpace},
		{"empty name", []File{{Name: ""}}, Options{}, ErrInvalidName},
		{"slash", []File{{Name: "a/b"}}, Options{}, ErrInvalidName},
		{"colon", []File{{Name: "a:b"}}, Options{}, ErrInvalidName},
		{"control", []File{{Name: "a\nb"}}, Options{}, ErrInvalidName},
		{"trailing dot", []File{{Name: "a."}}, Options{}, ErrInvalidName},
		{"trailing space", []File{{Name: "a "}}, Options{}, ErrInvalidName},
		{"dot", []File{{Name: "."}}, Options{}, ErrInvalidName},
		{"bad utf-8", []File{{Name: "a\xffb"}}, Options{}, ErrInvalidName},
		{"too long", []File{{Name: strings.Repeat("x", 256)}}, Options{}, ErrInvalidName},
		{"too long in utf-16", []File{{Name: strings.Repeat("😀", 128)}}, Options{}, ErrInvalidName},
		{"duplicate ignoring case", []File{{Name: "User-Data"}, {Name: "user-data"}}, Options{}, ErrInvalidName},
		{"label too long", nil, Options{Label: "CIDATACIDATA"}, nil},
		{"label char", nil, Options{Label: "CI.DATA"}, nil},
		{"label space first", nil, Options{Label: " CIDATA"}, nil},
		{"size", nil, Options{Size: 1000}, nil},
		{"time before 1980", nil, Options{ModTime: time.Date(1979, 12, 31, 0, 0, 0, 0, time.UTC)}, nil},
		{"time after 2107", nil, Options{ModTime: time.Date(2108, 1, 1, 0, 0, 0, 0, time.UTC)}, nil},
	}
	for _, tt := range tests {
		img, err := Build(tt.files, tt.opts)
		if err == nil {
			t.Errorf("%s: Build succeeded (%d bytes), want an error", tt.name, len(img))
			continue
		}
		if tt.is != nil && !errors.Is(err, tt.is) {
			t.Errorf("%s: error %v, want one wrapping %v", tt.name, err, tt.is)
		}
	}

	// The limits themselves fit.
	if _, err := Build(many(24, 255), Options{}); err != nil { // 1 + 24*21 = 505
		t.Errorf("24 names of 255 characters: %v", err)
	}
	if _, err := Build(many(255, 12), Options{}); err != nil { // 1 + 255*2 = 511
		t.Errorf("255 short names: %v", err)
	}
	if _, err := Build([]File{{Name: "a", Data: make([]byte, dataCap)}}, Options{}); err != nil {
		t.Errorf("a file filling the data area: %v", err)
	}
	if _, err := Build([]File{{Name: strings.Repeat("x", 255)}}, Options{}); err != nil {
		t.Errorf("a 255-character name: %v", err)
	}
}

func TestReadRejectsCorruption(t *testing.T) {
	_, img := writeImage(t, exampleFiles(t), Options{})
	tests := []struct {
		name   string
		damage func(b []byte)
	}{
		{"signature", func(b []byte) { b[0x1FF] = 0 }},
		{"FAT copies differ", func(b []byte) { b[0x600+5] ^= 1 }},
		{"LFN checksum", func(b []byte) { b[0xA20+13] ^= 1 }},
		{"LFN padding", func(b []byte) { b[0xA20+30] = 0 }},
		{"short name changed", func(b []byte) { b[0xA40] = 'X' }},
		{"size beyond chain", func(b []byte) { b[0xA40+29] = 0x10; b[0xA40+28] = 0 }},
		{"chain to cluster 0x7FF", func(b []byte) {
			for _, off := range []int{0x200, 0x600} {
				b[off+3] = 0xFF
				b[off+4] = 0x07
			}
		}},
		{"cluster shared", func(b []byte) { b[0xA80+26] = 2 }},
		{"orphan long name", func(b []byte) { copy(b[0xA40:0xA60], b[0xA60:0xA80]) }},
		{"long name sequence", func(b []byte) { b[0xAA0] = 0x43 }},
	}
	for _, tt := range tests {
		b := slices.Clone(img)
		tt.damage(b)
		if v, err := Read(bytes.NewReader(b), int64(len(b))); !errors.Is(err, ErrCorrupt) {
			t.Errorf("%s: Read = %v, %v; want ErrCorrupt", tt.name, v, err)
		}
	}
}

func TestWriteAndWriteSparseMatchBuild(t *testing.T) {
	files := append(exampleFiles(t), File{Name: "big", Data: bytes.Repeat([]byte{0xAB}, 100000)})
	want, err := Build(files, Options{})
	if err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	n, err := Write(&buf, files, Options{})
	if err != nil || n != DefaultSize || !bytes.Equal(buf.Bytes(), want) {
		t.Errorf("Write = %d, %v; bytes equal to Build: %v", n, err, bytes.Equal(buf.Bytes(), want))
	}

	// WriteSparse over a file full of junk, longer than the image.
	path := filepath.Join(t.TempDir(), "sparse.img")
	if err := os.WriteFile(path, bytes.Repeat([]byte{0xEE}, 2*DefaultSize), 0o644); err != nil {
		t.Fatal(err)
	}
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	n, err = WriteSparse(f, files, Options{})
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil || n != DefaultSize {
		t.Fatalf("WriteSparse = %d, %v", n, err)
	}
	got, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Errorf("WriteSparse file (%d bytes) differs from Build", len(got))
	}
	fatcheck.Fsck(t, path)

	// A failing writer's error comes back wrapped.
	if _, err := Write(failWriter{}, files, Options{}); !errors.Is(err, os.ErrClosed) {
		t.Errorf("Write to a failing writer = %v, want os.ErrClosed", err)
	}
	if _, err := Write(&buf, []File{{Name: "a:b"}}, Options{}); !errors.Is(err, ErrInvalidName) {
		t.Errorf("Write with a bad name = %v", err)
	}
}

type failWriter struct{}

func (failWriter) Write(p []byte) (int, error) { return 0, os.ErrClosed }
