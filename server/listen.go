package server

import (
	"fmt"
	"io/fs"
	"net"
	"os"
	"strings"
	"time"
)

// LocalSocket is the name of the local socket in the run directory: the
// API over a unix socket (mode 0600) beside the --listen address, with
// connection limits of its own.
const LocalSocket = "api.sock"

// listen opens the listening socket. "unix:/path" listens on a unix socket
// (mode 0600): a stale socket file is removed, but if something answers on
// it, listen refuses rather than steal the path from a running server.
func listen(addr string) (net.Listener, error) {
	path, ok := strings.CutPrefix(addr, "unix:")
	if !ok {
		ln, err := net.Listen("tcp", addr)
		if err != nil {
			return nil, fmt.Errorf("listening on %s: %w", addr, err)
		}
		return ln, nil
	}
	if c, err := net.DialTimeout("unix", path, time.Second); err == nil {
		c.Close()
		return nil, fmt.Errorf("listening on %s: another server is answering there", path)
	}
	if fi, err := os.Lstat(path); err == nil {
		if fi.Mode().Type() != fs.ModeSocket {
			return nil, fmt.Errorf("listening on %s: the path exists and is not a socket", path)
		}
		if err := os.Remove(path); err != nil {
			return nil, fmt.Errorf("removing stale socket %s: %w", path, err)
		}
	}
	ln, err := net.Listen("unix", path)
	if err != nil {
		return nil, fmt.Errorf("listening on %s: %w", path, err)
	}
	if err := os.Chmod(path, 0o600); err != nil {
		ln.Close()
		return nil, fmt.Errorf("listening on %s: %w", path, err)
	}
	return ln, nil
}

// listenAddr is how a listener's address is spelled to a client: --listen's
// "unix:/path", or host:port.
func listenAddr(ln net.Listener) string {
	if ln.Addr().Network() == "unix" {
		return "unix:" + ln.Addr().String()
	}
	return ln.Addr().String()
}
