package jail

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// helperTimeout bounds the wait for the helper to exec the program. Building
// a root takes milliseconds; a helper stuck longer (a hung file system under
// a bind) is killed by the caller.
const helperTimeout = 30 * time.Second

// Prepare rewrites cmd to start the jail's helper in new mount and IPC
// namespaces (and, with cgroup v2, in the VM's cgroup from its first
// instruction), handing it what to build and what to exec. cmd keeps its
// output, environment and ExtraFiles, which reach the program unchanged.
// The caller starts cmd and then calls started with Start's error: it
// releases what Prepare opened and, when the start succeeded, waits until
// the helper has exec'd the program, or returns the helper's error (the
// caller then kills and reaps the process).
func (c *Confinement) Prepare(cmd *exec.Cmd) (started func(startErr error) error, err error) {
	if !filepath.IsAbs(cmd.Path) {
		return nil, fmt.Errorf("jail: program %q is not an absolute path", cmd.Path)
	}
	prog, err := filepath.EvalSymlinks(cmd.Path)
	if err != nil {
		return nil, fmt.Errorf("jail: %w", err)
	}
	// The root with its links resolved, as the helper compares it with the
	// (resolved) binds.
	root, err := filepath.EvalSymlinks(c.vm.Root)
	if err != nil {
		return nil, fmt.Errorf("jail: %w", err)
	}
	files, err := ExecFiles(prog)
	if err != nil {
		return nil, fmt.Errorf("jail: %w", err)
	}
	args := cmd.Args
	if len(args) == 0 {
		args = []string{cmd.Path}
	}
	spec := helperSpec{
		Path: prog, Args: args, Dir: cmd.Dir,
		UID: c.vm.UID, GID: c.vm.GID, Groups: c.x.Groups,
		Root: root, Proc: c.x.Proc, MemlockBytes: c.x.MemlockBytes,
	}
	joinFiles := c.vm.cgroup.joinFiles()
	for _, b := range c.x.Binds {
		if !filepath.IsAbs(b.Path) {
			return nil, fmt.Errorf("jail: bind %q is not an absolute path", b.Path)
		}
		spec.Binds = append(spec.Binds, b)
	}
	for _, f := range files {
		spec.Binds = append(spec.Binds, Bind{Path: f, Exec: true})
	}
	for _, d := range c.x.Devices {
		if !filepath.IsAbs(d) {
			return nil, fmt.Errorf("jail: device %q is not an absolute path", d)
		}
		spec.Devices = append(spec.Devices, helperDevice{Path: d, Private: !publicDevices[d]})
	}
	b, err := json.Marshal(spec)
	if err != nil {
		return nil, fmt.Errorf("jail: %w", err)
	}

	var cgfd = -1
	if d := c.vm.cgroup.unifiedDir(); d != "" {
		if cgfd, err = unix.Open(d, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0); err != nil {
			return nil, fmt.Errorf("jail: opening cgroup %s: %w", d, err)
		}
	}
	specR, specW, err := os.Pipe()
	if err != nil {
		closeFD(cgfd)
		return nil, fmt.Errorf("jail: %w", err)
	}
	statR, statW, err := os.Pipe()
	if err != nil {
		closeFD(cgfd)
		specR.Close()
		specW.Close()
		return nil, fmt.Errorf("jail: %w", err)
	}
	// joinedW tells the helper that the agent has placed it in the v1
	// cgroups (a byte), or could not (closed without one).
	joinedR, joinedW, err := os.Pipe()
	if err != nil {
		closeFD(cgfd)
		specR.Close()
		specW.Close()
		statR.Close()
		statW.Close()
		return nil, fmt.Errorf("jail: %w", err)
	}
	// The spec may exceed a pipe's buffer; the helper reads it all first.
	go func() {
		specW.Write(b)
		specW.Close()
	}()

	first := 3 + len(cmd.ExtraFiles)
	cmd.ExtraFiles = append(slices.Clip(cmd.ExtraFiles), specR, statW, joinedR)
	cmd.Path = c.vm.helper
	cmd.Args = []string{helperArg0, strconv.Itoa(first)}
	cmd.Dir = ""
	attr := cmd.SysProcAttr
	if attr == nil {
		attr = &syscall.SysProcAttr{}
		cmd.SysProcAttr = attr
	}
	attr.Cloneflags |= syscall.CLONE_NEWNS | syscall.CLONE_NEWIPC
	if cgfd >= 0 {
		attr.UseCgroupFD = true
		attr.CgroupFD = cgfd
	}
	return func(startErr error) error {
		specR.Close()
		statW.Close()
		joinedR.Close()
		closeFD(cgfd)
		defer statR.Close()
		if startErr != nil {
			joinedW.Close()
			return startErr
		}
		// The v1 joins, while the helper starts and builds its root.
		pid := strconv.Itoa(cmd.Process.Pid)
		var joinErr error
		for _, f := range joinFiles {
			if err := writeCgroupFile(f, pid); err != nil {
				joinErr = fmt.Errorf("jail: placing %s in cgroup %s: %w", prog, filepath.Dir(f), err)
				break
			}
		}
		if joinErr == nil {
			if _, err := joinedW.Write([]byte{'j'}); err != nil {
				joinErr = fmt.Errorf("jail: starting %s: %w", prog, err)
			}
		}
		joinedW.Close() // without a byte, the helper gives up
		statR.SetReadDeadline(time.Now().Add(helperTimeout))
		msg, err := io.ReadAll(statR)
		if joinErr != nil {
			// A helper that failed on its own first (and exited, so the
			// joins or the pipe found it gone) says why.
			if len(msg) > 0 && string(msg) != errNotPlaced {
				return fmt.Errorf("jail: starting %s: %s", prog, msg)
			}
			return joinErr
		}
		if err != nil {
			return fmt.Errorf("jail: waiting for the helper to start %s: %w", prog, err)
		}
		if len(msg) > 0 {
			return fmt.Errorf("jail: starting %s: %s", prog, msg)
		}
		return nil
	}, nil
}

func closeFD(fd int) {
	if fd >= 0 {
		unix.Close(fd)
	}
}

// The helper runs from this package's initialisation rather than from
// main: Go initialises a program's packages before main, and most of
// vmhost's come after this one, so a jailed start pays for the runtime and
// this package's dependencies only, not for the whole agent's (a few
// milliseconds per process, measured by BenchmarkCreate). Any binary that
// links this package, test binaries included, can therefore be the helper.
func init() {
	if isHelper() {
		helperMain()
	}
	if len(os.Args) == 1 && os.Args[0] == checkArg0 {
		os.Exit(selfCheck())
	}
}

// helperMain is the jail's helper: it builds the process's root, drops its
// privileges and execs the program. It never returns: on failure it writes
// the reason for the agent and exits with status 126.
func helperMain() {
	// Capability sets, the bounding set and no_new_privs belong to a thread,
	// and exec keeps those of the thread that calls it: all of it happens on
	// this one.
	runtime.LockOSThread()
	fd, err := strconv.Atoi(os.Args[1])
	if err != nil || fd < 3 {
		fmt.Fprintf(os.Stderr, "%s: started without a spec\n", helperArg0)
		os.Exit(126)
	}
	status := os.NewFile(uintptr(fd+1), "status")
	unix.CloseOnExec(fd + 1)
	err = helper(os.NewFile(uintptr(fd), "spec"), os.NewFile(uintptr(fd+2), "joined"))
	status.WriteString(err.Error())
	os.Exit(126)
}

// errNotPlaced is the helper's failure when the agent could not place it in
// the VM's v1 cgroups (the agent says why).
const errNotPlaced = "the agent did not place the process in the VM's cgroups"

// helper returns only on failure.
func helper(specFile, joined *os.File) error {
	b, err := io.ReadAll(specFile)
	specFile.Close()
	if err != nil {
		return fmt.Errorf("reading the spec: %w", err)
	}
	var s helperSpec
	if err := json.Unmarshal(b, &s); err != nil {
		return fmt.Errorf("reading the spec: %w", err)
	}
	lastCap, err := readLastCap()
	if err != nil {
		return err
	}
	umask := unix.Umask(0o022)
	if err := buildRoot(&s); err != nil {
		return err
	}
	// The program runs only in every cgroup of the VM: the agent places
	// this process in the v1 ones meanwhile.
	unix.CloseOnExec(int(joined.Fd()))
	if n, _ := joined.Read(make([]byte, 1)); n != 1 {
		return errors.New(errNotPlaced)
	}
	joined.Close()
	if err := dropPrivileges(&s, lastCap); err != nil {
		return err
	}
	dir := s.Dir
	if dir == "" {
		dir = "/"
	}
	if err := os.Chdir(dir); err != nil {
		return fmt.Errorf("jailed: %w", err)
	}
	unix.Umask(umask)
	err = syscall.Exec(s.Path, s.Args, os.Environ())
	return fmt.Errorf("jailed: exec %s: %w", s.Path, err)
}

// readLastCap reads the highest capability number the kernel knows, which
// may be above what this program was built with.
func readLastCap() (int, error) {
	b, err := os.ReadFile("/proc/sys/kernel/cap_last_cap")
	if err != nil {
		return 0, fmt.Errorf("reading the last capability: %w", err)
	}
	n, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		return 0, fmt.Errorf("reading the last capability: %w", err)
	}
	return n, nil
}

// mountPlan is one bind of the root: what the host path resolves to.
type mountPlan struct {
	real string // the path with every symbolic link resolved: source and target
	Bind
	// inert: the bind's mount flags would change nothing (see inert), so
	// the remount that sets them is skipped.
	inert bool
}

// inert reports whether a read-only bind of the file st describes needs no
// flags of its own: a regular file of root's that group and others cannot
// write and without a set-id bit (a program, a library, a kernel image).
// The VM's uid cannot change it whether the mount is read-only or not,
// gains nothing from executing it that it has not already, and it is no
// device. Most binds of a dynamic program are such files: skipping their
// remount halves the mount calls of its jail.
func inert(st *unix.Stat_t) bool {
	return st.Mode&unix.S_IFMT == unix.S_IFREG && st.Uid == 0 &&
		st.Mode&(unix.S_IWGRP|unix.S_IWOTH|unix.S_ISUID|unix.S_ISGID) == 0
}

// buildRoot makes s.Root the process's root: a tmpfs holding the binds at
// their paths and the device nodes, then pivot_root into it. The mount
// namespace is the process's own; nothing done here is seen by the host.
func buildRoot(s *helperSpec) error {
	// Private first: no mount or unmount below reaches the host's
	// namespace, and none of the host's reaches this one.
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		return fmt.Errorf("making mounts private: %w", err)
	}
	// Not nodev: the device nodes live on it.
	if err := unix.Mount("vmhost-jail", s.Root, "tmpfs", unix.MS_NOSUID, "mode=0755,size=1m,nr_inodes=4096"); err != nil {
		return fmt.Errorf("mounting the root on %s: %w", s.Root, err)
	}
	root := s.Root
	// Every mount point and node is made before the first bind, so that
	// nothing is ever created through a bind, on the host's file system.
	rb := newRootBuilder(root)
	var plan []mountPlan
	for _, b := range s.Binds {
		var st unix.Stat_t
		if err := unix.Stat(b.Path, &st); err != nil {
			return fmt.Errorf("binding %s: %w", b.Path, err)
		}
		real, err := rb.ensure(b.Path, st.Mode&unix.S_IFMT == unix.S_IFDIR)
		if err != nil {
			return fmt.Errorf("binding %s: %w", b.Path, err)
		}
		if i := slices.IndexFunc(plan, func(p mountPlan) bool { return p.real == real }); i >= 0 {
			// The same file twice (a library under two names): the most
			// permissive wins.
			plan[i].Writable = plan[i].Writable || b.Writable
			plan[i].Exec = plan[i].Exec || b.Exec
			plan[i].inert = plan[i].inert && !b.Writable
			continue
		}
		plan = append(plan, mountPlan{real: real, Bind: b, inert: !b.Writable && inert(&st)})
	}
	plan, err := dropContained(plan)
	if err != nil {
		return err
	}
	for _, p := range plan {
		if p.real == root || strings.HasPrefix(p.real, root+"/") || strings.HasPrefix(root, p.real+"/") {
			return fmt.Errorf("binding %s: it overlaps the jail root %s", p.real, root)
		}
	}
	for _, d := range s.Devices {
		if err := makeDevice(rb, d, s.UID, s.GID); err != nil {
			return err
		}
	}
	if s.Proc {
		if err := os.Mkdir(root+"/proc", 0o555); err != nil {
			return fmt.Errorf("making /proc: %w", err)
		}
	}
	for _, p := range plan {
		target := root + p.real
		if err := unix.Mount(p.real, target, "", unix.MS_BIND, ""); err != nil {
			return fmt.Errorf("binding %s: %w", p.real, err)
		}
		if p.inert {
			continue
		}
		flags := uintptr(unix.MS_BIND | unix.MS_REMOUNT | unix.MS_NOSUID | unix.MS_NODEV)
		if !p.Writable {
			flags |= unix.MS_RDONLY
		}
		if !p.Exec {
			flags |= unix.MS_NOEXEC
		}
		if err := unix.Mount("", target, "", flags, ""); err != nil {
			return fmt.Errorf("binding %s: setting its flags: %w", p.real, err)
		}
	}
	if s.Proc {
		if err := unix.Mount("proc", root+"/proc", "proc", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, "hidepid=invisible,subset=pid"); err != nil {
			return fmt.Errorf("mounting /proc: %w", err)
		}
	}
	// pivot_root(".", ".") stacks the old root on top of the new one; the
	// detach then drops it (pivot_root(2)).
	if err := unix.Chdir(root); err != nil {
		return fmt.Errorf("entering the root: %w", err)
	}
	if err := unix.PivotRoot(".", "."); err != nil {
		return fmt.Errorf("pivot_root into %s: %w", root, err)
	}
	if err := unix.Unmount(".", unix.MNT_DETACH); err != nil {
		return fmt.Errorf("detaching the old root: %w", err)
	}
	if err := unix.Chdir("/"); err != nil {
		return fmt.Errorf("entering the root: %w", err)
	}
	if err := unix.Mount("", "/", "", unix.MS_BIND|unix.MS_REMOUNT|unix.MS_RDONLY|unix.MS_NOSUID, ""); err != nil {
		return fmt.Errorf("making the root read-only: %w", err)
	}
	return nil
}

// dropContained leaves out of plan every bind inside another bound
// directory (a library under a bound /usr): it shows through that
// directory already, which must then give at least its permissions
// (writable, executable); a bind that needs more than the directory
// around it gives is refused. What remains is sorted by path, and no
// bind is inside another.
func dropContained(plan []mountPlan) ([]mountPlan, error) {
	byPath := make(map[string]*mountPlan, len(plan))
	for i := range plan {
		byPath[plan[i].real] = &plan[i]
	}
	var out []mountPlan
	for _, p := range plan {
		var outer *mountPlan
		for d := filepath.Dir(p.real); outer == nil && d != "/" && d != "."; d = filepath.Dir(d) {
			outer = byPath[d]
		}
		switch {
		case outer == nil:
			out = append(out, p)
		case p.Writable && !outer.Writable || p.Exec && !outer.Exec:
			return nil, fmt.Errorf("binding %s: it is inside %s, bound with fewer permissions", p.real, outer.real)
		}
	}
	slices.SortFunc(out, func(a, b mountPlan) int { return strings.Compare(a.real, b.real) })
	return out, nil
}

// maxLinks bounds the symbolic links followed for one path, as the kernel's
// own limit does (40).
const maxLinks = 40

// rootBuilder makes paths in a root. It remembers what it has looked at on
// the host and made in the root: the binds of a dynamic program share most
// of their directories and links, and looking at each once makes a root of
// 25 binds several times faster.
type rootBuilder struct {
	root string
	host map[string]hostEntry // host paths walked: links and their targets
	made map[string]bool      // paths made in root: true for a directory
}

// hostEntry is what Lstat and Readlink said of a host path.
type hostEntry struct {
	link   string
	isLink bool
}

func newRootBuilder(root string) *rootBuilder {
	return &rootBuilder{root: root, host: map[string]hostEntry{}, made: map[string]bool{}}
}

// ensure makes host path p usable at the same path inside the root: every
// directory on the way exists in the root, every symbolic link on the way
// is copied as is (so both spellings work inside), and the last component
// is an empty directory or file to mount on. It returns p with every link
// resolved. Only paths without links are ever created in the root, so
// nothing made here follows a link (which would resolve against the host's
// root).
func (b *rootBuilder) ensure(p string, dir bool) (string, error) {
	return walkPath(p, b.host, func(path, link string, last bool) error {
		isDir := link == "" && (!last || dir)
		if was, ok := b.made[path]; ok {
			if was != isDir {
				return fmt.Errorf("%s: both a directory and a file", path)
			}
			return nil
		}
		var err error
		if link != "" {
			err = copyLink(b.root+path, link)
		} else {
			err = makeNode(b.root+path, isDir)
		}
		if err == nil {
			b.made[path] = isDir
		}
		return err
	})
}

// walkPath resolves host path p one component at a time, as the kernel
// does, and calls visit for each path on the way: a symbolic link (with its
// target), a directory, and finally the resolved p itself (last). It returns
// p resolved. cache, when not nil, keeps what the host said of each path.
func walkPath(p string, cache map[string]hostEntry, visit func(path, link string, last bool) error) (string, error) {
	links := 0
	cur := "/"
	rest := strings.Split(strings.Trim(filepath.Clean(p), "/"), "/")
	for len(rest) > 0 {
		name := rest[0]
		rest = rest[1:]
		if name == "" || name == "." {
			continue
		}
		if name == ".." {
			cur = filepath.Dir(cur)
			continue
		}
		next := filepath.Join(cur, name)
		e, ok := cache[next]
		if !ok {
			fi, err := os.Lstat(next)
			if err != nil {
				return "", err
			}
			if fi.Mode()&os.ModeSymlink != 0 {
				if e.link, err = os.Readlink(next); err != nil {
					return "", err
				}
				e.isLink = true
			}
			if cache != nil {
				cache[next] = e
			}
		}
		if e.isLink {
			if links++; links > maxLinks {
				return "", fmt.Errorf("%s: too many symbolic links", p)
			}
			if err := visit(next, e.link, false); err != nil {
				return "", err
			}
			if filepath.IsAbs(e.link) {
				cur = "/"
			}
			rest = append(strings.Split(e.link, "/"), rest...)
			continue
		}
		if err := visit(next, "", len(rest) == 0); err != nil {
			return "", err
		}
		cur = next
	}
	return cur, nil
}

// copyLink makes name a symbolic link to target, unless it is one already.
// The common case, a new link, is one system call.
func copyLink(name, target string) error {
	err := unix.Symlink(target, name)
	if errors.Is(err, unix.EEXIST) {
		if have, rerr := os.Readlink(name); rerr != nil || have != target {
			return fmt.Errorf("%s: two different links", name)
		}
		return nil
	}
	if err != nil {
		return fmt.Errorf("copying link %s: %w", name, err)
	}
	return nil
}

// makeNode makes a directory (mode 0755, the helper's umask being 022) or
// an empty file (a mount point) at name unless one is there. The common
// case, a new node, is one system call.
func makeNode(name string, dir bool) error {
	var err error
	if dir {
		err = unix.Mkdir(name, 0o755)
	} else {
		err = unix.Mknod(name, unix.S_IFREG|0o444, 0)
	}
	if !errors.Is(err, unix.EEXIST) {
		if err != nil {
			return fmt.Errorf("making %s: %w", name, err)
		}
		return nil
	}
	fi, err := os.Lstat(name)
	if err != nil {
		return err
	}
	if fi.IsDir() != dir {
		return fmt.Errorf("%s: both a directory and a file", name)
	}
	return nil
}

// makeDevice makes the node d.Path in root with the host node's type and
// numbers.
func makeDevice(rb *rootBuilder, d helperDevice, uid, gid uint32) error {
	var st unix.Stat_t
	if err := unix.Stat(d.Path, &st); err != nil {
		return fmt.Errorf("device %s: %w", d.Path, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFCHR {
		return fmt.Errorf("device %s: not a character device", d.Path)
	}
	real, err := rb.ensure(filepath.Dir(d.Path), true)
	if err != nil {
		return fmt.Errorf("device %s: %w", d.Path, err)
	}
	name := rb.root + filepath.Join(real, filepath.Base(d.Path))
	mode, owner, group := uint32(0o666), 0, 0
	if d.Private {
		mode, owner, group = 0o600, int(uid), int(gid)
	}
	if err := unix.Mknod(name, unix.S_IFCHR|mode, int(st.Rdev)); err != nil {
		return fmt.Errorf("device %s: %w", d.Path, err)
	}
	if err := unix.Chmod(name, mode); err != nil {
		return fmt.Errorf("device %s: %w", d.Path, err)
	}
	if err := unix.Lchown(name, owner, group); err != nil {
		return fmt.Errorf("device %s: %w", d.Path, err)
	}
	return nil
}

// dropPrivileges leaves this thread with s's uid, gid and groups, every
// capability set empty and no_new_privs set, which exec keeps.
func dropPrivileges(s *helperSpec, lastCap int) error {
	if s.MemlockBytes != 0 {
		// Raising the hard limit needs CAP_SYS_RESOURCE: while root.
		lim := unix.Rlimit{Cur: s.MemlockBytes, Max: s.MemlockBytes}
		if err := unix.Setrlimit(unix.RLIMIT_MEMLOCK, &lim); err != nil {
			return fmt.Errorf("setting RLIMIT_MEMLOCK to %d bytes (raising it needs CAP_SYS_RESOURCE): %w", s.MemlockBytes, err)
		}
	}
	// The bounding set needs CAP_SETPCAP to shrink: before the uid changes.
	for c := 0; c <= lastCap; c++ {
		if err := unix.Prctl(unix.PR_CAPBSET_DROP, uintptr(c), 0, 0, 0); err != nil {
			return fmt.Errorf("dropping capability %d from the bounding set: %w", c, err)
		}
	}
	if err := unix.Prctl(unix.PR_CAP_AMBIENT, unix.PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0); err != nil {
		return fmt.Errorf("clearing the ambient capabilities: %w", err)
	}
	if err := setThreadCreds(s.UID, s.GID, s.Groups); err != nil {
		return err
	}
	// Leaving uid 0 empties the permitted and effective sets, unless
	// securebits said to keep them, and never the inheritable set: empty
	// all three explicitly.
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var data [2]unix.CapUserData
	if err := unix.Capset(&hdr, &data[0]); err != nil {
		return fmt.Errorf("emptying the capability sets: %w", err)
	}
	if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
		return fmt.Errorf("setting no_new_privs: %w", err)
	}
	// Check rather than trust: exec must not run with anything left.
	if err := unix.Capget(&hdr, &data[0]); err != nil {
		return fmt.Errorf("reading the capability sets: %w", err)
	}
	for _, d := range data {
		if d.Effective|d.Permitted|d.Inheritable != 0 {
			return errors.New("capabilities remain after dropping them")
		}
	}
	ruid, euid, suid := unix.Getresuid()
	rgid, egid, sgid := unix.Getresgid()
	for i, id := range []int{ruid, euid, suid, rgid, egid, sgid} {
		if i < 3 && id != int(s.UID) || i >= 3 && id != int(s.GID) {
			return fmt.Errorf("running as uids %d %d %d, gids %d %d %d after switching to %d:%d",
				ruid, euid, suid, rgid, egid, sgid, s.UID, s.GID)
		}
	}
	return nil
}
