package chsim

import (
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
)

// dhcpAckRequest is the body of PUT /sim/v1/dhcp-ack.
type dhcpAckRequest struct {
	Net       string `json:"net"`        // net device id; empty means the first net with a tap
	IP        string `json:"ip"`         // yiaddr, the address leased to the guest
	Server    string `json:"server"`     // the DHCP server's address (option 54, IP source)
	ServerMAC string `json:"server_mac"` // Ethernet source; default 02:00:00:00:00:fe
	Mask      string `json:"mask"`       // option 1; default 255.255.255.0
	Router    string `json:"router"`     // option 3; omitted when empty
	Lease     uint32 `json:"lease"`      // option 51 in seconds; default 3600
}

// dhcpAck sends a DHCP ACK for the guest's MAC out of the VM's tap, toward
// the guest, as a DHCP server behind the bridge would: the kernel transmits
// it on the tap (an AF_PACKET send on the tap device), so host-side DHCP
// snooping, which watches the frames a tap carries to its guest, sees it on
// a real interface, and the guest end of the tap receives it.
func (s *sim) dhcpAck(req dhcpAckRequest) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.state != stateRunning {
		return errors.New("the VM is not running")
	}
	var mac, tap string
	for _, n := range s.vm.Net {
		if n.Tap == nil {
			continue
		}
		if req.Net == "" || deref(n.ID) == req.Net {
			mac, tap = n.Mac, *n.Tap
			break
		}
	}
	if tap == "" {
		return fmt.Errorf("no net device %q with a tap", req.Net)
	}
	return sendDHCPAck(tap, mac, req)
}

// SendDHCPAck sends on tap a DHCP ACK leasing ip to the guest whose MAC is
// guestMAC, from the DHCP server at server, as PUT /sim/v1/dhcp-ack does
// (defaults for the rest). It needs CAP_NET_RAW in the tap's network
// namespace, which a confined simulator lacks: a test running as root
// calls it there itself.
func SendDHCPAck(tap, guestMAC, ip, server string) error {
	return sendDHCPAck(tap, guestMAC, dhcpAckRequest{IP: ip, Server: server})
}

func sendDHCPAck(tap, mac string, req dhcpAckRequest) error {
	frame, err := buildDHCPAck(req, mac)
	if err != nil {
		return err
	}
	ifi, err := net.InterfaceByName(tap)
	if err != nil {
		return fmt.Errorf("finding tap %q: %w", tap, err)
	}
	hw, err := net.ParseMAC(mac)
	if err != nil {
		return fmt.Errorf("guest MAC %q: %w", mac, err)
	}
	return sendOnTap(ifi, hw, frame)
}

func buildDHCPAck(req dhcpAckRequest, guestMAC string) ([]byte, error) {
	parse4 := func(field, v, def string) (netip.Addr, error) {
		if v == "" {
			v = def
		}
		a, err := netip.ParseAddr(v)
		if err != nil || !a.Is4() {
			return netip.Addr{}, fmt.Errorf("%s: %q is not an IPv4 address", field, v)
		}
		return a, nil
	}
	yi, err := parse4("ip", req.IP, "")
	if err != nil {
		return nil, err
	}
	server, err := parse4("server", req.Server, "")
	if err != nil {
		return nil, err
	}
	mask, err := parse4("mask", req.Mask, "255.255.255.0")
	if err != nil {
		return nil, err
	}
	chaddr, err := net.ParseMAC(guestMAC)
	if err != nil {
		return nil, fmt.Errorf("guest mac %q: %w", guestMAC, err)
	}
	smacText := req.ServerMAC
	if smacText == "" {
		smacText = "02:00:00:00:00:fe"
	}
	smac, err := net.ParseMAC(smacText)
	if err != nil {
		return nil, fmt.Errorf("server_mac: %w", err)
	}
	lease := req.Lease
	if lease == 0 {
		lease = 3600
	}

	// BOOTP (RFC 2131 §2) with options (RFC 2132).
	bootp := make([]byte, 240)
	bootp[0], bootp[1], bootp[2] = 2, 1, 6 // BOOTREPLY, Ethernet, hlen 6
	rand.Read(bootp[4:8])                  // xid
	copy(bootp[16:20], yi.AsSlice())
	copy(bootp[20:24], server.AsSlice())
	copy(bootp[28:34], chaddr)
	copy(bootp[236:240], []byte{99, 130, 83, 99})
	opt := func(code byte, data ...byte) { bootp = append(append(bootp, code, byte(len(data))), data...) }
	opt(53, 5) // DHCPACK
	opt(54, server.AsSlice()...)
	var l [4]byte
	binary.BigEndian.PutUint32(l[:], lease)
	opt(51, l[:]...)
	opt(1, mask.AsSlice()...)
	if req.Router != "" {
		r, err := parse4("router", req.Router, "")
		if err != nil {
			return nil, err
		}
		opt(3, r.AsSlice()...)
	}
	bootp = append(bootp, 255)

	udp := make([]byte, 8, 8+len(bootp))
	binary.BigEndian.PutUint16(udp[0:], 67)
	binary.BigEndian.PutUint16(udp[2:], 68)
	binary.BigEndian.PutUint16(udp[4:], uint16(8+len(bootp)))
	udp = append(udp, bootp...) // checksum 0: none, allowed over IPv4

	ip := make([]byte, 20, 20+len(udp))
	ip[0] = 0x45
	binary.BigEndian.PutUint16(ip[2:], uint16(20+len(udp)))
	ip[8], ip[9] = 64, 17 // TTL, UDP
	copy(ip[12:16], server.AsSlice())
	copy(ip[16:20], yi.AsSlice())
	binary.BigEndian.PutUint16(ip[10:], ipChecksum(ip))
	ip = append(ip, udp...)

	eth := make([]byte, 14, 14+len(ip))
	copy(eth[0:6], chaddr)
	copy(eth[6:12], smac)
	binary.BigEndian.PutUint16(eth[12:], 0x0800)
	return append(eth, ip...), nil
}

func ipChecksum(h []byte) uint16 {
	var sum uint32
	for i := 0; i+1 < len(h); i += 2 {
		sum += uint32(binary.BigEndian.Uint16(h[i:]))
	}
	for sum>>16 != 0 {
		sum = sum&0xffff + sum>>16
	}
	return ^uint16(sum)
}
