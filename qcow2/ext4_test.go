package qcow2_test

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"vmhost/qcow2"
)

// TestCreateExt4: the volume is a qcow2 of the requested size whose
// contents are an ext4 file system (qemu-img convert back to raw, then
// dumpe2fs), replacing a blank volume in place.
func TestCreateExt4(t *testing.T) {
	for _, tool := range []string{"mkfs.ext4", "qemu-img", "dumpe2fs"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("%s not installed", tool)
		}
	}
	dir := t.TempDir()
	dst := filepath.Join(dir, "data0.qcow2")
	if err := qcow2.Create(dst, 1<<30); err != nil { // the engine's blank volume
		t.Fatal(err)
	}
	if err := qcow2.CreateExt4(context.Background(), dst, 1<<30, "data0"); err != nil {
		t.Fatal(err)
	}
	h, err := qcow2.ReadHeaderFile(dst)
	if err != nil {
		t.Fatal(err)
	}
	if h.Size != 1<<30 {
		t.Errorf("virtual size %d, want 1 GiB", h.Size)
	}
	if out, err := exec.Command("qemu-img", "check", dst).CombinedOutput(); err != nil {
		t.Fatalf("qemu-img check: %v\n%s", err, out)
	}
	fi, _ := os.Stat(dst)
	if fi.Size() > 64<<20 {
		t.Errorf("formatted 1 GiB volume takes %d bytes; want it sparse", fi.Size())
	}
	raw := filepath.Join(dir, "back.raw")
	if out, err := exec.Command("qemu-img", "convert", "-f", "qcow2", "-O", "raw", dst, raw).CombinedOutput(); err != nil {
		t.Fatalf("qemu-img convert: %v\n%s", err, out)
	}
	out, err := exec.Command("dumpe2fs", "-h", raw).CombinedOutput()
	if err != nil {
		t.Fatalf("dumpe2fs: %v\n%s", err, out)
	}
	if !strings.Contains(string(out), "Filesystem volume name:   data0") || !strings.Contains(string(out), "has_journal") {
		t.Errorf("dumpe2fs:\n%s", out)
	}
	left, _ := filepath.Glob(filepath.Join(dir, ".*"))
	if len(left) > 0 {
		t.Errorf("temp files left: %v", left)
	}
}
