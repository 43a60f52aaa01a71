package ociimage

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"strings"
	"syscall"
)

// source is where blobs and layout files are read from: a directory or an
// indexed tar file. Names are slash-separated and relative to the layout.
type source interface {
	// open returns the named file and its size in the source. A missing
	// name fails with an error matching fs.ErrNotExist.
	open(name string) (io.ReadCloser, int64, error)
	// truncation is non-nil when the source archive ended early, so names
	// after the cut are missing.
	truncation() error
	Close() error
}

var (
	gzipMagic = []byte{0x1f, 0x8b}
	zstdMagic = []byte{0x28, 0xb5, 0x2f, 0xfd}
)

// openSource opens src as a directory or a (possibly gzip-compressed) tar.
// A compressed tar is decompressed into tmp first, as blobs need random
// access. Anything else (a fifo, a socket, a device) is refused without
// being opened, so it can neither block the import nor be read from.
func openSource(ctx context.Context, src, tmp string, opts Options) (source, error) {
	fi, err := os.Stat(src)
	if err != nil {
		return nil, fmt.Errorf("opening image source: %w", err)
	}
	if fi.IsDir() {
		root, err := os.OpenRoot(src)
		if err != nil {
			return nil, fmt.Errorf("opening image source: %w", err)
		}
		return &dirSource{root: root}, nil
	}
	if !fi.Mode().IsRegular() {
		return nil, fmt.Errorf("%w: %s is %s, neither a directory nor a regular file", ErrInvalid, src, fileKind(fi.Mode()))
	}
	// O_NONBLOCK: should src have been replaced by a fifo since the
	// Stat, the open does not wait for a writer; the Stat below refuses it.
	f, err := openRegular(func() (*os.File, error) { return os.OpenFile(src, os.O_RDONLY|syscall.O_NONBLOCK, 0) }, src)
	if err != nil {
		return nil, fmt.Errorf("opening image source: %w", err)
	}
	var magic [4]byte
	n, _ := io.ReadFull(f, magic[:])
	switch {
	case bytes.HasPrefix(magic[:n], zstdMagic):
		f.Close()
		return nil, fmt.Errorf("archive %s is zstd-compressed, which is %w; decompress it first (zstd -d)", src, ErrUnsupported)
	case bytes.HasPrefix(magic[:n], gzipMagic):
		plain, err := gunzipTo(ctx, f, filepath.Join(tmp, "source.tar"), opts.MaxBytes)
		f.Close()
		if err != nil {
			return nil, err
		}
		f = plain
	}
	if _, err := f.Seek(0, io.SeekStart); err != nil {
		f.Close()
		return nil, fmt.Errorf("reading archive: %w", err)
	}
	ts, err := indexTar(ctx, f, opts.MaxEntries)
	if err != nil {
		f.Close()
		return nil, err
	}
	return ts, nil
}

// openRegular opens a file with open and refuses it unless it is a regular
// file. name is for errors.
func openRegular(open func() (*os.File, error), name string) (*os.File, error) {
	f, err := open()
	if err != nil {
		return nil, err
	}
	fi, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, err
	}
	if !fi.Mode().IsRegular() {
		f.Close()
		return nil, fmt.Errorf("%w: %s is %s, not a regular file", ErrInvalid, name, fileKind(fi.Mode()))
	}
	return f, nil
}

// fileKind names the type of a file for errors.
func fileKind(m fs.FileMode) string {
	switch {
	case m.IsRegular():
		return "a regular file"
	case m.IsDir():
		return "a directory"
	case m&fs.ModeNamedPipe != 0:
		return "a named pipe (fifo)"
	case m&fs.ModeSocket != 0:
		return "a socket"
	case m&fs.ModeCharDevice != 0:
		return "a character device"
	case m&fs.ModeDevice != 0:
		return "a block device"
	case m&fs.ModeSymlink != 0:
		return "a symlink"
	default:
		return "not a regular file"
	}
}

// gunzipTo decompresses f into the new file dst, failing as soon as more
// than maxBytes come out.
func gunzipTo(ctx context.Context, f *os.File, dst string, maxBytes int64) (*os.File, error) {
	if _, err := f.Seek(0, io.SeekStart); err != nil {
		return nil, fmt.Errorf("reading archive: %w", err)
	}
	zr, err := gzip.NewReader(f)
	if err != nil {
		return nil, fmt.Errorf("decompressing archive: %w", err)
	}
	out, err := os.Create(dst)
	if err != nil {
		return nil, fmt.Errorf("decompressing archive: %w", err)
	}
	var written int64
	for {
		if err := ctx.Err(); err != nil {
			out.Close()
			return nil, err
		}
		chunk := int64(1 << 20)
		if left := maxBytes - written; left < chunk {
			chunk = left + 1 // one byte more tells an exact fit from too much
		}
		n, err := io.CopyN(out, zr, chunk)
		written += n
		if written > maxBytes {
			out.Close()
			return nil, fmt.Errorf("%w: the decompressed archive passes image_import_max_bytes (%d bytes)", ErrLimit, maxBytes)
		}
		if err == io.EOF {
			return out, nil
		}
		if err != nil {
			out.Close()
			if errors.Is(err, io.ErrUnexpectedEOF) {
				return nil, fmt.Errorf("%w: unexpected EOF in the gzip stream", ErrTruncated)
			}
			return nil, fmt.Errorf("decompressing archive: %w", err)
		}
	}
}

// dirSource reads an image layout directory through an os.Root, so names
// from manifest.json cannot reach outside it.
type dirSource struct{ root *os.Root }

func (d *dirSource) open(name string) (io.ReadCloser, int64, error) {
	// Stat first, so a fifo or a device in the layout is never opened;
	// O_NONBLOCK and openRegular's check cover a swap after the Stat.
	fi, err := d.root.Stat(name)
	if err != nil {
		return nil, 0, err
	}
	if !fi.Mode().IsRegular() {
		return nil, 0, fmt.Errorf("%w: %s is %s, not a regular file", ErrInvalid, name, fileKind(fi.Mode()))
	}
	f, err := openRegular(func() (*os.File, error) { return d.root.OpenFile(name, os.O_RDONLY|syscall.O_NONBLOCK, 0) }, name)
	if err != nil {
		return nil, 0, err
	}
	fi, err = f.Stat()
	if err != nil {
		f.Close()
		return nil, 0, err
	}
	return f, fi.Size(), nil
}

func (d *dirSource) truncation() error { return nil }
func (d *dirSource) Close() error      { return d.root.Close() }

// tarSource reads files of a tar archive in place, by offset.
type tarSource struct {
	f       *os.File
	entries map[string]tarEntry
	trunc   error
}

type tarEntry struct {
	offset, size int64
	symlink      string // target, relative to the entry's directory
	hardlink     string // target, relative to the archive root
}

// indexTar records where each regular file's data lies in f. Symlinks and
// hard links are recorded and resolved on lookup (docker save links
// duplicate layer.tar files). A truncated archive keeps what was indexed
// before the cut and remembers the cut.
func indexTar(ctx context.Context, f *os.File, maxEntries int64) (*tarSource, error) {
	ts := &tarSource{f: f, entries: make(map[string]tarEntry)}
	tr := tar.NewReader(f)
	for n := int64(0); ; n++ {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		if n > maxEntries {
			return nil, fmt.Errorf("%w: the archive holds more than image_import_max_entries (%d) entries", ErrLimit, maxEntries)
		}
		hdr, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			if len(ts.entries) == 0 && !errors.Is(err, io.ErrUnexpectedEOF) {
				return nil, fmt.Errorf("%w: not a tar archive: %v", ErrInvalid, err)
			}
			ts.trunc = fmt.Errorf("%w: %v after %d entries", ErrTruncated, err, len(ts.entries))
			break
		}
		name := cleanArchiveName(hdr.Name)
		switch hdr.Typeflag {
		case tar.TypeReg, tar.TypeRegA:
			// tar.Reader reads f directly, unbuffered: after Next the
			// offset is the start of the entry's data.
			off, err := f.Seek(0, io.SeekCurrent)
			if err != nil {
				return nil, fmt.Errorf("indexing archive: %w", err)
			}
			ts.entries[name] = tarEntry{offset: off, size: hdr.Size}
		case tar.TypeSymlink:
			ts.entries[name] = tarEntry{symlink: hdr.Linkname}
		case tar.TypeLink:
			ts.entries[name] = tarEntry{hardlink: cleanArchiveName(hdr.Linkname)}
		}
	}
	return ts, nil
}

func cleanArchiveName(name string) string {
	return strings.TrimPrefix(path.Clean("/"+name), "/")
}

func (t *tarSource) open(name string) (io.ReadCloser, int64, error) {
	name = cleanArchiveName(name)
	for hops := 0; ; hops++ {
		e, ok := t.entries[name]
		if !ok {
			return nil, 0, &fs.PathError{Op: "open", Path: name, Err: fs.ErrNotExist}
		}
		if hops > 16 {
			return nil, 0, &fs.PathError{Op: "open", Path: name, Err: errors.New("too many links")}
		}
		switch {
		case e.symlink != "":
			if path.IsAbs(e.symlink) {
				return nil, 0, &fs.PathError{Op: "open", Path: name, Err: fs.ErrNotExist}
			}
			name = cleanArchiveName(path.Join(path.Dir(name), e.symlink))
		case e.hardlink != "":
			name = e.hardlink
		default:
			return io.NopCloser(io.NewSectionReader(t.f, e.offset, e.size)), e.size, nil
		}
	}
}

func (t *tarSource) truncation() error { return t.trunc }
func (t *tarSource) Close() error      { return t.f.Close() }

// descriptor names a blob: its digest and, when known, its size (-1 when
// not). what says what it is for error text, e.g. "layer 2 (sha256:…)".
type descriptor struct {
	MediaType string `json:"mediaType"`
	Digest    string `json:"digest"`
	Size      int64  `json:"size"`
	// Path is where the blob lies when it is not blobs/sha256/<hex>
	// (legacy docker save).
	Path string `json:"-"`
	// DiffID is the digest of a layer's uncompressed tar stream, from the
	// config's rootfs.diff_ids.
	DiffID string `json:"-"`
}

// validDigest reports whether d is "sha256:" and 64 lower-case hex digits.
func validDigest(d string) bool {
	hexPart, ok := strings.CutPrefix(d, "sha256:")
	if !ok || len(hexPart) != 64 {
		return false
	}
	for _, c := range hexPart {
		if !('0' <= c && c <= '9' || 'a' <= c && c <= 'f') {
			return false
		}
	}
	return true
}

// blobWhat names a blob in errors: "layer 2 (sha256:…)".
func blobWhat(label string, d descriptor) string {
	if d.Digest != "" {
		return label + " (" + d.Digest + ")"
	}
	return label + " (" + d.Path + ")"
}

// openBlob opens the blob of d, verifying its digest and size as it is
// read: the reader returns an error wrapping ErrDigestMismatch or
// ErrTruncated instead of io.EOF when the content is wrong. label says what
// the blob is ("layer 2", "config") for errors.
func openBlob(src source, d descriptor, label string) (*verifier, error) {
	what := blobWhat(label, d)
	name, id := d.Path, d.Path
	if name == "" {
		if !validDigest(d.Digest) {
			return nil, fmt.Errorf("%w: %s has digest %q, want sha256:<64 hex digits>", ErrInvalid, label, d.Digest)
		}
		name = "blobs/sha256/" + strings.TrimPrefix(d.Digest, "sha256:")
		id = d.Digest
	}
	rc, size, err := src.open(name)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			if trunc := src.truncation(); trunc != nil {
				return nil, fmt.Errorf("blob %s (%s) %w (%w)", id, label, ErrMissingBlob, trunc)
			}
			return nil, fmt.Errorf("blob %s (%s) %w", id, label, ErrMissingBlob)
		}
		return nil, fmt.Errorf("opening %s: %w", what, err)
	}
	want := d.Size
	if want <= 0 {
		want = size
	}
	if d.Size > 0 && size > d.Size {
		rc.Close()
		return nil, fmt.Errorf("%s %w: the blob holds %d bytes, its descriptor says %d", what, ErrDigestMismatch, size, d.Size)
	}
	return &verifier{rc: rc, h: sha256.New(), want: want, digest: d.Digest, what: what}, nil
}

// verifier hashes what is read through it and, at the end, checks length
// and digest. It replaces io.EOF with the error when they are wrong, so
// readers stacked on it (gzip, tar) fail with that error.
type verifier struct {
	rc     io.ReadCloser
	h      hash.Hash
	n      int64
	want   int64
	digest string
	what   string
	err    error
}

func (v *verifier) Read(p []byte) (int, error) {
	if v.err != nil {
		return 0, v.err
	}
	n, err := v.rc.Read(p)
	v.h.Write(p[:n])
	v.n += int64(n)
	if v.n > v.want {
		v.err = fmt.Errorf("%s %w: more than the %d bytes its descriptor says", v.what, ErrDigestMismatch, v.want)
		return n, v.err
	}
	if err == io.EOF {
		if v.n < v.want {
			v.err = fmt.Errorf("%w: unexpected EOF in %s after %d of %d bytes", ErrTruncated, v.what, v.n, v.want)
			return n, v.err
		}
		if got := "sha256:" + hex.EncodeToString(v.h.Sum(nil)); got != v.digest {
			v.err = fmt.Errorf("%s %w: got %s", v.what, ErrDigestMismatch, got)
			return n, v.err
		}
		v.err = io.EOF
	} else if err != nil {
		v.err = fmt.Errorf("reading %s: %w", v.what, err)
		return n, v.err
	}
	return n, err
}

// finish reads what is left and reports the verification result.
func (v *verifier) finish() error {
	_, err := io.Copy(io.Discard, v)
	return err
}

func (v *verifier) Close() error { return v.rc.Close() }

// readBlob reads and verifies a small blob (manifest, index, config) of at
// most limit bytes.
func readBlob(src source, d descriptor, label string, limit int64) ([]byte, error) {
	what := blobWhat(label, d)
	if d.Size > limit {
		return nil, fmt.Errorf("%w: %s is %d bytes, more than the %d allowed", ErrInvalid, what, d.Size, limit)
	}
	v, err := openBlob(src, d, label)
	if err != nil {
		return nil, err
	}
	defer v.Close()
	if v.want > limit {
		return nil, fmt.Errorf("%w: %s is %d bytes, more than the %d allowed", ErrInvalid, what, v.want, limit)
	}
	data, err := io.ReadAll(v)
	if err != nil {
		return nil, err
	}
	return data, nil
}

// readFile reads a small layout file that has no digest (index.json,
// manifest.json, oci-layout).
func readFile(src source, name string, limit int64) ([]byte, error) {
	rc, size, err := src.open(name)
	if err != nil {
		return nil, err
	}
	defer rc.Close()
	if size > limit {
		return nil, fmt.Errorf("%w: %s is %d bytes, more than the %d allowed", ErrInvalid, name, size, limit)
	}
	data, err := io.ReadAll(io.LimitReader(rc, limit))
	if err != nil {
		return nil, fmt.Errorf("reading %s: %w", name, err)
	}
	if int64(len(data)) < size {
		return nil, fmt.Errorf("%w: unexpected EOF in %s", ErrTruncated, name)
	}
	return data, nil
}
