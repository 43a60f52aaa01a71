package chsim

import (
	"os"
	"os/signal"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// childProcAttr makes a child (qemu, vhost-device-vsock, the guest agent) die with the
// simulator, even when the simulator is killed without a chance to stop it.
func childProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}

// die kills the process with sig, bypassing Go's signal handling so the parent sees a real
// signal death (and no core file).
func die(sig syscall.Signal) {
	unix.Setrlimit(unix.RLIMIT_CORE, &unix.Rlimit{})
	if sig != syscall.SIGKILL && sig != syscall.SIGSTOP {
		signal.Reset(sig)
		// The Go runtime ignores user-sent synchronous signals (SIGSEGV, SIGBUS, …);
		// restore the default action directly.
		var sa [4]uint64 // struct kernel_sigaction: handler SIG_DFL (0), flags, restorer, mask
		unix.RawSyscall6(unix.SYS_RT_SIGACTION, uintptr(sig), uintptr(unsafe.Pointer(&sa)), 0, 8, 0, 0)
		var set unix.Sigset_t
		set.Val[0] = 1 << (uint(sig) - 1)
		unix.PthreadSigmask(unix.SIG_UNBLOCK, &set, nil)
	}
	unix.Kill(os.Getpid(), sig)
	// A stopped process resumes here on SIGCONT; any other signal has killed us.
	time.Sleep(time.Hour)
}

// pressAgentPowerButton is the ACPI power button as the guest agent in
// process mode takes it: SIGPWR.
func pressAgentPowerButton(pid int) error { return syscall.Kill(pid, syscall.SIGPWR) }
