package ociimage

import (
	"archive/tar"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"vmhost/qcow2"
)

// testLayers are three layers exercising what Import must keep: owners,
// modes, symlinks, hard links within and across layers, devices, file and
// opaque whiteouts, a write through an in-root symlink, a directory merge,
// and an xattr.
func testLayers(t testing.TB) [][]byte {
	l1 := layerTar(t,
		dirEnt("./", 0o755, 0, 0),
		dirEnt("bin/", 0o755, 0, 0),
		fileEnt("bin/app", "#!/bin/sh\necho app\n", 0o4755, 0, 0),
		hardlinkEnt("bin/app2", "bin/app"),
		dirEnt("etc/", 0o755, 0, 0),
		fileEnt("etc/passwd", "root:x:0:0::/root:/bin/sh\n", 0o644, 0, 0),
		fileEnt("etc/shadow", "root:*:1::::::\n", 0o640, 0, 42),
		dirEnt("srv/", 0o755, 1000, 1000),
		fileEnt("srv/data.txt", "hello", 0o600, 1000, 1000),
		dirEnt("tmp/", 0o1777, 0, 0),
		dirEnt("sgid/", 0o2775, 0, 50),
		dirEnt("usr/", 0o755, 0, 0),
		dirEnt("usr/lib/", 0o755, 0, 0),
		fileEnt("usr/lib/libx.so", "ELF", 0o755, 0, 0),
		symlinkEnt("lib", "usr/lib"),
		dirEnt("gone/", 0o755, 0, 0),
		fileEnt("gone/a", "a", 0o644, 0, 0),
		fileEnt("gone/b", "b", 0o644, 0, 0),
		fileEnt("removeme", "x", 0o644, 0, 0),
		dirEnt("opq/", 0o755, 0, 0),
		fileEnt("opq/old1", "old", 0o644, 0, 0),
		dirEnt("opq/sub/", 0o755, 0, 0),
		fileEnt("opq/sub/old2", "old", 0o644, 0, 0),
		dirEnt("swap/", 0o755, 0, 0),
		fileEnt("swap/inner", "inner", 0o644, 0, 0),
		fileEnt("swap2", "file", 0o644, 0, 0),
		dirEnt("dev/", 0o755, 0, 0),
		ent{hdr: tar.Header{Typeflag: tar.TypeChar, Name: "dev/null", Mode: 0o666, Devmajor: 1, Devminor: 3}},
		ent{hdr: tar.Header{Typeflag: tar.TypeFifo, Name: "dev/fifo", Mode: 0o600, Uid: 7, Gid: 8}},
	)
	l2 := layerTar(t,
		fileEnt("gone/.wh.a", "", 0o644, 0, 0),
		fileEnt(".wh.removeme", "", 0o644, 0, 0),
		fileEnt("nodir/.wh.never", "", 0o644, 0, 0), // hides nothing, creates nothing
		dirEnt("opq/", 0o755, 0, 0),
		fileEnt("opq/.wh..wh..opq", "", 0o644, 0, 0),
		fileEnt("opq/new", "new", 0o644, 0, 0),
		fileEnt("lib/liby.so", "ELF2", 0o755, 0, 0),
		fileEnt("etc/passwd", "root:x:0:0::/root:/bin/sh\napp:x:1000:1000::/srv:/bin/sh\n", 0o644, 0, 0),
		dirEnt("srv/", 0o750, 1000, 1000),
		fileEnt("swap", "now a file", 0o600, 0, 0),
		dirEnt("swap2/", 0o700, 0, 0),
		fileEnt("swap2/inner", "now a dir", 0o644, 0, 0),
	)
	hostname := fileEnt("etc/hostname", "appvm\n", 0o644, 0, 0)
	hostname.hdr.PAXRecords = map[string]string{"SCHILY.xattr.user.origin": "layer3"}
	l3 := layerTar(t,
		hardlinkEnt("bin/app3", "bin/app"),
		hostname,
	)
	return [][]byte{l1, l2, l3}
}

func TestImportSources(t *testing.T) {
	requireTools(t)
	requireRoot(t)
	layers := testLayers(t)
	tests := []struct {
		name string
		// make writes the source under dir and returns its path and the
		// expected build digest.
		make func(t *testing.T, dir string) (string, string)
	}{
		{"oci dir, gzip layers", func(t *testing.T, dir string) (string, string) {
			files, md := newLayout(t, true, layers...).files(t)
			src := filepath.Join(dir, "layout")
			writeDir(t, src, files)
			return src, md
		}},
		{"oci tar, plain layers", func(t *testing.T, dir string) (string, string) {
			files, md := newLayout(t, false, layers...).files(t)
			src := filepath.Join(dir, "layout.tar")
			archive(t, src, sortedNames(files), files)
			return src, md
		}},
		{"docker save", func(t *testing.T, dir string) (string, string) {
			src := filepath.Join(dir, "save.tar")
			return src, dockerSave(t, src, layers)
		}},
		{"docker save, gzipped", func(t *testing.T, dir string) (string, string) {
			src := filepath.Join(dir, "save.tar")
			cd := dockerSave(t, src, layers)
			b, err := os.ReadFile(src)
			if err != nil {
				t.Fatal(err)
			}
			gz := src + ".gz"
			if err := os.WriteFile(gz, gzipped(t, b), 0o644); err != nil {
				t.Fatal(err)
			}
			return gz, cd
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			src, wantDigest := tt.make(t, dir)
			dst := filepath.Join(dir, "images", "app")
			img, err := Import(context.Background(), src, dst, Options{})
			if err != nil {
				t.Fatalf("Import: %v", err)
			}
			if img.BuildDigest != wantDigest {
				t.Errorf("BuildDigest = %s, want %s", img.BuildDigest, wantDigest)
			}
			checkImage(t, img, dst)
			checkTree(t, rawImage(t, img))
		})
	}
}

func checkImage(t *testing.T, img *Image, dst string) {
	t.Helper()
	if want := filepath.Join(dst, RootfsName); img.RootfsPath != want {
		t.Errorf("RootfsPath = %q, want %q", img.RootfsPath, want)
	}
	ents, err := os.ReadDir(dst)
	if err != nil {
		t.Fatal(err)
	}
	if len(ents) != 1 || ents[0].Name() != RootfsName {
		t.Errorf("dstDir holds %v, want only %s", ents, RootfsName)
	}
	h, err := qcow2.ReadHeaderFile(img.RootfsPath)
	if err != nil {
		t.Fatalf("reading qcow2 header: %v", err)
	}
	if int64(h.Size) != img.SizeBytes || img.SizeBytes < 64<<20 {
		t.Errorf("qcow2 virtual size = %d, SizeBytes = %d; want equal and at least 64 MiB", h.Size, img.SizeBytes)
	}
	want := &Image{
		BuildDigest:  img.BuildDigest,
		ConfigDigest: img.ConfigDigest,
		RootfsPath:   img.RootfsPath,
		SizeBytes:    img.SizeBytes,
		Created:      testTime,
		OS:           "linux",
		Architecture: "amd64",
		Entrypoint:   []string{"/bin/app"},
		Cmd:          []string{"--serve", "8080"},
		Env:          []string{"PATH=/usr/bin:/bin", "GREETING=hi"},
		WorkingDir:   "/srv",
		User:         "1000:1000",
		Healthcheck: &Healthcheck{
			Test:            []string{"CMD-SHELL", "wget -q localhost:8080"},
			IntervalSecs:    30,
			TimeoutSecs:     2, // 1.5 s, rounded up
			StartPeriodSecs: 5,
			Retries:         3,
		},
		StopSignal: "SIGTERM",
		Labels:     map[string]string{"org.example": "yes"},
		Layers:     3,
	}
	if !reflect.DeepEqual(img, want) {
		t.Errorf("Import() =\n%+v\nwant\n%+v", img, want)
	}
}

// checkTree reads the ext4 image back with debugfs.
func checkTree(t *testing.T, raw string) {
	t.Helper()
	type want struct {
		path     string
		typ      string
		mode     int64
		uid, gid int
	}
	for _, w := range []want{
		{"/", "directory", 0o755, 0, 0},
		{"/bin/app", "regular", 0o4755, 0, 0},
		{"/etc/shadow", "regular", 0o640, 0, 42},
		{"/srv", "directory", 0o750, 1000, 1000},
		{"/srv/data.txt", "regular", 0o600, 1000, 1000},
		{"/tmp", "directory", 0o1777, 0, 0},
		{"/sgid", "directory", 0o2775, 0, 50},
		{"/lib", "symlink", 0o777, 0, 0},
		{"/usr/lib/liby.so", "regular", 0o755, 0, 0},
		{"/gone/b", "regular", 0o644, 0, 0},
		{"/opq/new", "regular", 0o644, 0, 0},
		{"/dev/fifo", "FIFO", 0o600, 7, 8},
		{"/dev/null", "character special", 0o666, 0, 0},
		{"/swap", "regular", 0o600, 0, 0},
		{"/swap2", "directory", 0o700, 0, 0},
	} {
		got := stat(t, raw, w.path)
		if got.typ != w.typ || got.mode != w.mode || got.uid != w.uid || got.gid != w.gid {
			t.Errorf("%s: type %s mode %#o owner %d:%d, want %s %#o %d:%d", w.path, got.typ, got.mode, got.uid, got.gid, w.typ, w.mode, w.uid, w.gid)
		}
	}
	for _, gone := range []string{"/gone/a", "/removeme", "/opq/old1", "/opq/sub", "/nodir"} {
		if exists(t, raw, gone) {
			t.Errorf("%s exists; a whiteout should have removed it", gone)
		}
	}
	for p, body := range map[string]string{
		"/etc/passwd":      "root:x:0:0::/root:/bin/sh\napp:x:1000:1000::/srv:/bin/sh\n",
		"/srv/data.txt":    "hello",
		"/bin/app3":        "#!/bin/sh\necho app\n",
		"/usr/lib/libx.so": "ELF",
		"/etc/hostname":    "appvm\n",
		"/swap":            "now a file",
		"/swap2/inner":     "now a dir",
	} {
		if got := debugfs(t, raw, "cat "+p); got != body {
			t.Errorf("cat %s = %q, want %q", p, got, body)
		}
	}
	app, app2, app3 := stat(t, raw, "/bin/app"), stat(t, raw, "/bin/app2"), stat(t, raw, "/bin/app3")
	if app.inode != app2.inode || app.inode != app3.inode || app.links != 3 {
		t.Errorf("hard links: inodes %d %d %d, links %d; want one inode with 3 links", app.inode, app2.inode, app3.inode, app.links)
	}
	if s := stat(t, raw, "/lib").raw; !strings.Contains(s, `Fast link dest: "usr/lib"`) {
		t.Errorf("/lib is not a symlink to usr/lib:\n%s", s)
	}
	if s := stat(t, raw, "/dev/null").raw; !strings.Contains(s, "Device major/minor number: 01:03") {
		t.Errorf("/dev/null is not device 1:3:\n%s", s)
	}
	mtime := fmt.Sprintf("mtime: 0x%08x", testTime.Unix())
	for _, p := range []string{"/srv/data.txt", "/srv", "/lib", "/bin"} {
		if s := stat(t, raw, p).raw; !strings.Contains(s, mtime) {
			t.Errorf("%s: want %s in\n%s", p, mtime, s)
		}
	}
	if s := debugfs(t, raw, "ea_get /etc/hostname user.origin"); !strings.Contains(s, "layer3") {
		t.Errorf("xattr user.origin of /etc/hostname = %q, want layer3", s)
	}
	ls := debugfs(t, raw, "ls -l /opq")
	if strings.Contains(ls, "old1") || !strings.Contains(ls, "new") {
		t.Errorf("ls -l /opq after the opaque whiteout:\n%s", ls)
	}
}

func TestImportReplacesAndKeepsDstDir(t *testing.T) {
	requireTools(t)
	dir := t.TempDir()
	files, _ := newLayout(t, true, layerTar(t, fileEnt("a", "1", 0o644, 0, 0))).files(t)
	src := filepath.Join(dir, "layout")
	writeDir(t, src, files)
	dst := filepath.Join(dir, "img")
	if err := os.MkdirAll(dst, 0o755); err != nil {
		t.Fatal(err)
	}
	// The catalog's own file in dstDir must survive imports.
	if err := os.WriteFile(filepath.Join(dst, "image.json"), []byte("{}"), 0o644); err != nil {
		t.Fatal(err)
	}
	for i := range 2 {
		if _, err := Import(context.Background(), src, dst, asTestUser(Options{})); err != nil {
			t.Fatalf("import %d: %v", i+1, err)
		}
	}
	ents, _ := os.ReadDir(dst)
	var names []string
	for _, e := range ents {
		names = append(names, e.Name())
	}
	if want := []string{"image.json", RootfsName}; !reflect.DeepEqual(names, want) {
		t.Errorf("dstDir = %v, want %v", names, want)
	}
}

// TestImportRefusesNonRegularRootfs: a symlink where rootfs.qcow2 belongs
// is not replaced (it was, before the install went through atomicfile), and
// the import leaves no temp dir behind.
func TestImportRefusesNonRegularRootfs(t *testing.T) {
	requireTools(t)
	dir := t.TempDir()
	files, _ := newLayout(t, true, layerTar(t, fileEnt("a", "1", 0o644, 0, 0))).files(t)
	src := filepath.Join(dir, "layout")
	writeDir(t, src, files)
	dst := filepath.Join(dir, "img")
	if err := os.MkdirAll(dst, 0o755); err != nil {
		t.Fatal(err)
	}
	elsewhere := filepath.Join(dir, "elsewhere.qcow2")
	if err := os.Symlink(elsewhere, filepath.Join(dst, RootfsName)); err != nil {
		t.Fatal(err)
	}
	_, err := Import(context.Background(), src, dst, asTestUser(Options{}))
	if err == nil || !strings.Contains(err.Error(), "not a regular file") {
		t.Fatalf("Import over a symlinked %s = %v, want a not-a-regular-file error", RootfsName, err)
	}
	if fi, err := os.Lstat(filepath.Join(dst, RootfsName)); err != nil || fi.Mode().Type() != fs.ModeSymlink {
		t.Errorf("symlink replaced: %v, %v", fi, err)
	}
	if _, err := os.Lstat(elsewhere); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("symlink target written: %v", err)
	}
	if ents, _ := os.ReadDir(dst); len(ents) != 1 {
		t.Errorf("dstDir holds %d entries, want only the symlink", len(ents))
	}
}

func TestImportSelectsPlatform(t *testing.T) {
	requireTools(t)
	dir := t.TempDir()
	amd := newLayout(t, false, layerTar(t, fileEnt("which", "amd64", 0o644, 0, 0)))
	arm := newLayout(t, false, layerTar(t, fileEnt("which", "arm64", 0o644, 0, 0)))
	amdFiles, amdDigest := amd.files(t)
	armFiles, armDigest := arm.files(t)
	files := map[string][]byte{}
	for _, m := range []map[string][]byte{amdFiles, armFiles} {
		for k, v := range m {
			files[k] = v
		}
	}
	sizeOf := func(d string) int { return len(files["blobs/sha256/"+strings.TrimPrefix(d, "sha256:")]) }
	inner := mustJSON(t, map[string]any{
		"schemaVersion": 2, "mediaType": mediaOCIIndex,
		"manifests": []map[string]any{
			{"mediaType": mediaOCIManifest, "digest": armDigest, "size": sizeOf(armDigest), "platform": map[string]string{"os": "linux", "architecture": "arm64"}},
			{"mediaType": mediaOCIManifest, "digest": amdDigest, "size": sizeOf(amdDigest), "platform": map[string]string{"os": "linux", "architecture": "amd64"}},
		},
	})
	innerDigest := digestOf(inner)
	files["blobs/sha256/"+strings.TrimPrefix(innerDigest, "sha256:")] = inner
	files["index.json"] = mustJSON(t, map[string]any{
		"schemaVersion": 2, "mediaType": mediaOCIIndex,
		"manifests": []map[string]any{{"mediaType": mediaOCIIndex, "digest": innerDigest, "size": len(inner)}},
	})
	src := filepath.Join(dir, "layout")
	writeDir(t, src, files)
	for _, tt := range []struct{ platform, want, digest string }{
		{"linux/amd64", "amd64", amdDigest},
		{"linux/arm64", "arm64", armDigest},
	} {
		img, err := Import(context.Background(), src, filepath.Join(dir, tt.want), asTestUser(Options{Platform: tt.platform}))
		if err != nil {
			t.Fatalf("Import(%s): %v", tt.platform, err)
		}
		if img.BuildDigest != tt.digest {
			t.Errorf("Import(%s).BuildDigest = %s, want %s", tt.platform, img.BuildDigest, tt.digest)
		}
		if got := debugfs(t, rawImage(t, img), "cat /which"); got != tt.want {
			t.Errorf("Import(%s): /which = %q, want %q", tt.platform, got, tt.want)
		}
	}
	_, err := Import(context.Background(), src, filepath.Join(dir, "s390x"), Options{Platform: "linux/s390x"})
	if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "no manifest for platform linux/s390x") {
		t.Errorf("Import(linux/s390x) error = %v, want no manifest for the platform", err)
	}
}

// TestImportDockerSaveSharedLayer imports a docker save tarball whose third
// layer repeats the first, stored as a symlink to it as docker does: the
// file the second layer deletes comes back.
func TestImportDockerSaveSharedLayer(t *testing.T) {
	requireTools(t)
	dir := t.TempDir()
	add := layerTar(t, fileEnt("x", "x", 0o644, 0, 0))
	del := layerTar(t, fileEnt(".wh.x", "", 0o644, 0, 0), fileEnt("y", "y", 0o644, 0, 0))
	src := filepath.Join(dir, "save.tar")
	dockerSave(t, src, [][]byte{add, del, add})
	img, err := Import(context.Background(), src, filepath.Join(dir, "img"), asTestUser(Options{}))
	if err != nil {
		t.Fatalf("Import: %v", err)
	}
	raw := rawImage(t, img)
	for p, body := range map[string]string{"/x": "x", "/y": "y"} {
		if got := debugfs(t, raw, "cat "+p); got != body {
			t.Errorf("cat %s = %q, want %q", p, got, body)
		}
	}
}

// TestImportManySmallFiles checks the inode rule: 20000 empty files need
// more inodes than mkfs.ext4 would give a file system this small.
func TestImportManySmallFiles(t *testing.T) {
	requireTools(t)
	dir := t.TempDir()
	var ents []ent
	for d := range 100 {
		ents = append(ents, dirEnt(fmt.Sprintf("d%02d/", d), 0o755, 0, 0))
		for f := range 200 {
			ents = append(ents, fileEnt(fmt.Sprintf("d%02d/f%03d", d, f), "", 0o644, 0, 0))
		}
	}
	files, _ := newLayout(t, true, layerTar(t, ents...)).files(t)
	src := filepath.Join(dir, "layout")
	writeDir(t, src, files)
	img, err := Import(context.Background(), src, filepath.Join(dir, "img"), asTestUser(Options{}))
	if err != nil {
		t.Fatalf("Import: %v", err)
	}
	raw := rawImage(t, img)
	if !exists(t, raw, "/d99/f199") {
		t.Errorf("/d99/f199 missing")
	}
	out := debugfs(t, raw, "stats")
	var count, free int
	if m := regexp.MustCompile(`Inode count:\s+(\d+)`).FindStringSubmatch(out); m != nil {
		count, _ = strconv.Atoi(m[1])
	}
	if m := regexp.MustCompile(`Free inodes:\s+(\d+)`).FindStringSubmatch(out); m != nil {
		free, _ = strconv.Atoi(m[1])
	}
	if used := count - free; used < 20100 || free < 4096 {
		t.Errorf("inodes: %d used, %d free; want >= 20100 used and >= 4096 spare", used, free)
	}
}

func TestImportCancelled(t *testing.T) {
	requireTools(t)
	dir := t.TempDir()
	files, _ := newLayout(t, true, layerTar(t, fileEnt("a", "1", 0o644, 0, 0))).files(t)
	src := filepath.Join(dir, "layout")
	writeDir(t, src, files)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	dst := filepath.Join(dir, "img")
	if _, err := Import(ctx, src, dst, Options{}); !errors.Is(err, context.Canceled) {
		t.Fatalf("Import with a cancelled context: %v, want context.Canceled", err)
	}
	if _, err := os.Stat(dst); !os.IsNotExist(err) {
		t.Errorf("dstDir left behind after cancel (stat: %v)", err)
	}
}

func TestImportSelectsRef(t *testing.T) {
	requireTools(t)
	dir := t.TempDir()
	a := newLayout(t, false, layerTar(t, fileEnt("which", "a", 0o644, 0, 0)))
	a.ref = "a:1"
	b := newLayout(t, false, layerTar(t, fileEnt("which", "b", 0o644, 0, 0)))
	b.ref = "b:1"
	aFiles, _ := a.files(t)
	bFiles, _ := b.files(t)
	var aIndex, bIndex ociIndex
	if err := json.Unmarshal(aFiles["index.json"], &aIndex); err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(bFiles["index.json"], &bIndex); err != nil {
		t.Fatal(err)
	}
	for k, v := range bFiles {
		aFiles[k] = v
	}
	aFiles["index.json"] = mustJSON(t, ociIndex{SchemaVersion: 2, MediaType: mediaOCIIndex, Manifests: append(aIndex.Manifests, bIndex.Manifests...)})
	src := filepath.Join(dir, "layout.tar")
	archive(t, src, sortedNames(aFiles), aFiles)

	for _, ref := range []string{"a:1", "b:1"} {
		img, err := Import(context.Background(), src, filepath.Join(dir, ref), asTestUser(Options{Ref: ref}))
		if err != nil {
			t.Fatalf("Import(Ref %s): %v", ref, err)
		}
		if got, want := debugfs(t, rawImage(t, img), "cat /which"), ref[:1]; got != want {
			t.Errorf("Import(Ref %s): /which = %q, want %q", ref, got, want)
		}
	}
	for _, tt := range []struct{ ref, reason string }{
		{"", "invalid image: the index holds 2 images for linux/amd64; choose one by name (a:1, b:1)"},
		{"c:1", `invalid image: no image named "c:1" in the index (have a:1, b:1)`},
	} {
		_, err := Import(context.Background(), src, filepath.Join(dir, "none"), Options{Ref: tt.ref, Platform: "linux/amd64"})
		if err == nil || err.Error() != tt.reason {
			t.Errorf("Import(Ref %q) error = %v, want %q", tt.ref, err, tt.reason)
		}
	}
}

func TestRemoveStale(t *testing.T) {
	dst := t.TempDir()
	for _, d := range []string{".import-123/rootfs/etc", "keep-dir"} {
		if err := os.MkdirAll(filepath.Join(dst, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	for _, f := range []string{RootfsName, "image.json", ".import-file"} {
		if err := os.WriteFile(filepath.Join(dst, f), nil, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := RemoveStale(dst); err != nil {
		t.Fatalf("RemoveStale: %v", err)
	}
	ents, _ := os.ReadDir(dst)
	var names []string
	for _, e := range ents {
		names = append(names, e.Name())
	}
	if want := []string{".import-file", "image.json", "keep-dir", RootfsName}; !reflect.DeepEqual(names, want) {
		t.Errorf("after RemoveStale: %v, want %v", names, want)
	}
	if err := RemoveStale(filepath.Join(dst, "missing")); err != nil {
		t.Errorf("RemoveStale(missing dir) = %v, want nil", err)
	}
}

// TestImportZeroFilledFile checks that zero blocks become holes (in the
// staging tree, the ext4 image and the qcow2) without changing content.
func TestImportZeroFilledFile(t *testing.T) {
	requireTools(t)
	dir := t.TempDir()
	const size = 256 << 20
	body := make([]byte, size+10)
	copy(body[5000:], "data in the middle")
	copy(body[size:], "tail bytes")
	files, _ := newLayout(t, true, layerTar(t, fileEnt("big", string(body), 0o644, 0, 0))).files(t)
	src := filepath.Join(dir, "layout")
	writeDir(t, src, files)
	img, err := Import(context.Background(), src, filepath.Join(dir, "img"), asTestUser(Options{}))
	if err != nil {
		t.Fatalf("Import: %v", err)
	}
	raw := rawImage(t, img)
	st := stat(t, raw, "/big")
	if st.size != int64(len(body)) {
		t.Errorf("/big size = %d, want %d", st.size, len(body))
	}
	if m := regexp.MustCompile(`Blockcount: (\d+)`).FindStringSubmatch(st.raw); m == nil || len(m[1]) > 3 {
		t.Errorf("/big is not sparse in the ext4 image:\n%s", st.raw)
	}
	out := filepath.Join(dir, "big.out")
	debugfs(t, raw, "dump /big "+out)
	got, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, body) {
		t.Errorf("/big content differs after import")
	}
	fi, err := os.Stat(img.RootfsPath)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Size() > 64<<20 {
		t.Errorf("%s is %d bytes for a mostly zero file system", img.RootfsPath, fi.Size())
	}
}
