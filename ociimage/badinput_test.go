package ociimage

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// TestImportBadInput feeds broken or hostile images to Import. Each must
// fail with a reason naming the cause, leave dstDir as it was (empty, or
// not there at all when Import created it), and change nothing outside.
func TestImportBadInput(t *testing.T) {
	requireTools(t)
	// outside is a host directory a hostile image aims at; secret is a host
	// file in it that must survive and never be linked into an image.
	type env struct {
		dir, outside, secret string
	}
	// climb reaches outside from any directory less than 32 deep.
	climb := func(e env, rest string) string {
		return strings.Repeat("../", 32) + strings.TrimPrefix(e.outside, "/") + "/" + rest
	}
	layoutDir := func(t *testing.T, e env, l *ociLayout) string {
		files, _ := l.files(t)
		src := filepath.Join(e.dir, "layout")
		writeDir(t, src, files)
		return src
	}
	oneLayer := func(t *testing.T, e env, ents ...ent) string {
		return layoutDir(t, e, newLayout(t, true, layerTar(t, ents...)))
	}
	tests := []struct {
		name string
		src  func(t *testing.T, e env) string
		is   error
		// reason is a regexp the error text must match.
		reason string
	}{
		{
			name: "dot-dot path",
			src: func(t *testing.T, e env) string {
				return oneLayer(t, e, fileEnt("etc/../../escape", "x", 0o644, 0, 0))
			},
			is:     ErrUnsafePath,
			reason: `^layer 1 \(sha256:[0-9a-f]{64}\): path "etc/\.\./\.\./escape" escapes the image root$`,
		},
		{
			name: "dot-dot path to a host directory",
			src: func(t *testing.T, e env) string {
				return oneLayer(t, e, fileEnt(climb(e, "planted"), "x", 0o644, 0, 0))
			},
			is:     ErrUnsafePath,
			reason: `^layer 1 \(sha256:[0-9a-f]{64}\): path "(\.\./)+.*/planted" escapes the image root$`,
		},
		{
			// Absolute names are refused rather than taken as relative:
			// no image builder writes them, so one is a sign of a crafted
			// archive.
			name: "absolute path",
			src: func(t *testing.T, e env) string {
				return oneLayer(t, e, fileEnt(filepath.Join(e.outside, "planted"), "x", 0o644, 0, 0))
			},
			is:     ErrUnsafePath,
			reason: `^layer 1 \(sha256:[0-9a-f]{64}\): path "/.*/planted" is absolute and escapes the image root$`,
		},
		{
			name: "write through an absolute symlink",
			src: func(t *testing.T, e env) string {
				return oneLayer(t, e,
					symlinkEnt("etc", e.outside),
					fileEnt("etc/passwd", "owned", 0o644, 0, 0))
			},
			is:     ErrUnsafePath,
			reason: `^layer 1 \(sha256:[0-9a-f]{64}\): path "etc/passwd" leads through a symlink out of the root and escapes the image root$`,
		},
		{
			name: "write through a relative symlink from a lower layer",
			src: func(t *testing.T, e env) string {
				return layoutDir(t, e, newLayout(t, false,
					layerTar(t, dirEnt("a/", 0o755, 0, 0), symlinkEnt("a/up", climb(e, ""))),
					layerTar(t, fileEnt("a/up/planted", "x", 0o644, 0, 0))))
			},
			is:     ErrUnsafePath,
			reason: `^layer 2 \(sha256:[0-9a-f]{64}\): path "a/up/planted" leads through a symlink out of the root and escapes the image root$`,
		},
		{
			name: "hard link to a host file through a symlink",
			src: func(t *testing.T, e env) string {
				return oneLayer(t, e,
					symlinkEnt("h", e.outside),
					hardlinkEnt("leak", "h/secret"))
			},
			is:     ErrUnsafePath,
			reason: `^layer 1 \(sha256:[0-9a-f]{64}\): path "h/secret" leads through a symlink out of the root and escapes the image root$`,
		},
		{
			name: "whiteout through a symlink",
			src: func(t *testing.T, e env) string {
				return oneLayer(t, e,
					symlinkEnt("h", e.outside),
					fileEnt("h/.wh.secret", "", 0o644, 0, 0))
			},
			is:     ErrUnsafePath,
			reason: `^layer 1 \(sha256:[0-9a-f]{64}\): path "h/secret" leads through a symlink out of the root and escapes the image root$`,
		},
		{
			name: "opaque whiteout through a symlink",
			src: func(t *testing.T, e env) string {
				return oneLayer(t, e,
					symlinkEnt("h", e.outside),
					fileEnt("h/.wh..wh..opq", "", 0o644, 0, 0))
			},
			is:     ErrUnsafePath,
			reason: `^layer 1 \(sha256:[0-9a-f]{64}\): path "h/\.wh\.\.wh\.\.opq" leads through a symlink out of the root and escapes the image root$`,
		},
		{
			name: "missing layer",
			src: func(t *testing.T, e env) string {
				l := newLayout(t, true,
					layerTar(t, fileEnt("a", "1", 0o644, 0, 0)),
					layerTar(t, fileEnt("b", "2", 0o644, 0, 0)))
				l.skipped = map[int]bool{1: true}
				return layoutDir(t, e, l)
			},
			is:     ErrMissingBlob,
			reason: `^blob sha256:[0-9a-f]{64} \(layer 2\) missing from archive$`,
		},
		{
			name: "missing docker save layer",
			src: func(t *testing.T, e env) string {
				src := filepath.Join(e.dir, "save.tar")
				dockerSave(t, src, [][]byte{layerTar(t, fileEnt("a", "1", 0o644, 0, 0))})
				// Rewrite the archive without the layer.
				files := readTar(t, src)
				delete(files, strings.Repeat("0", 63)+"1/layer.tar")
				archive(t, src, sortedNames(files), files)
				return src
			},
			is:     ErrMissingBlob,
			reason: `^blob 0+1/layer.tar \(layer 1\) missing from archive$`,
		},
		{
			name: "digest mismatch",
			src: func(t *testing.T, e env) string {
				l := newLayout(t, false, layerTar(t, fileEnt("a", "original", 0o644, 0, 0)))
				files, _ := l.files(t)
				name := "blobs/sha256/" + strings.TrimPrefix(digestOf(l.layers[0]), "sha256:")
				files[name] = []byte(strings.Replace(string(files[name]), "original", "tampered", 1))
				src := filepath.Join(e.dir, "layout")
				writeDir(t, src, files)
				return src
			},
			is:     ErrDigestMismatch,
			reason: `^layer 1 \(sha256:[0-9a-f]{64}\) digest mismatch: got sha256:[0-9a-f]{64}$`,
		},
		{
			name: "digest mismatch in docker save",
			src: func(t *testing.T, e env) string {
				src := filepath.Join(e.dir, "save.tar")
				dockerSave(t, src, [][]byte{layerTar(t, fileEnt("a", "original", 0o644, 0, 0))})
				files := readTar(t, src)
				name := strings.Repeat("0", 63) + "1/layer.tar"
				files[name] = []byte(strings.Replace(string(files[name]), "original", "tampered", 1))
				archive(t, src, sortedNames(files), files)
				return src
			},
			is:     ErrDigestMismatch,
			reason: `^layer 1 \(sha256:[0-9a-f]{64}\) digest mismatch: got sha256:[0-9a-f]{64}$`,
		},
		{
			name: "corrupt gzip layer",
			src: func(t *testing.T, e env) string {
				l := newLayout(t, true, layerTar(t, fileEnt("a", strings.Repeat("data ", 1000), 0o644, 0, 0)))
				files, _ := l.files(t)
				name := "blobs/sha256/" + strings.TrimPrefix(digestOf(l.layers[0]), "sha256:")
				b := append([]byte(nil), files[name]...)
				b[len(b)/2] ^= 0xff
				files[name] = b
				src := filepath.Join(e.dir, "layout")
				writeDir(t, src, files)
				return src
			},
			is:     ErrDigestMismatch,
			reason: `^layer 1 \(sha256:[0-9a-f]{64}\) digest mismatch: got sha256:[0-9a-f]{64}$`,
		},
		{
			name: "truncated archive",
			src: func(t *testing.T, e env) string {
				big := strings.Repeat("0123456789abcdef", 4096)
				l := newLayout(t, false, layerTar(t, fileEnt("a", big, 0o644, 0, 0)))
				files, _ := l.files(t)
				// Small files first, the layer last, and cut in its middle.
				layer := "blobs/sha256/" + strings.TrimPrefix(digestOf(l.layers[0]), "sha256:")
				var names []string
				for _, n := range sortedNames(files) {
					if n != layer {
						names = append(names, n)
					}
				}
				src := filepath.Join(e.dir, "layout.tar")
				archive(t, src, append(names, layer), files)
				cut(t, src, 20000)
				return src
			},
			is:     ErrTruncated,
			reason: `^truncated archive: unexpected EOF in layer 1 \(sha256:[0-9a-f]{64}\) after \d+ of \d+ bytes$`,
		},
		{
			name: "truncated docker save",
			src: func(t *testing.T, e env) string {
				src := filepath.Join(e.dir, "save.tar")
				dockerSave(t, src, [][]byte{layerTar(t, fileEnt("a", strings.Repeat("x", 100000), 0o644, 0, 0))})
				cut(t, src, 50000)
				return src
			},
			is:     ErrTruncated,
			reason: `^neither index.json nor manifest.json in the archive: truncated archive: unexpected EOF after 1 entries$`,
		},
		{
			name: "truncated gzip archive",
			src: func(t *testing.T, e env) string {
				src := filepath.Join(e.dir, "save.tar")
				dockerSave(t, src, [][]byte{layerTar(t, fileEnt("a", "1", 0o644, 0, 0))})
				b, err := os.ReadFile(src)
				if err != nil {
					t.Fatal(err)
				}
				gz := gzipped(t, b)
				if err := os.WriteFile(src, gz[:len(gz)/2], 0o644); err != nil {
					t.Fatal(err)
				}
				return src
			},
			is:     ErrTruncated,
			reason: `^truncated archive: unexpected EOF in the gzip stream$`,
		},
		{
			name: "zstd layer",
			src: func(t *testing.T, e env) string {
				l := newLayout(t, false, layerTar(t, fileEnt("a", "1", 0o644, 0, 0)))
				l.layers[0] = append(append([]byte(nil), zstdMagic...), "rest of a zstd frame"...)
				return layoutDir(t, e, l)
			},
			is:     ErrUnsupported,
			reason: `^layer 1 \(sha256:[0-9a-f]{64}\) is zstd-compressed, which is not supported by this importer`,
		},
		{
			name: "not an image",
			src: func(t *testing.T, e env) string {
				src := filepath.Join(e.dir, "empty")
				if err := os.Mkdir(src, 0o755); err != nil {
					t.Fatal(err)
				}
				return src
			},
			is:     ErrInvalid,
			reason: `^invalid image: neither index.json \(OCI image layout\) nor manifest.json \(docker save\) found$`,
		},
		{
			// The parent of lib/a, reached through the symlink lib, must
			// not be reused for lib/b once lib is a file.
			name: "entry below a file that replaced a symlink",
			src: func(t *testing.T, e env) string {
				return oneLayer(t, e,
					dirEnt("usr/", 0o755, 0, 0),
					dirEnt("usr/lib/", 0o755, 0, 0),
					symlinkEnt("lib", "usr/lib"),
					fileEnt("lib/a", "a", 0o644, 0, 0),
					fileEnt("lib", "now a file", 0o644, 0, 0),
					fileEnt("lib/b", "b", 0o644, 0, 0))
			},
			is:     ErrInvalid,
			reason: `^invalid image: layer 1 \(sha256:[0-9a-f]{64}\): entry "lib/b": a parent is not a directory$`,
		},
		{
			name: "hard link to nothing",
			src: func(t *testing.T, e env) string {
				return oneLayer(t, e, hardlinkEnt("b", "missing"))
			},
			is:     ErrInvalid,
			reason: `^invalid image: layer 1 \(sha256:[0-9a-f]{64}\): hard link "b": target "missing" does not exist$`,
		},
	}
	for _, tt := range tests {
		for _, dstExists := range []bool{false, true} {
			name := tt.name
			if dstExists {
				name += ", dstDir exists"
			}
			t.Run(name, func(t *testing.T) {
				top := t.TempDir()
				e := env{dir: filepath.Join(top, "src"), outside: filepath.Join(top, "outside")}
				e.secret = filepath.Join(e.outside, "secret")
				for _, d := range []string{e.dir, e.outside} {
					if err := os.Mkdir(d, 0o755); err != nil {
						t.Fatal(err)
					}
				}
				if err := os.WriteFile(e.secret, []byte("host secret"), 0o600); err != nil {
					t.Fatal(err)
				}
				src := tt.src(t, e)
				dst := filepath.Join(top, "images", "app")
				if dstExists {
					if err := os.MkdirAll(dst, 0o755); err != nil {
						t.Fatal(err)
					}
				}

				img, err := Import(context.Background(), src, dst, asTestUser(Options{}))
				if err == nil {
					t.Fatalf("Import succeeded (%+v), want an error matching %q", img, tt.reason)
				}
				if img != nil {
					t.Errorf("Import returned an image with error %v", err)
				}
				if !errors.Is(err, tt.is) {
					t.Errorf("Import error %q does not match %v", err, tt.is)
				}
				if !regexp.MustCompile(tt.reason).MatchString(err.Error()) {
					t.Errorf("Import error = %q, want match for %q", err, tt.reason)
				}
				if dstExists {
					assertEmptyDir(t, dst)
				} else if _, err := os.Stat(dst); !os.IsNotExist(err) {
					t.Errorf("dstDir %s left behind (stat: %v)", dst, err)
				}
				// Outside holds only the untouched secret.
				ents, _ := os.ReadDir(e.outside)
				if len(ents) != 1 || ents[0].Name() != "secret" {
					t.Errorf("host dir %s changed: %v", e.outside, ents)
				}
				fi, err := os.Stat(e.secret)
				if err != nil {
					t.Fatalf("host file: %v", err)
				}
				if b, _ := os.ReadFile(e.secret); string(b) != "host secret" || fi.Sys() == nil || fi.Mode().Perm() != 0o600 {
					t.Errorf("host file changed: %q %v", b, fi.Mode())
				}
				if nlink := linkCount(t, e.secret); nlink != 1 {
					t.Errorf("host file has %d links, want 1", nlink)
				}
				// Nothing planted next to the test's directories either.
				if _, err := os.Stat(filepath.Join(top, "escape")); !os.IsNotExist(err) {
					t.Errorf("%s/escape exists", top)
				}
			})
		}
	}
}

// cut truncates the file at path to n bytes.
func cut(t *testing.T, path string, n int64) {
	t.Helper()
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Size() <= n {
		t.Fatalf("%s is %d bytes, cannot cut at %d", path, fi.Size(), n)
	}
	if err := os.Truncate(path, n); err != nil {
		t.Fatal(err)
	}
}
