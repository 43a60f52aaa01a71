// Package dirlock keeps one vmhost agent per directory: Acquire takes an
// exclusive flock on <dir>/vmhost.lock and writes the holder's pid into it,
// so a second agent is refused with a message naming the first.
//
// The kernel drops a flock when its last descriptor closes, so the lock
// ends with Close or with the process, however it dies (kill -9 included);
// a stale lock file never blocks a restart. The descriptor is close-on-exec:
// children such as Cloud Hypervisor, which may outlive the agent, do not
// keep it. (A child forked just before the agent died holds it until its
// exec; Acquire waits for that when the pid in the file is dead.)
package dirlock

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"time"

	"golang.org/x/sys/unix"
)

// FileName is the lock file Acquire takes in the directory.
const FileName = "vmhost.lock"

// HeldError is Acquire's error when another process holds the lock.
type HeldError struct {
	What string // e.g. "state directory"
	Dir  string
	PID  int // 0 when the holder's pid could not be read
}

func (e *HeldError) Error() string {
	holder := "pid unknown"
	if e.PID > 0 {
		holder = "pid " + strconv.Itoa(e.PID)
	}
	return fmt.Sprintf("%s %s is in use by another vmhost (%s)", e.What, e.Dir, holder)
}

// Lock is a held directory lock. It lasts until Close or the end of the
// process; the caller must keep the *Lock reachable (a deferred Close does)
// since an unreachable *os.File is closed by its finalizer.
type Lock struct {
	f *os.File
}

// Acquire takes the lock of dir without waiting, creating <dir>/vmhost.lock
// (mode 0600) if needed, and records the calling process's pid in it. what
// names the directory's role in errors ("state directory", "run
// directory"). When another process holds the lock the error is a
// *HeldError naming its pid.
func Acquire(dir, what string) (*Lock, error) {
	path := filepath.Join(dir, FileName)
	// O_NOFOLLOW: a symlink planted at the lock path must not make us
	// create or truncate a file elsewhere.
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|unix.O_NOFOLLOW, 0o600)
	if err != nil {
		return nil, fmt.Errorf("locking %s %s: %w", what, dir, err)
	}
	if err := lockOrWait(f); err != nil {
		defer f.Close()
		if errors.Is(err, unix.EWOULDBLOCK) {
			return nil, &HeldError{What: what, Dir: dir, PID: holderPID(f)}
		}
		return nil, fmt.Errorf("locking %s %s: %w", what, dir, err)
	}
	// A file left by an older run may have a wider mode.
	err = f.Chmod(0o600)
	if err == nil {
		err = f.Truncate(0)
	}
	if err == nil {
		_, err = f.WriteAt([]byte(strconv.Itoa(os.Getpid())+"\n"), 0)
	}
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("locking %s %s: writing pid: %w", what, dir, err)
	}
	return &Lock{f: f}, nil
}

// orphanWait bounds how long Acquire waits for a lock whose recorded
// holder is dead.
const orphanWait = 5 * time.Second

// lockOrWait takes the flock of f. Held by a live holder, it fails at
// once (EWOULDBLOCK). Held while the pid in the file is dead, it waits a
// while: a child the dead holder forked keeps a duplicate of the
// descriptor until it execs (close-on-exec closes it only then), and on a
// loaded machine that can take a moment after the holder died, so an
// agent restarted at once would otherwise be refused by a lock nobody
// holds a moment later.
func lockOrWait(f *os.File) error {
	deadline := time.Now().Add(orphanWait)
	for {
		err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
		if !errors.Is(err, unix.EWOULDBLOCK) || time.Now().After(deadline) {
			return err
		}
		pid := holderPID(f)
		if pid <= 0 {
			return err // no holder recorded: refused
		}
		if alive := unix.Kill(pid, 0); alive == nil || errors.Is(alive, unix.EPERM) {
			return err // the holder lives (or cannot be told): refused
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// holderPID reads the pid the holder wrote. The holder writes it just after
// taking the lock, so an empty file is read again for a short while.
func holderPID(f *os.File) int {
	buf := make([]byte, 32)
	for range 20 {
		n, _ := f.ReadAt(buf, 0)
		if pid, err := strconv.Atoi(string(bytes.TrimSpace(buf[:n]))); err == nil && pid > 0 {
			return pid
		}
		time.Sleep(5 * time.Millisecond)
	}
	return 0
}

// Close releases the lock. The lock file stays: unlinking it would let a
// process that opened the old file lock it while another locks a new one,
// both then believing they hold the directory.
func (l *Lock) Close() error {
	return l.f.Close()
}
