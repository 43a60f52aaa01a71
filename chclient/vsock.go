package chclient

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strconv"
	"strings"
	"syscall"
	"time"

	"vmhost/internal/nofollow"
)

// ErrVsockRefused means CH closed a hybrid vsock connection without "OK": no guest program
// listens on the port, the guest did not answer within CH's 2 s, or the command was
// malformed.
var ErrVsockRefused = errors.New("vsock connection refused by the guest")

// VsockConn is a host-initiated connection to a guest vsock port through CH's hybrid vsock
// socket. After the handshake it carries raw bytes both ways.
type VsockConn struct {
	net.Conn
	// HostPort is the port CH allocated for this connection (from 2^30 up).
	HostPort uint32
}

// DialVsock connects to guest port through the hybrid vsock unix socket at socketPath: it
// writes "CONNECT <port>\n" and reads CH's "OK <hostport>\n" one byte at a time, so no byte
// the guest sends after the handshake is lost. ctx bounds the dial and the handshake. A
// guest that does not listen gives an error matching ErrVsockRefused.
func DialVsock(ctx context.Context, socketPath string, port uint32) (*VsockConn, error) {
	c, err := nofollow.DialUnix(ctx, socketPath)
	if err != nil {
		return nil, fmt.Errorf("dialing vsock port %d via %s: %w", port, socketPath, err)
	}
	if dl, ok := ctx.Deadline(); ok {
		c.SetDeadline(dl)
	}
	stop := context.AfterFunc(ctx, func() { c.SetDeadline(time.Unix(1, 0)) })
	hostPort, err := vsockHandshake(c, port)
	stopped := stop()
	if err == nil && !stopped {
		err = ctx.Err() // the deadline was forced; the conn is unusable
	}
	if err != nil {
		c.Close()
		if ctx.Err() != nil {
			err = fmt.Errorf("%w (%w)", ctx.Err(), err)
		}
		return nil, fmt.Errorf("connecting to vsock port %d via %s: %w", port, socketPath, err)
	}
	c.SetDeadline(time.Time{})
	return &VsockConn{Conn: c, HostPort: hostPort}, nil
}

func vsockHandshake(c net.Conn, port uint32) (uint32, error) {
	if _, err := fmt.Fprintf(c, "CONNECT %d\n", port); err != nil {
		return 0, err
	}
	var line []byte
	b := make([]byte, 1)
	for {
		if _, err := io.ReadFull(c, b); err != nil {
			if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, syscall.ECONNRESET) {
				return 0, ErrVsockRefused
			}
			return 0, err
		}
		if b[0] == '\n' {
			break
		}
		line = append(line, b[0])
		if len(line) > 32 {
			return 0, fmt.Errorf("handshake answer %q is too long", line)
		}
	}
	rest, ok := strings.CutPrefix(string(line), "OK ")
	if !ok {
		return 0, fmt.Errorf("unexpected handshake answer %q", line)
	}
	hp, err := strconv.ParseUint(rest, 10, 32)
	if err != nil {
		return 0, fmt.Errorf("unexpected handshake answer %q", line)
	}
	return uint32(hp), nil
}

// VsockListenPath returns the unix socket CH connects to when the guest dials host port:
// "<socketPath>_<port>".
func VsockListenPath(socketPath string, port uint32) string {
	return socketPath + "_" + strconv.FormatUint(uint64(port), 10)
}

// ListenVsock listens for guest-initiated vsock connections to host port: CH connects to
// VsockListenPath(socketPath, port) for each. A stale socket file at that path (nothing
// accepting on it) is removed first; a live one is an error. Closing the listener removes
// the path.
func ListenVsock(socketPath string, port uint32) (*net.UnixListener, error) {
	path := VsockListenPath(socketPath, port)
	d := nofollow.Dialer{Dialer: net.Dialer{Timeout: time.Second}}
	if c, err := d.DialUnix(context.Background(), path); err == nil {
		c.Close()
		return nil, fmt.Errorf("listening on %s: another process is already listening", path)
	}
	if fi, err := os.Lstat(path); err == nil {
		if fi.Mode().Type() != os.ModeSocket {
			return nil, fmt.Errorf("listening on %s: path exists and is not a socket", path)
		}
		if err := os.Remove(path); err != nil {
			return nil, fmt.Errorf("removing stale socket %s: %w", path, err)
		}
	}
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("listening on %s: %w", path, err)
	}
	return l, nil
}
