package qcow2

import (
	"bytes"
	"crypto/rand"
	"errors"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

func TestCreateMatchesQemuImg(t *testing.T) {
	dir := t.TempDir()
	for _, size := range []uint64{0, 1, 1 << 30, 10 << 30, 3000000000, 8 << 40} {
		t.Run(strconv.FormatUint(size, 10), func(t *testing.T) {
			want := filepath.Join(dir, "want-"+strconv.FormatUint(size, 10))
			got := filepath.Join(dir, "got-"+strconv.FormatUint(size, 10))
			qemuImg(t, "create", "-q", "-f", "qcow2", want, strconv.FormatUint(size, 10))
			if err := Create(got, size); err != nil {
				t.Fatal(err)
			}
			a, err := os.ReadFile(want)
			if err != nil {
				t.Fatal(err)
			}
			b, err := os.ReadFile(got)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(a, b) {
				t.Errorf("Create(%d) differs from qemu-img create: %d bytes vs %d; first difference at %#x", size, len(b), len(a), firstDiff(a, b))
			}
			qemuImg(t, "check", "-q", got)
			h, err := ReadHeaderFile(got)
			if err != nil {
				t.Fatal(err)
			}
			if err := h.CheckBase(); size > 0 && err != nil {
				t.Errorf("CheckBase = %v", err)
			}
		})
	}
}

func firstDiff(a, b []byte) int {
	for i := range min(len(a), len(b)) {
		if a[i] != b[i] {
			return i
		}
	}
	return min(len(a), len(b))
}

func TestCreateRefusesExisting(t *testing.T) {
	p := filepath.Join(t.TempDir(), "x.qcow2")
	if err := os.WriteFile(p, []byte("data"), 0o600); err != nil {
		t.Fatal(err)
	}
	err := Create(p, 1<<30)
	if !errors.Is(err, fs.ErrExist) {
		t.Fatalf("Create over an existing file = %v, want fs.ErrExist", err)
	}
	if b, _ := os.ReadFile(p); string(b) != "data" {
		t.Errorf("existing file changed to %q", b)
	}
	if err := Create(filepath.Join(t.TempDir(), "big"), MaxSize+1); err == nil {
		t.Error("Create(MaxSize+1) succeeded")
	}
}

// TestConvertRaw builds a sparse raw image with data spread over several L2
// ranges (including an all-zero data extent and a partial last cluster),
// converts it, and has qemu-img compare and check the result.
func TestConvertRaw(t *testing.T) {
	if _, err := exec.LookPath("qemu-img"); err != nil {
		t.Skip("qemu-img not installed (apt-get install qemu-utils)")
	}
	dir := t.TempDir()
	for _, tc := range []struct {
		name   string
		size   int64
		writes []int64 // offsets of 100 KiB random writes
		zeros  []int64 // offsets of 1 MiB zero writes (data extents that read as zero)
	}{
		{"empty", 64 << 20, nil, nil},
		{"spread", 3<<30 + 4096 + 1000, []int64{0, 4096, 5 << 20, 512<<20 - 1000, 1<<30 + 12345, 3<<30 + 4000}, []int64{100 << 20, 2 << 30}},
		{"dense", 8 << 20, []int64{0, 100 << 10, 200 << 10, 300 << 10, 7 << 20}, []int64{1 << 20}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			raw := filepath.Join(dir, tc.name+".raw")
			f, err := os.Create(raw)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			if err := f.Truncate(tc.size); err != nil {
				t.Fatal(err)
			}
			for _, off := range tc.zeros {
				if _, err := f.WriteAt(make([]byte, 1<<20), off); err != nil {
					t.Fatal(err)
				}
			}
			for _, off := range tc.writes {
				b := make([]byte, 100<<10)
				rand.Read(b)
				if _, err := f.WriteAt(b[:min(int64(len(b)), tc.size-off)], off); err != nil {
					t.Fatal(err)
				}
			}
			out := filepath.Join(dir, tc.name+".qcow2")
			if err := ConvertRaw(out, f); err != nil {
				t.Fatal(err)
			}
			qemuImg(t, "check", "-q", out)
			qemuImg(t, "compare", "-q", "-f", "raw", "-F", "qcow2", raw, out)
			h, err := ReadHeaderFile(out)
			if err != nil {
				t.Fatal(err)
			}
			if want := uint64(roundUp(uint64(tc.size), 512)); h.Size != want || h.ClusterBits != 16 || h.Version != 3 {
				t.Errorf("header = %+v, want v3, cluster_bits 16, size %d", h, want)
			}
			// Only the written clusters are allocated: each 100 KiB write
			// touches at most 3 clusters.
			st, err := os.Stat(out)
			if err != nil {
				t.Fatal(err)
			}
			maxData := int64(len(tc.writes)) * 3 * clusterSize
			alloc := allocated(t, out)
			if alloc > maxData || alloc < int64(len(tc.writes))*clusterSize {
				t.Errorf("converted image maps %d bytes of data (file %d), want between %d and %d", alloc, st.Size(), len(tc.writes)*clusterSize, maxData)
			}
			if err := ConvertRaw(out, f); !errors.Is(err, fs.ErrExist) {
				t.Errorf("second ConvertRaw = %v, want fs.ErrExist", err)
			}
		})
	}
}

// allocated reports the bytes qemu-img map says hold data in a qcow2 image.
func allocated(t *testing.T, path string) int64 {
	t.Helper()
	out, err := exec.Command("qemu-img", "map", "--output=json", path).Output()
	if err != nil {
		t.Fatalf("qemu-img map: %v", err)
	}
	var total int64
	for _, line := range strings.Split(string(out), "\n") {
		if !strings.Contains(line, `"data": true`) {
			continue
		}
		i := strings.Index(line, `"length": `)
		j := strings.Index(line[i+10:], ",")
		n, err := strconv.ParseInt(line[i+10:i+10+j], 10, 64)
		if err != nil {
			t.Fatalf("parsing %q: %v", line, err)
		}
		total += n
	}
	return total
}

// TestConvertRawExt4 converts a fresh ext4 file system image, the case
// AppVM image import has.
func TestConvertRawExt4(t *testing.T) {
	mkfs, err := exec.LookPath("mkfs.ext4")
	if err != nil {
		t.Skip("mkfs.ext4 not installed (apt-get install e2fsprogs)")
	}
	dir := t.TempDir()
	raw := filepath.Join(dir, "fs.raw")
	if out, err := exec.Command(mkfs, "-q", "-F", raw, "256M").CombinedOutput(); err != nil {
		t.Fatalf("mkfs.ext4: %v\n%s", err, out)
	}
	f, err := os.Open(raw)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	out := filepath.Join(dir, "fs.qcow2")
	if err := ConvertRaw(out, f); err != nil {
		t.Fatal(err)
	}
	qemuImg(t, "check", "-q", out)
	qemuImg(t, "compare", "-q", "-f", "raw", "-F", "qcow2", raw, out)
}
