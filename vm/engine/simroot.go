package engine

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"

	"vmhost/internal/sbin"
	"vmhost/vm/record"
)

// unpackSimRoot readies, for the CH simulator (Options.SimGuestRoot), the
// directory its guest agent runs an AppVM's workload in: the root file
// system on the VM's root disk, unpacked as the guest's kernel would
// mount it, so the workload is the image's own (its entrypoint, its
// libraries). The disk is read as it is, backing build included: qemu-img
// converts it to a raw file beside the directory (-U: the storage daemon
// holds the image), and debugfs copies the ext4 tree out (rdump, which
// keeps modes, and owners only for root; docs/ref/debugfs-rdump.md).
// Without root the directories are made writable by their owner, so that
// the tree can be removed.
//
// The tree lives in the VM's run directory and goes with it; it is kept
// across boots (what the workload writes stays, as on a disk) and
// unpacked again when the root disk is another file than the one it came
// from (a redeploy swapped it), which a stamp beside it tells: the disk's
// device and inode. It is made under a temporary name and renamed into
// place, the stamp written last, so a kill at any step leaves either the
// old tree or one the next boot unpacks again. The temporary names (the
// tree and the raw image it is read from) are temp names
// (atomicfile.IsTemp): the startup sweep removes what a kill left.
func (e *Engine) unpackSimRoot(ctx context.Context, rec *record.Record) error {
	l := e.layout()
	disk := l.RootDisk(rec.ID)
	root := e.o.SimGuestRoot(l.VsockSocket(rec.ID))
	st, err := os.Stat(disk)
	if err != nil {
		return err
	}
	sys, ok := st.Sys().(*syscall.Stat_t)
	if !ok {
		return errors.New("reading the root disk's inode: not a Unix file system")
	}
	stamp := fmt.Sprintf("%d:%d\n", sys.Dev, sys.Ino)
	stampPath := root + ".disk"
	if b, err := os.ReadFile(stampPath); err == nil && string(b) == stamp {
		if fi, err := os.Stat(root); err == nil && fi.IsDir() {
			return nil
		}
	}
	dir, base := filepath.Split(root)
	next, raw := dir+"."+base+".tmp-new", dir+"."+base+".tmp-raw"
	defer os.Remove(raw)
	for _, p := range []string{stampPath, next, raw} {
		if err := removeTree(p); err != nil {
			return err
		}
	}
	if err := os.MkdirAll(filepath.Dir(root), 0o700); err != nil {
		return err
	}
	qemuImg := exec.CommandContext(ctx, "qemu-img", "convert", "-U", "-O", "raw", disk, raw)
	if out, err := qemuImg.CombinedOutput(); err != nil {
		return fmt.Errorf("reading the root disk with qemu-img (dev mode needs it: qemu-utils): %w: %s", err, bytes.TrimSpace(out))
	}
	if err := os.Mkdir(next, 0o755); err != nil {
		return err
	}
	// debugfs parses its request itself: the directory goes by a name of
	// plain characters, relative to its parent.
	debugfs := exec.CommandContext(ctx, sbin.Path("debugfs"), "-R", "rdump / "+filepath.Base(next), raw)
	debugfs.Dir = filepath.Dir(next)
	var stderr bytes.Buffer
	debugfs.Stderr = &stderr
	if err := debugfs.Run(); err != nil {
		return fmt.Errorf("unpacking the root disk with debugfs (dev mode needs it: e2fsprogs): %w: %s", err, lastLines(stderr.String()))
	}
	// debugfs exits 0 whatever happened: a tree with nothing in it (not
	// even lost+found) is a disk it could not read.
	if ents, err := os.ReadDir(next); err != nil || len(ents) == 0 {
		return fmt.Errorf("unpacking the root disk with debugfs: nothing came out (%v): %s", err, lastLines(stderr.String()))
	}
	if os.Geteuid() != 0 {
		if err := ownerWritable(next); err != nil {
			return err
		}
	}
	if err := removeTree(root); err != nil {
		return err
	}
	if err := os.Rename(next, root); err != nil {
		return err
	}
	return os.WriteFile(stampPath, []byte(stamp), 0o600)
}

// lastLines is the end of a program's complaints, without debugfs's
// banner and its notes on owners it could not set (without root).
func lastLines(s string) string {
	var keep []string
	for _, l := range strings.Split(strings.TrimSpace(s), "\n") {
		if strings.HasPrefix(l, "debugfs ") || strings.Contains(l, "while changing ownership") {
			continue
		}
		keep = append(keep, l)
	}
	if len(keep) > 5 {
		keep = keep[len(keep)-5:]
	}
	return strings.Join(keep, "; ")
}

// ownerWritable gives every directory under dir its owner's rwx, so that
// a tree unpacked without root (a 0555 directory of an image) can be
// changed and removed.
func ownerWritable(dir string) error {
	return filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || !d.IsDir() {
			return err
		}
		fi, err := d.Info()
		if err != nil {
			return err
		}
		if fi.Mode().Perm()&0o700 != 0o700 {
			return os.Chmod(p, fi.Mode().Perm()|0o700)
		}
		return nil
	})
}

// removeTree removes path and what is under it, like os.RemoveAll, and,
// should that fail (a directory whose owner may not write it, made by an
// AppVM's workload in the simulator's tree), gives the directories their
// owner's rwx and tries again.
func removeTree(path string) error {
	err := os.RemoveAll(path)
	if err == nil {
		return nil
	}
	if werr := ownerWritable(path); werr != nil && !errors.Is(werr, fs.ErrNotExist) {
		return errors.Join(err, werr)
	}
	return os.RemoveAll(path)
}
