package chsim

import (
	"os"
	"syscall"
)

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

// rootless makes attr start its process as root of a new user namespace that maps uid and
// gid 0 to the caller's own ids, and nothing else (setgroups denied, as an unprivileged
// user namespace must).
func rootless(attr *syscall.SysProcAttr) {
	attr.Cloneflags |= syscall.CLONE_NEWUSER
	attr.UidMappings = []syscall.SysProcIDMap{{ContainerID: 0, HostID: os.Geteuid(), Size: 1}}
	attr.GidMappings = []syscall.SysProcIDMap{{ContainerID: 0, HostID: os.Getegid(), Size: 1}}
	attr.GidMappingsEnableSetgroups = false
}
