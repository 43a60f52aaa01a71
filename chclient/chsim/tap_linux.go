package chsim

import (
	"fmt"
	"net"
	"os"

	"golang.org/x/sys/unix"
)

// attachTap opens an existing tap the way CH does (TUNSETIFF with IFF_TAP|IFF_NO_PI|
// IFF_VNET_HDR, plus IFF_MULTI_QUEUE for more than one queue pair). Unlike CH running as
// root, it never creates a tap that does not exist: a missing tap fails the boot, so tap
// wiring mistakes show up in tests.
func attachTap(name string, multiQueue bool) (*os.File, error) {
	if _, err := net.InterfaceByName(name); err != nil {
		return nil, fmt.Errorf("Unable to configure tap interface %s: No such device (os error 19)", name)
	}
	fd, err := unix.Open("/dev/net/tun", unix.O_RDWR|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("Couldn't open /dev/net/tun: %w", err)
	}
	ifr, err := unix.NewIfreq(name)
	if err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("Invalid interface name %s: %w", name, err)
	}
	flags := uint16(unix.IFF_TAP | unix.IFF_NO_PI | unix.IFF_VNET_HDR)
	if multiQueue {
		flags |= unix.IFF_MULTI_QUEUE
	}
	ifr.SetUint16(flags)
	if err := unix.IoctlIfreq(fd, unix.TUNSETIFF, ifr); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("Unable to configure tap interface %s: %w", name, err)
	}
	return os.NewFile(uintptr(fd), "tap:"+name), nil
}
