package guest

import (
	"errors"
	"net"

	"vmhost/appvm/guest/proto"
)

func dhcpLease(ifi *net.Interface, hostname string) (*proto.Lease, error) {
	return nil, errors.New("dhcp: not available yet")
}
