package netnstest

import (
	"fmt"
	"os"
	"runtime"
	"testing"

	"golang.org/x/sys/unix"
)

// RequireRoot skips the test unless it runs as root.
func RequireRoot(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) for a network namespace: run go test as root, e.g. sudo go test")
	}
}

// RequireTun skips the test when /dev/net/tun is missing (needed for taps).
func RequireTun(t testing.TB) {
	t.Helper()
	if _, err := os.Stat("/dev/net/tun"); err != nil {
		t.Skipf("no /dev/net/tun: %v (load the tun module: modprobe tun)", err)
	}
}

// NS is a network namespace made for one test, held by a locked thread
// that waits for work until the test ends.
type NS struct {
	// FD is an open descriptor of the namespace, for netlink sockets and
	// setns; it is closed when the test ends.
	FD    int
	steps chan func() error
	errc  chan error
}

// New creates a network namespace for t, skipping t when not root or when
// the kernel refuses (a container without CAP_SYS_ADMIN). The namespace,
// with every interface and nftables table made in it, goes away when the
// test ends (unless something else, such as a process started in it, still
// holds it).
func New(t testing.TB) *NS {
	t.Helper()
	RequireRoot(t)
	ns := &NS{steps: make(chan func() error), errc: make(chan error)}
	go func() {
		// Never unlocked: the thread is in the new namespace for good and
		// ends with this goroutine.
		runtime.LockOSThread()
		if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
			ns.errc <- fmt.Errorf("unshare(CLONE_NEWNET): %w", err)
			return
		}
		fd, err := unix.Open("/proc/thread-self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			ns.errc <- fmt.Errorf("opening the namespace: %w", err)
			return
		}
		ns.FD = fd
		ns.errc <- nil
		for f := range ns.steps {
			ns.errc <- f()
		}
	}()
	if err := <-ns.errc; err != nil {
		t.Skipf("cannot create a network namespace: %v (run go test as root, outside a container that denies CAP_SYS_ADMIN)", err)
	}
	t.Cleanup(func() {
		close(ns.steps)
		unix.Close(ns.FD)
	})
	return ns
}

// Run runs f on the namespace's thread and returns its error: sockets f
// opens and processes it starts live in the namespace. Calls are
// serialised; f must not call Run.
func (ns *NS) Run(f func() error) error {
	ns.steps <- f
	return <-ns.errc
}

// Enter moves the calling goroutine into a new network namespace for the
// rest of the test: it stays locked to its thread, so the thread (the
// namespace's last user) ends with the test. Call it from the test's own
// goroutine, before starting others that should share the namespace.
func Enter(t testing.TB) {
	t.Helper()
	RequireRoot(t)
	runtime.LockOSThread()
	if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
		runtime.UnlockOSThread() // still in the host's namespace: harmless
		t.Skipf("cannot create a network namespace: unshare(CLONE_NEWNET): %v (run go test as root, outside a container that denies CAP_SYS_ADMIN)", err)
	}
}

// RunIn runs f on a fresh thread that joined the network namespace fd and
// returns its error. The thread ends after f, so objects whose namespace is
// fixed when they are made (listeners, sockets, started processes) may
// outlive it.
func RunIn(fd int, f func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread ends with the goroutine
		if err := unix.Setns(fd, unix.CLONE_NEWNET); err != nil {
			errc <- fmt.Errorf("entering network namespace: %w", err)
			return
		}
		errc <- f()
	}()
	return <-errc
}
