//go:build linux && (amd64 || arm64 || riscv64 || ppc64 || ppc64le || s390x || loong64 || mips64 || mips64le)

package jail

import (
	"fmt"
	"unsafe"

	"golang.org/x/sys/unix"
)

// setThreadCreds sets the groups, gid and uid of the calling thread only.
// Exec gives the new program the credentials of the thread that calls it,
// and the helper execs from its one locked thread; Go's own calls would stop
// every thread of the runtime three times to change them all. These
// architectures have 32-bit ids in the plain system calls.
func setThreadCreds(uid, gid uint32, groups []uint32) error {
	var p unsafe.Pointer
	if len(groups) > 0 {
		p = unsafe.Pointer(&groups[0])
	}
	if _, _, e := unix.RawSyscall(unix.SYS_SETGROUPS, uintptr(len(groups)), uintptr(p), 0); e != 0 {
		return fmt.Errorf("setting groups %v: %w", groups, e)
	}
	if _, _, e := unix.RawSyscall(unix.SYS_SETRESGID, uintptr(gid), uintptr(gid), uintptr(gid)); e != 0 {
		return fmt.Errorf("setting gid %d: %w", gid, e)
	}
	if _, _, e := unix.RawSyscall(unix.SYS_SETRESUID, uintptr(uid), uintptr(uid), uintptr(uid)); e != 0 {
		return fmt.Errorf("setting uid %d: %w", uid, e)
	}
	return nil
}
