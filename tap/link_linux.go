package tap

import (
	"encoding/binary"
	"fmt"
	"net"

	"github.com/mdlayher/netlink"
	"github.com/mdlayher/netlink/nlenc"
	"golang.org/x/sys/unix"
)

// Attributes the x/sys/unix package does not define (linux/if_bridge.h).
const (
	iflaBridgeVLANInfo     = 2      // IFLA_BRIDGE_VLAN_INFO, inside IFLA_AF_SPEC
	bridgeVLANInfoPVID     = 1 << 1 // BRIDGE_VLAN_INFO_PVID
	bridgeVLANInfoUntagged = 1 << 2 // BRIDGE_VLAN_INFO_UNTAGGED
)

// ifInfo is struct ifinfomsg, the fixed header of an rtnetlink link message.
type ifInfo struct {
	Family uint8
	Type   uint16
	Index  int32
	Flags  uint32
	Change uint32
}

func (m ifInfo) marshal() []byte {
	b := make([]byte, unix.SizeofIfInfomsg)
	b[0] = m.Family
	nlenc.PutUint16(b[2:4], m.Type)
	nlenc.PutInt32(b[4:8], m.Index)
	nlenc.PutUint32(b[8:12], m.Flags)
	nlenc.PutUint32(b[12:16], m.Change)
	return b
}

// linkMessage builds an rtnetlink link request: the header and the attributes
// that attrs encodes (attrs may be nil).
func linkMessage(typ netlink.HeaderType, flags netlink.HeaderFlags, hdr ifInfo, attrs func(ae *netlink.AttributeEncoder)) (netlink.Message, error) {
	data := hdr.marshal()
	if attrs != nil {
		ae := netlink.NewAttributeEncoder()
		attrs(ae)
		b, err := ae.Encode()
		if err != nil {
			return netlink.Message{}, err
		}
		data = append(data, b...)
	}
	return netlink.Message{
		Header: netlink.Header{Type: typ, Flags: netlink.Request | flags},
		Data:   data,
	}, nil
}

// link is what this package reads back about a network interface.
type link struct {
	Index  int
	Name   string
	Alias  string
	Kind   string // IFLA_INFO_KIND: "tun", "bridge", ...
	Master int
	MTU    int
	Flags  uint32
	MAC    net.HardwareAddr

	// Bridge port (IFLA_INFO_SLAVE_DATA), when the link has a bridge master.
	Isolated  bool
	PortState uint8 // IFLA_BRPORT_STATE: BR_STATE_FORWARDING is 3

	// Bridge (IFLA_INFO_DATA of kind "bridge").
	VLANFiltering bool

	// Tun (IFLA_INFO_DATA of kind "tun"); Owner is -1 when unset.
	TunType       uint8
	Owner         int64
	VnetHdr       bool
	MultiQueue    bool
	Persist       bool
	hasTunDetails bool
}

func parseLink(m netlink.Message) (link, error) {
	l := link{Owner: -1}
	if len(m.Data) < unix.SizeofIfInfomsg {
		return l, fmt.Errorf("short link message: %d bytes", len(m.Data))
	}
	l.Index = int(nlenc.Int32(m.Data[4:8]))
	l.Flags = nlenc.Uint32(m.Data[8:12])
	ad, err := netlink.NewAttributeDecoder(m.Data[unix.SizeofIfInfomsg:])
	if err != nil {
		return l, err
	}
	for ad.Next() {
		switch ad.Type() {
		case unix.IFLA_IFNAME:
			l.Name = ad.String()
		case unix.IFLA_IFALIAS:
			l.Alias = ad.String()
		case unix.IFLA_MASTER:
			l.Master = int(ad.Uint32())
		case unix.IFLA_MTU:
			l.MTU = int(ad.Uint32())
		case unix.IFLA_ADDRESS:
			l.MAC = net.HardwareAddr(ad.Bytes())
		case unix.IFLA_LINKINFO:
			ad.Nested(func(nad *netlink.AttributeDecoder) error {
				return parseLinkInfo(nad, &l)
			})
		}
	}
	return l, ad.Err()
}

func parseLinkInfo(ad *netlink.AttributeDecoder, l *link) error {
	var data, slaveData []byte
	for ad.Next() {
		switch ad.Type() {
		case unix.IFLA_INFO_KIND:
			l.Kind = ad.String()
		case unix.IFLA_INFO_DATA:
			data = ad.Bytes()
		case unix.IFLA_INFO_SLAVE_DATA:
			slaveData = ad.Bytes()
		}
	}
	if err := ad.Err(); err != nil {
		return err
	}
	if slaveData != nil {
		sad, err := netlink.NewAttributeDecoder(slaveData)
		if err != nil {
			return err
		}
		for sad.Next() {
			switch sad.Type() {
			case unix.IFLA_BRPORT_ISOLATED:
				l.Isolated = sad.Uint8() != 0
			case unix.IFLA_BRPORT_STATE:
				l.PortState = sad.Uint8()
			}
		}
		if err := sad.Err(); err != nil {
			return err
		}
	}
	if data == nil {
		return nil
	}
	dad, err := netlink.NewAttributeDecoder(data)
	if err != nil {
		return err
	}
	for dad.Next() {
		switch l.Kind {
		case "bridge":
			if dad.Type() == unix.IFLA_BR_VLAN_FILTERING {
				l.VLANFiltering = dad.Uint8() != 0
			}
		case "tun":
			l.hasTunDetails = true
			switch dad.Type() {
			case unix.IFLA_TUN_OWNER:
				l.Owner = int64(dad.Uint32())
			case unix.IFLA_TUN_TYPE:
				l.TunType = dad.Uint8()
			case unix.IFLA_TUN_VNET_HDR:
				l.VnetHdr = dad.Uint8() != 0
			case unix.IFLA_TUN_MULTI_QUEUE:
				l.MultiQueue = dad.Uint8() != 0
			case unix.IFLA_TUN_PERSIST:
				l.Persist = dad.Uint8() != 0
			}
		}
	}
	return dad.Err()
}

// getLink reads one link by name (index 0) or by index. A missing link gives
// an error for which isNotExist is true.
func getLink(c *netlink.Conn, name string, index int) (link, error) {
	req, err := linkMessage(unix.RTM_GETLINK, 0, ifInfo{Index: int32(index)}, func(ae *netlink.AttributeEncoder) {
		if index == 0 {
			ae.String(unix.IFLA_IFNAME, name)
		}
	})
	if err != nil {
		return link{}, err
	}
	msgs, err := c.Execute(req)
	if err != nil {
		return link{}, err
	}
	for _, m := range msgs {
		if m.Header.Type == unix.RTM_NEWLINK {
			return parseLink(m)
		}
	}
	return link{}, fmt.Errorf("no link in the kernel's reply")
}

// listLinks dumps every link in the namespace.
func listLinks(c *netlink.Conn) ([]link, error) {
	req, err := linkMessage(unix.RTM_GETLINK, netlink.Dump, ifInfo{}, nil)
	if err != nil {
		return nil, err
	}
	msgs, err := c.Execute(req)
	if err != nil {
		return nil, err
	}
	links := make([]link, 0, len(msgs))
	for _, m := range msgs {
		if m.Header.Type != unix.RTM_NEWLINK {
			continue
		}
		l, err := parseLink(m)
		if err != nil {
			return nil, err
		}
		links = append(links, l)
	}
	return links, nil
}

// setLink sends an RTM_NEWLINK for an existing link and waits for the ack.
func setLink(c *netlink.Conn, hdr ifInfo, attrs func(ae *netlink.AttributeEncoder)) error {
	req, err := linkMessage(unix.RTM_NEWLINK, netlink.Acknowledge, hdr, attrs)
	if err != nil {
		return err
	}
	_, err = c.Execute(req)
	return err
}

// delLink removes a link by index.
func delLink(c *netlink.Conn, index int) error {
	req, err := linkMessage(unix.RTM_DELLINK, netlink.Acknowledge, ifInfo{Index: int32(index)}, nil)
	if err != nil {
		return err
	}
	_, err = c.Execute(req)
	return err
}

// delLinkByName removes a link by name.
func delLinkByName(c *netlink.Conn, name string) error {
	req, err := linkMessage(unix.RTM_DELLINK, netlink.Acknowledge, ifInfo{}, func(ae *netlink.AttributeEncoder) {
		ae.String(unix.IFLA_IFNAME, name)
	})
	if err != nil {
		return err
	}
	_, err = c.Execute(req)
	return err
}

// vlanInfo is struct bridge_vlan_info: flags, then the VLAN id.
func vlanInfo(flags, vid uint16) []byte {
	b := make([]byte, 4)
	binary.NativeEndian.PutUint16(b[0:2], flags)
	binary.NativeEndian.PutUint16(b[2:4], vid)
	return b
}
