//go:build !linux

package jail

import "fmt"

func (c *Cgroup) killMember(pid int) error {
	return fmt.Errorf("killing pid %d: %w", pid, errLinuxOnly)
}
