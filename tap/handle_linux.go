package tap

import (
	"errors"
	"fmt"
	"runtime"

	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"
)

// A Handle creates and configures taps, bridge ports, anti-spoof rules and
// snoopers in one network namespace. Each call opens and closes its own
// netlink sockets, so a Handle is safe for concurrent use.
type Handle struct {
	netns int
	agent string // Config.AgentID

	// dial opens a netlink socket of the given family. Tests replace it to
	// check messages on a fake conn (nltest.Dial).
	dial func(family int) (*netlink.Conn, error)
}

// New returns a Handle for the namespace in cfg. A nil cfg means the caller's
// namespace.
func New(cfg *Config) *Handle {
	h := &Handle{}
	if cfg != nil {
		h.netns, h.agent = cfg.NetNS, cfg.AgentID
	}
	h.dial = h.dialNetlink
	return h
}

func (h *Handle) dialNetlink(family int) (*netlink.Conn, error) {
	c, err := netlink.Dial(family, &netlink.Config{NetNS: h.netns})
	if err != nil {
		return nil, err
	}
	// Best effort: with extended acks the kernel's reason for a refusal
	// reaches OpError.Message.
	_ = c.SetOption(netlink.ExtendedAcknowledge, true)
	return c, nil
}

// checkAgent refuses to mark objects with an agent id that cannot be
// parsed back.
func (h *Handle) checkAgent() error {
	if h.agent != "" && !validAgentID(h.agent) {
		return fmt.Errorf("agent id %q: want 1 to 32 lowercase letters and digits", h.agent)
	}
	return nil
}

// guardTable is the table of this Handle's anti-spoof chains.
func (h *Handle) guardTable() string { return GuardTableOf(h.agent) }

// inNetNS runs fn on an OS thread that has entered the handle's namespace.
// Some kernel objects take the namespace of the thread that creates them
// (a tun device, at TUNSETIFF). The thread is never unlocked, so it dies with
// its goroutine and its namespace never leaks to other goroutines.
func (h *Handle) inNetNS(fn func() error) error {
	if h.netns == 0 {
		return fn()
	}
	return runInNetNS(h.netns, fn)
}

func runInNetNS(fd int, fn func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		// No UnlockOSThread: the thread's namespace is changed for good.
		if err := unix.Setns(fd, unix.CLONE_NEWNET); err != nil {
			errc <- fmt.Errorf("entering network namespace: %w", err)
			return
		}
		errc <- fn()
	}()
	return <-errc
}

// isNotExist reports whether err says a netlink object was not there.
func isNotExist(err error) bool {
	return errors.Is(err, unix.ENODEV) || errors.Is(err, unix.ENOENT)
}
