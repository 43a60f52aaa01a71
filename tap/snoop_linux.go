package tap

import (
	"context"
	"errors"
	"fmt"
	"net"

	"github.com/mdlayher/socket"
	"golang.org/x/net/bpf"
	"golang.org/x/sys/unix"
)

// A Snooper watches the DHCP replies the host sends to one tap (frames on
// their way to the guest) and reports the addresses DHCPACKs give the VM's
// MAC. Replies the guest itself sends, offers, ACKs for other MACs and
// malformed packets are ignored. Close releases the socket. Next must not be
// called concurrently.
type Snooper struct {
	tap  string
	mac  net.HardwareAddr
	conn *socket.Conn
	buf  []byte
}

// snoopFilter accepts IPv4 UDP frames from port 67 to port 68 (not
// fragments) that the host transmits on the interface (PACKET_OUTGOING), so
// the socket wakes up only for DHCP server replies toward the guest.
func snoopFilter() ([]bpf.RawInstruction, error) {
	prog := []bpf.Instruction{
		/* 0 */ bpf.LoadExtension{Num: bpf.ExtType},
		/* 1 */ bpf.JumpIf{Cond: bpf.JumpNotEqual, Val: unix.PACKET_OUTGOING, SkipTrue: 10},
		/* 2 */ bpf.LoadAbsolute{Off: 12, Size: 2},
		/* 3 */ bpf.JumpIf{Cond: bpf.JumpNotEqual, Val: unix.ETH_P_IP, SkipTrue: 8},
		/* 4 */ bpf.LoadAbsolute{Off: 23, Size: 1},
		/* 5 */ bpf.JumpIf{Cond: bpf.JumpNotEqual, Val: unix.IPPROTO_UDP, SkipTrue: 6},
		/* 6 */ bpf.LoadAbsolute{Off: 20, Size: 2},
		/* 7 */ bpf.JumpIf{Cond: bpf.JumpBitsSet, Val: 0x1fff, SkipTrue: 4},
		/* 8 */ bpf.LoadMemShift{Off: 14},
		/* 9 */ bpf.LoadIndirect{Off: 14, Size: 4},
		/* 10 */ bpf.JumpIf{Cond: bpf.JumpNotEqual, Val: dhcpServerPt<<16 | dhcpClientPt, SkipTrue: 1},
		/* 11 */ bpf.RetConstant{Val: 0x40000},
		/* 12 */ bpf.RetConstant{Val: 0},
	}
	return bpf.Assemble(prog)
}

// Snoop starts watching tap for DHCPACKs to mac. The tap must exist.
func (h *Handle) Snoop(tap string, mac net.HardwareAddr) (*Snooper, error) {
	if len(mac) != 6 {
		return nil, fmt.Errorf("snooping dhcp on %q: mac %v is not an ethernet address", tap, mac)
	}
	c, err := h.dial(unix.NETLINK_ROUTE)
	if err != nil {
		return nil, fmt.Errorf("snooping dhcp on %q: dialing rtnetlink: %w", tap, err)
	}
	l, err := getLink(c, tap, 0)
	c.Close()
	if isNotExist(err) {
		return nil, fmt.Errorf("snooping dhcp on %q: %w", tap, &notExist{msg: "no such interface"})
	}
	if err != nil {
		return nil, fmt.Errorf("snooping dhcp on %q: reading link: %w", tap, err)
	}
	filter, err := snoopFilter()
	if err != nil {
		return nil, fmt.Errorf("snooping dhcp on %q: assembling filter: %w", tap, err)
	}
	// Protocol 0 receives nothing until bind, so no frame slips past the
	// filter in between.
	conn, err := socket.Socket(unix.AF_PACKET, unix.SOCK_RAW, 0, "dhcp-snoop", &socket.Config{NetNS: h.netns})
	if err != nil {
		return nil, fmt.Errorf("snooping dhcp on %q: opening packet socket: %w", tap, err)
	}
	if err := conn.SetBPF(filter); err != nil {
		conn.Close()
		return nil, fmt.Errorf("snooping dhcp on %q: attaching filter: %w", tap, err)
	}
	// ETH_P_ALL: only ptype_all sockets see frames the host transmits.
	if err := conn.Bind(&unix.SockaddrLinklayer{Protocol: htons(unix.ETH_P_ALL), Ifindex: l.Index}); err != nil {
		conn.Close()
		return nil, fmt.Errorf("snooping dhcp on %q: binding: %w", tap, err)
	}
	return &Snooper{tap: tap, mac: mac, conn: conn, buf: make([]byte, 65536)}, nil
}

// Next blocks until a DHCPACK gives the MAC an address and returns the
// binding, or returns ctx's error when ctx ends first. Every ACK is reported,
// renewals of the same address included. When the tap is deleted, Next fails
// (the kernel reports ENETDOWN on the socket).
func (s *Snooper) Next(ctx context.Context) (Binding, error) {
	for {
		n, sa, err := s.conn.Recvfrom(ctx, s.buf, 0)
		if err != nil {
			if ctxErr := ctx.Err(); ctxErr != nil {
				return Binding{}, ctxErr
			}
			return Binding{}, fmt.Errorf("snooping dhcp on %q: %w", s.tap, err)
		}
		// The filter checks this too; a frame queued before the filter
		// was attached cannot exist (protocol 0), but be strict anyway.
		if ll, ok := sa.(*unix.SockaddrLinklayer); !ok || ll.Pkttype != unix.PACKET_OUTGOING {
			continue
		}
		payload, err := dhcpPayload(s.buf[:n])
		if err != nil {
			continue
		}
		b, err := ackBinding(payload, s.mac)
		if errors.Is(err, errNotDHCP) {
			continue
		}
		if err != nil {
			return Binding{}, fmt.Errorf("snooping dhcp on %q: %w", s.tap, err)
		}
		return b, nil
	}
}

// Close stops snooping and releases the socket.
func (s *Snooper) Close() error { return s.conn.Close() }

func htons(v uint16) uint16 { return v<<8 | v>>8 }

// FollowDHCP snoops tap for DHCPACKs to mac until ctx ends, and returns
// ctx's error then. For each ACK that gives a new address it calls found
// (when not nil). With a guard (not nil) whose IPv4 is not set, the guard is
// first re-applied with the learned address pinned, so the guest's traffic
// from it passes; a guard with a static IPv4 is left alone, since a static
// address is the pinned one. An error snooping or guarding ends the watch.
func (h *Handle) FollowDHCP(ctx context.Context, tap string, mac net.HardwareAddr, guard *GuardRule, found func(Binding)) error {
	s, err := h.Snoop(tap, mac)
	if err != nil {
		return err
	}
	defer s.Close()
	var last Binding
	for {
		b, err := s.Next(ctx)
		if err != nil {
			return err
		}
		if b.IP == last.IP {
			continue // a renewal
		}
		last = b
		if guard != nil && !guard.IPv4.IsValid() {
			pinned := *guard
			pinned.IPv4 = b.IP
			if err := h.Guard(ctx, pinned); err != nil {
				return fmt.Errorf("following dhcp on %q: pinning %v: %w", tap, b.IP, err)
			}
		}
		if found != nil {
			found(b)
		}
	}
}
