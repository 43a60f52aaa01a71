//go:build linux && (386 || arm)

package jail

import "golang.org/x/sys/unix"

// The plain calls take 16-bit ids here.
const (
	sysSetresuid = unix.SYS_SETRESUID32
	sysSetresgid = unix.SYS_SETRESGID32
)
