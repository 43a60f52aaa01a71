package tap

import (
	"context"
	"errors"
	"fmt"

	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"
)

// CreateBridge creates the bridge name (if it does not exist) and brings
// it up. An existing bridge is fine; an existing interface of another
// kind gives an error wrapping ErrNotBridge. vmhost creates only its
// development bridge this way (`serve --dev` as root); production bridges
// are the host's.
func (h *Handle) CreateBridge(ctx context.Context, name string) error {
	if err := validName(name); err != nil {
		return err
	}
	c, err := h.dial(unix.NETLINK_ROUTE)
	if err != nil {
		return fmt.Errorf("creating bridge %q: %w", name, err)
	}
	defer c.Close()
	l, err := getLink(c, name, 0)
	switch {
	case err == nil && l.Kind != "bridge":
		return fmt.Errorf("creating bridge %q: interface exists with kind %q: %w", name, l.Kind, ErrNotBridge)
	case err != nil && !isNotExist(err):
		return fmt.Errorf("creating bridge %q: %w", name, err)
	case err != nil:
		req, err := linkMessage(unix.RTM_NEWLINK, netlink.Create|netlink.Excl|netlink.Acknowledge, ifInfo{}, func(ae *netlink.AttributeEncoder) {
			ae.String(unix.IFLA_IFNAME, name)
			ae.Nested(unix.IFLA_LINKINFO, func(nae *netlink.AttributeEncoder) error {
				nae.String(unix.IFLA_INFO_KIND, "bridge")
				return nil
			})
		})
		if err != nil {
			return err
		}
		if _, err := c.Execute(req); err != nil && !errors.Is(err, unix.EEXIST) {
			return fmt.Errorf("creating bridge %q: %w", name, err)
		}
		if l, err = getLink(c, name, 0); err != nil {
			return fmt.Errorf("creating bridge %q: %w", name, err)
		}
	}
	if err := setLink(c, ifInfo{Index: int32(l.Index), Flags: unix.IFF_UP, Change: unix.IFF_UP}, nil); err != nil {
		return fmt.Errorf("bringing bridge %q up: %w", name, err)
	}
	return nil
}

// DeleteBridge removes the bridge name; one that does not exist is
// already gone. An interface of another kind is refused (ErrNotBridge).
func (h *Handle) DeleteBridge(ctx context.Context, name string) error {
	c, err := h.dial(unix.NETLINK_ROUTE)
	if err != nil {
		return fmt.Errorf("deleting bridge %q: %w", name, err)
	}
	defer c.Close()
	l, err := getLink(c, name, 0)
	if isNotExist(err) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("deleting bridge %q: %w", name, err)
	}
	if l.Kind != "bridge" {
		return fmt.Errorf("deleting bridge %q: interface has kind %q: %w", name, l.Kind, ErrNotBridge)
	}
	if err := delLink(c, l.Index); err != nil && !errors.Is(err, unix.ENODEV) {
		return fmt.Errorf("deleting bridge %q: %w", name, err)
	}
	return nil
}
