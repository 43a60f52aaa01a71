// Package initramfs writes Linux initramfs archives: cpio in the "newc"
// format (magic 070701), as the kernel's initramfs unpacker reads them.
//
// The writer is deterministic: inode numbers count up from 1 in entry order,
// owners are uid/gid 0, and every mtime is [MTime]. It writes no hard links
// and no compression (the kernel accepts an uncompressed archive); entries are
// written in the order given, so parents must come before their children.
// File sizes are limited to 4 GiB - 1 by the format.
//
// [ForGuestAgent] builds the AppVM initramfs: the static vmhost binary as
// /init plus the few directories and nodes the guest agent needs before it
// mounts devtmpfs, and the kernel modules it loads first (for a distro
// kernel whose virtio, ext4 and vsock drivers are modules).
package initramfs

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"strings"
)

// MTime is the modification time of every entry (seconds since the epoch),
// fixed so that the same inputs give the same bytes.
const MTime = 0

// magic opens every newc header.
const magic = "070701"

// trailer names the last, empty entry of every archive.
const trailer = "TRAILER!!!"

// Entry is one archive member.
type Entry struct {
	// Name is the path inside the archive, relative ("dev/console"); a
	// leading "/" is dropped.
	Name string
	// Mode holds the type (0 for a regular file, fs.ModeDir, fs.ModeSymlink,
	// fs.ModeDevice with or without fs.ModeCharDevice) and permission bits,
	// including setuid, setgid and sticky.
	Mode fs.FileMode
	// Data is a regular file's contents when Source is empty.
	Data []byte
	// Source is the host path of a regular file to copy in.
	Source string
	// Target is a symlink's target.
	Target string
	// Major and Minor number a device node.
	Major, Minor uint32
}

// Dir returns a directory entry.
func Dir(name string, perm fs.FileMode) Entry { return Entry{Name: name, Mode: fs.ModeDir | perm} }

// File returns a regular file entry with the given contents.
func File(name string, perm fs.FileMode, data []byte) Entry {
	return Entry{Name: name, Mode: perm, Data: data}
}

// FileFrom returns a regular file entry copied from the host path src.
func FileFrom(name string, perm fs.FileMode, src string) Entry {
	return Entry{Name: name, Mode: perm, Source: src}
}

// Symlink returns a symbolic link entry.
func Symlink(name, target string) Entry {
	return Entry{Name: name, Mode: fs.ModeSymlink | 0o777, Target: target}
}

// CharDev returns a character device node.
func CharDev(name string, perm fs.FileMode, major, minor uint32) Entry {
	return Entry{Name: name, Mode: fs.ModeDevice | fs.ModeCharDevice | perm, Major: major, Minor: minor}
}

// Write writes entries and the trailer to w as a newc archive.
func Write(w io.Writer, entries []Entry) error {
	bw := bufio.NewWriterSize(w, 1<<16)
	cw := &countWriter{w: bw}
	for i, e := range entries {
		if err := writeEntry(cw, uint32(i+1), e); err != nil {
			return fmt.Errorf("writing initramfs entry %q: %w", e.Name, err)
		}
	}
	if err := writeHeader(cw, header{name: trailer, nlink: 1}); err != nil {
		return fmt.Errorf("writing initramfs trailer: %w", err)
	}
	if err := bw.Flush(); err != nil {
		return fmt.Errorf("writing initramfs: %w", err)
	}
	return nil
}

// ModuleDir is the archive directory holding the kernel modules of
// ForGuestAgent, one <name>.ko each.
const ModuleDir = "lib/modules"

// ModuleList is the archive file naming the modules in ModuleDir, one name a
// line, in the order the guest agent loads them (dependencies first).
// Without it the agent loads nothing.
const ModuleList = "etc/vmhost-modules"

// Module is a kernel module for the guest agent to load.
type Module struct {
	// Name is the module name ("virtio_blk"); the file is <Name>.ko.
	Name string
	// Data is the uncompressed module.
	Data []byte
}

// ForGuestAgent writes the AppVM initramfs: binaryPath (the static vmhost
// binary) as /init, mode 0755, and /dev (with /dev/console, which the kernel
// opens for init's stdio before any devtmpfs exists), /proc, /sys, /run, /tmp,
// /etc, /mnt/root. modules, in load order, go to ModuleDir with their
// names in ModuleList; with none, neither exists.
func ForGuestAgent(w io.Writer, binaryPath string, modules []Module) error {
	entries := []Entry{
		Dir("dev", 0o755),
		CharDev("dev/console", 0o600, 5, 1),
		CharDev("dev/null", 0o666, 1, 3),
		Dir("proc", 0o555),
		Dir("sys", 0o555),
		Dir("run", 0o755),
		Dir("tmp", fs.ModeSticky|0o777),
		Dir("etc", 0o755),
		Dir("mnt", 0o755),
		Dir("mnt/root", 0o755),
		FileFrom("init", 0o755, binaryPath),
	}
	if len(modules) > 0 {
		var list strings.Builder
		entries = append(entries, Dir("lib", 0o755), Dir(ModuleDir, 0o755))
		for _, m := range modules {
			if m.Name == "" || strings.ContainsAny(m.Name, "/\n\x00") {
				return fmt.Errorf("invalid module name %q", m.Name)
			}
			entries = append(entries, File(path.Join(ModuleDir, m.Name+".ko"), 0o644, m.Data))
			list.WriteString(m.Name + "\n")
		}
		entries = append(entries, File(ModuleList, 0o644, []byte(list.String())))
	}
	return Write(w, entries)
}

// header is one newc header's variable fields.
type header struct {
	name                 string
	ino, mode, nlink     uint32
	size                 uint64
	rdevMajor, rdevMinor uint32
}

// Unix file type bits of the cpio mode field.
const (
	sIFDIR = 0o040000
	sIFCHR = 0o020000
	sIFBLK = 0o060000
	sIFREG = 0o100000
	sIFLNK = 0o120000
)

// unixMode converts a FileMode to the cpio mode field.
func unixMode(m fs.FileMode) (uint32, error) {
	mode := uint32(m.Perm())
	if m&fs.ModeSetuid != 0 {
		mode |= 0o4000
	}
	if m&fs.ModeSetgid != 0 {
		mode |= 0o2000
	}
	if m&fs.ModeSticky != 0 {
		mode |= 0o1000
	}
	switch t := m.Type(); t {
	case 0:
		mode |= sIFREG
	case fs.ModeDir:
		mode |= sIFDIR
	case fs.ModeSymlink:
		mode |= sIFLNK
	case fs.ModeDevice | fs.ModeCharDevice:
		mode |= sIFCHR
	case fs.ModeDevice:
		mode |= sIFBLK
	default:
		return 0, fmt.Errorf("unsupported file type %v", t)
	}
	return mode, nil
}

// checkName refuses names the kernel would place outside the archive root.
func checkName(name string) (string, error) {
	name = strings.TrimPrefix(name, "/")
	if name == "" || name == trailer || path.Clean(name) != name || name == ".." || strings.HasPrefix(name, "../") || strings.IndexByte(name, 0) >= 0 {
		return "", fmt.Errorf("invalid archive name %q", name)
	}
	return name, nil
}

func writeEntry(w *countWriter, ino uint32, e Entry) error {
	name, err := checkName(e.Name)
	if err != nil {
		return err
	}
	mode, err := unixMode(e.Mode)
	if err != nil {
		return err
	}
	h := header{name: name, ino: ino, mode: mode, nlink: 1}
	switch e.Mode.Type() {
	case fs.ModeDir:
		h.nlink = 2
		return writeHeader(w, h)
	case fs.ModeSymlink:
		if e.Target == "" {
			return errors.New("symlink without a target")
		}
		h.size = uint64(len(e.Target))
		if err := writeHeader(w, h); err != nil {
			return err
		}
		io.WriteString(w, e.Target)
		return w.pad()
	case fs.ModeDevice, fs.ModeDevice | fs.ModeCharDevice:
		h.rdevMajor, h.rdevMinor = e.Major, e.Minor
		return writeHeader(w, h)
	}
	if e.Source == "" {
		h.size = uint64(len(e.Data))
		if err := writeHeader(w, h); err != nil {
			return err
		}
		w.Write(e.Data)
		return w.pad()
	}
	f, err := os.Open(e.Source)
	if err != nil {
		return err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return err
	}
	if !st.Mode().IsRegular() {
		return fmt.Errorf("source %q is not a regular file", e.Source)
	}
	h.size = uint64(st.Size())
	if err := writeHeader(w, h); err != nil {
		return err
	}
	// The header already promised st.Size() bytes: a file that shrinks or
	// grows meanwhile must fail rather than corrupt the archive.
	n, err := io.Copy(w, io.LimitReader(f, st.Size()))
	if err != nil {
		return fmt.Errorf("copying %q: %w", e.Source, err)
	}
	if n != st.Size() {
		return fmt.Errorf("copying %q: read %d bytes, stat said %d", e.Source, n, st.Size())
	}
	return w.pad()
}

// writeHeader writes the 110-byte header, the NUL-terminated name and the
// padding to a multiple of 4.
func writeHeader(w *countWriter, h header) error {
	if h.size > 0xffffffff {
		return fmt.Errorf("size %d exceeds the newc limit", h.size)
	}
	_, err := fmt.Fprintf(w, "%s%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x%s\x00",
		magic, h.ino, h.mode, 0, 0, h.nlink, MTime, h.size, 0, 0, h.rdevMajor, h.rdevMinor,
		len(h.name)+1, 0, h.name)
	if err != nil {
		return err
	}
	return w.pad()
}

// countWriter tracks the offset for padding and keeps the first error.
type countWriter struct {
	w   io.Writer
	n   int64
	err error
}

func (c *countWriter) Write(p []byte) (int, error) {
	if c.err != nil {
		return 0, c.err
	}
	n, err := c.w.Write(p)
	c.n += int64(n)
	c.err = err
	return n, err
}

// pad writes NULs up to the next multiple of 4 and reports any earlier error.
func (c *countWriter) pad() error {
	if r := c.n % 4; r != 0 {
		c.Write(make([]byte, 4-r))
	}
	return c.err
}
