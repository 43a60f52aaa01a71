//go:build !linux

package jail

import (
	"context"
	"fmt"
	"os/exec"
)

// Start fails off Linux: there is no jail to start a process in.
func (c *Confinement) Start(cmd *exec.Cmd) error {
	return fmt.Errorf("jail: %w", errLinuxOnly)
}

// Own fails off Linux.
func Own(uid, gid uint32, paths ...string) error { return fmt.Errorf("jail: %w", errLinuxOnly) }

// Disown fails off Linux.
func Disown(paths ...string) error { return fmt.Errorf("jail: %w", errLinuxOnly) }

// OwnTree fails off Linux.
func OwnTree(uid, gid uint32, dir string) error { return fmt.Errorf("jail: %w", errLinuxOnly) }

// SelfTest fails off Linux.
func (j *Jailer) SelfTest(ctx context.Context, inUse map[uint32]bool) error {
	return fmt.Errorf("jail: %w", errLinuxOnly)
}
