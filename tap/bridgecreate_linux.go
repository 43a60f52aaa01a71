package tap

import (
	"context"
	"errors"
	"fmt"

	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"
)

// CreateBridge creates the bridge name (if it does not exist) and brings
// it up; a bridge it creates with an agent's Handle carries the ifalias
// BridgeAlias(agent), so RemoveBridge knows it as the agent's. An existing
// bridge is fine and keeps its alias; an existing interface of another
// kind gives an error wrapping ErrNotBridge. vmhost creates only its
// development bridge this way (`serve --dev` as root); production bridges
// are the host's.
func (h *Handle) CreateBridge(ctx context.Context, name string) error {
	if err := validName(name); err != nil {
		return err
	}
	if err := h.checkAgent(); err != nil {
		return fmt.Errorf("creating bridge %q: %w", name, err)
	}
	c, err := h.dial(unix.NETLINK_ROUTE)
	if err != nil {
		return fmt.Errorf("creating bridge %q: %w", name, err)
	}
	defer c.Close()
	l, err := getLink(c, name, 0)
	created := false
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
		created = true
	}
	mark := created && h.agent != ""
	if err := setLink(c, ifInfo{Index: int32(l.Index), Flags: unix.IFF_UP, Change: unix.IFF_UP}, func(ae *netlink.AttributeEncoder) {
		if mark {
			ae.String(unix.IFLA_IFALIAS, BridgeAlias(h.agent))
		}
	}); err != nil {
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

// RemoveBridge removes the bridge name when it is this agent's (its
// ifalias is BridgeAlias of the Handle's AgentID) and no interface is a
// port of it, and reports whether it did. A bridge that is missing, not
// the agent's (the host's own, another agent's, or made before agents had
// ids), or still in use by a tap is left alone: (false, nil). It is how
// `serve --dev` removes at a clean exit the bridge it made, unless a VM
// that outlives the agent still uses it.
func (h *Handle) RemoveBridge(ctx context.Context, name string) (bool, error) {
	if h.agent == "" {
		return false, nil // nothing made by a Handle without an id is known as its own
	}
	c, err := h.dial(unix.NETLINK_ROUTE)
	if err != nil {
		return false, fmt.Errorf("removing bridge %q: %w", name, err)
	}
	defer c.Close()
	links, err := listLinks(c)
	if err != nil {
		return false, fmt.Errorf("removing bridge %q: %w", name, err)
	}
	var br *link
	for i := range links {
		if links[i].Name == name {
			br = &links[i]
		}
	}
	if br == nil || br.Kind != "bridge" || br.Alias != BridgeAlias(h.agent) {
		return false, nil
	}
	for _, l := range links {
		if l.Master == br.Index {
			return false, nil
		}
	}
	// A port attached between the dump and here makes the bridge go with
	// it; the dev bridge's ports are only this agent's taps, made by the
	// engine that has stopped by now.
	if err := delLink(c, br.Index); err != nil {
		if isNotExist(err) {
			return false, nil
		}
		return false, fmt.Errorf("removing bridge %q: %w", name, err)
	}
	return true, nil
}
