// Package nofollow opens files and dials unix sockets in directories that a
// less trusted process may change: a confined VM owns its run directory
// (<run>/vms/<id>), so it can replace any name there with a symbolic link
// to another VM's socket or to a secret of the host. The agent reads and
// dials there only through this package, which never follows a link in the
// last component, refuses what is not a regular file (or a socket), and
// never blocks opening a FIFO. The directories above the last component
// must be the agent's own.
package nofollow

import (
	"context"
	"fmt"
	"io"
	"net"
	"os"
)

// Open opens the regular file name for reading. A symbolic link, a FIFO,
// a device or a directory at name is refused (a link with an error
// satisfying errors.Is(err, syscall.ELOOP)).
func Open(name string) (*os.File, error) {
	f, err := openFile(name)
	if err != nil {
		return nil, err
	}
	fi, err := f.Stat()
	if err == nil && !fi.Mode().IsRegular() {
		err = fmt.Errorf("open %s: is a %v, not a regular file", name, fi.Mode().Type())
	}
	if err != nil {
		f.Close()
		return nil, err
	}
	return f, nil
}

// ReadFile reads the regular file name, as Open opens it.
func ReadFile(name string) ([]byte, error) {
	f, err := Open(name)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return io.ReadAll(f)
}

// Dialer dials unix sockets without following a link at their name.
type Dialer struct {
	net.Dialer
}

// DialUnix connects to the unix socket at path, with d's timeout and ctx.
// A symbolic link or anything but a socket at path is refused; a missing
// one fails with an error satisfying errors.Is(err, syscall.ENOENT), and a
// socket nobody listens on with syscall.ECONNREFUSED, as net.Dial's would.
func (d *Dialer) DialUnix(ctx context.Context, path string) (net.Conn, error) {
	return dialUnix(ctx, &d.Dialer, path)
}

// DialUnix is Dialer.DialUnix with no timeout but ctx's.
func DialUnix(ctx context.Context, path string) (net.Conn, error) {
	return dialUnix(ctx, &net.Dialer{}, path)
}

// Chmod sets the permission bits of what is at name (a socket the agent
// just bound, say) without following a link there.
func Chmod(name string, mode os.FileMode) error { return chmod(name, mode) }
