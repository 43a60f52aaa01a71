//go:build !linux

package nofollow

import (
	"context"
	"fmt"
	"net"
	"os"
	"syscall"
)

func openFile(name string) (*os.File, error) {
	fi, err := os.Lstat(name)
	if err != nil {
		return nil, err
	}
	if fi.Mode()&os.ModeSymlink != 0 {
		return nil, &os.PathError{Op: "open", Path: name, Err: syscall.ELOOP}
	}
	return os.Open(name)
}

// dialUnix checks the name before dialing: without Linux's O_PATH the check
// and the dial are two steps (vmhost confines VMs on Linux only).
func dialUnix(ctx context.Context, d *net.Dialer, path string) (net.Conn, error) {
	fi, err := os.Lstat(path)
	if err == nil && fi.Mode()&os.ModeSymlink != 0 {
		err = fmt.Errorf("%s is a symbolic link, not followed: %w", path, syscall.ELOOP)
	}
	if err != nil {
		return nil, &net.OpError{Op: "dial", Net: "unix", Addr: &net.UnixAddr{Name: path, Net: "unix"}, Err: err}
	}
	return d.DialContext(ctx, "unix", path)
}

func chmod(name string, mode os.FileMode) error {
	fi, err := os.Lstat(name)
	if err != nil {
		return err
	}
	if fi.Mode()&os.ModeSymlink != 0 {
		return &os.PathError{Op: "chmod", Path: name, Err: syscall.ELOOP}
	}
	return os.Chmod(name, mode)
}
