package main

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"vmhost/appvm"
	"vmhost/disk"
	"vmhost/ociimage/ocitest"
)

// buildsTempDir is a temp dir that may come to hold a catalog: the builds
// an import commits are sealed (immutable, as root), which TempDir's own
// cleanup cannot remove.
func buildsTempDir(t *testing.T) string {
	dir := t.TempDir()
	t.Cleanup(func() { disk.RemoveAll(dir) })
	return dir
}

func TestImageImportCommand(t *testing.T) {
	if _, err := exec.LookPath("mkfs.ext4"); err != nil {
		t.Skip("mkfs.ext4 not installed (apt-get install e2fsprogs)")
	}
	dir := buildsTempDir(t)
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
	if _, err := os.Stat(cat.RootFS(stored)); err != nil {
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

// zeroBombLayout writes an OCI layout whose one gzip layer holds a single
// file of gib GiB of zeros, built from a repeated gzip member (1 KiB of
// gzip per MiB). Its diff_id is the digest of the tar header alone, so the
// layer is never valid: the tests stop the import long before its end.
func zeroBombLayout(t *testing.T, dir string, gib int64) string {
	t.Helper()
	gz := func(b []byte) []byte {
		var buf bytes.Buffer
		zw, _ := gzip.NewWriterLevel(&buf, gzip.BestCompression)
		zw.Write(b)
		zw.Close()
		return buf.Bytes()
	}
	var hdr bytes.Buffer
	tw := tar.NewWriter(&hdr)
	if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: "big", Mode: 0o644, Size: gib << 30, ModTime: ocitest.ModTime}); err != nil {
		t.Fatal(err)
	}
	mib := gz(make([]byte, 1<<20))
	layer := bytes.NewBuffer(gz(hdr.Bytes()))
	for range gib << 10 {
		layer.Write(mib)
	}
	files, _ := ocitest.Image{Layers: [][]byte{hdr.Bytes()}}.Files(t)
	// Swap the layer blob for the bomb, keeping the config (diff_id of
	// the header) and rewriting the manifest and index around it.
	src := filepath.Join(dir, "bomb")
	bomb := layer.Bytes()
	for name, b := range files {
		if strings.HasPrefix(name, "blobs/") && bytes.Equal(b, hdr.Bytes()) {
			delete(files, name)
		}
	}
	var manifest map[string]any
	for name, b := range files {
		if strings.HasPrefix(name, "blobs/") && json.Unmarshal(b, &manifest) == nil && manifest["layers"] != nil {
			delete(files, name)
			break
		}
	}
	manifest["layers"] = []any{map[string]any{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": ocitest.Digest(bomb), "size": len(bomb)}}
	mb, _ := json.Marshal(manifest)
	files["blobs/sha256/"+strings.TrimPrefix(ocitest.Digest(bomb), "sha256:")] = bomb
	files["blobs/sha256/"+strings.TrimPrefix(ocitest.Digest(mb), "sha256:")] = mb
	files["index.json"], _ = json.Marshal(map[string]any{"schemaVersion": 2, "manifests": []any{map[string]any{
		"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": ocitest.Digest(mb), "size": len(mb)}}})
	for name, b := range files {
		p := filepath.Join(src, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return src
}

// TestImageImportInterrupted: SIGINT or SIGTERM stops a running import
// at once; it exits 1 saying so, leaves no staging and records the image
// as failed. The source unpacks to 64 GiB (allowed by its config), which
// would take minutes to read through.
func TestImageImportInterrupted(t *testing.T) {
	dir := t.TempDir()
	src := zeroBombLayout(t, dir, 64)
	cfg := filepath.Join(dir, "config.json")
	if err := os.WriteFile(cfg, []byte(`{"image_import_max_bytes": 1099511627776}`), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, sig := range []syscall.Signal{syscall.SIGTERM, syscall.SIGINT} {
		t.Run(sig.String(), func(t *testing.T) {
			state := filepath.Join(t.TempDir(), "state")
			cmd := exec.Command(binary(t), "image", "import", "--state-dir", state, "--id", "app", "--config", cfg,
				"--ignore-owners", "--skip-devices", src)
			var stdout, stderr bytes.Buffer
			cmd.Stdout, cmd.Stderr = &stdout, &stderr
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			exited := make(chan error, 1)
			go func() { exited <- cmd.Wait() }()
			// Signal once the big file is being written.
			imageDir := filepath.Join(state, "appvm-images", "app")
			for {
				if m, _ := filepath.Glob(filepath.Join(imageDir, ".next", ".import-*", "rootfs", "big")); len(m) > 0 {
					break
				}
				select {
				case err := <-exited:
					t.Fatalf("import ended before the signal: %v\n%s", err, stderr.String())
				case <-time.After(10 * time.Millisecond):
				}
			}
			if err := cmd.Process.Signal(sig); err != nil {
				t.Fatal(err)
			}
			var err error
			select {
			case err = <-exited:
			case <-time.After(time.Minute):
				cmd.Process.Kill()
				<-exited
				t.Fatalf("import still running a minute after %v", sig)
			}
			var ee *exec.ExitError
			if !errors.As(err, &ee) || ee.ExitCode() != 1 || stdout.Len() != 0 ||
				!strings.Contains(stderr.String(), "vmhost image import: interrupted ("+sig.String()+" signal received)") {
				t.Errorf("after %v: exit %v, stdout %q, stderr %q; want 1 saying it was interrupted", sig, err, stdout.String(), stderr.String())
			}
			ents, _ := os.ReadDir(imageDir)
			for _, e := range ents {
				if e.Name() != "image.json" {
					t.Errorf("left behind in %s: %s", imageDir, e.Name())
				}
			}
			img, err := appvm.Catalog{Dir: filepath.Join(state, "appvm-images")}.Get("app")
			if err != nil || img.Status != appvm.StatusFailed || img.Failure != "import cancelled: "+sig.String()+" signal received" {
				t.Errorf("catalog entry = %+v, %v; want failed, cancelled by the signal", img, err)
			}
		})
	}
}

// TestImageImportConfigLimits: --config's image_import_max_bytes applies
// to a CLI import, and the failure names it.
func TestImageImportConfigLimits(t *testing.T) {
	dir := t.TempDir()
	src := zeroBombLayout(t, dir, 1)
	cfg := filepath.Join(dir, "config.json")
	if err := os.WriteFile(cfg, []byte(`{"image_import_max_bytes": 1048576}`), 0o644); err != nil {
		t.Fatal(err)
	}
	state := filepath.Join(dir, "state")
	out, errOut, code := vmhost(t, dir, "image", "import", "--state-dir", state, "--id", "app", "--config", cfg,
		"--ignore-owners", "--skip-devices", src)
	if code != 1 || out != "" || !strings.Contains(errOut, "over an import limit: the unpacked content passes image_import_max_bytes (1048576 bytes)") {
		t.Errorf("import over the limit = %d, stdout %q, stderr %q; want 1 naming image_import_max_bytes", code, out, errOut)
	}
	if _, errOut, code := vmhost(t, dir, "image", "import", "--state-dir", state, "--id", "app", "--config", filepath.Join(dir, "missing.json"), src); code != 1 ||
		!strings.Contains(errOut, "missing.json") {
		t.Errorf("import with a missing --config = %d, stderr %q; want 1 naming the file", code, errOut)
	}
}
