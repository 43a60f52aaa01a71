//go:build !linux

package chsim

import (
	"fmt"
	"net"
	"os"
)

func attachTap(name string, multiQueue bool) (*os.File, error) {
	return nil, fmt.Errorf("Unable to configure tap interface %s: %w", name, errNotLinux)
}

func sendOnTap(ifi *net.Interface, guestMAC net.HardwareAddr, frame []byte) error {
	return fmt.Errorf("sending on tap %q: %w", ifi.Name, errNotLinux)
}
