// Package ocitest builds small container images for tests of the packages
// that import them (appvm, api, main): layer tars, OCI image layouts as a
// directory or a tar, written with archive/tar so tests need no container
// tooling. It exists only for tests; ociimage's own tests keep their richer
// builders.
package ocitest

import (
	"archive/tar"
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"io"
	"maps"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"
)

// ModTime is the mtime of every entry the builders write.
var ModTime = time.Date(2024, 5, 6, 7, 8, 9, 0, time.UTC)

// Entry is one entry of a layer tar.
type Entry struct {
	Header tar.Header
	Body   string
}

// Dir is a directory entry owned by root.
func Dir(name string, mode int64) Entry {
	return Entry{Header: tar.Header{Typeflag: tar.TypeDir, Name: name, Mode: mode}}
}

// File is a regular file entry owned by uid:gid.
func File(name, body string, mode int64, uid, gid int) Entry {
	return Entry{Header: tar.Header{Typeflag: tar.TypeReg, Name: name, Mode: mode, Uid: uid, Gid: gid, Size: int64(len(body))}, Body: body}
}

// Symlink is a symbolic link entry.
func Symlink(name, target string) Entry {
	return Entry{Header: tar.Header{Typeflag: tar.TypeSymlink, Name: name, Linkname: target, Mode: 0o777}}
}

// Whiteout removes name (a path) from lower layers.
func Whiteout(name string) Entry {
	dir, base := filepath.Split(name)
	return File(dir+".wh."+base, "", 0o644, 0, 0)
}

// Layer returns an uncompressed layer tar of entries, in order.
func Layer(tb testing.TB, entries ...Entry) []byte {
	tb.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range entries {
		h := e.Header
		if h.ModTime.IsZero() {
			h.ModTime = ModTime
		}
		h.Format = tar.FormatPAX
		if err := tw.WriteHeader(&h); err != nil {
			tb.Fatalf("writing tar header %q: %v", h.Name, err)
		}
		if _, err := io.WriteString(tw, e.Body); err != nil {
			tb.Fatal(err)
		}
	}
	if err := tw.Close(); err != nil {
		tb.Fatal(err)
	}
	return buf.Bytes()
}

// Config is the part of an image config the builders write.
type Config struct {
	Entrypoint []string
	Cmd        []string
	Env        []string
	WorkingDir string
	User       string
}

// Image is an image to write: uncompressed layers and a config.
type Image struct {
	Layers [][]byte
	Config Config
	// Ref is the ref-name annotation of the manifest in index.json.
	Ref string
}

// Digest is "sha256:" and the hex sha256 of b.
func Digest(b []byte) string {
	sum := sha256.Sum256(b)
	return "sha256:" + hex.EncodeToString(sum[:])
}

// Files returns the OCI image layout of img as path → content, and the
// manifest digest (the build digest an import reports).
func (img Image) Files(tb testing.TB) (map[string][]byte, string) {
	tb.Helper()
	files := map[string][]byte{"oci-layout": []byte(`{"imageLayoutVersion":"1.0.0"}`)}
	blob := func(b []byte) string {
		d := Digest(b)
		files["blobs/sha256/"+strings.TrimPrefix(d, "sha256:")] = b
		return d
	}
	var diffIDs []string
	var layers []map[string]any
	for _, l := range img.Layers {
		layers = append(layers, map[string]any{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": blob(l), "size": len(l)})
		diffIDs = append(diffIDs, Digest(l))
	}
	cfg := mustJSON(tb, map[string]any{
		"created":      ModTime.Format(time.RFC3339),
		"architecture": runtime.GOARCH,
		"os":           "linux",
		"config": map[string]any{
			"Entrypoint": img.Config.Entrypoint,
			"Cmd":        img.Config.Cmd,
			"Env":        img.Config.Env,
			"WorkingDir": img.Config.WorkingDir,
			"User":       img.Config.User,
		},
		"rootfs": map[string]any{"type": "layers", "diff_ids": diffIDs},
	})
	manifest := mustJSON(tb, map[string]any{
		"schemaVersion": 2,
		"mediaType":     "application/vnd.oci.image.manifest.v1+json",
		"config":        map[string]any{"mediaType": "application/vnd.oci.image.config.v1+json", "digest": blob(cfg), "size": len(cfg)},
		"layers":        layers,
	})
	md := blob(manifest)
	desc := map[string]any{"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": md, "size": len(manifest)}
	if img.Ref != "" {
		desc["annotations"] = map[string]string{"org.opencontainers.image.ref.name": img.Ref}
	}
	files["index.json"] = mustJSON(tb, map[string]any{
		"schemaVersion": 2,
		"mediaType":     "application/vnd.oci.image.index.v1+json",
		"manifests":     []any{desc},
	})
	return files, md
}

// WriteDir writes img as an OCI layout directory dir and returns the
// manifest digest.
func (img Image) WriteDir(tb testing.TB, dir string) string {
	tb.Helper()
	files, md := img.Files(tb)
	for name, b := range files {
		p := filepath.Join(dir, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			tb.Fatal(err)
		}
		if err := os.WriteFile(p, b, 0o644); err != nil {
			tb.Fatal(err)
		}
	}
	return md
}

// WriteTar writes img as a tar of an OCI layout at path and returns the
// manifest digest.
func (img Image) WriteTar(tb testing.TB, path string) string {
	tb.Helper()
	files, md := img.Files(tb)
	names := slices.Sorted(maps.Keys(files))
	var entries []Entry
	for _, n := range names {
		entries = append(entries, File(n, string(files[n]), 0o644, 0, 0))
	}
	if err := os.WriteFile(path, Layer(tb, entries...), 0o644); err != nil {
		tb.Fatal(err)
	}
	return md
}

func mustJSON(tb testing.TB, v any) []byte {
	tb.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		tb.Fatal(err)
	}
	return b
}
