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

// sendOnTap transmits frame on the tap ifi to the guest whose MAC is guestMAC: an AF_PACKET
// send on the tap device, which the kernel carries to the guest end.
func sendOnTap(ifi *net.Interface, guestMAC net.HardwareAddr, frame []byte) error {
	const ethPIP = 0x0800
	proto := ethPIP<<8&0xff00 | ethPIP>>8 // network byte order
	fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("opening a packet socket: %w", err)
	}
	defer unix.Close(fd)
	to := &unix.SockaddrLinklayer{Protocol: uint16(proto), Ifindex: ifi.Index, Halen: 6}
	copy(to.Addr[:], guestMAC)
	if err := unix.Sendto(fd, frame, 0, to); err != nil {
		return fmt.Errorf("sending on tap %q: %w", ifi.Name, err)
	}
	return nil
}
