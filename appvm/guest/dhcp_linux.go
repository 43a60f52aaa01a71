package guest

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"vmhost/appvm/guest/proto"
)

// DHCP message types (option 53).
const (
	dhcpDiscover = 1
	dhcpOffer    = 2
	dhcpRequest  = 3
	dhcpAck      = 5
	dhcpNak      = 6
)

// DHCP option codes used by the client.
const (
	optSubnetMask   = 1
	optRouter       = 3
	optDNS          = 6
	optHostname     = 12
	optDomain       = 15
	optRequestedIP  = 50
	optLeaseTime    = 51
	optMessageType  = 53
	optServerID     = 54
	optParamList    = 55
	optMaxSize      = 57
	optClientID     = 61
	optDomainSearch = 119
	optEnd          = 255
	optPad          = 0
)

// dhcpCookie is the magic cookie that opens the options (RFC 2131 §3).
var dhcpCookie = []byte{99, 130, 83, 99}

// dhcpTimeout bounds the whole initial exchange.
const dhcpTimeout = 60 * time.Second

// dhcpClient is a minimal RFC 2131 client: DISCOVER, OFFER, REQUEST, ACK
// over a UDP socket bound to port 68 on one interface (SO_BINDTODEVICE), with
// the broadcast flag set so servers answer before the interface has an
// address.
type dhcpClient struct {
	ifi      *net.Interface
	hostname string
	conn     net.PacketConn
	xid      uint32
	// attempt is the wait for one answer; it doubles up to 8 s.
	attempt time.Duration
}

// dhcpReply is a parsed OFFER, ACK or NAK.
type dhcpReply struct {
	msgType  byte
	yiaddr   netip.Addr
	serverID netip.Addr
	lease    proto.Lease
}

// dhcpLease obtains a lease on ifi, configures the address and default
// route, and, for a finite lease, keeps renewing it in the background,
// calling report with each renewed lease. The wait for the lease ends
// after dhcpTimeout, or at once when ctx ends (a Stop).
func dhcpLease(ctx context.Context, ifi *net.Interface, hostname string, report func(*proto.Lease)) (*proto.Lease, error) {
	c, err := newDHCPClient(ifi, hostname)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(ctx, dhcpTimeout)
	defer cancel()
	// A read waiting for an answer returns when ctx ends.
	defer context.AfterFunc(ctx, func() { c.conn.SetReadDeadline(time.Now()) })()
	r, err := c.obtain(ctx)
	if err != nil {
		c.conn.Close()
		return nil, err
	}
	if err := c.apply(r); err != nil {
		c.conn.Close()
		return nil, err
	}
	if r.lease.LeaseSecs > 0 && report != nil {
		go c.renewLoop(r, report)
	} else {
		c.conn.Close()
	}
	l := r.lease
	return &l, nil
}

func newDHCPClient(ifi *net.Interface, hostname string) (*dhcpClient, error) {
	lc := net.ListenConfig{Control: func(_, _ string, rc syscall.RawConn) error {
		var serr error
		err := rc.Control(func(fd uintptr) {
			if serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_REUSEADDR, 1); serr != nil {
				return
			}
			if serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_BROADCAST, 1); serr != nil {
				return
			}
			serr = unix.BindToDevice(int(fd), ifi.Name)
		})
		if err != nil {
			return err
		}
		return serr
	}}
	conn, err := lc.ListenPacket(context.Background(), "udp4", "0.0.0.0:68")
	if err != nil {
		return nil, fmt.Errorf("dhcp: opening port 68 on %s: %w", ifi.Name, err)
	}
	var x [4]byte
	rand.Read(x[:])
	return &dhcpClient{ifi: ifi, hostname: hostname, conn: conn, xid: binary.BigEndian.Uint32(x[:]), attempt: time.Second}, nil
}

// obtain runs DISCOVER/OFFER/REQUEST/ACK until an ACK or ctx ends; a NAK
// starts over.
func (c *dhcpClient) obtain(ctx context.Context) (*dhcpReply, error) {
	for {
		offer, err := c.exchange(ctx, c.message(dhcpDiscover, netip.Addr{}, netip.Addr{}, netip.Addr{}), dhcpOffer)
		if errors.Is(err, context.DeadlineExceeded) {
			// The workload does not start without its network: say why
			// (a network without a DHCP server, such as dev mode's bridge).
			return nil, fmt.Errorf("dhcp on %s: no DHCP server answered within %v: is one serving the network's bridge? (or give the AppVM a static ip)", c.ifi.Name, dhcpTimeout)
		}
		if err != nil {
			return nil, fmt.Errorf("dhcp on %s: waiting for an offer: %w", c.ifi.Name, err)
		}
		ack, err := c.exchange(ctx, c.message(dhcpRequest, netip.Addr{}, offer.yiaddr, offer.serverID), dhcpAck)
		if err != nil {
			return nil, fmt.Errorf("dhcp on %s: waiting for an ack: %w", c.ifi.Name, err)
		}
		if ack.msgType == dhcpAck {
			return ack, nil
		}
	}
}

// exchange broadcasts msg and waits for a reply of type want (or a NAK),
// resending with a doubling wait.
func (c *dhcpClient) exchange(ctx context.Context, msg []byte, want byte) (*dhcpReply, error) {
	wait := c.attempt
	dst := &net.UDPAddr{IP: net.IPv4bcast, Port: 67}
	buf := make([]byte, 1500)
	for {
		if _, err := c.conn.WriteTo(msg, dst); err != nil {
			return nil, err
		}
		deadline := time.Now().Add(wait)
		if d, ok := ctx.Deadline(); ok && d.Before(deadline) {
			deadline = d
		}
		c.conn.SetReadDeadline(deadline)
		if err := ctx.Err(); err != nil { // ended before the deadline was set
			return nil, err
		}
		for {
			n, _, err := c.conn.ReadFrom(buf)
			if err != nil {
				if ctx.Err() != nil {
					return nil, ctx.Err()
				}
				if errors.Is(err, syscall.EAGAIN) || isTimeout(err) {
					break
				}
				return nil, err
			}
			r, err := parseDHCP(buf[:n], c.xid, c.ifi.HardwareAddr)
			if err != nil {
				continue // not ours, or malformed
			}
			if r.msgType == want || (want == dhcpAck && r.msgType == dhcpNak) {
				return r, nil
			}
		}
		wait = min(2*wait, 8*time.Second)
	}
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

// message builds a BOOTREQUEST. ciaddr is set when renewing; requested and
// server select an offer.
func (c *dhcpClient) message(typ byte, ciaddr, requested, server netip.Addr) []byte {
	b := make([]byte, 240, 576)
	b[0] = 1 // BOOTREQUEST
	b[1] = 1 // Ethernet
	b[2] = 6
	binary.BigEndian.PutUint32(b[4:], c.xid)
	// Broadcast flag: answer to the broadcast address, as we may have no
	// address to receive unicast on.
	binary.BigEndian.PutUint16(b[10:], 0x8000)
	if ciaddr.IsValid() {
		a := ciaddr.As4()
		copy(b[12:16], a[:])
	}
	copy(b[28:], c.ifi.HardwareAddr)
	copy(b[236:], dhcpCookie)
	opt := func(code byte, data []byte) {
		b = append(b, code, byte(len(data)))
		b = append(b, data...)
	}
	opt(optMessageType, []byte{typ})
	opt(optClientID, append([]byte{1}, c.ifi.HardwareAddr...))
	if requested.IsValid() {
		a := requested.As4()
		opt(optRequestedIP, a[:])
	}
	if server.IsValid() {
		a := server.As4()
		opt(optServerID, a[:])
	}
	if c.hostname != "" && len(c.hostname) < 256 {
		opt(optHostname, []byte(c.hostname))
	}
	opt(optMaxSize, []byte{0x05, 0xdc})
	opt(optParamList, []byte{optSubnetMask, optRouter, optDNS, optHostname, optDomain, optLeaseTime, optDomainSearch})
	b = append(b, optEnd)
	for len(b) < 300 {
		// Some relays drop BOOTP messages shorter than 300 bytes.
		b = append(b, optPad)
	}
	return b
}

// parseDHCP parses a BOOTREPLY for our xid and hardware address.
func parseDHCP(b []byte, xid uint32, mac net.HardwareAddr) (*dhcpReply, error) {
	if len(b) < 240 || b[0] != 2 || binary.BigEndian.Uint32(b[4:]) != xid || string(b[236:240]) != string(dhcpCookie) {
		return nil, errors.New("not a reply to us")
	}
	if len(mac) > 0 && string(b[28:28+len(mac)]) != string(mac) {
		return nil, errors.New("not a reply to us")
	}
	opts := map[byte][]byte{}
	for i := 240; i < len(b); {
		code := b[i]
		if code == optPad {
			i++
			continue
		}
		if code == optEnd {
			break
		}
		if i+1 >= len(b) || i+2+int(b[i+1]) > len(b) {
			return nil, errors.New("truncated option")
		}
		// Options longer than 255 bytes come split (RFC 3396): concatenate.
		opts[code] = append(opts[code], b[i+2:i+2+int(b[i+1])]...)
		i += 2 + int(b[i+1])
	}
	r := &dhcpReply{}
	if t := opts[optMessageType]; len(t) == 1 {
		r.msgType = t[0]
	} else {
		return nil, errors.New("no message type")
	}
	r.yiaddr = netip.AddrFrom4([4]byte(b[16:20]))
	if s := opts[optServerID]; len(s) == 4 {
		r.serverID = netip.AddrFrom4([4]byte(s))
	}
	if r.msgType == dhcpNak {
		return r, nil
	}
	if !r.yiaddr.IsUnspecified() {
		r.lease.IP = r.yiaddr.String()
	} else {
		return nil, errors.New("no address offered")
	}
	r.lease.Prefix = 24
	if m := opts[optSubnetMask]; len(m) == 4 {
		ones, bits := net.IPMask(m).Size()
		if bits == 32 {
			r.lease.Prefix = ones
		}
	}
	if g := opts[optRouter]; len(g) >= 4 {
		r.lease.Gateway = netip.AddrFrom4([4]byte(g[:4])).String()
	}
	for d := opts[optDNS]; len(d) >= 4; d = d[4:] {
		r.lease.DNS = append(r.lease.DNS, netip.AddrFrom4([4]byte(d[:4])).String())
	}
	if h := opts[optHostname]; len(h) > 0 {
		r.lease.Hostname = strings.TrimRight(string(h), "\x00")
	}
	if l := opts[optLeaseTime]; len(l) == 4 {
		if v := binary.BigEndian.Uint32(l); v != 0xffffffff {
			r.lease.LeaseSecs = v
		}
	}
	if s := opts[optDomainSearch]; len(s) > 0 {
		r.lease.Search = decodeSearch(s)
	}
	if len(r.lease.Search) == 0 {
		if d := strings.TrimRight(string(opts[optDomain]), "\x00"); d != "" {
			r.lease.Search = []string{d}
		}
	}
	return r, nil
}

// decodeSearch decodes RFC 3397 domain search data: DNS wire-format names
// with compression pointers into the same data.
func decodeSearch(b []byte) []string {
	var out []string
	for i := 0; i < len(b); {
		name, next, ok := decodeName(b, i)
		if !ok {
			break
		}
		if name != "" {
			out = append(out, name)
		}
		i = next
	}
	return out
}

// decodeName reads one name at off and returns it and the offset after it.
func decodeName(b []byte, off int) (string, int, bool) {
	var labels []string
	next := -1
	for jumps := 0; ; {
		if off >= len(b) {
			return "", 0, false
		}
		l := int(b[off])
		switch {
		case l == 0:
			if next < 0 {
				next = off + 1
			}
			return strings.Join(labels, "."), next, true
		case l&0xc0 == 0xc0:
			if off+1 >= len(b) || jumps > 32 {
				return "", 0, false
			}
			if next < 0 {
				next = off + 2
			}
			off = (l&0x3f)<<8 | int(b[off+1])
			jumps++
		case l&0xc0 != 0:
			return "", 0, false
		default:
			if off+1+l > len(b) {
				return "", 0, false
			}
			labels = append(labels, string(b[off+1:off+1+l]))
			off += 1 + l
		}
	}
}

// apply configures the leased address and the default route.
func (c *dhcpClient) apply(r *dhcpReply) error {
	var gw netip.Addr
	if r.lease.Gateway != "" {
		gw = netip.MustParseAddr(r.lease.Gateway)
	}
	return addAddrAndRoute(c.ifi.Index, netip.PrefixFrom(r.yiaddr, r.lease.Prefix), gw)
}

// renewLoop renews at half the lease (REQUEST with ciaddr, broadcast as in
// the rebinding state, so it works whatever the server's address), retrying
// at half the remaining time, and reports each renewed lease.
func (c *dhcpClient) renewLoop(r *dhcpReply, report func(*proto.Lease)) {
	defer c.conn.Close()
	for {
		lease := time.Duration(r.lease.LeaseSecs) * time.Second
		expiry := time.Now().Add(lease)
		wait := lease / 2
		for {
			time.Sleep(max(wait, time.Second))
			ctx, cancel := context.WithDeadline(context.Background(), expiry)
			ack, err := c.exchange(ctx, c.message(dhcpRequest, r.yiaddr, netip.Addr{}, netip.Addr{}), dhcpAck)
			cancel()
			if err == nil && ack.msgType == dhcpAck && ack.yiaddr == r.yiaddr {
				r = ack
				l := ack.lease
				report(&l)
				break
			}
			if time.Now().After(expiry) {
				// Keep the address: a guest without one helps nobody, and
				// the host sees the stale lease_secs.
				expiry = time.Now().Add(lease)
			}
			wait = time.Until(expiry) / 2
		}
	}
}
