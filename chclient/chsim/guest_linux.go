package chsim

import (
	"os"
	"syscall"
)

// agentProcAttr starts the guest agent in a session of its own, without a parent-death
// signal: a suspended guest outlives the simulator that saved it. (A session, not only a
// process group: a group that becomes orphaned while stopped gets SIGHUP and SIGCONT from
// the kernel when its parent exits, which would wake a kept guest; the group of a session
// leader whose parent is outside its session never becomes orphaned, it is one from the
// start.) Its --vmm-fd pipe ends it instead when no one holds the pipe (a simulator killed
// outright included), and the agent then kills everything below it, so no process of the
// guest is left behind.
func agentProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setsid: true}
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
