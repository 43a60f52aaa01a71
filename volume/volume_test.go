package volume_test

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"vmhost/qcow2"
	"vmhost/volume"
)

func open(t *testing.T, dir string) *volume.Store {
	t.Helper()
	s, err := volume.Open(dir, nil)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func names(t *testing.T, dir string) []string {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range ents {
		out = append(out, e.Name())
	}
	return out
}

// TestCreateListGetDelete: a raw volume is a blank qcow2 of its size, 0600,
// with metadata beside it; a second create of the id is ErrExists; List is
// sorted; Delete removes both files and a second Delete is ErrNotFound.
func TestCreateListGetDelete(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "volumes")
	s := open(t, dir)
	at := time.Date(2026, 11, 25, 1, 2, 3, 0, time.UTC)
	for _, id := range []string{"zeta", "alpha"} {
		if err := s.Create(context.Background(), volume.Volume{ID: id, Format: volume.FormatRaw, SizeGiB: 3, CreatedAt: at}); err != nil {
			t.Fatal(err)
		}
	}
	err := s.Create(context.Background(), volume.Volume{ID: "alpha", Format: volume.FormatRaw, SizeGiB: 1, CreatedAt: at})
	if !errors.Is(err, volume.ErrExists) {
		t.Fatalf("second create = %v, want ErrExists", err)
	}
	h, err := qcow2.ReadHeaderFile(s.Path("alpha"))
	if err != nil || h.Size != 3<<30 {
		t.Fatalf("alpha image: %+v %v, want a 3 GiB qcow2", h, err)
	}
	if fi, err := os.Stat(s.Path("alpha")); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("alpha image mode: %v %v, want 0600", fi.Mode(), err)
	}
	vols, err := s.List()
	if err != nil {
		t.Fatal(err)
	}
	if len(vols) != 2 || vols[0].ID != "alpha" || vols[1].ID != "zeta" || !vols[0].CreatedAt.Equal(at) || vols[0].SizeGiB != 3 || vols[0].Format != "raw" {
		t.Fatalf("List = %+v", vols)
	}
	if v, err := open(t, dir).Get("zeta"); err != nil || v.SizeGiB != 3 {
		t.Fatalf("Get after reopen = %+v %v", v, err)
	}
	if _, err := s.Get("nope"); !errors.Is(err, volume.ErrNotFound) {
		t.Fatalf("Get(nope) = %v, want ErrNotFound", err)
	}
	if err := s.Delete("alpha"); err != nil {
		t.Fatal(err)
	}
	if err := s.Delete("alpha"); !errors.Is(err, volume.ErrNotFound) {
		t.Fatalf("second Delete = %v, want ErrNotFound", err)
	}
	if got := names(t, dir); !slices.Equal(got, []string{"zeta.json", "zeta.qcow2"}) {
		t.Fatalf("files after delete: %v", got)
	}
	for _, bad := range []volume.Volume{{ID: "../x", Format: "raw", SizeGiB: 1}, {ID: ".x", Format: "raw", SizeGiB: 1}, {ID: "x", Format: "xfs", SizeGiB: 1}, {ID: "x", Format: "raw"}} {
		if err := s.Create(context.Background(), bad); err == nil {
			t.Errorf("Create(%+v) succeeded", bad)
		}
	}
}

// TestCreateExt4: the image holds an ext4 file system (qemu-img convert
// back to raw, then dumpe2fs).
func TestCreateExt4(t *testing.T) {
	for _, tool := range []string{"mkfs.ext4", "qemu-img", "dumpe2fs"} {
		if _, err := exec.LookPath(tool); err != nil {
			if os.Getenv("CI") != "" {
				t.Fatalf("%s not installed", tool)
			}
			t.Skipf("%s not installed", tool)
		}
	}
	dir := t.TempDir()
	s := open(t, dir)
	if err := s.Create(context.Background(), volume.Volume{ID: "fs", Format: volume.FormatExt4, SizeGiB: 1}); err != nil {
		t.Fatal(err)
	}
	raw := filepath.Join(t.TempDir(), "fs.raw")
	if out, err := exec.Command("qemu-img", "convert", "-O", "raw", s.Path("fs"), raw).CombinedOutput(); err != nil {
		t.Fatalf("qemu-img convert: %v\n%s", err, out)
	}
	out, err := exec.Command("dumpe2fs", "-h", raw).CombinedOutput()
	if err != nil || !strings.Contains(string(out), "Filesystem volume name:   fs") {
		t.Fatalf("dumpe2fs: %v\n%s", err, out)
	}
	if got := names(t, dir); !slices.Equal(got, []string{"fs.json", "fs.qcow2"}) {
		t.Fatalf("files: %v", got)
	}
}

// TestOpenRemovesLeftovers: an image without metadata (a create cut short)
// and temporary files go at Open; a whole volume stays.
func TestOpenRemovesLeftovers(t *testing.T) {
	dir := t.TempDir()
	s := open(t, dir)
	if err := s.Create(context.Background(), volume.Volume{ID: "keep", Format: volume.FormatRaw, SizeGiB: 1}); err != nil {
		t.Fatal(err)
	}
	for _, n := range []string{"half.qcow2", ".format-123.raw", ".keep.json.tmp-abc"} {
		if err := os.WriteFile(filepath.Join(dir, n), []byte("x"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	open(t, dir)
	if got := names(t, dir); !slices.Equal(got, []string{"keep.json", "keep.qcow2"}) {
		t.Fatalf("files after Open: %v", got)
	}
	// A create over the leftover image's name works.
	if err := os.WriteFile(filepath.Join(dir, "half.qcow2"), []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := s.Create(context.Background(), volume.Volume{ID: "half", Format: volume.FormatRaw, SizeGiB: 1}); err != nil {
		t.Fatal(err)
	}
}

// TestAdopt: a VM-owned image becomes a volume by a hard link (same inode,
// no copy); an id in use is ErrExists and links nothing.
func TestAdopt(t *testing.T) {
	dir := t.TempDir()
	s := open(t, filepath.Join(dir, "volumes"))
	src := filepath.Join(dir, "data0.qcow2")
	if err := qcow2.Create(src, 1<<30); err != nil {
		t.Fatal(err)
	}
	if err := s.Adopt(volume.Volume{ID: "vm1-data0", Format: volume.FormatRaw, SizeGiB: 1}, src); err != nil {
		t.Fatal(err)
	}
	a, _ := os.Stat(src)
	b, err := os.Stat(s.Path("vm1-data0"))
	if err != nil || !os.SameFile(a, b) {
		t.Fatalf("adopted image is not the same file: %v", err)
	}
	if err := s.Adopt(volume.Volume{ID: "vm1-data0", Format: volume.FormatRaw, SizeGiB: 1}, src); !errors.Is(err, volume.ErrExists) {
		t.Fatalf("second Adopt = %v, want ErrExists", err)
	}
	if v, err := s.Get("vm1-data0"); err != nil || v.SizeGiB != 1 {
		t.Fatalf("Get = %+v %v", v, err)
	}
}
