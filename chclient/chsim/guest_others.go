//go:build !linux

package chsim

import "syscall"

// agentProcAttr starts the guest agent in a session of its own (the agent runs on Linux
// only; see guest_linux.go).
func agentProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setsid: true}
}

// rootless does nothing: only Linux has user namespaces (and runs the agent).
func rootless(*syscall.SysProcAttr) {}
