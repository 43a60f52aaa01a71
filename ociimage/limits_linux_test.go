package ociimage

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// bombLayer returns a gzip layer of n regular files of size bytes of 'x'
// each, and its diff_id. It is made of concatenated gzip members (which
// gzip readers take as one stream): the data member is compressed once and
// repeated, so a layer of GiBs costs a few MB to build.
func bombLayer(t testing.TB, n int, size int64) (blob []byte, diffID string) {
	t.Helper()
	gz := func(b []byte) []byte {
		var buf bytes.Buffer
		zw, _ := gzip.NewWriterLevel(&buf, gzip.BestCompression)
		zw.Write(b)
		zw.Close()
		return buf.Bytes()
	}
	if size%512 != 0 {
		t.Fatalf("bombLayer: size %d is not a multiple of the tar block", size)
	}
	data := bytes.Repeat([]byte("x"), int(size))
	dataMember := gz(data)
	h := sha256.New()
	var out bytes.Buffer
	for i := range n {
		var hb bytes.Buffer
		tw := tar.NewWriter(&hb)
		hdr := &tar.Header{Typeflag: tar.TypeReg, Name: fmt.Sprintf("f%06d", i),
			Mode: 0o644, Size: size, ModTime: testTime, Format: tar.FormatUSTAR}
		if err := tw.WriteHeader(hdr); err != nil {
			t.Fatal(err)
		}
		// The header alone: the data is the shared member.
		h.Write(hb.Bytes())
		out.Write(gz(hb.Bytes()))
		h.Write(data)
		out.Write(dataMember)
	}
	end := make([]byte, 1024)
	h.Write(end)
	out.Write(gz(end))
	return out.Bytes(), "sha256:" + hex.EncodeToString(h.Sum(nil))
}

// countingSource counts the bytes read from its blobs.
type countingSource struct {
	memSource
	read *int64
}

func (c countingSource) open(name string) (io.ReadCloser, int64, error) {
	rc, size, err := c.memSource.open(name)
	if err != nil {
		return nil, 0, err
	}
	return struct {
		io.Reader
		io.Closer
	}{readFunc(func(p []byte) (int, error) {
		n, err := rc.Read(p)
		*c.read += int64(n)
		return n, err
	}), rc}, size, nil
}

type readFunc func([]byte) (int, error)

func (f readFunc) Read(p []byte) (int, error) { return f(p) }

// diskUsage is the bytes the files under dir occupy.
func diskUsage(t *testing.T, dir string) int64 {
	t.Helper()
	var used int64
	filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if fi, err := d.Info(); err == nil && fi.Mode().IsRegular() {
			used += fi.Sys().(*syscall.Stat_t).Blocks * 512
		}
		return nil
	})
	return used
}

// A layer of 1 GiB in about 1 MB of gzip fails as soon as the unpacked
// content passes the limit: what it wrote stays within the limit, and most
// of the compressed blob is never read.
func TestApplyLayerStopsAtMaxBytes(t *testing.T) {
	blob, diffID := bombLayer(t, 1024, 1<<20)
	t.Logf("bomb: %d bytes of gzip for 1 GiB of files", len(blob))
	const limit = 8 << 20
	rootfs := t.TempDir()
	var read int64
	d := digestOf(blob)
	src := countingSource{memSource{"blobs/sha256/" + d[len("sha256:"):]: blob}, &read}
	_, err := applyLayers(context.Background(), src, []descriptor{{Digest: d, Size: int64(len(blob)), DiffID: diffID}}, rootfs, asTestUser(Options{MaxBytes: limit}))
	if !errors.Is(err, ErrLimit) || !regexp.MustCompile(`^layer 1 \(sha256:[0-9a-f]{64}\): over an import limit: the unpacked content passes image_import_max_bytes \(8388608 bytes\)$`).MatchString(err.Error()) {
		t.Fatalf("applyLayers = %v, want the image_import_max_bytes limit", err)
	}
	if used := diskUsage(t, rootfs); used > limit {
		t.Errorf("the staging tree holds %d bytes, more than the %d limit", used, limit)
	}
	if read > int64(len(blob))/10 {
		t.Errorf("read %d of the blob's %d bytes before failing; want an early stop", read, len(blob))
	}
}

func TestImportLimits(t *testing.T) {
	requireTools(t)
	deep := func(n int, leaf string) string { return strings.Repeat("d/", n-1) + leaf }
	tests := []struct {
		name   string
		src    func(t *testing.T, dir string) string
		opts   Options
		reason string
	}{
		{
			name: "gzip bomb layer",
			src: func(t *testing.T, dir string) string {
				blob, diffID := bombLayer(t, 1024, 1<<20)
				return writeLayout(t, dir, [][]byte{blob}, []string{diffID})
			},
			opts:   Options{MaxBytes: 8 << 20},
			reason: `^layer 1 \(sha256:[0-9a-f]{64}\): over an import limit: the unpacked content passes image_import_max_bytes \(8388608 bytes\)$`,
		},
		{
			// The header alone condemns it: nothing is written, and the
			// layer need not even hold the data it announces.
			name: "one file larger than the limit",
			src: func(t *testing.T, dir string) string {
				var hb bytes.Buffer
				tw := tar.NewWriter(&hb)
				tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: "huge", Mode: 0o644, Size: 1 << 40, ModTime: testTime})
				layer := append(hb.Bytes(), make([]byte, 4096)...)
				return writeLayout(t, dir, [][]byte{layer}, []string{digestOf(layer)})
			},
			opts:   Options{MaxBytes: 1 << 30},
			reason: `^layer 1 \(sha256:[0-9a-f]{64}\): over an import limit: the unpacked content passes image_import_max_bytes \(1073741824 bytes\)$`,
		},
		{
			name: "gzip bomb archive",
			src: func(t *testing.T, dir string) string {
				blob, _ := bombLayer(t, 64, 1<<20) // a gzip of 64 MiB of tar
				src := filepath.Join(dir, "save.tar.gz")
				if err := os.WriteFile(src, blob, 0o644); err != nil {
					t.Fatal(err)
				}
				return src
			},
			opts:   Options{MaxBytes: 8 << 20},
			reason: `^over an import limit: the decompressed archive passes image_import_max_bytes \(8388608 bytes\)$`,
		},
		{
			name: "too many entries across layers",
			src: func(t *testing.T, dir string) string {
				var a, b []ent
				for i := range 60 {
					a = append(a, fileEnt("a"+strconv.Itoa(i), "", 0o644, 0, 0))
					b = append(b, fileEnt("b"+strconv.Itoa(i), "", 0o644, 0, 0))
				}
				return layoutSrc(t, dir, newLayout(t, true, layerTar(t, a...), layerTar(t, b...)))
			},
			opts:   Options{MaxEntries: 100},
			reason: `^layer 2 \(sha256:[0-9a-f]{64}\): over an import limit: more than image_import_max_entries \(100\) entries$`,
		},
		{
			name: "too many archive entries",
			src: func(t *testing.T, dir string) string {
				files, _ := newLayout(t, false, layerTar(t, fileEnt("a", "1", 0o644, 0, 0))).files(t)
				for i := range 20 {
					files["junk/"+strconv.Itoa(i)] = nil
				}
				src := filepath.Join(dir, "layout.tar")
				archive(t, src, sortedNames(files), files)
				return src
			},
			opts:   Options{MaxEntries: 10},
			reason: `^over an import limit: the archive holds more than image_import_max_entries \(10\) entries$`,
		},
		{
			name: "path too deep",
			src: func(t *testing.T, dir string) string {
				return layoutSrc(t, dir, newLayout(t, false, layerTar(t, fileEnt(deep(MaxPathDepth+1, "f"), "x", 0o644, 0, 0))))
			},
			reason: `^layer 1 \(sha256:[0-9a-f]{64}\): over an import limit: path "(d/){32}\.\.\." is 257 components deep, more than 256$`,
		},
		{
			name: "path too long",
			src: func(t *testing.T, dir string) string {
				name := strings.Repeat("n", 250) + "/" + strings.Repeat("m", 250) + "/"
				return layoutSrc(t, dir, newLayout(t, false, layerTar(t, fileEnt(strings.Repeat(name, 9)+"f", "x", 0o644, 0, 0))))
			},
			reason: `^layer 1 \(sha256:[0-9a-f]{64}\): over an import limit: path "n{64}\.\.\." is 4519 bytes long, more than 4096$`,
		},
		{
			// Each name is within the limit; the tree made through the
			// symlink is not.
			name: "path too deep through a symlink",
			src: func(t *testing.T, dir string) string {
				return layoutSrc(t, dir, newLayout(t, false, layerTar(t,
					dirEnt(deep(200, "d/"), 0o755, 0, 0),
					symlinkEnt("s", deep(200, "d")),
					fileEnt("s/"+strings.Repeat("e/", 99)+"f", "x", 0o644, 0, 0))))
			},
			reason: `^unpacked tree: over an import limit: path "(d/){32}\.\.\." is 257 components deep, more than 256$`,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			// A mkfs that leaves a mark: a refused tree never reaches it.
			mark := filepath.Join(dir, "mkfs-ran")
			mkfs := filepath.Join(dir, "mkfs.ext4")
			if err := os.WriteFile(mkfs, []byte("#!/bin/sh\ntouch '"+mark+"'\nexit 1\n"), 0o755); err != nil {
				t.Fatal(err)
			}
			opts := tt.opts
			opts.Mkfs = mkfs
			dst := filepath.Join(dir, "img")
			_, err := Import(context.Background(), tt.src(t, dir), dst, asTestUser(opts))
			if !errors.Is(err, ErrLimit) || !regexp.MustCompile(tt.reason).MatchString(err.Error()) {
				t.Fatalf("Import = %v, want a match for %q", err, tt.reason)
			}
			if _, err := os.Stat(mark); err == nil {
				t.Error("mkfs.ext4 ran on a refused tree")
			}
			if _, err := os.Stat(dst); !os.IsNotExist(err) {
				t.Errorf("dstDir left behind (stat: %v)", err)
			}
		})
	}
}

// writeLayout writes an OCI layout of the given layer blobs with a config
// stating diffIDs, and returns its directory.
func writeLayout(t *testing.T, dir string, blobs [][]byte, diffIDs []string) string {
	l := &ociLayout{layers: blobs, ref: "example.com/app:1"}
	l.config = mustJSON(t, map[string]any{"architecture": "amd64", "os": "linux",
		"rootfs": map[string]any{"type": "layers", "diff_ids": diffIDs}})
	return layoutSrc(t, dir, l)
}

func layoutSrc(t *testing.T, dir string, l *ociLayout) string {
	files, _ := l.files(t)
	src := filepath.Join(dir, "layout")
	writeDir(t, src, files)
	return src
}

// importWithin runs Import and fails the test if it has not returned
// within a minute: sources that block must not hang it.
func importWithin(t *testing.T, src, dst string, unblock func()) error {
	t.Helper()
	done := make(chan error, 1)
	go func() {
		_, err := Import(context.Background(), src, dst, Options{})
		done <- err
	}()
	select {
	case err := <-done:
		return err
	case <-time.After(time.Minute):
		unblock()
		<-done
		t.Fatal("Import blocked on its source")
		return nil
	}
}

// TestImportNonRegularSources: a fifo, a socket or a device where the
// source should have a regular file is refused at once, never opened for
// reading (a fifo would block the import forever).
func TestImportNonRegularSources(t *testing.T) {
	requireTools(t)
	mknod := func(t *testing.T, p string, mode uint32, dev int) {
		os.Remove(p)
		if err := syscall.Mknod(p, mode, dev); err != nil {
			if errors.Is(err, syscall.EPERM) {
				t.Skipf("mknod %s needs root: %v", p, err)
			}
			t.Fatal(err)
		}
	}
	for _, c := range []struct {
		kind string
		mode uint32
		dev  int
		want string
	}{
		{"fifo", syscall.S_IFIFO | 0o644, 0, "a named pipe (fifo)"},
		{"socket", syscall.S_IFSOCK | 0o644, 0, "a socket"},
		{"device", syscall.S_IFCHR | 0o644, 1<<8 | 3, "a character device"}, // 1:3, /dev/null
	} {
		for _, which := range []string{"layer blob", "index.json", "archive path"} {
			t.Run(c.kind+" as "+which, func(t *testing.T) {
				dir := t.TempDir()
				l := newLayout(t, true, layerTar(t, fileEnt("a", "1", 0o644, 0, 0)))
				src := layoutSrc(t, dir, l)
				var node, reason string
				switch which {
				case "layer blob":
					name := "blobs/sha256/" + strings.TrimPrefix(digestOf(l.layers[0]), "sha256:")
					node = filepath.Join(src, name)
					reason = `^opening layer 1 \(sha256:[0-9a-f]{64}\): invalid image: ` + regexp.QuoteMeta(name+" is "+c.want+", not a regular file") + "$"
				case "index.json":
					node = filepath.Join(src, "index.json")
					reason = "^invalid image: " + regexp.QuoteMeta("index.json is "+c.want+", not a regular file") + "$"
				default:
					node = filepath.Join(dir, "image.tar")
					src = node
					reason = "^invalid image: " + regexp.QuoteMeta(node+" is "+c.want+", neither a directory nor a regular file") + "$"
				}
				mknod(t, node, c.mode, c.dev)
				unblock := func() {
					if f, err := os.OpenFile(node, os.O_WRONLY|syscall.O_NONBLOCK, 0); err == nil {
						f.Close()
					}
				}
				dst := filepath.Join(dir, "img")
				err := importWithin(t, src, dst, unblock)
				if !errors.Is(err, ErrInvalid) || !regexp.MustCompile(reason).MatchString(err.Error()) {
					t.Fatalf("Import = %v, want a match for %q", err, reason)
				}
				if _, err := os.Stat(dst); !os.IsNotExist(err) {
					t.Errorf("dstDir left behind (stat: %v)", err)
				}
			})
		}
	}
}

// TestImportVerifiesDiffIDs: every layer's uncompressed stream must hash
// to the config's diff_id, whatever the source format.
func TestImportVerifiesDiffIDs(t *testing.T) {
	requireTools(t)
	plain := [][]byte{
		layerTar(t, fileEnt("a", "1", 0o644, 0, 0)),
		layerTar(t, fileEnt("b", "2", 0o644, 0, 0)),
	}
	lie := layerTar(t, fileEnt("b", "what the config claims", 0o644, 0, 0))
	liar := testConfig(t, [][]byte{plain[0], lie})
	mismatch := `^layer 2 \(sha256:[0-9a-f]{64}\) digest mismatch: its uncompressed content is ` +
		regexp.QuoteMeta(digestOf(plain[1])) + `, the config's diff_id says ` + regexp.QuoteMeta(digestOf(lie)) + `$`
	tests := []struct {
		name   string
		src    func(t *testing.T, dir string) string
		is     error
		reason string
	}{
		{
			name: "OCI layout, gzip layers",
			src: func(t *testing.T, dir string) string {
				l := newLayout(t, true, plain...)
				l.config = liar
				return layoutSrc(t, dir, l)
			},
			is: ErrDigestMismatch, reason: mismatch,
		},
		{
			name: "OCI layout tar, plain layers",
			src: func(t *testing.T, dir string) string {
				l := newLayout(t, false, plain...)
				l.config = liar
				files, _ := l.files(t)
				src := filepath.Join(dir, "layout.tar")
				archive(t, src, sortedNames(files), files)
				return src
			},
			is: ErrDigestMismatch, reason: mismatch,
		},
		{
			// docker save of Docker 25+: manifest.json naming blobs by
			// digest, so the layer's own digest checks out.
			name: "docker save with blob paths",
			src: func(t *testing.T, dir string) string {
				files := map[string][]byte{}
				blob := func(b []byte) string {
					p := "blobs/sha256/" + strings.TrimPrefix(digestOf(b), "sha256:")
					files[p] = b
					return p
				}
				files["manifest.json"] = mustJSON(t, []map[string]any{{
					"Config":   blob(liar),
					"RepoTags": []string{"example.com/app:1"},
					"Layers":   []string{blob(plain[0]), blob(plain[1])},
				}})
				src := filepath.Join(dir, "save.tar")
				archive(t, src, sortedNames(files), files)
				return src
			},
			is: ErrDigestMismatch, reason: mismatch,
		},
		{
			// Legacy docker save: the diff_id is the only digest of
			// layer.tar, so a lie shows as that layer's digest mismatch.
			name: "legacy docker save",
			src: func(t *testing.T, dir string) string {
				src := filepath.Join(dir, "save.tar")
				dockerSave(t, src, plain)
				files := readTar(t, src)
				var manifest []map[string]any
				if err := json.Unmarshal(files["manifest.json"], &manifest); err != nil {
					t.Fatal(err)
				}
				cfgName := strings.TrimPrefix(digestOf(liar), "sha256:") + ".json"
				for n := range files {
					if strings.HasSuffix(n, ".json") && n != "manifest.json" {
						delete(files, n)
					}
				}
				files[cfgName] = liar
				manifest[0]["Config"] = cfgName
				files["manifest.json"] = mustJSON(t, manifest)
				archive(t, src, sortedNames(files), files)
				return src
			},
			is:     ErrDigestMismatch,
			reason: `^layer 2 \(` + regexp.QuoteMeta(digestOf(lie)) + `\) digest mismatch: got ` + regexp.QuoteMeta(digestOf(plain[1])) + `$`,
		},
		{
			name: "OCI layout, fewer diff_ids than layers",
			src: func(t *testing.T, dir string) string {
				l := newLayout(t, true, plain...)
				l.config = testConfig(t, plain[:1])
				return layoutSrc(t, dir, l)
			},
			is: ErrInvalid, reason: `^invalid image: config has 1 diff_ids for 2 layers$`,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			dst := filepath.Join(dir, "img")
			_, err := Import(context.Background(), tt.src(t, dir), dst, Options{IgnoreOwners: true})
			if !errors.Is(err, tt.is) || !regexp.MustCompile(tt.reason).MatchString(err.Error()) {
				t.Fatalf("Import = %v, want a match for %q", err, tt.reason)
			}
			if _, err := os.Stat(dst); !os.IsNotExist(err) {
				t.Errorf("dstDir left behind (stat: %v)", err)
			}
		})
	}
}
