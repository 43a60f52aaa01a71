// Package sbin finds the system programs vmhost runs from e2fsprogs
// (mkfs.ext4, debugfs): in PATH, else in /usr/sbin and /sbin, where
// distributions put them and which the PATH of a user who is not root
// often leaves out (Debian's does), so that dev mode works without root.
package sbin

import (
	"os"
	"os/exec"
	"path/filepath"
)

// dirs are where system programs live outside a user's PATH.
var dirs = []string{"/usr/sbin", "/sbin"}

// Path returns the program name as PATH finds it, else the executable
// /usr/sbin/name or /sbin/name, else name itself (so that running it
// fails naming it).
func Path(name string) string {
	if p, err := exec.LookPath(name); err == nil {
		return p
	}
	for _, d := range dirs {
		p := filepath.Join(d, name)
		if fi, err := os.Stat(p); err == nil && fi.Mode().IsRegular() && fi.Mode()&0o111 != 0 {
			return p
		}
	}
	return name
}
