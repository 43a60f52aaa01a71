//go:build !linux

package chsim

import (
	"errors"
	"fmt"
	"os"
	"syscall"
)

// errNotLinux is what the simulator's Linux-only parts (taps, packet sockets, network
// namespaces, the qemu backend's plumbing) answer on other systems.
var errNotLinux = fmt.Errorf("chsim: the simulator runs only on Linux: %w", errors.ErrUnsupported)

// childProcAttr sets no parent-death signal: only Linux has one.
func childProcAttr() *syscall.SysProcAttr { return &syscall.SysProcAttr{} }

// die cannot reset the Go runtime's handlers outside Linux, so it exits instead of dying
// by sig.
func die(sig syscall.Signal) {
	fmt.Fprintf(os.Stderr, "chsim: dying by signal %d: %v\n", sig, errNotLinux)
	os.Exit(2)
}

// pressAgentPowerButton: the guest agent runs on Linux only.
func pressAgentPowerButton(int) error { return errNotLinux }
