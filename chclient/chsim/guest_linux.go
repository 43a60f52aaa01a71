package chsim

import "syscall"

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
