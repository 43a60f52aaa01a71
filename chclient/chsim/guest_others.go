//go:build !linux

package chsim

import "syscall"

// agentProcAttr starts the guest agent in a process group of its own; only Linux has a
// parent-death signal (and runs the agent).
func agentProcAttr() *syscall.SysProcAttr {
	attr := childProcAttr()
	attr.Setpgid = true
	return attr
}

// rootless does nothing: only Linux has user namespaces (and runs the agent).
func rootless(*syscall.SysProcAttr) {}
