// Package kmod reads a Linux kernel module tree (lib/modules/<release>) on
// the host: it finds modules by name, reads each one's .modinfo section
// (depends=, vermagic=), resolves dependencies (from modules.dep when the
// tree has one, else from .modinfo), orders them so that every module comes
// after the ones it needs, and skips modules the kernel has built in
// (modules.builtin). It also reads a kernel image's release, so that a
// module set built for another kernel is refused before a guest boots it.
//
// Compressed modules (.ko.gz, .ko.xz, .ko.zst) are decompressed on the host:
// .gz by the standard library, .xz and .zst by the xz and zstd programs. The
// host has to decompress them anyway to read their .modinfo, and a guest
// given plain .ko files loads them whatever its CONFIG_MODULE_DECOMPRESS.
//
// The package imports none of vmhost's packages.
package kmod

import (
	"bufio"
	"bytes"
	"compress/gzip"
	"debug/elf"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
)

// Module is one module to load, decompressed.
type Module struct {
	// Name is the module's name ("virtio_blk"), underscores for dashes.
	Name string
	// Path is the host file it was read from.
	Path string
	// Data is the module's ELF object, decompressed.
	Data []byte
	// Depends are the modules it needs loaded first (the kernel's own
	// names; built-in ones included as listed).
	Depends []string
	// Vermagic is the .modinfo vermagic string; its first field is the
	// kernel release the module was built for.
	Vermagic string
}

// Release returns the kernel release m was built for: the first field of
// its vermagic.
func (m Module) Release() string {
	f := strings.Fields(m.Vermagic)
	if len(f) == 0 {
		return ""
	}
	return f[0]
}

// Tree is an opened module directory.
type Tree struct {
	// Dir is the lib/modules/<release> directory.
	Dir string
	// files maps a module name to its path relative to Dir.
	files map[string]string
	// deps are modules.dep's lists by module name; nil without the file.
	deps map[string][]string
	// builtin are the names in modules.builtin.
	builtin map[string]bool
}

// moduleSuffixes are the file endings of modules, plain first.
var moduleSuffixes = []string{".ko", ".ko.gz", ".ko.xz", ".ko.zst"}

// Name returns the module name of a module file path: its base name
// without the suffix, with dashes turned into underscores as the kernel
// does.
func Name(path string) string {
	base := filepath.Base(path)
	for _, s := range moduleSuffixes {
		if b, ok := strings.CutSuffix(base, s); ok {
			base = b
			break
		}
	}
	return strings.ReplaceAll(base, "-", "_")
}

func isModuleFile(name string) bool {
	for _, s := range moduleSuffixes {
		if strings.HasSuffix(name, s) {
			return true
		}
	}
	return false
}

// Open opens dir as a module tree. dir is either the lib/modules/<release>
// directory itself (it has modules.order, modules.dep, modules.builtin or
// a kernel/ directory) or the root of an extracted kernel package holding
// exactly one lib/modules/<release> (or usr/lib/modules/<release>).
func Open(dir string) (*Tree, error) {
	moddir, err := findModuleDir(dir)
	if err != nil {
		return nil, err
	}
	t := &Tree{Dir: moddir, files: map[string]string{}, builtin: map[string]bool{}}
	err = filepath.WalkDir(moddir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() || !isModuleFile(d.Name()) {
			return nil
		}
		rel, _ := filepath.Rel(moddir, p)
		name := Name(rel)
		// Two files for one name (say an updates/ override): the kernel's
		// depmod prefers updates/, but the plain shortest path is what a
		// package ships; keep the first in walk order and say nothing.
		if _, dup := t.files[name]; !dup {
			t.files[name] = rel
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("scanning modules in %s: %w", moddir, err)
	}
	if err := t.readBuiltin(); err != nil {
		return nil, err
	}
	if err := t.readDep(); err != nil {
		return nil, err
	}
	return t, nil
}

// Release is the tree's directory name, which is the kernel release it was
// installed for.
func (t *Tree) Release() string { return filepath.Base(t.Dir) }

func findModuleDir(dir string) (string, error) {
	for _, marker := range []string{"modules.order", "modules.dep", "modules.builtin", "kernel"} {
		if _, err := os.Stat(filepath.Join(dir, marker)); err == nil {
			return dir, nil
		}
	}
	var found []string
	for _, sub := range []string{"lib/modules", "usr/lib/modules"} {
		ents, err := os.ReadDir(filepath.Join(dir, sub))
		if err != nil {
			continue
		}
		for _, e := range ents {
			if e.IsDir() {
				found = append(found, filepath.Join(dir, sub, e.Name()))
			}
		}
	}
	switch len(found) {
	case 1:
		return found[0], nil
	case 0:
		return "", fmt.Errorf("%s is neither a lib/modules/<release> directory (no modules.order, modules.dep, modules.builtin or kernel/) nor a tree holding lib/modules/<release>", dir)
	}
	return "", fmt.Errorf("%s holds several kernel releases (%s): name one lib/modules/<release> directory", dir, strings.Join(found, ", "))
}

func (t *Tree) readBuiltin() error {
	f, err := os.Open(filepath.Join(t.Dir, "modules.builtin"))
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("reading modules.builtin: %w", err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if line := strings.TrimSpace(sc.Text()); line != "" {
			t.builtin[Name(line)] = true
		}
	}
	if err := sc.Err(); err != nil {
		return fmt.Errorf("reading modules.builtin: %w", err)
	}
	return nil
}

// readDep reads modules.dep: "path: dep-path dep-path ...".
func (t *Tree) readDep() error {
	f, err := os.Open(filepath.Join(t.Dir, "modules.dep"))
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("reading modules.dep: %w", err)
	}
	defer f.Close()
	t.deps = map[string][]string{}
	sc := bufio.NewScanner(f)
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		mod, rest, ok := strings.Cut(sc.Text(), ":")
		if !ok {
			continue
		}
		var deps []string
		for _, d := range strings.Fields(rest) {
			deps = append(deps, Name(d))
		}
		t.deps[Name(mod)] = deps
	}
	if err := sc.Err(); err != nil {
		return fmt.Errorf("reading modules.dep: %w", err)
	}
	return nil
}

// Builtin reports whether modules.builtin lists name.
func (t *Tree) Builtin(name string) bool { return t.builtin[normalize(name)] }

func normalize(name string) string { return strings.ReplaceAll(name, "-", "_") }

// Resolve returns the modules to load for required and optional, with all
// their dependencies, each after the modules it depends on. A built-in
// module is skipped; a required module (or any dependency) that is neither
// a file in the tree nor built in is an error; an optional module that is
// not in the tree is left out.
func (t *Tree) Resolve(required, optional []string) ([]Module, error) {
	var out []Module
	state := map[string]int{} // 1 visiting, 2 done
	var visit func(name string, chain []string) error
	visit = func(name string, chain []string) error {
		switch state[name] {
		case 2:
			return nil
		case 1:
			return fmt.Errorf("modules depend on each other in a cycle: %s", strings.Join(append(chain, name), " -> "))
		}
		if t.builtin[name] {
			state[name] = 2
			return nil
		}
		rel, ok := t.files[name]
		if !ok {
			what := "module " + name
			if len(chain) > 0 {
				what += " (needed by " + strings.Join(chain, " <- ") + ")"
			}
			return fmt.Errorf("%s is not in %s: neither a module file nor listed in modules.builtin", what, t.Dir)
		}
		state[name] = 1
		m, err := ReadModule(filepath.Join(t.Dir, rel))
		if err != nil {
			return err
		}
		m.Name = name
		if t.deps != nil {
			if d, listed := t.deps[name]; listed {
				m.Depends = d
			}
		}
		for _, d := range m.Depends {
			if err := visit(normalize(d), append(slices.Clone(chain), name)); err != nil {
				return err
			}
		}
		state[name] = 2
		out = append(out, m)
		return nil
	}
	for _, n := range required {
		if err := visit(normalize(n), nil); err != nil {
			return nil, err
		}
	}
	for _, n := range optional {
		n = normalize(n)
		if _, ok := t.files[n]; !ok {
			continue
		}
		if err := visit(n, nil); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// ReadModule reads and decompresses the module file path and its .modinfo
// depends and vermagic. Name is taken from .modinfo's name= when present,
// else from the file name.
func ReadModule(path string) (Module, error) {
	data, err := readDecompressed(path)
	if err != nil {
		return Module{}, err
	}
	info, err := Modinfo(data)
	if err != nil {
		return Module{}, fmt.Errorf("reading module %s: %w", path, err)
	}
	m := Module{Name: Name(path), Path: path, Data: data}
	for _, kv := range info {
		k, v, _ := strings.Cut(kv, "=")
		switch k {
		case "name":
			m.Name = normalize(v)
		case "vermagic":
			m.Vermagic = v
		case "depends":
			for d := range strings.SplitSeq(v, ",") {
				if d = strings.TrimSpace(d); d != "" {
					m.Depends = append(m.Depends, normalize(d))
				}
			}
		}
	}
	if m.Vermagic == "" {
		return Module{}, fmt.Errorf("reading module %s: .modinfo has no vermagic", path)
	}
	return m, nil
}

// Modinfo returns the key=value strings of the .modinfo section of the ELF
// object data.
func Modinfo(data []byte) ([]string, error) {
	f, err := elf.NewFile(bytes.NewReader(data))
	if err != nil {
		return nil, fmt.Errorf("not an ELF object: %w", err)
	}
	defer f.Close()
	if f.Type != elf.ET_REL {
		return nil, fmt.Errorf("ELF type %v, want a relocatable object (ET_REL)", f.Type)
	}
	s := f.Section(".modinfo")
	if s == nil {
		return nil, errors.New("no .modinfo section")
	}
	b, err := s.Data()
	if err != nil {
		return nil, fmt.Errorf("reading .modinfo: %w", err)
	}
	var out []string
	for kv := range bytes.SplitSeq(b, []byte{0}) {
		if len(kv) > 0 {
			out = append(out, string(kv))
		}
	}
	return out, nil
}

// decompressors are the programs for compressed module formats the
// standard library cannot read, with the package that installs them.
var decompressors = map[string][2]string{
	".xz":  {"xz", "xz-utils"},
	".zst": {"zstd", "zstd"},
}

func readDecompressed(path string) ([]byte, error) {
	ext := filepath.Ext(path)
	switch ext {
	case ".ko":
		b, err := os.ReadFile(path)
		if err != nil {
			return nil, fmt.Errorf("reading module: %w", err)
		}
		return b, nil
	case ".gz":
		f, err := os.Open(path)
		if err != nil {
			return nil, fmt.Errorf("reading module: %w", err)
		}
		defer f.Close()
		zr, err := gzip.NewReader(f)
		if err != nil {
			return nil, fmt.Errorf("decompressing %s: %w", path, err)
		}
		b, err := io.ReadAll(zr)
		if err != nil {
			return nil, fmt.Errorf("decompressing %s: %w", path, err)
		}
		return b, nil
	}
	prog, ok := decompressors[ext]
	if !ok {
		return nil, fmt.Errorf("reading module %s: unknown module file format", path)
	}
	bin, err := exec.LookPath(prog[0])
	if err != nil {
		return nil, fmt.Errorf("decompressing %s: the %s program is not installed (package %s): %w", path, prog[0], prog[1], err)
	}
	var stderr bytes.Buffer
	cmd := exec.Command(bin, "-dc", "--", path)
	cmd.Stderr = &stderr
	b, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("decompressing %s with %s: %w: %s", path, prog[0], err, strings.TrimSpace(stderr.String()))
	}
	return b, nil
}

// CheckVermagic returns an error naming every module built for another
// kernel release than release, grouped by the release they were built for.
func CheckVermagic(mods []Module, release string) error {
	byRelease := map[string][]string{}
	var others []string
	for _, m := range mods {
		r := m.Release()
		if r == release {
			continue
		}
		if _, seen := byRelease[r]; !seen {
			others = append(others, r)
		}
		byRelease[r] = append(byRelease[r], m.Name)
	}
	if len(others) == 0 {
		return nil
	}
	var parts []string
	for _, r := range others {
		parts = append(parts, fmt.Sprintf("modules built for %q: %s", r, strings.Join(byRelease[r], ", ")))
	}
	return fmt.Errorf("the kernel is release %s; %s", release, strings.Join(parts, "; "))
}
