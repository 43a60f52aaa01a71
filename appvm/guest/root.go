package guest

import (
	"bufio"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"strconv"
	"strings"
)

// maxLinks bounds symlink resolution, as the kernel's ELOOP limit does.
const maxLinks = 40

// inRoot returns the host path of p (a guest path) inside the workload root,
// following symlinks the way the workload will see them: an absolute target
// starts again at root, and ".." stops at root. Missing trailing components
// are appended as they are, so the result can be created.
func inRoot(root, p string) (string, error) {
	parts := strings.Split(p, "/")
	resolved := ""
	links := 0
	for len(parts) > 0 {
		c := parts[0]
		parts = parts[1:]
		switch c {
		case "", ".":
			continue
		case "..":
			resolved = path.Dir(resolved)
			if resolved == "." || resolved == "/" {
				resolved = ""
			}
			continue
		}
		next := path.Join(resolved, c)
		fi, err := os.Lstat(filepath.Join(root, next))
		if errors.Is(err, fs.ErrNotExist) {
			resolved = next
			continue
		}
		if err != nil {
			return "", fmt.Errorf("resolving %q in the workload root: %w", p, err)
		}
		if fi.Mode()&fs.ModeSymlink == 0 {
			resolved = next
			continue
		}
		if links++; links > maxLinks {
			return "", fmt.Errorf("resolving %q in the workload root: too many symlinks", p)
		}
		target, err := os.Readlink(filepath.Join(root, next))
		if err != nil {
			return "", fmt.Errorf("resolving %q in the workload root: %w", p, err)
		}
		if strings.HasPrefix(target, "/") {
			resolved = ""
		}
		parts = append(strings.Split(target, "/"), parts...)
	}
	return filepath.Join(root, resolved), nil
}

// account is a resolved workload user.
type account struct {
	uid, gid uint32
	groups   []uint32
	home     string
	// named reports whether the user came from /etc/passwd.
	named bool
}

// lookupUser resolves spec.User ("", "name", "uid", "name:group", "uid:gid")
// through the root's /etc/passwd and /etc/group, as container runtimes do:
// a numeric uid missing from passwd runs with gid 0 and home /.
func lookupUser(root, spec string) (account, error) {
	userPart, groupPart, hasGroup := strings.Cut(spec, ":")
	if userPart == "" {
		userPart = "0"
	}
	acc := account{home: "/"}
	passwd, err := readColonFile(root, "/etc/passwd")
	if err != nil {
		return acc, err
	}
	var name string
	found := false
	for _, f := range passwd {
		if len(f) < 7 {
			continue
		}
		if f[0] == userPart || f[2] == userPart {
			uid, err1 := strconv.ParseUint(f[2], 10, 32)
			gid, err2 := strconv.ParseUint(f[3], 10, 32)
			if err1 != nil || err2 != nil {
				continue
			}
			acc.uid, acc.gid, acc.home, name, found, acc.named = uint32(uid), uint32(gid), f[5], f[0], true, true
			break
		}
	}
	if !found {
		uid, err := strconv.ParseUint(userPart, 10, 32)
		if err != nil {
			return acc, fmt.Errorf("user %q not found in /etc/passwd", userPart)
		}
		acc.uid = uint32(uid)
	}
	if acc.home == "" {
		acc.home = "/"
	}
	groups, err := readColonFile(root, "/etc/group")
	if err != nil {
		return acc, err
	}
	if hasGroup {
		gid, found := uint64(0), false
		for _, f := range groups {
			if len(f) >= 3 && (f[0] == groupPart || f[2] == groupPart) {
				if g, err := strconv.ParseUint(f[2], 10, 32); err == nil {
					gid, found = g, true
					break
				}
			}
		}
		if !found {
			g, err := strconv.ParseUint(groupPart, 10, 32)
			if err != nil {
				return acc, fmt.Errorf("group %q not found in /etc/group", groupPart)
			}
			gid = g
		}
		acc.gid = uint32(gid)
	}
	if name != "" {
		for _, f := range groups {
			if len(f) < 4 {
				continue
			}
			for _, member := range strings.Split(f[3], ",") {
				if member == name {
					if g, err := strconv.ParseUint(f[2], 10, 32); err == nil && uint32(g) != acc.gid {
						acc.groups = append(acc.groups, uint32(g))
					}
				}
			}
		}
	}
	return acc, nil
}

// readColonFile reads a passwd-style file of the root; a missing file is
// empty.
func readColonFile(root, name string) ([][]string, error) {
	p, err := inRoot(root, name)
	if err != nil {
		return nil, err
	}
	f, err := os.Open(p)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("reading %s: %w", name, err)
	}
	defer f.Close()
	var out [][]string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || line[0] == '#' {
			continue
		}
		out = append(out, strings.Split(line, ":"))
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("reading %s: %w", name, err)
	}
	return out, nil
}

// lookPath finds argv0 the way execvp would inside root, and returns the
// guest path (for a chrooted exec) and the host path.
func lookPath(root, argv0, pathEnv string) (guestPath, hostPath string, err error) {
	try := func(g string) (string, bool) {
		h, err := inRoot(root, g)
		if err != nil {
			return "", false
		}
		fi, err := os.Stat(h)
		if err != nil || !fi.Mode().IsRegular() || fi.Mode().Perm()&0o111 == 0 {
			return "", false
		}
		return h, true
	}
	if strings.Contains(argv0, "/") {
		g := argv0
		if !strings.HasPrefix(g, "/") {
			return "", "", fmt.Errorf("command %q: relative paths are not supported", argv0)
		}
		if h, ok := try(g); ok {
			return g, h, nil
		}
		return "", "", fmt.Errorf("command %q not found or not executable", argv0)
	}
	for _, dir := range strings.Split(pathEnv, ":") {
		if dir == "" || !strings.HasPrefix(dir, "/") {
			continue
		}
		g := path.Join(dir, argv0)
		if h, ok := try(g); ok {
			return g, h, nil
		}
	}
	return "", "", fmt.Errorf("command %q not found in PATH", argv0)
}
