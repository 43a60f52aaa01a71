package jail

import (
	"bufio"
	"debug/elf"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"
)

// ExecFiles returns the files the kernel and the dynamic loader open to run
// the program at prog: the program, its ELF interpreter, the shared
// libraries it needs (transitively) and the loader's cache
// (/etc/ld.so.cache), each once. A static program needs itself alone.
//
// Libraries are found as glibc's loader finds them: the object's
// DT_RPATH (when it has no DT_RUNPATH) and the program's, its DT_RUNPATH,
// the directories of /etc/ld.so.conf, then the system's default ones; a
// candidate of another ELF class or machine is passed over. libgcc_s.so.1
// is added when libc.so.6 is linked: glibc loads it on demand to unwind a
// thread that exits or is cancelled, and aborts the process without it.
//
// Results are kept per program (path, size, modification time) and given
// again while every file is still the one it was (the same file, size and
// modification time): an upgrade that replaces a library, whose
// dependencies may have changed with it, has them found again.
func ExecFiles(prog string) ([]string, error) {
	fi, err := os.Stat(prog)
	if err != nil {
		return nil, err
	}
	key := execKey{prog, fi.Size(), fi.ModTime()}
	execCache.Lock()
	e, ok := execCache.m[key]
	execCache.Unlock()
	if ok && unchanged(e) {
		return e.files, nil
	}
	files, err := execFiles(prog)
	if err != nil {
		return nil, err
	}
	e = execEntry{files: files}
	for _, f := range files {
		fi, err := os.Stat(f)
		if err != nil {
			return nil, err
		}
		e.infos = append(e.infos, fi)
	}
	execCache.Lock()
	execCache.m[key] = e
	execCache.Unlock()
	return files, nil
}

type execKey struct {
	path  string
	size  int64
	mtime time.Time
}

// execEntry is what ExecFiles found for a program: the files, and what
// Stat said of each then.
type execEntry struct {
	files []string
	infos []os.FileInfo
}

var execCache = struct {
	sync.Mutex
	m map[execKey]execEntry
}{m: map[execKey]execEntry{}}

// unchanged reports whether every file of e is still the file it was, of
// the same size and modification time.
func unchanged(e execEntry) bool {
	for i, f := range e.files {
		fi, err := os.Stat(f)
		if err != nil || !os.SameFile(fi, e.infos[i]) || fi.Size() != e.infos[i].Size() || !fi.ModTime().Equal(e.infos[i].ModTime()) {
			return false
		}
	}
	return true
}

// elfObject is what the loader reads of one object.
type elfObject struct {
	path           string
	class          elf.Class
	machine        elf.Machine
	interp         string // PT_INTERP, the program's loader
	dynamic        bool   // has a PT_DYNAMIC header
	needed         []string
	rpath, runpath []string
}

func readELF(name string) (*elfObject, error) {
	f, err := elf.Open(name)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	o := &elfObject{path: name, class: f.Class, machine: f.Machine}
	for _, p := range f.Progs {
		switch p.Type {
		case elf.PT_INTERP:
			b := make([]byte, p.Filesz)
			if _, err := p.ReadAt(b, 0); err != nil {
				return nil, fmt.Errorf("%s: reading its interpreter: %w", name, err)
			}
			o.interp = strings.TrimRight(string(b), "\x00")
		case elf.PT_DYNAMIC:
			o.dynamic = true
		}
	}
	if !o.dynamic {
		return o, nil
	}
	if o.needed, err = f.DynString(elf.DT_NEEDED); err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	origin := filepath.Dir(name)
	for _, tag := range []elf.DynTag{elf.DT_RPATH, elf.DT_RUNPATH} {
		vals, err := f.DynString(tag)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", name, err)
		}
		var dirs []string
		for _, v := range vals {
			for _, d := range strings.Split(v, ":") {
				d = strings.ReplaceAll(strings.ReplaceAll(d, "${ORIGIN}", origin), "$ORIGIN", origin)
				if d != "" && !strings.Contains(d, "$") {
					dirs = append(dirs, d)
				}
			}
		}
		if tag == elf.DT_RPATH {
			o.rpath = dirs
		} else {
			o.runpath = dirs
		}
	}
	return o, nil
}

func execFiles(prog string) ([]string, error) {
	exe, err := readELF(prog)
	if err != nil {
		return nil, fmt.Errorf("%s is not an ELF program the jail can run: %w", prog, err)
	}
	files := []string{prog}
	if exe.interp == "" && len(exe.needed) == 0 {
		return files, nil
	}
	if exe.interp != "" {
		files = append(files, exe.interp)
	}
	if _, err := os.Stat("/etc/ld.so.cache"); err == nil {
		files = append(files, "/etc/ld.so.cache")
	}
	conf := ldSoConfDirs()
	defaults := defaultLibDirs(exe.machine)
	type pending struct {
		soname string
		by     *elfObject
	}
	var queue []pending
	for _, n := range exe.needed {
		queue = append(queue, pending{n, exe})
	}
	seen := map[string]bool{}
	libc := false
	for len(queue) > 0 {
		p := queue[0]
		queue = queue[1:]
		if seen[p.soname] {
			continue
		}
		seen[p.soname] = true
		libc = libc || p.soname == "libc.so.6"
		var dirs []string
		if len(p.by.runpath) == 0 {
			dirs = append(dirs, p.by.rpath...)
			if p.by != exe {
				dirs = append(dirs, exe.rpath...)
			}
		}
		dirs = append(append(append(dirs, p.by.runpath...), conf...), defaults...)
		lib, obj := findLib(p.soname, dirs, exe)
		if lib == "" {
			return nil, fmt.Errorf("%s: library %s (needed by %s) not found in %s", prog, p.soname, p.by.path, strings.Join(dirs, ":"))
		}
		files = append(files, lib)
		for _, n := range obj.needed {
			queue = append(queue, pending{n, obj})
		}
	}
	if libc && !seen["libgcc_s.so.1"] {
		if lib, _ := findLib("libgcc_s.so.1", append(conf, defaults...), exe); lib != "" {
			files = append(files, lib)
		}
	}
	return files, nil
}

// findLib returns the first file called soname in dirs that is an ELF object
// of exe's class and machine.
func findLib(soname string, dirs []string, exe *elfObject) (string, *elfObject) {
	if strings.Contains(soname, "/") {
		dirs, soname = []string{filepath.Dir(soname)}, filepath.Base(soname)
	}
	for _, d := range dirs {
		name := filepath.Join(d, soname)
		o, err := readELF(name)
		if err == nil && o.class == exe.class && o.machine == exe.machine {
			return name, o
		}
	}
	return "", nil
}

// defaultLibDirs are glibc's default directories on Debian-style
// (multiarch) and other systems.
func defaultLibDirs(m elf.Machine) []string {
	var triplet string
	switch m {
	case elf.EM_X86_64:
		triplet = "x86_64-linux-gnu"
	case elf.EM_AARCH64:
		triplet = "aarch64-linux-gnu"
	case elf.EM_386:
		triplet = "i386-linux-gnu"
	case elf.EM_RISCV:
		triplet = "riscv64-linux-gnu"
	}
	var dirs []string
	if triplet != "" {
		dirs = append(dirs, "/lib/"+triplet, "/usr/lib/"+triplet)
	}
	return append(dirs, "/lib64", "/usr/lib64", "/lib", "/usr/lib")
}

// ldSoConfDirs reads the directories of /etc/ld.so.conf and the files it
// includes.
func ldSoConfDirs() []string {
	var dirs []string
	seen := map[string]bool{}
	var read func(name string, depth int)
	read = func(name string, depth int) {
		if depth > 8 || seen[name] {
			return
		}
		seen[name] = true
		f, err := os.Open(name)
		if err != nil {
			return
		}
		defer f.Close()
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			line, _, _ := strings.Cut(sc.Text(), "#")
			line = strings.TrimSpace(line)
			if rest, ok := strings.CutPrefix(line, "include"); ok && rest != "" && (rest[0] == ' ' || rest[0] == '\t') {
				for _, pat := range strings.Fields(rest) {
					if !filepath.IsAbs(pat) {
						pat = filepath.Join(filepath.Dir(name), pat)
					}
					matches, _ := filepath.Glob(pat)
					slices.Sort(matches)
					for _, m := range matches {
						read(m, depth+1)
					}
				}
				continue
			}
			if filepath.IsAbs(line) && !slices.Contains(dirs, line) {
				dirs = append(dirs, line)
			}
		}
	}
	read("/etc/ld.so.conf", 0)
	return dirs
}
