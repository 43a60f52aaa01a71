package qcow2

import (
	"bytes"
	"encoding/binary"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

func qemuImg(t *testing.T, args ...string) {
	t.Helper()
	if _, err := exec.LookPath("qemu-img"); err != nil {
		t.Skip("qemu-img not installed (apt-get install qemu-utils)")
	}
	out, err := exec.Command("qemu-img", args...).CombinedOutput()
	if err != nil {
		t.Fatalf("qemu-img %s: %v\n%s", strings.Join(args, " "), err, out)
	}
}

func TestReadHeaderQemuImg(t *testing.T) {
	dir := t.TempDir()
	base := filepath.Join(dir, "base.qcow2")
	overlay := filepath.Join(dir, "overlay.qcow2")
	v2 := filepath.Join(dir, "v2.qcow2")
	qemuImg(t, "create", "-q", "-f", "qcow2", base, "1G")
	qemuImg(t, "create", "-q", "-f", "qcow2", "-b", base, "-F", "qcow2", overlay)
	qemuImg(t, "create", "-q", "-f", "qcow2", "-o", "compat=0.10", v2, "3000000000")

	h, err := ReadHeaderFile(base)
	if err != nil {
		t.Fatal(err)
	}
	if h.Version != 3 || h.Size != 1<<30 || h.ClusterBits != 16 || h.HeaderLength != 112 {
		t.Errorf("base header = %+v, want v3, 1 GiB, cluster_bits 16, header_length 112", h)
	}
	if err := h.CheckBase(); err != nil {
		t.Errorf("CheckBase(base) = %v, want nil", err)
	}

	h, err = ReadHeaderFile(overlay)
	if err != nil {
		t.Fatal(err)
	}
	if h.BackingFile != base || !h.HasBackingFormat {
		t.Errorf("overlay backing = %q (format ext %v), want %q with format ext", h.BackingFile, h.HasBackingFormat, base)
	}
	if err := h.CheckBase(); err == nil || !strings.Contains(err.Error(), "backing file") {
		t.Errorf("CheckBase(overlay) = %v, want a backing-file error", err)
	}

	h, err = ReadHeaderFile(v2)
	if err != nil {
		t.Fatal(err)
	}
	if h.Version != 2 || h.Size != 3000000000 {
		t.Errorf("v2 header = %+v, want version 2 and size 3000000000", h)
	}
	if err := h.CheckBase(); err != nil {
		t.Errorf("CheckBase(v2) = %v, want nil", err)
	}
}

func TestReadHeaderRejects(t *testing.T) {
	dir := t.TempDir()
	for _, tc := range []struct {
		name    string
		content []byte
		notQ    bool
	}{
		{"empty", nil, true},
		{"raw", make([]byte, 4096), true},
		{"short", []byte("QFI\xfb\x00\x00\x00\x03"), true},
		{"version9", append([]byte("QFI\xfb\x00\x00\x00\x09"), make([]byte, 200)...), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := filepath.Join(dir, tc.name)
			if err := os.WriteFile(p, tc.content, 0o600); err != nil {
				t.Fatal(err)
			}
			_, err := ReadHeaderFile(p)
			if err == nil {
				t.Fatal("ReadHeaderFile succeeded, want an error")
			}
			if got := errors.Is(err, ErrNotQcow2); got != tc.notQ {
				t.Errorf("errors.Is(%v, ErrNotQcow2) = %v, want %v", err, got, tc.notQ)
			}
		})
	}
}

func FuzzReadHeader(f *testing.F) {
	f.Add([]byte("QFI\xfb\x00\x00\x00\x03"))
	f.Fuzz(func(t *testing.T, b []byte) {
		h, err := ReadHeader(strings.NewReader(string(b)))
		if err == nil {
			_ = h.CheckBase()
		}
	})
}

// TestCheckBaseRefusals patches one field of a blank image at a time: each
// must make CheckBase refuse an image it otherwise accepts.
func TestCheckBaseRefusals(t *testing.T) {
	dir := t.TempDir()
	blank := filepath.Join(dir, "blank.qcow2")
	if err := Create(blank, 1<<30); err != nil {
		t.Fatal(err)
	}
	orig, err := os.ReadFile(blank)
	if err != nil {
		t.Fatal(err)
	}
	if h, err := ReadHeader(bytes.NewReader(orig)); err != nil || h.CheckBase() != nil {
		t.Fatalf("blank image: header %v, CheckBase %v; want it accepted", err, h.CheckBase())
	}
	be := binary.BigEndian
	// extension writes one header extension right after the 112-byte header
	// of a created image, followed by the end marker.
	extension := func(typ uint32, data string) func(b []byte) {
		return func(b []byte) {
			be.PutUint32(b[112:], typ)
			be.PutUint32(b[116:], uint32(len(data)))
			off := 120 + copy(b[120:], data)
			clear(b[off : 120+(len(data)+7)/8*8+8])
		}
	}
	for _, tc := range []struct {
		name  string
		patch func(b []byte)
		want  string
	}{
		{"dirty", func(b []byte) { be.PutUint64(b[72:], IncompatDirty) }, "dirty"},
		{"corrupt", func(b []byte) { be.PutUint64(b[72:], IncompatCorrupt) }, "corrupt"},
		{"external data bit", func(b []byte) { be.PutUint64(b[72:], IncompatExternalData) }, "external data file"},
		{"unknown incompatible feature", func(b []byte) { be.PutUint64(b[72:], 1<<5) }, "unknown incompatible"},
		{"aes encryption", func(b []byte) { be.PutUint32(b[32:], 1) }, "encrypted"},
		{"encryption extension", extension(extEncryption, "0123456789abcdef"), "encrypted"},
		{"backing format extension", extension(extBackingFormat, "qcow2"), "backing-format"},
		{"data file extension", extension(extDataFile, "data.raw"), "external data file"},
		{"backing file", func(b []byte) {
			be.PutUint64(b[8:], 1024)
			be.PutUint32(b[16:], 4)
			copy(b[1024:], "base")
		}, `backing file "base"`},
		{"cluster bits", func(b []byte) { be.PutUint32(b[20:], 22) }, "cluster_bits 22"},
		{"zero size", func(b []byte) { be.PutUint64(b[24:], 0) }, "virtual size of 0"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := bytes.Clone(orig)
			tc.patch(b)
			h, err := ReadHeader(bytes.NewReader(b))
			if err != nil {
				t.Fatalf("ReadHeader = %v", err)
			}
			if err := h.CheckBase(); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("CheckBase = %v, want an error containing %q", err, tc.want)
			}
		})
	}
}
