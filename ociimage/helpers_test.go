package ociimage

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// testTime is the mtime of every entry the tests build.
var testTime = time.Date(2024, 5, 6, 7, 8, 9, 0, time.UTC)

// ent is one tar entry of a test layer.
type ent struct {
	hdr  tar.Header
	body string
}

func dirEnt(name string, mode int64, uid, gid int) ent {
	return ent{hdr: tar.Header{Typeflag: tar.TypeDir, Name: name, Mode: mode, Uid: uid, Gid: gid}}
}

func fileEnt(name, body string, mode int64, uid, gid int) ent {
	return ent{hdr: tar.Header{Typeflag: tar.TypeReg, Name: name, Mode: mode, Uid: uid, Gid: gid, Size: int64(len(body))}, body: body}
}

func symlinkEnt(name, target string) ent {
	return ent{hdr: tar.Header{Typeflag: tar.TypeSymlink, Name: name, Linkname: target, Mode: 0o777}}
}

func hardlinkEnt(name, target string) ent {
	return ent{hdr: tar.Header{Typeflag: tar.TypeLink, Name: name, Linkname: target}}
}

// layerTar builds an uncompressed layer tar.
func layerTar(t testing.TB, ents ...ent) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range ents {
		h := e.hdr
		if h.ModTime.IsZero() {
			h.ModTime = testTime
		}
		h.Format = tar.FormatPAX
		if err := tw.WriteHeader(&h); err != nil {
			t.Fatalf("writing tar header %q: %v", h.Name, err)
		}
		if _, err := io.WriteString(tw, e.body); err != nil {
			t.Fatal(err)
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

func gzipped(t testing.TB, b []byte) []byte {
	t.Helper()
	var buf bytes.Buffer
	zw := gzip.NewWriter(&buf)
	if _, err := zw.Write(b); err != nil {
		t.Fatal(err)
	}
	if err := zw.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

func digestOf(b []byte) string {
	sum := sha256.Sum256(b)
	return "sha256:" + hex.EncodeToString(sum[:])
}

func mustJSON(t testing.TB, v any) []byte {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// testConfig is an image config with workload defaults for layers whose
// uncompressed tars are plain.
func testConfig(t testing.TB, plain [][]byte) []byte {
	var diffIDs []string
	for _, p := range plain {
		diffIDs = append(diffIDs, digestOf(p))
	}
	return mustJSON(t, map[string]any{
		"created":      "2024-05-06T07:08:09Z",
		"architecture": "amd64",
		"os":           "linux",
		"config": map[string]any{
			"User":       "1000:1000",
			"Env":        []string{"PATH=/usr/bin:/bin", "GREETING=hi"},
			"Entrypoint": []string{"/bin/app"},
			"Cmd":        []string{"--serve", "8080"},
			"WorkingDir": "/srv",
			"StopSignal": "SIGTERM",
			"Labels":     map[string]string{"org.example": "yes"},
			"Healthcheck": map[string]any{
				"Test":        []string{"CMD-SHELL", "wget -q localhost:8080"},
				"Interval":    int64(30 * time.Second),
				"Timeout":     int64(1500 * time.Millisecond),
				"StartPeriod": int64(5 * time.Second),
				"Retries":     3,
			},
		},
		"rootfs": map[string]any{"type": "layers", "diff_ids": diffIDs},
	})
}

// ociLayout describes an OCI image layout the tests write.
type ociLayout struct {
	layers  [][]byte // blobs as stored (maybe gzip)
	plain   [][]byte // the same, uncompressed, for diff_ids
	config  []byte
	ref     string
	skipped map[int]bool // layer blobs left out
}

func newLayout(t testing.TB, gz bool, layers ...[]byte) *ociLayout {
	l := &ociLayout{plain: layers, ref: "example.com/app:1"}
	for _, p := range layers {
		if gz {
			p = gzipped(t, p)
		}
		l.layers = append(l.layers, p)
	}
	l.config = testConfig(t, layers)
	return l
}

// files returns the layout as name → content, and the manifest digest.
func (l *ociLayout) files(t testing.TB) (map[string][]byte, string) {
	files := map[string][]byte{"oci-layout": []byte(`{"imageLayoutVersion":"1.0.0"}`)}
	blob := func(b []byte) string {
		d := digestOf(b)
		files["blobs/sha256/"+strings.TrimPrefix(d, "sha256:")] = b
		return d
	}
	var layerDescs []map[string]any
	for i, b := range l.layers {
		mt := "application/vnd.oci.image.layer.v1.tar"
		if bytes.HasPrefix(b, gzipMagic) {
			mt += "+gzip"
		}
		d := digestOf(b)
		if !l.skipped[i] {
			blob(b)
		}
		layerDescs = append(layerDescs, map[string]any{"mediaType": mt, "digest": d, "size": len(b)})
	}
	manifest := mustJSON(t, map[string]any{
		"schemaVersion": 2,
		"mediaType":     mediaOCIManifest,
		"config":        map[string]any{"mediaType": "application/vnd.oci.image.config.v1+json", "digest": blob(l.config), "size": len(l.config)},
		"layers":        layerDescs,
	})
	md := blob(manifest)
	files["index.json"] = mustJSON(t, map[string]any{
		"schemaVersion": 2,
		"mediaType":     mediaOCIIndex,
		"manifests": []map[string]any{{
			"mediaType":   mediaOCIManifest,
			"digest":      md,
			"size":        len(manifest),
			"annotations": map[string]string{annotRefName: l.ref},
		}},
	})
	return files, md
}

// writeDir writes files under dir.
func writeDir(t testing.TB, dir string, files map[string][]byte) {
	t.Helper()
	for name, b := range files {
		p := filepath.Join(dir, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

// archive writes the named files as a tar, in the order of names, plus
// extra raw entries (links) after them.
func archive(t testing.TB, path string, names []string, files map[string][]byte, extra ...ent) {
	t.Helper()
	var ents []ent
	for _, n := range names {
		ents = append(ents, fileEnt(n, string(files[n]), 0o644, 0, 0))
	}
	ents = append(ents, extra...)
	if err := os.WriteFile(path, layerTar(t, ents...), 0o644); err != nil {
		t.Fatal(err)
	}
}

func sortedNames(files map[string][]byte) []string {
	var names []string
	for n := range files {
		names = append(names, n)
	}
	// Blobs first and index.json last, as archives often have it, so a
	// cut archive loses the index too.
	sortFunc := func(a string) string {
		if strings.HasPrefix(a, "blobs/") {
			return "0" + a
		}
		return "1" + a
	}
	for i := range names {
		for j := i + 1; j < len(names); j++ {
			if sortFunc(names[j]) < sortFunc(names[i]) {
				names[i], names[j] = names[j], names[i]
			}
		}
	}
	return names
}

// dockerSave writes a legacy `docker save` tarball of the plain layers:
// manifest.json, <config hex>.json, <id>/layer.tar. The last layer, if it
// equals an earlier one, is stored as a symlink to it as docker does.
func dockerSave(t testing.TB, path string, plain [][]byte) string {
	t.Helper()
	config := testConfig(t, plain)
	cfgName := strings.TrimPrefix(digestOf(config), "sha256:") + ".json"
	files := map[string][]byte{cfgName: config}
	var names []string
	var layerPaths []string
	var links []ent
	first := map[string]string{}
	for i, p := range plain {
		id := fmt.Sprintf("%064x", i+1)
		lp := id + "/layer.tar"
		layerPaths = append(layerPaths, lp)
		if prev, ok := first[digestOf(p)]; ok {
			links = append(links, symlinkEnt(lp, "../"+prev))
			continue
		}
		first[digestOf(p)] = lp
		files[lp] = p
		names = append(names, lp)
	}
	files["manifest.json"] = mustJSON(t, []map[string]any{{
		"Config":   cfgName,
		"RepoTags": []string{"example.com/app:1"},
		"Layers":   layerPaths,
	}})
	names = append(names, cfgName, "manifest.json")
	archive(t, path, names, files, links...)
	return digestOf(config)
}

// rawImage returns a raw copy of the imported qcow2 for debugfs.
func rawImage(t testing.TB, img *Image) string {
	t.Helper()
	if _, err := exec.LookPath("qemu-img"); err != nil {
		t.Skip("qemu-img not installed (apt-get install qemu-utils)")
	}
	raw := filepath.Join(t.TempDir(), "rootfs.raw")
	out, err := exec.Command("qemu-img", "convert", "-f", "qcow2", "-O", "raw", img.RootfsPath, raw).CombinedOutput()
	if err != nil {
		t.Fatalf("qemu-img convert: %v: %s", err, out)
	}
	return raw
}

func requireTools(t testing.TB) {
	t.Helper()
	for _, tool := range []string{"mkfs.ext4", "debugfs"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("%s not installed (apt-get install e2fsprogs)", tool)
		}
	}
}

func debugfs(t testing.TB, raw, req string) string {
	t.Helper()
	out, err := exec.Command("debugfs", "-R", req, raw).CombinedOutput()
	if err != nil {
		t.Fatalf("debugfs -R %q: %v: %s", req, err, out)
	}
	// debugfs prints its version banner first.
	s := string(out)
	if i := strings.Index(s, "\n"); strings.HasPrefix(s, "debugfs ") && i >= 0 {
		s = s[i+1:]
	}
	return s
}

// inodeInfo is what the tests read from `debugfs -R 'stat PATH'`.
type inodeInfo struct {
	inode, links int
	typ          string
	mode         int64
	uid, gid     int
	size         int64
	raw          string
}

var (
	reInode = regexp.MustCompile(`Inode: (\d+)\s+Type: (.+?)\s+Mode:\s+(\d+)`)
	reOwner = regexp.MustCompile(`User:\s+(\d+)\s+Group:\s+(\d+)(?:\s+Project:\s+\d+)?\s+Size: (\d+)`)
	reLinks = regexp.MustCompile(`Links: (\d+)`)
)

func stat(t testing.TB, raw, p string) inodeInfo {
	t.Helper()
	out := debugfs(t, raw, "stat "+p)
	m := reInode.FindStringSubmatch(out)
	o := reOwner.FindStringSubmatch(out)
	l := reLinks.FindStringSubmatch(out)
	if m == nil || o == nil || l == nil {
		t.Fatalf("debugfs stat %s: unexpected output:\n%s", p, out)
	}
	atoi := func(s string) int { n, _ := strconv.Atoi(s); return n }
	mode, _ := strconv.ParseInt(m[3], 8, 64)
	size, _ := strconv.ParseInt(o[3], 10, 64)
	return inodeInfo{inode: atoi(m[1]), typ: m[2], mode: mode, uid: atoi(o[1]), gid: atoi(o[2]), size: size, links: atoi(l[1]), raw: out}
}

// exists reports whether debugfs finds p in the image.
func exists(t testing.TB, raw, p string) bool {
	t.Helper()
	out, _ := exec.Command("debugfs", "-R", "stat "+p, raw).CombinedOutput()
	return !strings.Contains(string(out), "File not found")
}

// assertEmptyDir fails unless dir holds nothing (or is gone).
func assertEmptyDir(t testing.TB, dir string) {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	if len(ents) != 0 {
		var names []string
		filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
			names = append(names, p)
			return nil
		})
		t.Fatalf("%s is not empty after a failed import: %v", dir, names)
	}
}

// readTar returns the regular files of the tar at path.
func readTar(t testing.TB, path string) map[string][]byte {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	files := map[string][]byte{}
	tr := tar.NewReader(f)
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			return files
		}
		if err != nil {
			t.Fatal(err)
		}
		if hdr.Typeflag == tar.TypeReg {
			b, err := io.ReadAll(tr)
			if err != nil {
				t.Fatal(err)
			}
			files[hdr.Name] = b
		}
	}
}

func linkCount(t testing.TB, path string) uint64 {
	t.Helper()
	var st syscall.Stat_t
	if err := syscall.Stat(path, &st); err != nil {
		t.Fatal(err)
	}
	return uint64(st.Nlink)
}

// asTestUser is opts as the user running the tests can import: root (CI)
// keeps the layers' owners; any other user cannot chown, so IgnoreOwners
// is set for the tests that are not about owners.
func asTestUser(opts Options) Options {
	if os.Geteuid() != 0 {
		opts.IgnoreOwners = true
	}
	return opts
}

// requireRoot skips a test that checks what only root can make: the
// layers' owners and device nodes.
func requireRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("checks the owners and device nodes an import keeps, which needs root (CAP_CHOWN, CAP_MKNOD): run go test as root")
	}
}
