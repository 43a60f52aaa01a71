package jail

import (
	"fmt"

	"golang.org/x/sys/unix"
)

// setThreadRealIDs makes uid and gid the calling thread's real ids, keeping
// its effective and saved ids (0) and so its capabilities. Only this thread
// changes: Go's own calls would change every thread of the agent.
func setThreadRealIDs(uid, gid uint32) error {
	keep := ^uintptr(0) // -1: unchanged
	if _, _, e := unix.RawSyscall(sysSetresgid, uintptr(gid), keep, keep); e != 0 {
		return fmt.Errorf("setting the real gid %d: %w", gid, e)
	}
	if _, _, e := unix.RawSyscall(sysSetresuid, uintptr(uid), keep, keep); e != 0 {
		return fmt.Errorf("setting the real uid %d: %w", uid, e)
	}
	return nil
}
