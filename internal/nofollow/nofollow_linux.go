package nofollow

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"strconv"

	"golang.org/x/sys/unix"
)

func openFile(name string) (*os.File, error) {
	// O_NONBLOCK: opening a FIFO for reading would wait for a writer.
	fd, err := unix.Open(name, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: name, Err: err}
	}
	return os.NewFile(uintptr(fd), name), nil
}

// dialUnix opens the socket's inode without following a link (O_PATH) and
// connects through /proc/self/fd/N, which names that inode: whatever is
// put at path after the check is not what is dialed.
func dialUnix(ctx context.Context, d *net.Dialer, path string) (net.Conn, error) {
	fail := func(err error) error {
		return &net.OpError{Op: "dial", Net: "unix", Addr: &net.UnixAddr{Name: path, Net: "unix"}, Err: err}
	}
	fd, err := unix.Open(path, unix.O_PATH|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fail(os.NewSyscallError("open", err))
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, fail(os.NewSyscallError("fstat", err))
	}
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFSOCK:
	case unix.S_IFLNK:
		return nil, fail(fmt.Errorf("%s is a symbolic link, not followed: %w", path, unix.ELOOP))
	default:
		return nil, fail(fmt.Errorf("%s is not a socket: %w", path, unix.ENOTSOCK))
	}
	c, err := d.DialContext(ctx, "unix", "/proc/self/fd/"+strconv.Itoa(fd))
	if err != nil {
		var oe *net.OpError
		if errors.As(err, &oe) {
			oe.Addr = &net.UnixAddr{Name: path, Net: "unix"}
			return nil, oe
		}
		return nil, fail(err)
	}
	return c, nil
}

// chmod changes the mode of what is at name, which must not be a link: it
// opens the inode (O_PATH) and changes it through /proc/self/fd/N, since
// fchmodat cannot refuse to follow a link on older kernels.
func chmod(name string, mode os.FileMode) error {
	fd, err := unix.Open(name, unix.O_PATH|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return &os.PathError{Op: "chmod", Path: name, Err: err}
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return &os.PathError{Op: "chmod", Path: name, Err: err}
	}
	if st.Mode&unix.S_IFMT == unix.S_IFLNK {
		return &os.PathError{Op: "chmod", Path: name, Err: unix.ELOOP}
	}
	if err := unix.Chmod("/proc/self/fd/"+strconv.Itoa(fd), uint32(mode.Perm())); err != nil {
		return &os.PathError{Op: "chmod", Path: name, Err: err}
	}
	return nil
}
