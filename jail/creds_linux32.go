//go:build linux && !(amd64 || arm64 || riscv64 || ppc64 || ppc64le || s390x || loong64 || mips64 || mips64le)

package jail

import (
	"fmt"
	"syscall"
)

// setThreadCreds sets the groups, gid and uid. Where the plain system calls
// take 16-bit ids, Go's own calls (which pick the 32-bit ones, for every
// thread) are used.
func setThreadCreds(uid, gid uint32, groups []uint32) error {
	gs := make([]int, len(groups))
	for i, g := range groups {
		gs[i] = int(g)
	}
	if err := syscall.Setgroups(gs); err != nil {
		return fmt.Errorf("setting groups %v: %w", groups, err)
	}
	if err := syscall.Setresgid(int(gid), int(gid), int(gid)); err != nil {
		return fmt.Errorf("setting gid %d: %w", gid, err)
	}
	if err := syscall.Setresuid(int(uid), int(uid), int(uid)); err != nil {
		return fmt.Errorf("setting uid %d: %w", uid, err)
	}
	return nil
}
