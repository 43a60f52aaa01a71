package main

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"vmhost/appvm"
	"vmhost/ociimage/ocitest"
)

func TestImageImportCommand(t *testing.T) {
	if _, err := exec.LookPath("mkfs.ext4"); err != nil {
		t.Skip("mkfs.ext4 not installed (apt-get install e2fsprogs)")
	}
	dir := t.TempDir()
	state := filepath.Join(dir, "state")
	src := filepath.Join(dir, "app.tar")
	digest := ocitest.Image{
		Layers: [][]byte{ocitest.Layer(t, ocitest.Dir("etc/", 0o755), ocitest.File("etc/motd", "hello\n", 0o644, 0, 0))},
		Config: ocitest.Config{Cmd: []string{"/bin/sh"}, Env: []string{"A=1"}},
	}.WriteTar(t, src)
	var nonRoot []string
	if os.Geteuid() != 0 {
		nonRoot = []string{"--ignore-owners", "--skip-devices"}
	}

	// A relative FILE is taken from the working directory.
	args := append([]string{"image", "import", "--state-dir", state, "--id", "app"}, nonRoot...)
	out, errOut, code := vmhost(t, dir, append(args, "app.tar")...)
	if code != 0 {
		t.Fatalf("image import = %d, stderr %s", code, errOut)
	}
	var img appvm.Image
	if err := json.Unmarshal([]byte(out), &img); err != nil {
		t.Fatalf("stdout is not the image as JSON: %v\n%s", err, out)
	}
	if img.ID != "app" || img.Status != appvm.StatusReady || img.BuildDigest != digest || img.Source != src ||
		!slices.Equal(img.Cmd, []string{"/bin/sh"}) || img.SizeBytes == 0 {
		t.Errorf("printed image = %+v, want app ready with build_digest %s", img, digest)
	}
	cat := appvm.Catalog{Dir: filepath.Join(state, "appvm-images")}
	stored, err := cat.Get("app")
	if err != nil || stored.BuildDigest != digest || stored.Status != appvm.StatusReady {
		t.Fatalf("catalog entry = %+v, %v", stored, err)
	}
	if _, err := os.Stat(cat.RootFS("app")); err != nil {
		t.Errorf("rootfs: %v", err)
	}

	// A bad archive: exit 1 with the reason; the entry records it.
	bad := filepath.Join(dir, "bad.tar")
	if err := os.WriteFile(bad, []byte("garbage"), 0o644); err != nil {
		t.Fatal(err)
	}
	out, errOut, code = vmhost(t, dir, append(append([]string{"image", "import", "--state-dir", state, "--id", "broken"}, nonRoot...), bad)...)
	if code != 1 || out != "" || !strings.Contains(errOut, "vmhost image import: ") {
		t.Errorf("import of a bad archive = %d, stdout %q, stderr %q; want 1 with the reason", code, out, errOut)
	}
	if b, err := cat.Get("broken"); err != nil || b.Status != appvm.StatusFailed || b.Failure == "" ||
		!strings.Contains(errOut, b.Failure) {
		t.Errorf("entry after the failed import = %+v, %v; want failed with the printed reason", b, err)
	}

	for _, c := range []struct {
		args []string
		code int
	}{
		{[]string{"image"}, 2},
		{[]string{"image", "frob"}, 2},
		{[]string{"image", "import", "--id", "x", src}, 2},
		{[]string{"image", "import", "--state-dir", state, src}, 2},
		{[]string{"image", "import", "--state-dir", state, "--id", "x"}, 2},
		{[]string{"image", "import", "--state-dir", state, "--id", "../x", src}, 1},
		{[]string{"image", "import", "--state-dir", state, "--id", "x", filepath.Join(dir, "missing.tar")}, 1},
	} {
		if out, errOut, code := vmhost(t, dir, c.args...); code != c.code || out != "" {
			t.Errorf("vmhost %q = %d, stdout %q, stderr %q; want %d and no stdout", c.args, code, out, errOut, c.code)
		}
	}
	if _, err := cat.Get("x"); err == nil {
		t.Error("a refused import wrote a catalog entry")
	}
}
