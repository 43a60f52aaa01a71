package guest

import (
	"errors"
	"os"
	"os/exec"
	"os/signal"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"
)

// reaper is the PID-1 duty of collecting every child: the agent's own
// (workload, exec health checks) and the orphans the kernel reparents to it.
// It is the only caller of wait4 in the process, so children are started
// through it and learn their status from a channel; os/exec's Wait is never
// used.
type reaper struct {
	// mu is held across start+register and across each reaping pass, so a
	// child can't be reaped before its waiter exists.
	mu      sync.Mutex
	waiters map[int]chan syscall.WaitStatus
	// orphans counts reaped processes nobody waited for.
	orphans int
	sigs    chan os.Signal
	done    chan struct{}
}

// newReaper starts reaping on SIGCHLD. Call stop when done.
func newReaper() *reaper {
	r := &reaper{
		waiters: make(map[int]chan syscall.WaitStatus),
		sigs:    make(chan os.Signal, 1),
		done:    make(chan struct{}),
	}
	signal.Notify(r.sigs, syscall.SIGCHLD)
	go r.loop()
	return r
}

func (r *reaper) loop() {
	for {
		select {
		case <-r.sigs:
			r.reap()
		case <-r.done:
			return
		}
	}
}

// reap collects every exited child without blocking.
func (r *reaper) reap() {
	r.mu.Lock()
	defer r.mu.Unlock()
	for {
		var ws unix.WaitStatus
		pid, err := unix.Wait4(-1, &ws, unix.WNOHANG, nil)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil || pid <= 0 {
			return
		}
		if ch, ok := r.waiters[pid]; ok {
			ch <- syscall.WaitStatus(ws)
			delete(r.waiters, pid)
		} else {
			r.orphans++
		}
	}
}

// start starts cmd (whose Stdin, Stdout and Stderr must be nil or *os.File,
// so os/exec runs no copying goroutines) and returns a channel that receives
// its pid and a channel that receives its wait status once.
func (r *reaper) start(cmd *exec.Cmd) (pid int, status <-chan syscall.WaitStatus, err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if err := cmd.Start(); err != nil {
		return 0, nil, err
	}
	pid = cmd.Process.Pid
	ch := make(chan syscall.WaitStatus, 1)
	r.waiters[pid] = ch
	// The pid stays ours until reaped; drop os.Process's pidfd, we signal by pid.
	cmd.Process.Release()
	return pid, ch, nil
}

// signal sends sig to pid if pid is still an unreaped child of ours, so a
// recycled pid is never signalled.
func (r *reaper) signal(pid int, sig syscall.Signal) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, ok := r.waiters[pid]; !ok {
		return os.ErrProcessDone
	}
	return unix.Kill(pid, sig)
}

// signalGroup sends sig to the process group led by pid (the workload is
// started with Setpgid), if pid is still an unreaped child.
func (r *reaper) signalGroup(pid int, sig syscall.Signal) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, ok := r.waiters[pid]; !ok {
		return os.ErrProcessDone
	}
	return unix.Kill(-pid, sig)
}

// orphanCount returns how many orphans were reaped so far.
func (r *reaper) orphanCount() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.orphans
}

func (r *reaper) stop() {
	signal.Stop(r.sigs)
	close(r.done)
}
