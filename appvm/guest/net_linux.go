package guest

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"time"

	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"

	"vmhost/appvm/guest/proto"
)

// applyNetwork brings the loopback up and configures the guest interface:
// static over rtnetlink, or through the agent's DHCP client, whose lease it
// returns; renewed leases go to report. Mode none has no interface.
func applyNetwork(ctx context.Context, n proto.Network, hostname string, report func(*proto.Lease)) (*proto.Lease, error) {
	if err := linkUp("lo"); err != nil {
		return nil, err
	}
	if n.Mode == proto.NetworkNone {
		return nil, nil
	}
	ifi, err := guestInterface(n.Interface)
	if err != nil {
		return nil, err
	}
	if err := linkUp(ifi.Name); err != nil {
		return nil, err
	}
	switch n.Mode {
	case proto.NetworkStatic:
		ip, err := netip.ParseAddr(n.IP)
		if err != nil {
			return nil, fmt.Errorf("parsing ip %q: %w", n.IP, err)
		}
		var gw netip.Addr
		if n.Gateway != "" {
			if gw, err = netip.ParseAddr(n.Gateway); err != nil {
				return nil, fmt.Errorf("parsing gateway %q: %w", n.Gateway, err)
			}
		}
		return nil, addAddrAndRoute(ifi.Index, netip.PrefixFrom(ip, n.Prefix), gw)
	case proto.NetworkDHCP:
		return dhcpLease(ctx, ifi, hostname, report)
	}
	return nil, nil
}

// guestInterface returns the named interface, or the first that is not a
// loopback.
func guestInterface(name string) (*net.Interface, error) {
	if name != "" {
		ifi, err := net.InterfaceByName(name)
		if err != nil {
			return nil, fmt.Errorf("finding interface %q: %w", name, err)
		}
		return ifi, nil
	}
	ifs, err := net.Interfaces()
	if err != nil {
		return nil, fmt.Errorf("listing interfaces: %w", err)
	}
	for i := range ifs {
		if ifs[i].Flags&net.FlagLoopback == 0 {
			return &ifs[i], nil
		}
	}
	return nil, errors.New("no network interface besides loopback")
}

// waitForInterface waits for the named interface, or any besides loopback,
// which the kernel adds once virtio_net has probed the NIC.
func waitForInterface(name string, timeout time.Duration) error {
	ok := waitFor(timeout, func() bool {
		_, err := guestInterface(name)
		return err == nil
	})
	if ok {
		return nil
	}
	what := "no network interface besides loopback appeared"
	if name != "" {
		what = "network interface " + name + " did not appear"
	}
	return fmt.Errorf("%s in %s (is virtio_net built in or listed in appvm_modules?)", what, timeout)
}

// rtnl dials rtnetlink with extended acks, best effort.
func rtnl() (*netlink.Conn, error) {
	c, err := netlink.Dial(unix.NETLINK_ROUTE, nil)
	if err != nil {
		return nil, fmt.Errorf("dialing rtnetlink: %w", err)
	}
	c.SetOption(netlink.ExtendedAcknowledge, true)
	return c, nil
}

// linkUp sets IFF_UP on the named link.
func linkUp(name string) error {
	ifi, err := net.InterfaceByName(name)
	if err != nil {
		return fmt.Errorf("finding interface %q: %w", name, err)
	}
	c, err := rtnl()
	if err != nil {
		return err
	}
	defer c.Close()
	// struct ifinfomsg: family, pad, type, index, flags, change.
	b := make([]byte, unix.SizeofIfInfomsg)
	b[0] = unix.AF_UNSPEC
	binary.NativeEndian.PutUint32(b[4:], uint32(ifi.Index))
	binary.NativeEndian.PutUint32(b[8:], unix.IFF_UP)
	binary.NativeEndian.PutUint32(b[12:], unix.IFF_UP)
	_, err = c.Execute(netlink.Message{
		Header: netlink.Header{Type: unix.RTM_NEWLINK, Flags: netlink.Request | netlink.Acknowledge},
		Data:   b,
	})
	if err != nil {
		return fmt.Errorf("setting %s up: %w", name, err)
	}
	return nil
}

// addAddrAndRoute adds addr to the interface and, when gw is valid, a
// default route through it. Existing entries count as done.
func addAddrAndRoute(index int, addr netip.Prefix, gw netip.Addr) error {
	c, err := rtnl()
	if err != nil {
		return err
	}
	defer c.Close()
	ae := netlink.NewAttributeEncoder()
	ip4 := addr.Addr().As4()
	ae.Bytes(unix.IFA_LOCAL, ip4[:])
	ae.Bytes(unix.IFA_ADDRESS, ip4[:])
	if addr.Bits() < 31 {
		bcast := broadcast(addr)
		ae.Bytes(unix.IFA_BROADCAST, bcast[:])
	}
	attrs, err := ae.Encode()
	if err != nil {
		return err
	}
	// struct ifaddrmsg: family, prefixlen, flags, scope, index.
	hdr := make([]byte, unix.SizeofIfAddrmsg)
	hdr[0] = unix.AF_INET
	hdr[1] = byte(addr.Bits())
	hdr[3] = unix.RT_SCOPE_UNIVERSE
	binary.NativeEndian.PutUint32(hdr[4:], uint32(index))
	_, err = c.Execute(netlink.Message{
		Header: netlink.Header{Type: unix.RTM_NEWADDR, Flags: netlink.Request | netlink.Acknowledge | netlink.Create | netlink.Excl},
		Data:   append(hdr, attrs...),
	})
	if err != nil && !errors.Is(err, unix.EEXIST) {
		return fmt.Errorf("adding address %v: %w", addr, err)
	}
	if !gw.IsValid() {
		return nil
	}
	ae = netlink.NewAttributeEncoder()
	g4 := gw.As4()
	ae.Bytes(unix.RTA_GATEWAY, g4[:])
	ae.Uint32(unix.RTA_OIF, uint32(index))
	attrs, err = ae.Encode()
	if err != nil {
		return err
	}
	// struct rtmsg: family, dst_len, src_len, tos, table, protocol, scope, type, flags.
	rt := make([]byte, unix.SizeofRtMsg)
	rt[0] = unix.AF_INET
	rt[4] = unix.RT_TABLE_MAIN
	rt[5] = unix.RTPROT_BOOT
	rt[6] = unix.RT_SCOPE_UNIVERSE
	rt[7] = unix.RTN_UNICAST
	_, err = c.Execute(netlink.Message{
		Header: netlink.Header{Type: unix.RTM_NEWROUTE, Flags: netlink.Request | netlink.Acknowledge | netlink.Create | netlink.Excl},
		Data:   append(rt, attrs...),
	})
	if err != nil && !errors.Is(err, unix.EEXIST) {
		return fmt.Errorf("adding default route via %v: %w", gw, err)
	}
	return nil
}

// broadcast returns the broadcast address of an IPv4 prefix.
func broadcast(p netip.Prefix) [4]byte {
	a := p.Addr().As4()
	v := binary.BigEndian.Uint32(a[:]) | (1<<(32-p.Bits()) - 1)
	var out [4]byte
	binary.BigEndian.PutUint32(out[:], v)
	return out
}
