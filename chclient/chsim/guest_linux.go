package chsim

import "syscall"

// agentProcAttr starts the guest agent in a process group of its own (paused and resumed
// with the VM) with guestHaltSignal as its parent-death signal: a simulator killed outright
// halts it, and the agent then kills everything below it, so no process of the guest is
// left behind.
func agentProcAttr() *syscall.SysProcAttr {
	attr := childProcAttr()
	attr.Setpgid = true
	attr.Pdeathsig = guestHaltSignal
	return attr
}
