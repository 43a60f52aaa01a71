//go:build !linux

package proc

import (
	"errors"
	"fmt"
	"syscall"
)

// errNoPidfd is what the pidfd calls answer outside Linux.
var errNoPidfd = fmt.Errorf("pidfd is Linux-only: %w", errors.ErrUnsupported)

// Adopt needs a pidfd, which only Linux has: it always fails with an error
// satisfying errors.Is(err, errors.ErrUnsupported).
func Adopt(pid int, startTime uint64) (*Adopted, error) {
	return nil, fmt.Errorf("adopting pid %d: %w", pid, errNoPidfd)
}

// Signal needs a pidfd, which only Linux has.
func (a *Adopted) Signal(sig syscall.Signal) error {
	return fmt.Errorf("signalling pid %d: %w", a.Pid, errNoPidfd)
}
