package proto

import (
	"archive/tar"
	"errors"
	"fmt"
	"io"
	"path"
	"strings"
)

// TarChecker applies the rules an archive extracted into a directory of
// the workload's root must follow, member by member. The host checks a
// whole archive with CheckTar before it sends it; the guest checks each
// member again before it writes it. The rules:
//
//   - no absolute member name and no ".." segment;
//   - no member below a symbolic link or a file of the archive (writing it
//     would follow the link);
//   - a symbolic link's target, taken relative to the link's directory
//     (an absolute one relative to the root), stays inside the directory;
//   - a hard link names an earlier file of the archive;
//   - regular files, directories, links and FIFOs only: no device node;
//   - the members' contents add up to at most the cap (and the archive
//     itself, counted by the reader, is at most the cap too).
//
// The link rule is lexical: the extraction itself never follows a link
// (each member is created anew, below directories it created), which is
// what keeps writes inside the directory.
type TarChecker struct {
	dir      string
	maxBytes int64
	total    int64
	members  int
	// kinds maps each member name seen to its type flag.
	kinds map[string]byte
}

// NewTarChecker checks members headed for dir (an absolute path of the
// workload's root) with contents of at most maxBytes in all.
func NewTarChecker(dir string, maxBytes int64) *TarChecker {
	return &TarChecker{dir: path.Clean(dir), maxBytes: maxBytes, kinds: map[string]byte{}}
}

// Members returns how many members passed the check.
func (c *TarChecker) Members() int { return c.members }

// Bytes returns the contents of the regular files that passed, in bytes.
func (c *TarChecker) Bytes() int64 { return c.total }

// refuse is an OpError naming the member.
func refuse(name, format string, args ...any) error {
	return &OpError{Code: ErrBadRequest, Message: fmt.Sprintf("archive member %q: ", name) + fmt.Sprintf(format, args...)}
}

// Check checks one header and returns the member's clean name relative to
// the directory ("" for the directory itself, as "./" names it).
func (c *TarChecker) Check(h *tar.Header) (string, error) {
	name, err := memberName(h.Name)
	if err != nil {
		return "", refuse(h.Name, "%v", err)
	}
	switch h.Typeflag {
	case tar.TypeReg, tar.TypeDir, tar.TypeSymlink, tar.TypeLink, tar.TypeFifo:
	case tar.TypeChar, tar.TypeBlock:
		return "", refuse(h.Name, "device nodes are not accepted")
	default:
		return "", refuse(h.Name, "unsupported member type %q", h.Typeflag)
	}
	if name == "" {
		if h.Typeflag != tar.TypeDir {
			return "", refuse(h.Name, "names the directory itself but is not a directory")
		}
		c.members++
		return "", nil
	}
	// Every parent must be (or become) a directory, never a link or file
	// of the archive.
	for i := 0; i < len(name); i++ {
		if name[i] != '/' {
			continue
		}
		switch c.kinds[name[:i]] {
		case tar.TypeSymlink, tar.TypeLink:
			return "", refuse(h.Name, "lies below the link %q of the archive", name[:i])
		case tar.TypeReg, tar.TypeFifo:
			return "", refuse(h.Name, "lies below the file %q of the archive", name[:i])
		}
	}
	switch h.Typeflag {
	case tar.TypeSymlink:
		if h.Linkname == "" {
			return "", refuse(h.Name, "symbolic link without a target")
		}
		target := h.Linkname
		if !strings.HasPrefix(target, "/") {
			target = path.Join(c.dir, path.Dir(name), target)
		}
		if !within(c.dir, path.Clean(target)) {
			return "", refuse(h.Name, "symbolic link to %q leaves %s", h.Linkname, c.dir)
		}
	case tar.TypeLink:
		target, err := memberName(h.Linkname)
		if err != nil || target == "" || target == name || c.kinds[target] != tar.TypeReg {
			return "", refuse(h.Name, "hard link to %q, which is not an earlier file of the archive", h.Linkname)
		}
	case tar.TypeReg:
		if h.Size > c.maxBytes-c.total {
			return "", refuse(h.Name, "the archive's contents exceed %d bytes", c.maxBytes)
		}
		c.total += h.Size
	}
	if h.Typeflag == tar.TypeDir {
		if k, ok := c.kinds[name]; ok && k != tar.TypeDir {
			return "", refuse(h.Name, "a directory replaces an earlier member of another type")
		}
	} else if c.kinds[name] == tar.TypeDir {
		return "", refuse(h.Name, "replaces an earlier directory of the archive")
	}
	// Parents the archive does not list are made as directories.
	for i := 0; i < len(name); i++ {
		if name[i] == '/' {
			if _, ok := c.kinds[name[:i]]; !ok {
				c.kinds[name[:i]] = tar.TypeDir
			}
		}
	}
	c.kinds[name] = h.Typeflag
	c.members++
	return name, nil
}

// memberName cleans a member name: relative, without "..", without a
// leading "./" or a trailing "/"; "" names the directory itself.
func memberName(n string) (string, error) {
	if n == "" {
		return "", errors.New("empty name")
	}
	if strings.HasPrefix(n, "/") {
		return "", errors.New("absolute name")
	}
	for _, seg := range strings.Split(n, "/") {
		if seg == ".." {
			return "", errors.New("name with a .. segment")
		}
	}
	c := path.Clean(n)
	if c == "." {
		return "", nil
	}
	return c, nil
}

// within reports whether p is dir or below it (both clean and absolute).
func within(dir, p string) bool {
	return dir == "/" || p == dir || strings.HasPrefix(p, dir+"/")
}

// CountingReader counts the bytes read through it and fails (for good) once
// more than Max were read.
type CountingReader struct {
	R   io.Reader
	Max int64
	N   int64
}

func (r *CountingReader) Read(p []byte) (int, error) {
	if r.N > r.Max {
		return 0, r.tooLarge()
	}
	// Read at most one byte past the cap: enough to tell, no more.
	if rem := r.Max - r.N + 1; int64(len(p)) > rem {
		p = p[:rem]
	}
	n, err := r.R.Read(p)
	r.N += int64(n)
	if r.N > r.Max {
		return n, r.tooLarge()
	}
	return n, err
}

func (r *CountingReader) tooLarge() error {
	return &OpError{Code: ErrBadRequest, Message: fmt.Sprintf("the archive exceeds %d bytes", r.Max)}
}

// CheckTar reads a whole archive from r and checks it for dir with a cap of
// maxBytes (the archive's bytes and its members' contents). A broken rule
// is an *OpError with code ErrBadRequest naming the member; a read error is
// returned as it is.
func CheckTar(r io.Reader, dir string, maxBytes int64) error {
	cr := &CountingReader{R: r, Max: maxBytes}
	tr := tar.NewReader(cr)
	c := NewTarChecker(dir, maxBytes)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return TarReadError(err)
		}
		if _, err := c.Check(h); err != nil {
			return err
		}
	}
	// What follows the end-of-archive blocks still counts toward the cap.
	if _, err := io.Copy(io.Discard, cr); err != nil {
		return TarReadError(err)
	}
	return nil
}

// TarReadError turns an archive/tar error into a bad request; an OpError
// (the cap) passes as it is, and other errors (the transport) too.
func TarReadError(err error) error {
	var oe *OpError
	if errors.As(err, &oe) {
		return oe
	}
	if errors.Is(err, tar.ErrHeader) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, tar.ErrFieldTooLong) {
		return &OpError{Code: ErrBadRequest, Message: "not a valid tar archive: " + err.Error()}
	}
	return err
}
