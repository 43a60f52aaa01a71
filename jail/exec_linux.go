package jail

import (
	"errors"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"
)

// Start starts cmd in the VM's jail and returns once the program runs
// there, or why it could not (nothing is left running then). cmd keeps its
// arguments, environment, output and ExtraFiles; its Path must be absolute.
//
// The start happens on an OS thread of its own, which then ends: the thread
// joins the VM's v1 cgroups, unshares its mount namespace, builds the root
// and pivots into it, empties its bounding, ambient and inheritable
// capability sets and sets no_new_privs; the program is cloned from it
// (into a new IPC namespace and, with cgroup v2, straight into the VM's
// cgroup) and inherits all of it, and Go's exec switches it to the VM's uid,
// gid and groups, which empties its permitted and effective sets. So the
// program never runs outside its cgroups, its root or its uid, and nothing
// is exec'd on the way but the program itself.
func (c *Confinement) Start(cmd *exec.Cmd) error {
	if !filepath.IsAbs(cmd.Path) {
		return fmt.Errorf("jail: program %q is not an absolute path", cmd.Path)
	}
	prog, err := filepath.EvalSymlinks(cmd.Path)
	if err != nil {
		return fmt.Errorf("jail: %w", err)
	}
	s, err := c.rootSpec(prog)
	if err != nil {
		return err
	}
	lastCap, err := kernelLastCap()
	if err != nil {
		return fmt.Errorf("jail: %w", err)
	}
	// exec.Cmd opens the null device for a stream it is not given; inside
	// the root there is none, so it is opened here.
	var null *os.File
	if cmd.Stdin == nil || cmd.Stdout == nil || cmd.Stderr == nil {
		if null, err = os.OpenFile(os.DevNull, os.O_RDWR, 0); err != nil {
			return fmt.Errorf("jail: %w", err)
		}
		defer null.Close()
		if cmd.Stdin == nil {
			cmd.Stdin = null
		}
		if cmd.Stdout == nil {
			cmd.Stdout = null
		}
		if cmd.Stderr == nil {
			cmd.Stderr = null
		}
	}
	attr := cmd.SysProcAttr
	if attr == nil {
		attr = &syscall.SysProcAttr{}
		cmd.SysProcAttr = attr
	}
	attr.Cloneflags |= syscall.CLONE_NEWIPC
	attr.Credential = &syscall.Credential{Uid: c.vm.UID, Gid: c.vm.GID, Groups: c.x.Groups}
	if d := c.vm.cgroup.unifiedDir(); d != "" {
		cgfd, err := unix.Open(d, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("jail: opening cgroup %s: %w", d, err)
		}
		defer unix.Close(cgfd)
		attr.UseCgroupFD = true
		attr.CgroupFD = cgfd
	}
	cmd.Path = prog
	if len(cmd.Args) == 0 {
		cmd.Args = []string{prog}
	}
	start := func() error {
		return onOwnThread(func() error {
			return startOnThread(cmd, s, c.vm.cgroup, lastCap, c.x.MemlockBytes)
		})
	}
	if err = start(); errors.Is(err, errStalePaths) {
		// What an earlier start saw of the program's paths is no longer
		// so (an upgrade replaced a library): once more, looking again.
		forgetProgramPaths()
		err = start()
	}
	if err != nil {
		return fmt.Errorf("jail: starting %s: %w", prog, err)
	}
	return nil
}

// rootSpec says what the root of a process running prog holds.
func (c *Confinement) rootSpec(prog string) (*rootSpec, error) {
	// The root with its links resolved, as buildRoot compares it with the
	// (resolved) binds.
	root, err := filepath.EvalSymlinks(c.vm.Root)
	if err != nil {
		return nil, fmt.Errorf("jail: %w", err)
	}
	files, err := ExecFiles(prog)
	if err != nil {
		return nil, fmt.Errorf("jail: %w", err)
	}
	s := &rootSpec{UID: c.vm.UID, GID: c.vm.GID, Root: root, Proc: c.x.Proc}
	for _, b := range c.x.Binds {
		if !filepath.IsAbs(b.Path) {
			return nil, fmt.Errorf("jail: bind %q is not an absolute path", b.Path)
		}
		s.Binds = append(s.Binds, b)
	}
	s.Programs = files
	for _, d := range c.x.Devices {
		if !filepath.IsAbs(d) {
			return nil, fmt.Errorf("jail: device %q is not an absolute path", d)
		}
		s.Devices = append(s.Devices, rootDevice{Path: d, Private: !publicDevices[d]})
	}
	return s, nil
}

// onOwnThread runs f on an OS thread locked to it, which ends after: a
// goroutine that returns locked ends its thread, and with it whatever f
// changed of it. The main thread cannot end (the runtime parks it instead)
// and is the one /proc/self shows: f never runs there.
func onOwnThread(f func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		if unix.Gettid() == unix.Getpid() {
			// Held here, the main thread is not the one the next
			// goroutine locks.
			errc <- onOwnThread(f)
			runtime.UnlockOSThread()
			return
		}
		errc <- f()
	}()
	return <-errc
}

// startOnThread confines the calling thread, which is its own and ends
// after, and starts cmd from it, with memlock (when not 0) as the process's
// RLIMIT_MEMLOCK.
func startOnThread(cmd *exec.Cmd, s *rootSpec, cg *Cgroup, lastCap int, memlock uint64) error {
	// The thread joins the VM's v1 cgroups, so that the process it
	// clones is born there, and leaves them once it has: opened now,
	// while the host's cgroup file systems are in its root.
	self, err := os.ReadFile("/proc/thread-self/cgroup")
	if err != nil {
		return fmt.Errorf("reading the thread's cgroups: %w", err)
	}
	join, leave := cg.taskFiles(self)
	for _, f := range leave {
		fd, err := unix.Open(f, unix.O_WRONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("opening %s: %w", f, err)
		}
		defer func() {
			unix.Write(fd, []byte("0"))
			unix.Close(fd)
		}()
	}
	// "0" moves the writer only: a single thread moved by itself needs
	// no threadgroup lock, and so does not wait for the RCU grace period
	// that lock takes in v1 (kernel/cgroup/cgroup.c,
	// cgroup_procs_write_start).
	for _, f := range join {
		if err := writeCgroupFile(f, "0"); err != nil {
			return fmt.Errorf("joining cgroup %s: %w", filepath.Dir(f), err)
		}
	}
	// CLONE_FS too: the root, working directory and umask changed below
	// are then this thread's alone.
	if err := unix.Unshare(unix.CLONE_NEWNS | unix.CLONE_FS); err != nil {
		return fmt.Errorf("unsharing the mount namespace: %w", err)
	}
	umask := unix.Umask(0o022)
	if err := buildRoot(s); err != nil {
		return err
	}
	unix.Umask(umask)
	if err := dropPrivileges(lastCap); err != nil {
		return err
	}
	if err := cmd.Start(); err != nil {
		return err
	}
	if memlock != 0 {
		cred := cmd.SysProcAttr.Credential
		if err := setMemlock(cmd.Process.Pid, cred.Uid, cred.Gid, memlock); err != nil {
			cmd.Process.Kill()
			cmd.Wait()
			return err
		}
	}
	return nil
}

// setMemlock sets the RLIMIT_MEMLOCK of the jailed process pid, which runs
// as the VM's uid and gid, before anything asks it to lock memory. A limit
// belongs to a process, not a thread: it is set from outside. Setting
// another process's limit takes CAP_SYS_RESOURCE or the process's ids as
// one's real ids: this thread takes those, keeping its capabilities, which
// raising the hard limit still needs.
func setMemlock(pid int, uid, gid uint32, bytes uint64) error {
	if err := setThreadRealIDs(uid, gid); err != nil {
		return fmt.Errorf("setting RLIMIT_MEMLOCK: %w", err)
	}
	lim := unix.Rlimit{Cur: bytes, Max: bytes}
	if err := unix.Prlimit(pid, unix.RLIMIT_MEMLOCK, &lim, nil); err != nil {
		return fmt.Errorf("setting RLIMIT_MEMLOCK to %d bytes (raising it needs CAP_SYS_RESOURCE): %w", bytes, err)
	}
	return nil
}

// kernelLastCap is the highest capability number the kernel knows, which may be
// above what this program was built with; read once.
var kernelLastCap = sync.OnceValues(readLastCap)

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

// The jailed self-check runs from this package's initialisation, so any
// binary that links the package can be it (SelfTest).
func init() {
	if len(os.Args) == 1 && os.Args[0] == checkArg0 {
		os.Exit(selfCheck())
	}
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
func buildRoot(s *rootSpec) error {
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
	rb := newRootBuilder(root)
	if err := rb.build(s); err != nil {
		if rb.seen {
			return fmt.Errorf("%w: %w", errStalePaths, err)
		}
		return err
	}
	rb.keepProgramPaths()
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

// build makes s's mount points, links and device nodes in the root and
// mounts the binds and /proc there.
func (rb *rootBuilder) build(s *rootSpec) error {
	// Every mount point and node is made before the first bind, so that
	// nothing is ever created through a bind, on the host's file system.
	root := rb.root
	var plan []mountPlan
	binds := slices.Clone(s.Binds)
	for _, f := range s.Programs {
		binds = append(binds, Bind{Path: f, Exec: true})
	}
	for i, b := range binds {
		var st unix.Stat_t
		if err := unix.Stat(b.Path, &st); err != nil {
			return fmt.Errorf("binding %s: %w", b.Path, err)
		}
		var real string
		var err error
		if i < len(s.Binds) {
			real, err = rb.ensure(b.Path, st.Mode&unix.S_IFMT == unix.S_IFDIR)
		} else {
			real, err = rb.ensureProgram(b.Path)
		}
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
	// programs is what was walked on the way to the program's files,
	// starting from what earlier starts saw (programPaths); seen says
	// whether it started with anything.
	programs map[string]hostEntry
	seen     bool
}

// programPaths keeps what the host said of the paths on the way to the
// programs jailed processes run and their libraries, which are root's and
// change only when root changes them (an upgrade), so that a start does
// not look at each again: a dynamic program's root is half its walk. The
// paths of a VM (its disks, its run directory) are looked at every time.
// A start that fails with what was kept (a link now elsewhere, a file
// gone) tries again without (Start).
var programPaths = struct {
	sync.Mutex
	m map[string]hostEntry
}{m: map[string]hostEntry{}}

// errStalePaths wraps the failure of a root built with what earlier starts
// saw of the program's paths.
var errStalePaths = errors.New("the program's files as an earlier start saw them")

func forgetProgramPaths() {
	programPaths.Lock()
	clear(programPaths.m)
	programPaths.Unlock()
}

// keepProgramPaths adds what b walked on the way to the program's files to
// programPaths.
func (b *rootBuilder) keepProgramPaths() {
	programPaths.Lock()
	maps.Copy(programPaths.m, b.programs)
	programPaths.Unlock()
}

// hostEntry is what Lstat and Readlink said of a host path.
type hostEntry struct {
	link   string
	isLink bool
}

func newRootBuilder(root string) *rootBuilder {
	programPaths.Lock()
	programs := maps.Clone(programPaths.m)
	programPaths.Unlock()
	return &rootBuilder{root: root, host: map[string]hostEntry{}, made: map[string]bool{}, programs: programs, seen: len(programs) > 0}
}

// ensure makes host path p usable at the same path inside the root: every
// directory on the way exists in the root, every symbolic link on the way
// is copied as is (so both spellings work inside), and the last component
// is an empty directory or file to mount on. It returns p with every link
// resolved. Only paths without links are ever created in the root, so
// nothing made here follows a link (which would resolve against the host's
// root).
func (b *rootBuilder) ensure(p string, dir bool) (string, error) {
	return b.ensureWith(b.host, p, dir)
}

// ensureProgram is ensure for a file of the program, walked with what
// earlier starts saw.
func (b *rootBuilder) ensureProgram(p string) (string, error) {
	return b.ensureWith(b.programs, p, false)
}

func (b *rootBuilder) ensureWith(host map[string]hostEntry, p string, dir bool) (string, error) {
	return walkPath(p, host, func(path, link string, last bool) error {
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

// makeNode makes a directory (mode 0755, the umask being 022 then) or
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
func makeDevice(rb *rootBuilder, d rootDevice, uid, gid uint32) error {
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

// The securebits that would keep capabilities across the uid change
// (linux/securebits.h).
const (
	secbitNoSetuidFixup = 1 << 2
	secbitKeepCaps      = 1 << 4
)

// dropPrivileges empties this thread's bounding, ambient and inheritable
// capability sets and sets its no_new_privs, which a process cloned from it
// inherits. The thread keeps its permitted and effective sets, with which
// the clone switches to the VM's uid and gid; leaving uid 0 then empties
// them, as long as no securebit says to keep them (checked).
func dropPrivileges(lastCap int) error {
	bits, err := unix.PrctlRetInt(unix.PR_GET_SECUREBITS, 0, 0, 0, 0)
	if err != nil {
		return fmt.Errorf("reading the securebits: %w", err)
	}
	if bits&(secbitKeepCaps|secbitNoSetuidFixup) != 0 {
		return fmt.Errorf("securebits %#x keep capabilities across the uid change", bits)
	}
	// The bounding set needs CAP_SETPCAP to shrink: it is still there.
	for c := 0; c <= lastCap; c++ {
		if err := unix.Prctl(unix.PR_CAPBSET_DROP, uintptr(c), 0, 0, 0); err != nil {
			return fmt.Errorf("dropping capability %d from the bounding set: %w", c, err)
		}
	}
	if err := unix.Prctl(unix.PR_CAP_AMBIENT, unix.PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0); err != nil {
		return fmt.Errorf("clearing the ambient capabilities: %w", err)
	}
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var data [2]unix.CapUserData
	if err := unix.Capget(&hdr, &data[0]); err != nil {
		return fmt.Errorf("reading the capability sets: %w", err)
	}
	data[0].Inheritable, data[1].Inheritable = 0, 0
	if err := unix.Capset(&hdr, &data[0]); err != nil {
		return fmt.Errorf("emptying the inheritable capabilities: %w", err)
	}
	if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
		return fmt.Errorf("setting no_new_privs: %w", err)
	}
	return nil
}
