package tap

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"net"
	"net/netip"

	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"
)

// neighbour is one IPv4 entry of the kernel's neighbour table.
type neighbour struct {
	Index   int
	State   uint16
	IP      netip.Addr
	MAC     net.HardwareAddr
	Updated uint32 // NDA_CACHEINFO ndm_updated: clock ticks since the last update
}

func parseNeighbour(m netlink.Message) (neighbour, error) {
	var n neighbour
	if len(m.Data) < unix.SizeofNdMsg {
		return n, fmt.Errorf("short neighbour message: %d bytes", len(m.Data))
	}
	n.Index = int(int32(binary.NativeEndian.Uint32(m.Data[4:8])))
	n.State = binary.NativeEndian.Uint16(m.Data[8:10])
	ad, err := netlink.NewAttributeDecoder(m.Data[unix.SizeofNdMsg:])
	if err != nil {
		return n, err
	}
	for ad.Next() {
		switch ad.Type() {
		case unix.NDA_DST:
			if a, ok := netip.AddrFromSlice(ad.Bytes()); ok {
				n.IP = a.Unmap()
			}
		case unix.NDA_LLADDR:
			n.MAC = net.HardwareAddr(ad.Bytes())
		case unix.NDA_CACHEINFO:
			if b := ad.Bytes(); len(b) >= 12 {
				n.Updated = binary.NativeEndian.Uint32(b[8:12])
			}
		}
	}
	return n, ad.Err()
}

// LastIPv4 returns the IPv4 address the neighbour table most recently saw
// for mac, on any interface of the namespace. It is what the guest asserts
// (a display fallback); the caller keeps the answer, since the entry expires
// with ARP. No entry gives an error satisfying errors.Is(err, fs.ErrNotExist).
func (h *Handle) LastIPv4(ctx context.Context, mac net.HardwareAddr) (netip.Addr, error) {
	if err := ctx.Err(); err != nil {
		return netip.Addr{}, err
	}
	c, err := h.dial(unix.NETLINK_ROUTE)
	if err != nil {
		return netip.Addr{}, fmt.Errorf("reading neighbours of %v: dialing rtnetlink: %w", mac, err)
	}
	defer c.Close()
	hdr := make([]byte, unix.SizeofNdMsg)
	hdr[0] = unix.AF_INET
	msgs, err := c.Execute(netlink.Message{
		Header: netlink.Header{Type: unix.RTM_GETNEIGH, Flags: netlink.Request | netlink.Dump},
		Data:   hdr,
	})
	if err != nil {
		return netip.Addr{}, fmt.Errorf("reading neighbours of %v: %w", mac, err)
	}
	var best neighbour
	for _, m := range msgs {
		if m.Header.Type != unix.RTM_NEWNEIGH {
			continue
		}
		n, err := parseNeighbour(m)
		if err != nil {
			return netip.Addr{}, fmt.Errorf("reading neighbours of %v: %w", mac, err)
		}
		// Incomplete and failed entries carry no (or a stale) answer.
		if n.State&(unix.NUD_INCOMPLETE|unix.NUD_FAILED) != 0 || !n.IP.Is4() || !bytes.Equal(n.MAC, mac) {
			continue
		}
		if !best.IP.IsValid() || n.Updated < best.Updated {
			best = n
		}
	}
	if !best.IP.IsValid() {
		return netip.Addr{}, fmt.Errorf("reading neighbours of %v: %w", mac, &notExist{msg: "no IPv4 neighbour has this MAC"})
	}
	return best.IP, nil
}
