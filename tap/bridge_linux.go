package tap

import (
	"context"
	"errors"
	"fmt"

	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"
)

// Attach makes tap a port of the bridge named bridge and applies opts. A
// bridge that does not exist gives an error satisfying
// errors.Is(err, fs.ErrNotExist); an interface that is not a bridge gives
// one wrapping ErrNotBridge. Attaching again with the same options is
// success.
func (h *Handle) Attach(ctx context.Context, tap, bridge string, opts PortOptions) error {
	return h.attach(ctx, tap, bridge, 0, opts)
}

// AttachIndex is Attach with the bridge given by interface index.
func (h *Handle) AttachIndex(ctx context.Context, tap string, bridgeIndex int, opts PortOptions) error {
	if bridgeIndex <= 0 {
		return fmt.Errorf("attaching tap %q: bridge index %d is not valid", tap, bridgeIndex)
	}
	return h.attach(ctx, tap, "", bridgeIndex, opts)
}

func (h *Handle) attach(ctx context.Context, tap, bridge string, bridgeIndex int, opts PortOptions) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	bridgeRef := bridge
	if bridgeIndex != 0 {
		bridgeRef = fmt.Sprintf("#%d", bridgeIndex)
	}
	wrap := func(format string, a ...any) error {
		return fmt.Errorf("attaching tap %q to bridge %s: %w", tap, bridgeRef, fmt.Errorf(format, a...))
	}
	if opts.VLAN > 4094 {
		return wrap("vlan %d outside 1..4094", opts.VLAN)
	}
	c, err := h.dial(unix.NETLINK_ROUTE)
	if err != nil {
		return wrap("dialing rtnetlink: %w", err)
	}
	defer c.Close()

	br, err := getLink(c, bridge, bridgeIndex)
	if isNotExist(err) {
		return wrap("%w", &notExist{msg: fmt.Sprintf("bridge %s does not exist", bridgeRef)})
	}
	if err != nil {
		return wrap("reading bridge: %w", err)
	}
	if br.Kind != "bridge" {
		return wrap("%w: %s is of kind %q", ErrNotBridge, br.Name, br.Kind)
	}
	t, err := getLink(c, tap, 0)
	if isNotExist(err) {
		return wrap("%w", &notExist{msg: fmt.Sprintf("tap %s does not exist", tap)})
	}
	if err != nil {
		return wrap("reading tap: %w", err)
	}
	if t.Master != br.Index {
		err := setLink(c, ifInfo{Index: int32(t.Index)}, func(ae *netlink.AttributeEncoder) {
			ae.Uint32(unix.IFLA_MASTER, uint32(br.Index))
		})
		if errors.Is(err, unix.EBUSY) {
			return wrap("setting master: %w (the tap is probably a port of another bridge or bond)", err)
		}
		if err != nil {
			return wrap("setting master: %w", err)
		}
	}
	if err := setIsolated(c, t.Index, opts.Isolated); err != nil {
		return wrap("setting port isolation: %w", err)
	}
	if opts.VLAN != 0 && br.VLANFiltering {
		if err := setPVID(c, t.Index, opts.VLAN); err != nil {
			return wrap("setting vlan %d: %w", opts.VLAN, err)
		}
	}
	return nil
}

func setIsolated(c *netlink.Conn, index int, on bool) error {
	return setLink(c, ifInfo{Index: int32(index)}, func(ae *netlink.AttributeEncoder) {
		ae.Nested(unix.IFLA_LINKINFO, func(nae *netlink.AttributeEncoder) error {
			nae.String(unix.IFLA_INFO_SLAVE_KIND, "bridge")
			nae.Nested(unix.IFLA_INFO_SLAVE_DATA, func(sae *netlink.AttributeEncoder) error {
				sae.Uint8(unix.IFLA_BRPORT_ISOLATED, boolByte(on))
				return nil
			})
			return nil
		})
	})
}

// setPVID makes vid the port's untagged PVID, then removes VLAN 1, which
// every new port of a filtering bridge gets by default.
func setPVID(c *netlink.Conn, index int, vid uint16) error {
	hdr := ifInfo{Family: unix.AF_BRIDGE, Index: int32(index)}
	vlan := func(flags, vid uint16) func(ae *netlink.AttributeEncoder) {
		return func(ae *netlink.AttributeEncoder) {
			ae.Nested(unix.IFLA_AF_SPEC, func(nae *netlink.AttributeEncoder) error {
				nae.Bytes(iflaBridgeVLANInfo, vlanInfo(flags, vid))
				return nil
			})
		}
	}
	req, err := linkMessage(unix.RTM_SETLINK, netlink.Acknowledge, hdr, vlan(bridgeVLANInfoPVID|bridgeVLANInfoUntagged, vid))
	if err != nil {
		return err
	}
	if _, err := c.Execute(req); err != nil {
		return fmt.Errorf("adding pvid: %w", err)
	}
	if vid == 1 {
		return nil
	}
	req, err = linkMessage(unix.RTM_DELLINK, netlink.Acknowledge, hdr, vlan(0, 1))
	if err != nil {
		return err
	}
	// VLAN 1 is absent on a bridge whose default_pvid is 0 or another VLAN.
	if _, err := c.Execute(req); err != nil && !isNotExist(err) {
		return fmt.Errorf("removing default vlan 1: %w", err)
	}
	return nil
}

// CheckBridge reports whether name is a bridge taps can join: an error
// satisfying errors.Is(err, fs.ErrNotExist) when there is no such
// interface, one wrapping ErrNotBridge when it is not a bridge.
func (h *Handle) CheckBridge(ctx context.Context, name string) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	c, err := h.dial(unix.NETLINK_ROUTE)
	if err != nil {
		return fmt.Errorf("reading bridge %s: dialing rtnetlink: %w", name, err)
	}
	defer c.Close()
	l, err := getLink(c, name, 0)
	switch {
	case isNotExist(err):
		return &notExist{msg: fmt.Sprintf("bridge %s does not exist", name)}
	case err != nil:
		return fmt.Errorf("reading bridge %s: %w", name, err)
	case l.Kind != "bridge":
		return fmt.Errorf("%w: %s is of kind %q", ErrNotBridge, name, l.Kind)
	}
	return nil
}

// Port reads back the bridge port state of tap. A missing tap gives an error
// satisfying errors.Is(err, fs.ErrNotExist).
func (h *Handle) Port(ctx context.Context, tap string) (Port, error) {
	if err := ctx.Err(); err != nil {
		return Port{}, err
	}
	c, err := h.dial(unix.NETLINK_ROUTE)
	if err != nil {
		return Port{}, fmt.Errorf("reading port %q: dialing rtnetlink: %w", tap, err)
	}
	defer c.Close()
	l, err := getLink(c, tap, 0)
	if isNotExist(err) {
		return Port{}, fmt.Errorf("reading port %q: %w", tap, &notExist{msg: "no such interface"})
	}
	if err != nil {
		return Port{}, fmt.Errorf("reading port %q: %w", tap, err)
	}
	return Port{Master: l.Master, Isolated: l.Isolated, Up: l.Flags&unix.IFF_UP != 0, MTU: l.MTU, Alias: l.Alias}, nil
}
