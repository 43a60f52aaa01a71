// Package sdnotify tells systemd how a Type=notify service is doing: it
// sends sd_notify(3) datagrams ("READY=1", "STOPPING=1", "RELOADING=1",
// "STATUS=...") to the unix datagram socket systemd names in
// $NOTIFY_SOCKET. A path starting with "@" is a socket in the abstract
// namespace (Linux): its first byte becomes NUL.
//
// Outside systemd (no NOTIFY_SOCKET) every send is a no-op. The package
// imports none of ours.
package sdnotify

import (
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
)

// Env is the environment variable systemd sets for a Type=notify service.
const Env = "NOTIFY_SOCKET"

// Notifier sends to one notify socket. The zero value (and a nil one)
// sends nothing. It is safe for concurrent use.
type Notifier struct {
	addr *net.UnixAddr
}

// FromEnv returns the notifier of $NOTIFY_SOCKET (one that sends nothing
// when it is unset) and unsets the variable, so that the programs the
// service starts (which systemd would not accept notifications from
// anyway) do not inherit it.
func FromEnv() (*Notifier, error) {
	path := os.Getenv(Env)
	os.Unsetenv(Env)
	return New(path)
}

// New returns a notifier for the socket at path ("" = none). Only unix
// socket paths, absolute or "@abstract", are supported.
func New(path string) (*Notifier, error) {
	switch {
	case path == "":
		return &Notifier{}, nil
	case strings.HasPrefix(path, "/"):
	case strings.HasPrefix(path, "@") && len(path) > 1:
		// The kernel's abstract namespace starts with a NUL byte; Go's
		// sockaddr conversion writes that NUL for a leading "@".
	default:
		return nil, fmt.Errorf("%s=%q: not a unix socket path (want /path or @abstract)", Env, path)
	}
	return &Notifier{addr: &net.UnixAddr{Name: path, Net: "unixgram"}}, nil
}

// Enabled reports whether n sends anywhere.
func (n *Notifier) Enabled() bool { return n != nil && n.addr != nil }

// Notify sends state, one or more "KEY=value" lines (sd_notify's format),
// as one datagram. It returns nil without sending when n is not enabled.
func (n *Notifier) Notify(state string) error {
	if !n.Enabled() {
		return nil
	}
	if state == "" || strings.ContainsRune(state, 0) {
		return errors.New("sdnotify: empty state or NUL in it")
	}
	c, err := net.DialUnix("unixgram", nil, n.addr)
	if err != nil {
		return fmt.Errorf("sdnotify: dialing %s: %w", n.addr.Name, err)
	}
	defer c.Close()
	if _, err := c.Write([]byte(state)); err != nil {
		return fmt.Errorf("sdnotify: sending %q: %w", firstLine(state), err)
	}
	return nil
}

func firstLine(s string) string {
	line, _, _ := strings.Cut(s, "\n")
	return line
}

// Ready is READY=1: start-up finished.
const Ready = "READY=1"

// Stopping is STOPPING=1: the service is shutting down.
const Stopping = "STOPPING=1"

// Reloading is RELOADING=1: a configuration reload started; send Ready
// when it is over.
const Reloading = "RELOADING=1"
