package tap

import (
	"bytes"
	"encoding/binary"
	"errors"
	"net"
	"net/netip"
	"testing"
	"time"
)

// dhcpReply builds a BOOTP reply for chaddr with the given message type and
// yiaddr, plus mask, router, server id and lease options.
func dhcpReply(msgType byte, chaddr net.HardwareAddr, yiaddr netip.Addr) []byte {
	b := make([]byte, dhcpMinLen)
	b[0], b[1], b[2] = bootpReply, 1, byte(len(chaddr))
	binary.BigEndian.PutUint32(b[4:8], 0x1234abcd)
	y := yiaddr.As4()
	copy(b[16:20], y[:])
	copy(b[28:44], chaddr)
	copy(b[bootpFixed:], dhcpMagic)
	b = append(b, optMsgType, 1, msgType)
	b = append(b, optServerID, 4, 10, 0, 0, 1)
	b = append(b, optLease, 4, 0, 0, 0x0e, 0x10) // 3600 s
	b = append(b, optMask, 4, 255, 255, 255, 0)
	b = append(b, optRouter, 4, 10, 0, 0, 1)
	return append(b, optEnd)
}

// udpFrame wraps payload in Ethernet, IPv4 and UDP headers.
func udpFrame(dst, src net.HardwareAddr, srcIP, dstIP netip.Addr, sport, dport uint16, payload []byte) []byte {
	udp := make([]byte, 8, 8+len(payload))
	binary.BigEndian.PutUint16(udp[0:2], sport)
	binary.BigEndian.PutUint16(udp[2:4], dport)
	binary.BigEndian.PutUint16(udp[4:6], uint16(8+len(payload)))
	udp = append(udp, payload...)
	ip := ipv4Header(srcIP, dstIP, 17, len(udp))
	return rawFrame(dst, src, 0x0800, append(ip, udp...))
}

func ipv4Header(src, dst netip.Addr, proto byte, payloadLen int) []byte {
	h := make([]byte, 20)
	h[0] = 0x45
	binary.BigEndian.PutUint16(h[2:4], uint16(20+payloadLen))
	h[8], h[9] = 64, proto
	s, d := src.As4(), dst.As4()
	copy(h[12:16], s[:])
	copy(h[16:20], d[:])
	var sum uint32
	for i := 0; i < 20; i += 2 {
		sum += uint32(binary.BigEndian.Uint16(h[i : i+2]))
	}
	for sum > 0xffff {
		sum = sum&0xffff + sum>>16
	}
	binary.BigEndian.PutUint16(h[10:12], ^uint16(sum))
	return h
}

var (
	guestMAC = mustMAC("02:00:00:00:00:0a")
	otherMAC = mustMAC("02:00:00:00:00:0b")
	serverIP = netip.MustParseAddr("10.0.0.1")
	bcastIP  = netip.MustParseAddr("255.255.255.255")
)

func TestAckBinding(t *testing.T) {
	yi := netip.MustParseAddr("10.0.0.50")
	ack := dhcpReply(dhcpACK, guestMAC, yi)

	got, err := ackBinding(ack, guestMAC)
	if err != nil {
		t.Fatalf("ackBinding(ACK) = %v", err)
	}
	want := Binding{MAC: guestMAC, IP: yi, Prefix: netip.MustParsePrefix("10.0.0.50/24"),
		Router: serverIP, Server: serverIP, Lease: time.Hour}
	if got.IP != want.IP || got.Prefix != want.Prefix || got.Router != want.Router || got.Server != want.Server ||
		got.Lease != want.Lease || !bytes.Equal(got.MAC, want.MAC) {
		t.Errorf("ackBinding(ACK) = %+v, want %+v", got, want)
	}

	// Options moved into the file field by option overload are read too.
	over := make([]byte, dhcpMinLen)
	copy(over, ack[:dhcpMinLen])
	over = append(over, optOverload, 1, 1, optEnd)
	copy(over[108:], []byte{optMsgType, 1, dhcpACK, optEnd})
	if b, err := ackBinding(over, guestMAC); err != nil || b.IP != yi {
		t.Errorf("ackBinding(overloaded ACK) = %+v, %v, want %v", b, err, yi)
	}

	infinite := bytes.Replace(bytes.Clone(ack), []byte{optLease, 4, 0, 0, 0x0e, 0x10}, []byte{optLease, 4, 0xff, 0xff, 0xff, 0xff}, 1)
	if b, err := ackBinding(infinite, guestMAC); err != nil || b.Lease != -1 {
		t.Errorf("ackBinding(infinite lease) = %+v, %v, want lease -1", b, err)
	}

	bad := []struct {
		name string
		msg  []byte
	}{
		{"offer", dhcpReply(dhcpOffer, guestMAC, yi)},
		{"other mac", dhcpReply(dhcpACK, otherMAC, yi)},
		{"no address (inform ack)", dhcpReply(dhcpACK, guestMAC, netip.IPv4Unspecified())},
		{"request, not reply", func() []byte { b := bytes.Clone(ack); b[0] = 1; return b }()},
		{"truncated header", ack[:100]},
		{"no cookie", func() []byte { b := bytes.Clone(ack); b[bootpFixed] = 0; return b }()},
		{"option overruns", append(bytes.Clone(ack[:dhcpMinLen]), optMsgType, 9, dhcpACK)},
		{"option without length", append(bytes.Clone(ack[:dhcpMinLen]), optMsgType)},
		{"no message type", append(bytes.Clone(ack[:dhcpMinLen]), optEnd)},
		{"hlen too big", func() []byte { b := bytes.Clone(ack); b[2] = 17; return b }()},
		{"bad overload", append(bytes.Clone(ack[:dhcpMinLen]), optOverload, 1, 9, optEnd)},
		{"empty", nil},
	}
	for _, tt := range bad {
		if b, err := ackBinding(tt.msg, guestMAC); !errors.Is(err, errNotDHCP) {
			t.Errorf("ackBinding(%s) = %+v, %v, want errNotDHCP", tt.name, b, err)
		}
	}
}

func TestDHCPPayload(t *testing.T) {
	msg := dhcpReply(dhcpACK, guestMAC, netip.MustParseAddr("10.0.0.50"))
	good := udpFrame(guestMAC, otherMAC, serverIP, bcastIP, 67, 68, msg)
	if p, err := dhcpPayload(good); err != nil || !bytes.Equal(p, msg) {
		t.Fatalf("dhcpPayload(good) = %d bytes, %v", len(p), err)
	}
	tagged := append(append(bytes.Clone(good[:12]), 0x81, 0x00, 0x00, 0x2a), good[12:]...)
	if p, err := dhcpPayload(tagged); err != nil || !bytes.Equal(p, msg) {
		t.Errorf("dhcpPayload(802.1Q) = %d bytes, %v", len(p), err)
	}
	bad := map[string][]byte{
		"client to server": udpFrame(guestMAC, otherMAC, serverIP, bcastIP, 68, 67, msg),
		"tcp":              func() []byte { f := bytes.Clone(good); f[14+9] = 6; return f }(),
		"fragment":         func() []byte { f := bytes.Clone(good); f[14+6] = 0x20; return f }(),
		"ipv6 ethertype":   func() []byte { f := bytes.Clone(good); f[12], f[13] = 0x86, 0xdd; return f }(),
		"ip total too big": func() []byte { f := bytes.Clone(good); f[14+2] = 0xff; return f }(),
		"udp len too big":  func() []byte { f := bytes.Clone(good); f[14+20+4] = 0xff; return f }(),
		"short":            good[:20],
	}
	for name, f := range bad {
		if _, err := dhcpPayload(f); !errors.Is(err, errNotDHCP) {
			t.Errorf("dhcpPayload(%s) = %v, want errNotDHCP", name, err)
		}
	}
}

// FuzzParseDHCP checks that no input panics the parser and that whatever it
// accepts survives a round trip through a re-encoding.
func FuzzParseDHCP(f *testing.F) {
	f.Add(dhcpReply(dhcpACK, guestMAC, netip.MustParseAddr("10.0.0.50")))
	f.Add(dhcpReply(dhcpOffer, otherMAC, netip.MustParseAddr("192.168.1.9")))
	f.Add(append(make([]byte, bootpFixed), 99, 130, 83, 99, optOverload, 1, 3, optEnd))
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := parseDHCP(b)
		if err != nil {
			if !errors.Is(err, errNotDHCP) {
				t.Fatalf("parseDHCP error %v does not wrap errNotDHCP", err)
			}
			return
		}
		// Re-encode what was understood, options in plain form.
		enc := make([]byte, dhcpMinLen)
		enc[0], enc[1], enc[2] = m.Op, m.HType, m.HLen
		binary.BigEndian.PutUint32(enc[4:8], m.XID)
		y := m.YIAddr.As4()
		copy(enc[16:20], y[:])
		copy(enc[28:44], m.CHAddr)
		copy(enc[bootpFixed:], dhcpMagic)
		for code, v := range m.Options {
			if code == optOverload {
				continue
			}
			for len(v) > 255 {
				enc = append(enc, code, 255)
				enc = append(enc, v[:255]...)
				v = v[255:]
			}
			enc = append(append(enc, code, byte(len(v))), v...)
		}
		enc = append(enc, optEnd)
		m2, err := parseDHCP(enc)
		if err != nil {
			t.Fatalf("re-encoded message does not parse: %v", err)
		}
		if m2.Op != m.Op || m2.XID != m.XID || m2.YIAddr != m.YIAddr || !bytes.Equal(m2.CHAddr, m.CHAddr) {
			t.Fatalf("round trip changed the header: %+v, then %+v", m, m2)
		}
		for code, v := range m.Options {
			if code != optOverload && !bytes.Equal(m2.Options[code], v) {
				t.Fatalf("round trip changed option %d: %x, then %x", code, v, m2.Options[code])
			}
		}
		// ackBinding must not panic on anything the parser accepts.
		_, _ = ackBinding(b, m.CHAddr)
	})
}

func mustMAC(s string) net.HardwareAddr {
	m, err := net.ParseMAC(s)
	if err != nil {
		panic(err)
	}
	return m
}

// rawFrame builds an Ethernet frame with an arbitrary ethertype and payload.
func rawFrame(dst, src net.HardwareAddr, etherType uint16, payload []byte) []byte {
	f := make([]byte, 14, 14+len(payload))
	copy(f[0:6], dst)
	copy(f[6:12], src)
	f[12], f[13] = byte(etherType>>8), byte(etherType)
	return append(f, payload...)
}
