package guest

import (
	"archive/tar"
	"bufio"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"os"
	"path"
	"path/filepath"
	"strconv"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"vmhost/appvm/guest/proto"
)

// fileKey identifies a file across names (hard links, secret files).
type fileKey struct{ dev, ino uint64 }

func keyOf(fi fs.FileInfo) (fileKey, bool) {
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return fileKey{}, false
	}
	return fileKey{uint64(st.Dev), st.Ino}, true
}

// secretSet names the workload's secret files as they are now: their
// paths in the root and their inodes (another name for one is a secret
// too).
type secretSet struct {
	paths map[string]bool
	keys  map[fileKey]bool
}

func (a *agent) secrets(oc *opsContext) secretSet {
	s := secretSet{paths: map[string]bool{}, keys: map[fileKey]bool{}}
	for _, f := range oc.spec.SecretFiles {
		h, err := inRoot(a.opts.root, f.Path)
		if err != nil {
			continue
		}
		s.paths[h] = true
		if fi, err := os.Lstat(h); err == nil && fi.Mode().IsRegular() {
			if k, ok := keyOf(fi); ok {
				s.keys[k] = true
			}
		}
	}
	return s
}

func (s secretSet) has(hostPath string, fi fs.FileInfo) bool {
	if s.paths[hostPath] {
		return true
	}
	if !fi.Mode().IsRegular() {
		return false
	}
	k, ok := keyOf(fi)
	return ok && s.keys[k]
}

// frameWriter writes what it is given as FrameData frames.
type frameWriter struct {
	c  net.Conn
	fc *proto.FrameConn
}

func (w frameWriter) Write(p []byte) (int, error) {
	n := 0
	for len(p) > 0 {
		chunk := p[:min(len(p), proto.MaxPayload)]
		w.c.SetWriteDeadline(time.Now().Add(stallTimeout))
		if err := w.fc.WriteFrame(proto.FrameData, chunk); err != nil {
			return n, err
		}
		n += len(chunk)
		p = p[len(chunk):]
	}
	return n, nil
}

// opGetFiles sends a tar archive of p: the file or directory (not followed
// if it is a link) with members named relative to p's parent, owners as
// numbers, secret files left out. The frames' writes block while the host
// does not read.
func (a *agent) opGetFiles(c net.Conn, fc *proto.FrameConn, oc *opsContext, p string) error {
	root := a.opts.root
	target, name := root, "."
	if p != "/" {
		dir, err := inRoot(root, path.Dir(p))
		if err != nil {
			return opFail(proto.ErrBadRequest, "path: %v", err)
		}
		target, name = filepath.Join(dir, path.Base(p)), path.Base(p)
	}
	fi, err := os.Lstat(target)
	if errors.Is(err, fs.ErrNotExist) || errors.Is(err, syscall.ENOTDIR) {
		return opFail(proto.ErrNotFound, "%s does not exist in the workload's root", p)
	}
	if err != nil {
		return fmt.Errorf("reading %s: %w", p, err)
	}
	out := &tarOut{secrets: a.secrets(oc), links: map[fileKey]string{}}
	if out.secrets.has(target, fi) {
		return opFail(proto.ErrBadRequest, "%s is a secret file: it cannot be copied out", p)
	}
	bw := bufio.NewWriterSize(frameWriter{c, fc}, proto.MaxPayload)
	out.tw = tar.NewWriter(bw)
	if err := out.add(target, name, fi, 0); err != nil {
		return err
	}
	if err := out.tw.Close(); err != nil {
		return err
	}
	if err := bw.Flush(); err != nil {
		return err
	}
	a.log.Info("files sent", "path", p, "members", out.members)
	c.SetWriteDeadline(time.Now().Add(stallTimeout))
	return fc.WriteFrame(proto.FrameEnd, nil)
}

// tarOut writes a tree into a tar archive.
type tarOut struct {
	tw      *tar.Writer
	secrets secretSet
	// links maps a file with several names to its first member.
	links   map[fileKey]string
	members int
}

// add writes hostPath as member name, and a directory's entries below it.
// parentDev is the device of the parent directory (0 for the top).
func (t *tarOut) add(hostPath, name string, fi fs.FileInfo, parentDev uint64) error {
	if t.secrets.has(hostPath, fi) {
		return nil
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return fmt.Errorf("no file status for %s", name)
	}
	h := &tar.Header{Name: name, Mode: int64(st.Mode & 0o7777), Uid: int(st.Uid), Gid: int(st.Gid), ModTime: fi.ModTime()}
	var content *os.File
	switch fi.Mode().Type() {
	case 0:
		if st.Nlink > 1 {
			k := fileKey{uint64(st.Dev), st.Ino}
			if first, ok := t.links[k]; ok {
				h.Typeflag, h.Linkname = tar.TypeLink, first
				break
			}
			t.links[k] = name
		}
		f, err := os.OpenFile(hostPath, os.O_RDONLY|syscall.O_NOFOLLOW, 0)
		if errors.Is(err, fs.ErrNotExist) {
			return nil // gone since the directory was read
		}
		if err != nil {
			return fmt.Errorf("reading %s: %w", name, err)
		}
		defer f.Close()
		h.Typeflag, h.Size, content = tar.TypeReg, fi.Size(), f
	case fs.ModeDir:
		h.Typeflag, h.Name = tar.TypeDir, name+"/"
	case fs.ModeSymlink:
		target, err := os.Readlink(hostPath)
		if err != nil {
			return fmt.Errorf("reading the link %s: %w", name, err)
		}
		h.Typeflag, h.Linkname = tar.TypeSymlink, target
	case fs.ModeNamedPipe:
		h.Typeflag = tar.TypeFifo
	case fs.ModeDevice | fs.ModeCharDevice, fs.ModeDevice:
		h.Typeflag = tar.TypeBlock
		if fi.Mode()&fs.ModeCharDevice != 0 {
			h.Typeflag = tar.TypeChar
		}
		h.Devmajor, h.Devminor = int64(unix.Major(uint64(st.Rdev))), int64(unix.Minor(uint64(st.Rdev)))
	default:
		return nil // a socket: tar has no such member
	}
	if err := t.tw.WriteHeader(h); err != nil {
		return err
	}
	t.members++
	if content != nil {
		// Exactly the size the header says, though the file may have
		// changed since: cut what grew, pad what shrank.
		n, err := io.Copy(t.tw, io.LimitReader(content, h.Size))
		if err != nil {
			return fmt.Errorf("reading %s: %w", name, err)
		}
		if n < h.Size {
			if _, err := io.CopyN(t.tw, zeros{}, h.Size-n); err != nil {
				return err
			}
		}
		return nil
	}
	if h.Typeflag != tar.TypeDir || pseudoFS(hostPath, uint64(st.Dev), parentDev) {
		return nil
	}
	entries, err := os.ReadDir(hostPath)
	if err != nil {
		return fmt.Errorf("reading the directory %s: %w", name, err)
	}
	for _, e := range entries {
		child := filepath.Join(hostPath, e.Name())
		cfi, err := os.Lstat(child)
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return fmt.Errorf("reading %s/%s: %w", name, e.Name(), err)
		}
		if err := t.add(child, name+"/"+e.Name(), cfi, uint64(st.Dev)); err != nil {
			return err
		}
	}
	return nil
}

// pseudoFS reports a mount of a kernel file system (proc, sysfs, cgroups,
// …) at dir: an archive holds its mountpoint, not its contents.
func pseudoFS(dir string, dev, parentDev uint64) bool {
	if dev == parentDev {
		return false
	}
	var sfs unix.Statfs_t
	if unix.Statfs(dir, &sfs) != nil {
		return false
	}
	switch int64(sfs.Type) {
	case unix.PROC_SUPER_MAGIC, unix.SYSFS_MAGIC, unix.DEVPTS_SUPER_MAGIC, unix.CGROUP_SUPER_MAGIC,
		unix.CGROUP2_SUPER_MAGIC, unix.DEBUGFS_MAGIC, unix.TRACEFS_MAGIC, unix.SECURITYFS_MAGIC,
		unix.BPF_FS_MAGIC, unix.PSTOREFS_MAGIC:
		return true
	}
	return false
}

// zeros reads as endless zero bytes.
type zeros struct{}

func (zeros) Read(p []byte) (int, error) {
	clear(p)
	return len(p), nil
}

// frameReader reads the host's FrameData payloads as one stream, up to
// FrameEnd (then io.EOF).
type frameReader struct {
	fc   *proto.FrameConn
	rest []byte
	end  bool
}

// errHostGone reports a connection that broke during a put.
var errHostGone = errors.New("the host's connection ended before the archive did")

func (r *frameReader) Read(p []byte) (int, error) {
	for len(r.rest) == 0 {
		if r.end {
			return 0, io.EOF
		}
		t, b, err := r.fc.ReadFrame()
		if err != nil {
			return 0, fmt.Errorf("%w: %v", errHostGone, err)
		}
		switch t {
		case proto.FrameData:
			r.rest = b
		case proto.FrameEnd:
			r.end = true
		default:
			return 0, opFail(proto.ErrBadRequest, "a frame of type %d inside the archive", t)
		}
	}
	n := copy(p, r.rest)
	r.rest = r.rest[n:]
	return n, nil
}

// stagingPrefix names the directory a put extracts into before anything
// reaches its destination.
const stagingPrefix = ".vmhost-put-"

// dirMode is a directory's metadata from the archive, applied once every
// member is in place (a read-only mode must not stop the extraction).
type dirMode struct {
	rel      string
	mode     uint32
	uid, gid int
}

// opPutFiles extracts the archive the host sends into the directory req.Path
// of the workload's root. Every member is checked (proto.TarChecker) and
// written into a staging directory inside the destination; only when the
// whole archive passed and nothing in it would replace an existing
// directory with a file does it move into place. A refusal at any point
// leaves the destination as it was.
func (a *agent) opPutFiles(c net.Conn, fc *proto.FrameConn, oc *opsContext, req *proto.PutFilesRequest) error {
	dest, err := inRoot(a.opts.root, req.Path)
	if err != nil {
		return opFail(proto.ErrBadRequest, "path: %v", err)
	}
	fi, err := os.Stat(dest)
	if errors.Is(err, fs.ErrNotExist) || errors.Is(err, syscall.ENOTDIR) {
		return opFail(proto.ErrNotFound, "the directory %s does not exist in the workload's root", req.Path)
	}
	if err != nil {
		return fmt.Errorf("reading %s: %w", req.Path, err)
	}
	if !fi.IsDir() {
		return opFail(proto.ErrBadRequest, "%s is not a directory", req.Path)
	}
	staging, err := os.MkdirTemp(dest, stagingPrefix)
	if err != nil {
		return fmt.Errorf("creating a staging directory in %s: %w", req.Path, err)
	}
	defer os.RemoveAll(staging)

	cr := &proto.CountingReader{R: &frameReader{fc: fc}, Max: req.MaxBytes}
	tr := tar.NewReader(cr)
	chk := proto.NewTarChecker(req.Path, req.MaxBytes)
	x := &extractor{staging: staging, owners: switchesUsers()}
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return proto.TarReadError(err)
		}
		name, err := chk.Check(h)
		if err != nil {
			return err
		}
		if name == "" {
			continue // the destination itself keeps its metadata
		}
		if err := x.extract(name, h, tr); err != nil {
			return err
		}
	}
	// The rest of the stream (the end-of-archive blocks) up to FrameEnd.
	if _, err := io.Copy(io.Discard, cr); err != nil {
		return proto.TarReadError(err)
	}
	if err := conflicts(staging, dest, "."); err != nil {
		return err
	}
	if err := move(staging, dest); err != nil {
		return fmt.Errorf("moving the extracted files into %s: %w", req.Path, err)
	}
	for i := len(x.dirs) - 1; i >= 0; i-- {
		d := x.dirs[i]
		p := filepath.Join(dest, d.rel)
		if x.owners {
			os.Lchown(p, d.uid, d.gid)
		}
		unix.Chmod(p, d.mode)
	}
	// Gone before the answer: the host finds the destination as it stays.
	os.RemoveAll(staging)
	a.log.Info("files received", "path", req.Path, "members", chk.Members(), "bytes", chk.Bytes())
	c.SetWriteDeadline(time.Now().Add(stallTimeout))
	return fc.WriteFrame(proto.FrameDone, []byte(`{"members":`+strconv.Itoa(chk.Members())+`,"bytes":`+strconv.FormatInt(chk.Bytes(), 10)+`}`))
}

// extractor writes checked members into the staging directory. It never
// follows a link: parents are directories it made (the checker refuses a
// member below a link or file of the archive) and each member is created
// anew.
type extractor struct {
	staging string
	owners  bool
	dirs    []dirMode
}

func (x *extractor) extract(name string, h *tar.Header, r io.Reader) error {
	p := filepath.Join(x.staging, name)
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		return fmt.Errorf("extracting %s: %w", name, err)
	}
	if h.Typeflag != tar.TypeDir {
		// A member named again replaces the earlier one.
		if err := os.Remove(p); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("extracting %s: %w", name, err)
		}
	}
	mode := uint32(h.Mode) & 0o7777
	var err error
	switch h.Typeflag {
	case tar.TypeDir:
		if err = os.Mkdir(p, 0o700); errors.Is(err, fs.ErrExist) {
			err = nil
		}
		x.dirs = append(x.dirs, dirMode{rel: name, mode: mode, uid: h.Uid, gid: h.Gid})
		return wrapExtract(name, err)
	case tar.TypeReg:
		var f *os.File
		f, err = os.OpenFile(p, os.O_WRONLY|os.O_CREATE|os.O_EXCL|syscall.O_NOFOLLOW, 0o600)
		if err != nil {
			return wrapExtract(name, err)
		}
		_, err = io.Copy(f, r)
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return proto.TarReadError(err)
		}
	case tar.TypeSymlink:
		err = os.Symlink(h.Linkname, p)
	case tar.TypeLink:
		// The checker made sure it is an earlier file of the archive.
		err = os.Link(filepath.Join(x.staging, path.Clean(h.Linkname)), p)
	case tar.TypeFifo:
		err = unix.Mkfifo(p, 0o600)
	}
	if err != nil {
		return wrapExtract(name, err)
	}
	if h.Typeflag == tar.TypeLink {
		return nil // the file's metadata is its first name's
	}
	if x.owners {
		os.Lchown(p, h.Uid, h.Gid)
	}
	if h.Typeflag != tar.TypeSymlink {
		// After the chown, which clears setuid and setgid bits.
		if err := unix.Chmod(p, mode); err != nil {
			return wrapExtract(name, err)
		}
		os.Chtimes(p, h.ModTime, h.ModTime)
	}
	return nil
}

func wrapExtract(name string, err error) error {
	if err == nil {
		return nil
	}
	return fmt.Errorf("extracting %s: %w", name, err)
}

// conflicts refuses an archive that would replace an existing directory of
// the destination with something else (tar refuses it too).
func conflicts(src, dst, rel string) error {
	entries, err := os.ReadDir(src)
	if err != nil {
		return err
	}
	for _, e := range entries {
		d := filepath.Join(dst, e.Name())
		dfi, err := os.Lstat(d)
		if err != nil || !dfi.IsDir() {
			continue
		}
		r := path.Join(rel, e.Name())
		if !e.IsDir() {
			return opFail(proto.ErrBadRequest, "archive member %q would replace an existing directory", r)
		}
		if err := conflicts(filepath.Join(src, e.Name()), d, r); err != nil {
			return err
		}
	}
	return nil
}

// move puts the staged tree into dst: a directory that exists there is
// merged into, anything else is replaced (a rename, or a copy where the
// destination is another file system).
func move(src, dst string) error {
	entries, err := os.ReadDir(src)
	if err != nil {
		return err
	}
	for _, e := range entries {
		s, d := filepath.Join(src, e.Name()), filepath.Join(dst, e.Name())
		dfi, derr := os.Lstat(d)
		if e.IsDir() {
			if derr == nil && dfi.IsDir() {
				if err := move(s, d); err != nil {
					return err
				}
				continue
			}
			if derr == nil {
				if err := os.Remove(d); err != nil {
					return err
				}
			}
			err := os.Rename(s, d)
			if errors.Is(err, syscall.EXDEV) {
				if err = os.Mkdir(d, 0o700); err == nil {
					err = move(s, d)
				}
			}
			if err != nil {
				return err
			}
			continue
		}
		err := os.Rename(s, d)
		if errors.Is(err, syscall.EXDEV) {
			err = copyAcross(s, d)
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// copyAcross copies the file, link or FIFO s to d on another file system:
// made beside d under a temporary name, then renamed over it.
func copyAcross(s, d string) error {
	fi, err := os.Lstat(s)
	if err != nil {
		return err
	}
	tmp := filepath.Join(filepath.Dir(d), stagingPrefix+filepath.Base(d))
	os.Remove(tmp)
	switch fi.Mode().Type() {
	case fs.ModeSymlink:
		target, err := os.Readlink(s)
		if err == nil {
			err = os.Symlink(target, tmp)
		}
		if err != nil {
			return err
		}
	case fs.ModeNamedPipe:
		if err := unix.Mkfifo(tmp, 0o600); err != nil {
			return err
		}
	default:
		in, err := os.Open(s)
		if err != nil {
			return err
		}
		defer in.Close()
		out, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_EXCL|syscall.O_NOFOLLOW, 0o600)
		if err != nil {
			return err
		}
		_, err = io.Copy(out, in)
		if cerr := out.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			os.Remove(tmp)
			return err
		}
	}
	if st, ok := fi.Sys().(*syscall.Stat_t); ok && switchesUsers() {
		os.Lchown(tmp, int(st.Uid), int(st.Gid))
		if fi.Mode().Type() != fs.ModeSymlink {
			unix.Chmod(tmp, st.Mode&0o7777)
		}
	} else if fi.Mode().Type() != fs.ModeSymlink {
		unix.Chmod(tmp, uint32(fi.Mode().Perm()))
	}
	if fi.Mode().Type() != fs.ModeSymlink {
		os.Chtimes(tmp, fi.ModTime(), fi.ModTime())
	}
	if err := os.Rename(tmp, d); err != nil {
		os.Remove(tmp)
		return err
	}
	return nil
}
