package jail

import (
	"errors"

	"golang.org/x/sys/unix"
)

// killMember sends SIGKILL to pid if it is in the cgroup. The pid is pinned
// by a pidfd before its membership is checked, so a pid reused by a process
// outside the cgroup after it was listed is never signalled.
func (c *Cgroup) killMember(pid int) error {
	fd, err := unix.PidfdOpen(pid, 0)
	if errors.Is(err, unix.ESRCH) {
		return nil
	}
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	in, err := c.Contains(pid)
	if err != nil || !in {
		return err
	}
	if err := unix.PidfdSendSignal(fd, unix.SIGKILL, nil, 0); err != nil && !errors.Is(err, unix.ESRCH) {
		return err
	}
	return nil
}
