package fat

import (
	"bytes"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"vmhost/seed/internal/fatcheck"
)

// FuzzWriteRead writes arbitrary names ('/'-separated, since '/' can never
// be part of a name) with slices of arbitrary data, then reads the image
// back: either Build refuses with ErrInvalidName or ErrNoSpace, or every
// name and byte comes back identical and fsck.fat (where installed) finds
// nothing to say.
func FuzzWriteRead(f *testing.F) {
	f.Add("meta-data/user-data/network-config", []byte("instance-id: x\n#cloud-config\nversion: 2\n"), uint16(3))
	f.Add("vendor-data", []byte{}, uint16(0))
	f.Add("ünïcödé 😀 name.tar.gz/日本語/.hidden/a b  c/x.y.z", bytes.Repeat([]byte{0, 0xFF}, 3000), uint16(4000))
	f.Add(strings.Repeat("n", 255)+"/"+strings.Repeat("é", 13), []byte("13"), uint16(1))
	f.Add("Same/same", []byte("dup"), uint16(1))
	f.Add("bad:name", []byte("x"), uint16(1))
	_, fsckErr := exec.LookPath("fsck.fat")
	f.Fuzz(func(t *testing.T, names string, data []byte, repeat uint16) {
		parts := strings.Split(names, "/")
		if len(parts) > 300 {
			t.Skip("more files than any root directory holds")
		}
		// repeat stretches the data so that chains span many clusters; a
		// little more than the data area is enough to reach ErrNoSpace.
		if n := int(repeat%512) + 1; len(data)*n <= 2*DefaultSize {
			data = bytes.Repeat(data, n)
		}
		files := make([]File, len(parts))
		for i, name := range parts {
			files[i] = File{Name: name, Data: data[i*len(data)/len(parts) : (i+1)*len(data)/len(parts)]}
		}
		img, err := Build(files, Options{})
		if err != nil {
			if !errors.Is(err, ErrInvalidName) && !errors.Is(err, ErrNoSpace) {
				t.Fatalf("Build: unexpected error kind: %v", err)
			}
			if errors.Is(err, ErrInvalidName) {
				bad := false
				for i, fl := range files {
					bad = bad || CheckName(fl.Name) != nil
					for _, prev := range files[:i] {
						bad = bad || strings.EqualFold(prev.Name, fl.Name)
					}
				}
				if !bad {
					t.Fatalf("Build: %v, but every name is valid and distinct", err)
				}
			}
			return
		}
		if len(img) != DefaultSize {
			t.Fatalf("image has %d bytes", len(img))
		}
		v, err := Read(bytes.NewReader(img), int64(len(img)))
		if err != nil {
			t.Fatalf("Read: %v", err)
		}
		if v.Label != DefaultLabel || v.BootLabel != DefaultLabel {
			t.Errorf("labels %q, %q", v.Label, v.BootLabel)
		}
		if len(v.Files) != len(files) {
			t.Fatalf("read %d files, wrote %d", len(v.Files), len(files))
		}
		for i := range files {
			if v.Files[i].Name != files[i].Name || !bytes.Equal(v.Files[i].Data, files[i].Data) {
				t.Fatalf("file %d: read %q (%d bytes), wrote %q (%d bytes)", i, v.Files[i].Name, len(v.Files[i].Data), files[i].Name, len(files[i].Data))
			}
		}
		if fsckErr == nil {
			path := filepath.Join(t.TempDir(), "f.img")
			if err := os.WriteFile(path, img, 0o644); err != nil {
				t.Fatal(err)
			}
			fatcheck.Fsck(t, path)
		}
	})
}

// FuzzRead feeds damaged images to Read: it may refuse them, but must not
// panic, loop or allocate beyond the image size, and whatever it returns
// must be consistent with the bytes. The fuzzed bytes are laid over the
// start of a valid MinSize image (boot sector, FATs, root directory and the
// first clusters), so inputs stay small while sizes still vary: a short
// input can also be taken as the whole image.
func FuzzRead(f *testing.F) {
	good, err := Build([]File{
		{Name: "meta-data", Data: []byte("instance-id: x\n")},
		{Name: "user-data", Data: bytes.Repeat([]byte("#cloud-config\n"), 400)},
		{Name: "network-config"},
	}, Options{Size: MinSize})
	if err != nil {
		f.Fatal(err)
	}
	l, _ := newLayout(MinSize)
	f.Add(good[:l.dataStart+3*ClusterSize], false)
	f.Add(good[:SectorSize], true)
	f.Fuzz(func(t *testing.T, head []byte, whole bool) {
		img := head
		if !whole {
			img = bytes.Clone(good)
			copy(img, head)
		}
		v, err := Read(bytes.NewReader(img), int64(len(img)))
		if err != nil {
			return
		}
		total := 0
		for _, fl := range v.Files {
			total += len(fl.Data)
		}
		if total > len(img) {
			t.Fatalf("read %d bytes of files from a %d-byte image", total, len(img))
		}
	})
}
