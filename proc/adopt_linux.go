package proc

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"syscall"

	"golang.org/x/sys/unix"
)

// Adopt opens a pidfd for pid and verifies that its start time equals
// startTime. It fails with an error satisfying errors.Is(err,
// fs.ErrNotExist) when the process is gone, and with ErrIdentityMismatch
// when the pid now belongs to another process. Close releases the pidfd.
func Adopt(pid int, startTime uint64) (*Adopted, error) {
	fd, err := unix.PidfdOpen(pid, unix.PIDFD_NONBLOCK)
	if err != nil {
		if errors.Is(err, unix.ESRCH) {
			return nil, fmt.Errorf("adopting pid %d: %w", pid, os.ErrNotExist)
		}
		return nil, fmt.Errorf("adopting pid %d: pidfd_open: %w", pid, err)
	}
	// Check the start time after opening the pidfd: if the pid is reused
	// between the two steps, the start time read here is the new process's
	// and the mismatch is caught.
	st, state, err := readStat(pid)
	if err != nil {
		unix.Close(fd)
		if errors.Is(err, os.ErrNotExist) {
			return nil, fmt.Errorf("adopting pid %d: %w", pid, os.ErrNotExist)
		}
		return nil, fmt.Errorf("adopting pid %d: %w", pid, err)
	}
	// A zombie has exited; only its parent's wait is missing (an init that
	// does not reap leaves it forever). It is not a live process to adopt.
	if state == 'Z' || state == 'X' {
		unix.Close(fd)
		return nil, fmt.Errorf("adopting pid %d: process has exited (zombie): %w", pid, os.ErrNotExist)
	}
	if st != startTime {
		unix.Close(fd)
		return nil, fmt.Errorf("adopting pid %d: start time %d, recorded %d: %w", pid, st, startTime, ErrIdentityMismatch)
	}
	a := &Adopted{
		Pid:       pid,
		StartTime: st,
		pidfd:     os.NewFile(uintptr(fd), "pidfd:"+strconv.Itoa(pid)),
		done:      make(chan struct{}),
	}
	go a.watch()
	return a, nil
}

// watch waits, in the runtime poller, for the pidfd to become readable,
// which happens when the process exits.
func (a *Adopted) watch() {
	rc, err := a.pidfd.SyscallConn()
	if err != nil {
		return
	}
	exited := false
	_ = rc.Read(func(fd uintptr) bool {
		fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
		n, err := unix.Poll(fds, 0)
		if err == nil && n > 0 {
			exited = true
			return true
		}
		return false // not yet: park in the poller until readable
	})
	if exited {
		close(a.done)
	}
}

// Signal sends sig through the pidfd, so it cannot reach a process that
// reused the pid.
func (a *Adopted) Signal(sig syscall.Signal) error {
	rc, err := a.pidfd.SyscallConn()
	if err != nil {
		return err
	}
	var serr error
	if err := rc.Control(func(fd uintptr) {
		serr = unix.PidfdSendSignal(int(fd), sig, nil, 0)
	}); err != nil {
		return err
	}
	if errors.Is(serr, unix.ESRCH) {
		return os.ErrProcessDone
	}
	return serr
}
