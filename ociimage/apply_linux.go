package ociimage

import (
	"archive/tar"
	"bufio"
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
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Whiteout names of the OCI layer format.
const (
	whiteoutPrefix = ".wh."
	opaqueMarker   = ".wh..wh..opq"
	xattrPAXPrefix = "SCHILY.xattr."
)

// applyLayers applies the layers in order onto the empty directory rootfs
// and returns how many device nodes were skipped.
func applyLayers(ctx context.Context, src source, layers []descriptor, rootfs string, opts Options) (int, error) {
	opts.setDefaults()
	root, err := os.OpenRoot(rootfs)
	if err != nil {
		return 0, fmt.Errorf("opening staging rootfs: %w", err)
	}
	defer root.Close()
	a := &applier{ctx: ctx, root: root, opts: opts, buf: make([]byte, 1<<20)}
	defer a.dropParent()
	if a.rootDir, err = root.Open("."); err != nil {
		return 0, fmt.Errorf("opening staging rootfs: %w", err)
	}
	defer a.rootDir.Close()
	for i, l := range layers {
		a.layer = i + 1
		a.what = fmt.Sprintf("layer %d (%s)", i+1, l.Digest)
		if err := a.applyLayer(ctx, src, l); err != nil {
			return 0, err
		}
	}
	return a.skippedDevices, nil
}

// applier holds the state of applying layers onto one staging tree.
type applier struct {
	ctx     context.Context
	root    *os.Root
	rootDir *os.File
	opts    Options
	buf     []byte

	layer int       // 1-based, for errors
	what  string    // "layer N (digest)", for errors
	blob  *verifier // the layer being read
	// unpacked holds the paths this layer created and their ancestors: an
	// opaque marker hides only what lower layers put in its directory.
	unpacked map[string]bool
	// dirTimes are the times each directory touched by this layer gets
	// at its end: those of its entry, or else those it had before.
	dirTimes map[string]dirTime

	// The parent directory of the last entry, kept open because tar
	// entries come grouped by directory. Dropped whenever something is
	// removed that it might be, be inside of, or be reached through.
	parentName string
	parentDir  *os.File

	skippedDevices int
	// unpackedBytes and entries count the uncompressed layer streams and
	// their entries so far, all layers together, against the limits.
	unpackedBytes int64
	entries       int64
}

type dirTime struct {
	atime, mtime time.Time
}

// keepTimes remembers the times of directory dir before this layer
// changes its contents, unless they are known already.
func (a *applier) keepTimes(dir string, fi fs.FileInfo) {
	if _, ok := a.dirTimes[dir]; ok || !fi.IsDir() {
		return
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return
	}
	a.dirTimes[dir] = dirTime{
		atime: time.Unix(st.Atim.Unix()),
		mtime: time.Unix(st.Mtim.Unix()),
	}
}

func (a *applier) applyLayer(ctx context.Context, src source, l descriptor) error {
	v, err := openBlob(src, l, fmt.Sprintf("layer %d", a.layer))
	if err != nil {
		return err
	}
	defer v.Close()
	a.blob = v
	br := bufio.NewReaderSize(v, 64<<10)
	magic, _ := br.Peek(4)
	var r io.Reader = br
	switch {
	case bytes.HasPrefix(magic, zstdMagic):
		return fmt.Errorf("%s is zstd-compressed, which is %w by this importer (the Go standard library has no zstd decoder)", a.what, ErrUnsupported)
	case bytes.HasPrefix(magic, gzipMagic):
		zr, err := gzip.NewReader(br)
		if err != nil {
			return a.readErr(err)
		}
		defer zr.Close()
		r = zr
	}
	stream := &layerStream{r: r, h: sha256.New(), a: a}
	a.unpacked = make(map[string]bool)
	a.dirTimes = make(map[string]dirTime)
	if fi, err := a.rootDir.Stat(); err == nil {
		a.keepTimes(".", fi)
	}
	tr := tar.NewReader(stream)
	for {
		if err := ctx.Err(); err != nil {
			return err
		}
		hdr, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return a.readErr(err)
		}
		if a.entries++; a.entries > a.opts.MaxEntries {
			return fmt.Errorf("%s: %w: more than image_import_max_entries (%d) entries", a.what, ErrLimit, a.opts.MaxEntries)
		}
		if err := a.applyEntry(hdr, tr); err != nil {
			return err
		}
	}
	// The diff_id covers the whole uncompressed stream and the digest the
	// whole blob, both including what follows the end of the tar stream.
	if _, err := io.Copy(io.Discard, stream); err != nil {
		return a.readErr(err)
	}
	if err := v.finish(); err != nil {
		return err
	}
	if got := "sha256:" + hex.EncodeToString(stream.h.Sum(nil)); got != l.DiffID {
		return fmt.Errorf("%s %w: its uncompressed content is %s, the config's diff_id says %s", a.what, ErrDigestMismatch, got, l.DiffID)
	}
	// Directory times last, since adding entries changes them. Setting
	// a directory's times does not change its parent's.
	dirTimes := a.dirTimes
	a.dirTimes = make(map[string]dirTime) // setTimes opens parents
	for name, dt := range dirTimes {
		if err := a.setTimes(name, dt.atime, dt.mtime); err != nil {
			return err
		}
	}
	return nil
}

// layerStream is a layer's uncompressed tar stream. It hashes what is read
// for the diff_id and counts it against Options.MaxBytes, failing before
// it hands on a byte beyond the limit.
type layerStream struct {
	r   io.Reader
	h   hash.Hash
	a   *applier
	err error
}

func (s *layerStream) Read(p []byte) (int, error) {
	if s.err != nil {
		return 0, s.err
	}
	n, err := s.r.Read(p)
	if over := s.a.unpackedBytes + int64(n) - s.a.opts.MaxBytes; over > 0 {
		n -= int(over)
		s.err = s.a.tooBig()
		err = s.err
	}
	s.h.Write(p[:n])
	s.a.unpackedBytes += int64(n)
	return n, err
}

func (a *applier) tooBig() error {
	return fmt.Errorf("%s: %w: the unpacked content passes image_import_max_bytes (%d bytes)", a.what, ErrLimit, a.opts.MaxBytes)
}

// readErr explains an error from reading a layer's stream. When the blob
// itself is wrong (a corrupt gzip stream usually is), that is the cause to
// report; the verifier's errors already name the layer.
func (a *applier) readErr(err error) error {
	if errors.Is(err, ErrDigestMismatch) || errors.Is(err, ErrTruncated) || errors.Is(err, ErrLimit) ||
		errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return err
	}
	if verr := a.blob.finish(); verr != nil && (errors.Is(verr, ErrDigestMismatch) || errors.Is(verr, ErrTruncated)) {
		return verr
	}
	if errors.Is(err, io.ErrUnexpectedEOF) {
		return fmt.Errorf("%w: unexpected EOF in %s", ErrTruncated, a.what)
	}
	return fmt.Errorf("%s: reading: %w", a.what, err)
}

// cleanEntryName turns a tar entry name into a clean path relative to the
// root ("." for the root itself), refusing absolute and climbing ones.
func (a *applier) cleanEntryName(name string) (string, error) {
	if name == "" {
		return "", fmt.Errorf("%w: %s: entry with an empty name", ErrInvalid, a.what)
	}
	if strings.HasPrefix(name, "/") {
		return "", a.unsafe(name, "is absolute")
	}
	clean := path.Clean(name)
	if clean == ".." || strings.HasPrefix(clean, "../") {
		return "", a.unsafe(name, "")
	}
	if err := checkPathLimits(clean); err != nil {
		return "", fmt.Errorf("%s: %w", a.what, err)
	}
	return clean, nil
}

func (a *applier) unsafe(name, how string) error {
	if how != "" {
		return fmt.Errorf("%s: path %q %s and %w", a.what, name, how, ErrUnsafePath)
	}
	return fmt.Errorf("%s: path %q %w", a.what, name, ErrUnsafePath)
}

// isEscape reports whether err is os.Root refusing a path that leaves it
// (os keeps that error unexported).
func isEscape(err error) bool {
	var pe *fs.PathError
	return errors.As(err, &pe) && pe.Err != nil && pe.Err.Error() == "path escapes from parent"
}

// markUnpacked records name and its ancestors as created by this layer.
func (a *applier) markUnpacked(name string) {
	for name != "." && !a.unpacked[name] {
		a.unpacked[name] = true
		name = path.Dir(name)
	}
}

func (a *applier) dropParent() {
	if a.parentDir != nil {
		a.parentDir.Close()
		a.parentDir, a.parentName = nil, ""
	}
}

// parent opens the directory dir of the tree, creating it (and its
// ancestors, 0755, root-owned as a container runtime would) when missing
// and create is set. Following symlinks on the way is left to os.Root,
// which refuses any that lead out of the root.
func (a *applier) parent(dir, entry string, create bool) (int, error) {
	if dir == "." {
		return int(a.rootDir.Fd()), nil
	}
	if a.parentDir != nil && a.parentName == dir {
		return int(a.parentDir.Fd()), nil
	}
	a.dropParent()
	f, err := a.root.Open(dir)
	if errors.Is(err, fs.ErrNotExist) && create {
		if err = a.root.MkdirAll(dir, 0o755); err == nil {
			f, err = a.root.Open(dir)
		}
	}
	if err != nil {
		if isEscape(err) {
			return -1, a.unsafe(entry, "leads through a symlink out of the root")
		}
		if errors.Is(err, unix.ENOTDIR) {
			return -1, fmt.Errorf("%w: %s: entry %q: a parent is not a directory", ErrInvalid, a.what, entry)
		}
		return -1, fmt.Errorf("%s: opening parent of %q: %w", a.what, entry, err)
	}
	fi, err := f.Stat()
	if err != nil || !fi.IsDir() {
		f.Close()
		return -1, fmt.Errorf("%w: %s: entry %q: a parent is not a directory", ErrInvalid, a.what, entry)
	}
	a.keepTimes(dir, fi)
	a.parentDir, a.parentName = f, dir
	return int(f.Fd()), nil
}

// removeAll removes name (a whole tree if it is a directory; nothing if
// it is missing) and forgets the cached parent, which might be inside it,
// also when reached through a symlink.
func (a *applier) removeAll(name string) error {
	a.dropParent()
	if fi, err := a.root.Lstat(path.Dir(name)); err == nil {
		a.keepTimes(path.Dir(name), fi)
	}
	if err := a.root.RemoveAll(name); err != nil {
		if isEscape(err) {
			return a.unsafe(name, "leads through a symlink out of the root")
		}
		return fmt.Errorf("%s: removing %q: %w", a.what, name, err)
	}
	return nil
}

func (a *applier) applyEntry(hdr *tar.Header, tr *tar.Reader) error {
	if hdr.Typeflag == tar.TypeXGlobalHeader {
		return nil
	}
	name, err := a.cleanEntryName(hdr.Name)
	if err != nil {
		return err
	}
	dir, base := path.Split(name)
	dir = path.Clean(dir)
	if dir == "" {
		dir = "."
	}

	if base == opaqueMarker {
		return a.opaque(dir, name)
	}
	if hidden, ok := strings.CutPrefix(base, whiteoutPrefix); ok {
		if hidden == "" || hidden == "." || hidden == ".." {
			return fmt.Errorf("%w: %s: bad whiteout %q", ErrInvalid, a.what, hdr.Name)
		}
		return a.removeAll(path.Join(dir, hidden))
	}

	if name == "." {
		if hdr.Typeflag != tar.TypeDir {
			return fmt.Errorf("%w: %s: the root entry is not a directory", ErrInvalid, a.what)
		}
		return a.setMeta(a.rootDir, int(a.rootDir.Fd()), ".", ".", hdr, true)
	}
	a.markUnpacked(name)

	dirfd, err := a.parent(dir, name, true)
	if err != nil {
		return err
	}
	var st unix.Stat_t
	exists := unix.Fstatat(dirfd, base, &st, unix.AT_SYMLINK_NOFOLLOW) == nil
	if exists {
		isDir := st.Mode&unix.S_IFMT == unix.S_IFDIR
		switch {
		case isDir && hdr.Typeflag == tar.TypeDir:
			// Merge: keep the contents, take the new metadata.
			return a.setMeta(nil, dirfd, base, name, hdr, true)
		case isDir:
			if err := a.removeAll(name); err != nil {
				return err
			}
			if dirfd, err = a.parent(dir, name, true); err != nil {
				return err
			}
		default:
			if err := unix.Unlinkat(dirfd, base, 0); err != nil {
				return fmt.Errorf("%s: replacing %q: %w", a.what, name, err)
			}
			if st.Mode&unix.S_IFMT == unix.S_IFLNK {
				// The cached parent may have been reached through it.
				a.dropParent()
				if dirfd, err = a.parent(dir, name, true); err != nil {
					return err
				}
			}
		}
	}

	switch hdr.Typeflag {
	case tar.TypeDir:
		if err := unix.Mkdirat(dirfd, base, 0o700); err != nil {
			return fmt.Errorf("%s: creating directory %q: %w", a.what, name, err)
		}
		return a.setMeta(nil, dirfd, base, name, hdr, true)
	case tar.TypeReg, tar.TypeRegA, tar.TypeGNUSparse:
		return a.writeFile(dirfd, base, name, hdr, tr)
	case tar.TypeSymlink:
		if err := unix.Symlinkat(hdr.Linkname, dirfd, base); err != nil {
			return fmt.Errorf("%s: creating symlink %q: %w", a.what, name, err)
		}
		return a.setMeta(nil, dirfd, base, name, hdr, false)
	case tar.TypeLink:
		return a.link(dirfd, base, name, hdr)
	case tar.TypeChar, tar.TypeBlock, tar.TypeFifo:
		return a.mknod(dirfd, base, name, hdr)
	default:
		return fmt.Errorf("%s: entry %q has tar type %q, which is %w", a.what, name, hdr.Typeflag, ErrUnsupported)
	}
}

func (a *applier) writeFile(dirfd int, base, name string, hdr *tar.Header, tr *tar.Reader) error {
	// Refuse a file the limit cannot hold before writing any of it.
	if hdr.Size > a.opts.MaxBytes-a.unpackedBytes {
		return a.tooBig()
	}
	fd, err := unix.Openat(dirfd, base, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return fmt.Errorf("%s: creating %q: %w", a.what, name, err)
	}
	f := os.NewFile(uintptr(fd), name)
	defer f.Close()
	if err := a.copySparse(f, tr); err != nil {
		var pe *fs.PathError
		if errors.As(err, &pe) && pe.Path == name {
			return fmt.Errorf("%s: writing %q: %w", a.what, name, err)
		}
		return a.readErr(err)
	}
	if err := a.setMeta(f, fd, "", name, hdr, false); err != nil {
		return err
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("%s: writing %q: %w", a.what, name, err)
	}
	return a.setTimesAt(dirfd, base, name, hdr.AccessTime, hdr.ModTime)
}

// zeroBlock is one file system block of zeros.
var zeroBlock [blockSize]byte

// copySparse copies r into the empty file f, leaving holes where whole
// blocks are zero: mkfs.ext4 -d keeps holes, so zero-filled files (and
// sparse tar entries) cost no space in the staging tree or the image.
func (a *applier) copySparse(f *os.File, r io.Reader) error {
	var off int64
	for {
		if err := a.ctx.Err(); err != nil {
			return err
		}
		n, rerr := fill(r, a.buf)
		chunk := a.buf[:n]
		for i := 0; i < n; {
			end := min(i+blockSize, n)
			if bytes.Equal(chunk[i:end], zeroBlock[:end-i]) {
				i = end
				continue
			}
			// Write the run of non-zero blocks in one call.
			j := end
			for j < n {
				next := min(j+blockSize, n)
				if bytes.Equal(chunk[j:next], zeroBlock[:next-j]) {
					break
				}
				j = next
			}
			if _, err := f.WriteAt(chunk[i:j], off+int64(i)); err != nil {
				return err
			}
			i = j
		}
		off += int64(n)
		if rerr == io.EOF {
			break
		}
		if rerr != nil {
			return rerr
		}
	}
	// Trailing zeros are a hole too; the size must still be right.
	return f.Truncate(off)
}

// fill reads from r until buf is full or r fails; io.EOF means r ended.
func fill(r io.Reader, buf []byte) (int, error) {
	n := 0
	for n < len(buf) {
		m, err := r.Read(buf[n:])
		n += m
		if err != nil {
			return n, err
		}
	}
	return n, nil
}

func (a *applier) link(dirfd int, base, name string, hdr *tar.Header) error {
	target, err := a.cleanEntryName(hdr.Linkname)
	if err != nil {
		return err
	}
	if target == "." {
		return fmt.Errorf("%w: %s: hard link %q to the root", ErrInvalid, a.what, name)
	}
	tdir, tbase := path.Split(target)
	tdir = path.Clean(tdir)
	if tdir == "" {
		tdir = "."
	}
	tdirfd := int(a.rootDir.Fd())
	if tdir != "." {
		d, err := a.root.Open(tdir)
		if err != nil {
			if isEscape(err) {
				return a.unsafe(hdr.Linkname, "leads through a symlink out of the root")
			}
			return fmt.Errorf("%w: %s: hard link %q: target %q does not exist", ErrInvalid, a.what, name, hdr.Linkname)
		}
		defer d.Close()
		tdirfd = int(d.Fd())
	}
	// Flags 0: a link to a symlink links the symlink itself.
	if err := unix.Linkat(tdirfd, tbase, dirfd, base, 0); err != nil {
		if errors.Is(err, unix.ENOENT) {
			return fmt.Errorf("%w: %s: hard link %q: target %q does not exist", ErrInvalid, a.what, name, hdr.Linkname)
		}
		return fmt.Errorf("%s: hard link %q to %q: %w", a.what, name, hdr.Linkname, err)
	}
	return nil
}

func (a *applier) mknod(dirfd int, base, name string, hdr *tar.Header) error {
	mode := uint32(hdr.Mode & 0o7777)
	switch hdr.Typeflag {
	case tar.TypeChar:
		mode |= unix.S_IFCHR
	case tar.TypeBlock:
		mode |= unix.S_IFBLK
	default:
		mode |= unix.S_IFIFO
	}
	dev := unix.Mkdev(uint32(hdr.Devmajor), uint32(hdr.Devminor))
	if err := unix.Mknodat(dirfd, base, mode, int(dev)); err != nil {
		if errors.Is(err, unix.EPERM) && hdr.Typeflag != tar.TypeFifo {
			if a.opts.SkipDevices {
				a.skippedDevices++
				return nil
			}
			return fmt.Errorf("%s: creating device node %q needs root (CAP_MKNOD), or import with --skip-devices: %w", a.what, name, err)
		}
		return fmt.Errorf("%s: creating %q: %w", a.what, name, err)
	}
	return a.setMeta(nil, dirfd, base, name, hdr, false)
}

// setMeta applies owner, mode, extended attributes and (except for
// directories, whose times wait for the end of the layer, and for regular
// files, which are still open) times. With f set it works on that open
// file; otherwise on base in dirfd without following a final symlink.
func (a *applier) setMeta(f *os.File, dirfd int, base, name string, hdr *tar.Header, isDir bool) error {
	var err error
	if f != nil && base == "" {
		err = unix.Fchown(int(f.Fd()), hdr.Uid, hdr.Gid)
	} else {
		err = unix.Fchownat(dirfd, base, hdr.Uid, hdr.Gid, unix.AT_SYMLINK_NOFOLLOW)
	}
	if err != nil && !(errors.Is(err, unix.EPERM) && a.opts.IgnoreOwners) {
		if errors.Is(err, unix.EPERM) {
			return fmt.Errorf("%s: setting owner of %q needs root (CAP_CHOWN), or import with --ignore-owners: %w", a.what, name, err)
		}
		return fmt.Errorf("%s: setting owner of %q: %w", a.what, name, err)
	}
	if hdr.Typeflag == tar.TypeSymlink {
		// Symlink modes mean nothing on Linux; only their times remain.
		return a.setTimesAt(dirfd, base, name, hdr.AccessTime, hdr.ModTime)
	}
	// After chown, which clears setuid and setgid.
	mode := uint32(hdr.Mode & 0o7777)
	if f != nil && base == "" {
		err = unix.Fchmod(int(f.Fd()), mode)
	} else {
		// The final component was just created by us, or is a directory
		// found by Fstatat without following: not a symlink.
		err = unix.Fchmodat(dirfd, base, mode, 0)
	}
	if err != nil {
		return fmt.Errorf("%s: setting mode of %q: %w", a.what, name, err)
	}
	if err := a.setXattrs(f, dirfd, base, name, hdr, isDir); err != nil {
		return err
	}
	if isDir {
		a.dirTimes[name] = dirTime{atime: hdr.AccessTime, mtime: hdr.ModTime}
		return nil
	}
	if f != nil {
		return nil
	}
	return a.setTimesAt(dirfd, base, name, hdr.AccessTime, hdr.ModTime)
}

// setXattrs sets SCHILY.xattr.* records on regular files and directories
// (mkfs.ext4 -d copies them). Other types keep none; file systems without
// xattr support are tolerated.
func (a *applier) setXattrs(f *os.File, dirfd int, base, name string, hdr *tar.Header, isDir bool) error {
	var attrs [][2]string
	for k, v := range hdr.PAXRecords {
		if attr, ok := strings.CutPrefix(k, xattrPAXPrefix); ok {
			attrs = append(attrs, [2]string{attr, v})
		}
	}
	if len(attrs) == 0 || (f == nil && !isDir) {
		return nil
	}
	fd := -1
	if f != nil && base == "" {
		fd = int(f.Fd())
	} else if f != nil {
		fd = int(f.Fd()) // the root directory
	} else {
		d, err := unix.Openat(dirfd, base, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("%s: opening %q for xattrs: %w", a.what, name, err)
		}
		defer unix.Close(d)
		fd = d
	}
	for _, kv := range attrs {
		if err := unix.Fsetxattr(fd, kv[0], []byte(kv[1]), 0); err != nil {
			if errors.Is(err, unix.ENOTSUP) {
				continue
			}
			return fmt.Errorf("%s: setting xattr %s on %q: %w", a.what, kv[0], name, err)
		}
	}
	return nil
}

func (a *applier) setTimesAt(dirfd int, base, name string, atime, mtime time.Time) error {
	if atime.IsZero() {
		atime = mtime
	}
	ts := []unix.Timespec{unix.NsecToTimespec(atime.UnixNano()), unix.NsecToTimespec(mtime.UnixNano())}
	flags := unix.AT_SYMLINK_NOFOLLOW
	if base == "." {
		flags = 0
	}
	if err := unix.UtimesNanoAt(dirfd, base, ts, flags); err != nil {
		return fmt.Errorf("%s: setting times of %q: %w", a.what, name, err)
	}
	return nil
}

// setTimes sets the times of the directory name (relative to the root).
func (a *applier) setTimes(name string, atime, mtime time.Time) error {
	if name == "." {
		return a.setTimesAt(int(a.rootDir.Fd()), ".", name, atime, mtime)
	}
	dir, base := path.Split(name)
	dir = path.Clean(dir)
	if dir == "" {
		dir = "."
	}
	dirfd, err := a.parent(dir, name, false)
	if errors.Is(err, fs.ErrNotExist) {
		return nil // removed later in the same layer
	}
	if err != nil {
		return err
	}
	err = a.setTimesAt(dirfd, base, name, atime, mtime)
	if errors.Is(err, unix.ENOENT) {
		return nil // removed later in the same layer
	}
	return err
}

// opaque empties dir of everything this layer did not create.
func (a *applier) opaque(dir, entry string) error {
	a.markUnpacked(dir)
	return a.hideLower(dir, entry)
}

func (a *applier) hideLower(dir, entry string) error {
	d, err := a.root.Open(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		if isEscape(err) {
			return a.unsafe(entry, "leads through a symlink out of the root")
		}
		return fmt.Errorf("%s: opening %q: %w", a.what, dir, err)
	}
	ents, err := d.ReadDir(-1)
	d.Close()
	if err != nil {
		return fmt.Errorf("%s: reading %q: %w", a.what, dir, err)
	}
	for _, e := range ents {
		child := path.Join(dir, e.Name())
		switch {
		case !a.unpacked[child]:
			if err := a.removeAll(child); err != nil {
				return err
			}
		case e.IsDir():
			if err := a.hideLower(child, entry); err != nil {
				return err
			}
		}
	}
	return nil
}
