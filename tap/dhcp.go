package tap

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"time"
)

// Binding is what a DHCPACK tells about the address a server gave a MAC.
type Binding struct {
	MAC    net.HardwareAddr
	IP     netip.Addr   // yiaddr
	Prefix netip.Prefix // IP with the subnet mask (option 1); invalid when absent
	Router netip.Addr   // first router (option 3); invalid when absent
	Server netip.Addr   // server identifier (option 54); invalid when absent
	// Lease is the lease time (option 51); zero when absent, and -1 for an
	// infinite lease.
	Lease time.Duration
}

// DHCP message types (option 53) and option codes this package reads.
const (
	dhcpOffer = 2
	dhcpACK   = 5

	optPad      = 0
	optMask     = 1
	optRouter   = 3
	optLease    = 51
	optOverload = 52
	optMsgType  = 53
	optServerID = 54
	optEnd      = 255

	bootpReply   = 2
	bootpFixed   = 236 // fixed BOOTP header before the magic cookie
	dhcpMinLen   = bootpFixed + 4
	dhcpServerPt = 67
	dhcpClientPt = 68
)

var dhcpMagic = []byte{99, 130, 83, 99}

// errNotDHCP is returned for frames and messages that are not a DHCP reply
// the snooper can use.
var errNotDHCP = errors.New("not a usable dhcp reply")

// dhcpMessage is the part of a DHCP message this package reads.
type dhcpMessage struct {
	Op      byte
	HType   byte
	HLen    byte
	XID     uint32
	YIAddr  netip.Addr
	CHAddr  net.HardwareAddr // hlen bytes of chaddr
	Options map[byte][]byte  // RFC 3396: repeated codes are concatenated
}

// parseDHCP decodes a DHCP message (the UDP payload).
func parseDHCP(b []byte) (dhcpMessage, error) {
	var m dhcpMessage
	if len(b) < dhcpMinLen {
		return m, fmt.Errorf("%w: %d bytes, shorter than the %d-byte header", errNotDHCP, len(b), dhcpMinLen)
	}
	if !bytes.Equal(b[bootpFixed:dhcpMinLen], dhcpMagic) {
		return m, fmt.Errorf("%w: no magic cookie", errNotDHCP)
	}
	m.Op, m.HType, m.HLen = b[0], b[1], b[2]
	if m.HLen > 16 {
		return m, fmt.Errorf("%w: hlen %d exceeds chaddr", errNotDHCP, m.HLen)
	}
	m.XID = binary.BigEndian.Uint32(b[4:8])
	m.YIAddr = netip.AddrFrom4([4]byte(b[16:20]))
	m.CHAddr = net.HardwareAddr(bytes.Clone(b[28 : 28+int(m.HLen)]))
	m.Options = map[byte][]byte{}
	if err := parseOptions(b[dhcpMinLen:], m.Options); err != nil {
		return m, err
	}
	if ov, ok := m.Options[optOverload]; ok {
		if len(ov) != 1 || ov[0] < 1 || ov[0] > 3 {
			return m, fmt.Errorf("%w: bad option overload %v", errNotDHCP, ov)
		}
		// RFC 2131 4.1: the file field is read before sname.
		if ov[0]&1 != 0 {
			if err := parseOptions(b[108:236], m.Options); err != nil {
				return m, err
			}
		}
		if ov[0]&2 != 0 {
			if err := parseOptions(b[44:108], m.Options); err != nil {
				return m, err
			}
		}
	}
	return m, nil
}

func parseOptions(b []byte, into map[byte][]byte) error {
	for i := 0; i < len(b); {
		code := b[i]
		switch code {
		case optPad:
			i++
			continue
		case optEnd:
			return nil
		}
		if i+1 >= len(b) {
			return fmt.Errorf("%w: option %d has no length", errNotDHCP, code)
		}
		n := int(b[i+1])
		if i+2+n > len(b) {
			return fmt.Errorf("%w: option %d overruns the message", errNotDHCP, code)
		}
		into[code] = append(into[code], b[i+2:i+2+n]...)
		i += 2 + n
	}
	// A message without the end option is tolerated, as clients do.
	return nil
}

// ackBinding returns the binding a DHCP message gives mac, or an error
// wrapping errNotDHCP when the message is not a DHCPACK for mac with an
// address.
func ackBinding(payload []byte, mac net.HardwareAddr) (Binding, error) {
	m, err := parseDHCP(payload)
	if err != nil {
		return Binding{}, err
	}
	if m.Op != bootpReply {
		return Binding{}, fmt.Errorf("%w: op %d is not a reply", errNotDHCP, m.Op)
	}
	if t := m.Options[optMsgType]; len(t) != 1 || t[0] != dhcpACK {
		return Binding{}, fmt.Errorf("%w: message type %v is not DHCPACK", errNotDHCP, t)
	}
	if !bytes.Equal(m.CHAddr, mac) {
		return Binding{}, fmt.Errorf("%w: for %v, not %v", errNotDHCP, m.CHAddr, mac)
	}
	ip := m.YIAddr
	if ip.IsUnspecified() || ip == netip.AddrFrom4([4]byte{255, 255, 255, 255}) || ip.IsMulticast() {
		// A DHCPACK to a DHCPINFORM carries no address.
		return Binding{}, fmt.Errorf("%w: yiaddr %v", errNotDHCP, ip)
	}
	bnd := Binding{MAC: bytes.Clone(mac), IP: ip}
	if mask := m.Options[optMask]; len(mask) == 4 {
		ones, bits := net.IPMask(mask).Size()
		if bits == 32 {
			bnd.Prefix = netip.PrefixFrom(ip, ones)
		}
	}
	if r := m.Options[optRouter]; len(r) >= 4 {
		bnd.Router = netip.AddrFrom4([4]byte(r[:4]))
	}
	if s := m.Options[optServerID]; len(s) == 4 {
		bnd.Server = netip.AddrFrom4([4]byte(s))
	}
	if l := m.Options[optLease]; len(l) == 4 {
		secs := binary.BigEndian.Uint32(l)
		if secs == 0xffffffff {
			bnd.Lease = -1
		} else {
			bnd.Lease = time.Duration(secs) * time.Second
		}
	}
	return bnd, nil
}

// dhcpPayload returns the DHCP message in an Ethernet frame carrying
// IPv4/UDP from port 67 to port 68, or an error wrapping errNotDHCP.
func dhcpPayload(frame []byte) ([]byte, error) {
	if len(frame) < 14 {
		return nil, fmt.Errorf("%w: short frame", errNotDHCP)
	}
	etherType := binary.BigEndian.Uint16(frame[12:14])
	ip := frame[14:]
	if etherType == 0x8100 && len(frame) >= 18 { // one 802.1Q tag
		etherType = binary.BigEndian.Uint16(frame[16:18])
		ip = frame[18:]
	}
	if etherType != 0x0800 {
		return nil, fmt.Errorf("%w: ethertype %#04x", errNotDHCP, etherType)
	}
	if len(ip) < 20 || ip[0]>>4 != 4 {
		return nil, fmt.Errorf("%w: not an ipv4 header", errNotDHCP)
	}
	ihl := int(ip[0]&0x0f) * 4
	total := int(binary.BigEndian.Uint16(ip[2:4]))
	if ihl < 20 || total < ihl || total > len(ip) {
		return nil, fmt.Errorf("%w: bad ipv4 lengths", errNotDHCP)
	}
	if ip[9] != 17 {
		return nil, fmt.Errorf("%w: ip protocol %d", errNotDHCP, ip[9])
	}
	if binary.BigEndian.Uint16(ip[6:8])&0x3fff != 0 { // MF or an offset
		return nil, fmt.Errorf("%w: fragment", errNotDHCP)
	}
	udp := ip[ihl:total]
	if len(udp) < 8 {
		return nil, fmt.Errorf("%w: short udp header", errNotDHCP)
	}
	sport, dport := binary.BigEndian.Uint16(udp[0:2]), binary.BigEndian.Uint16(udp[2:4])
	if sport != dhcpServerPt || dport != dhcpClientPt {
		return nil, fmt.Errorf("%w: udp ports %d->%d", errNotDHCP, sport, dport)
	}
	ulen := int(binary.BigEndian.Uint16(udp[4:6]))
	if ulen < 8 || ulen > len(udp) {
		return nil, fmt.Errorf("%w: bad udp length", errNotDHCP)
	}
	return udp[8:ulen], nil
}
