package tap

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"
)

// Create makes a persistent tap as cfg describes, sets its MTU and alias and
// brings it up. Creating a tap that already exists with the same settings
// (alias, owner, queue mode) only reapplies MTU and state, and succeeds; an
// existing interface of that name with other settings gives an error wrapping
// ErrConflict. If a step after creation fails, the new tap is deleted again.
func (h *Handle) Create(ctx context.Context, cfg TapConfig) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if err := validName(cfg.Name); err != nil {
		return fmt.Errorf("creating tap: %w", err)
	}
	if cfg.VMID == "" || strings.Contains(cfg.VMID, ":") || cfg.Index < 0 {
		return fmt.Errorf("creating tap %q: vm id %q and index %d cannot form an alias", cfg.Name, cfg.VMID, cfg.Index)
	}
	if cfg.MTU != 0 && (cfg.MTU < 68 || cfg.MTU > 65521) {
		return fmt.Errorf("creating tap %q: mtu %d outside 68..65521", cfg.Name, cfg.MTU)
	}
	alias := Alias(cfg.VMID, cfg.Index)

	c, err := h.dial(unix.NETLINK_ROUTE)
	if err != nil {
		return fmt.Errorf("creating tap %q: dialing rtnetlink: %w", cfg.Name, err)
	}
	defer c.Close()

	existing, err := getLink(c, cfg.Name, 0)
	switch {
	case err == nil:
		if err := sameTap(existing, cfg, alias); err != nil {
			return fmt.Errorf("creating tap %q: %w", cfg.Name, err)
		}
		if err := configureTap(c, existing.Index, cfg.MTU, alias); err != nil {
			return fmt.Errorf("creating tap %q: %w", cfg.Name, err)
		}
		return nil
	case !isNotExist(err):
		return fmt.Errorf("creating tap %q: reading link: %w", cfg.Name, err)
	}

	if err := h.inNetNS(func() error { return makeTap(cfg) }); err != nil {
		return fmt.Errorf("creating tap %q: %w", cfg.Name, err)
	}
	created, err := getLink(c, cfg.Name, 0)
	if err == nil {
		err = configureTap(c, created.Index, cfg.MTU, alias)
	}
	if err != nil {
		// Roll back, so that a retry starts from nothing.
		if derr := delLinkByName(c, cfg.Name); derr != nil && !isNotExist(derr) {
			err = errors.Join(err, fmt.Errorf("removing it again: %w", derr))
		}
		return fmt.Errorf("creating tap %q: %w", cfg.Name, err)
	}
	return nil
}

// sameTap reports (as a nil error) whether l is the tap cfg asks for.
func sameTap(l link, cfg TapConfig, alias string) error {
	if l.Kind != "tun" || (l.hasTunDetails && l.TunType != unix.IFF_TAP) {
		return fmt.Errorf("%w: it is not a tap (kind %q)", ErrConflict, l.Kind)
	}
	if l.Alias != alias {
		return fmt.Errorf("%w: alias %q, want %q", ErrConflict, l.Alias, alias)
	}
	if !l.hasTunDetails {
		return nil
	}
	wantOwner := int64(-1)
	if cfg.Owner != 0 {
		wantOwner = int64(cfg.Owner)
	}
	if l.Owner != wantOwner && !(wantOwner == -1 && l.Owner == int64(^uint32(0))) {
		return fmt.Errorf("%w: owner %d, want %d", ErrConflict, l.Owner, wantOwner)
	}
	if l.MultiQueue != cfg.MultiQueue {
		return fmt.Errorf("%w: multi-queue %t, want %t", ErrConflict, l.MultiQueue, cfg.MultiQueue)
	}
	return nil
}

// makeTap creates the device with the TUN ioctls. It runs in the target
// namespace, since a tun device belongs to the namespace of its creator.
func makeTap(cfg TapConfig) error {
	fd, err := unix.Open("/dev/net/tun", unix.O_RDWR|unix.O_CLOEXEC, 0)
	if errors.Is(err, unix.ENOENT) || errors.Is(err, unix.ENODEV) {
		return fmt.Errorf("opening /dev/net/tun: %w (is the tun module loaded? try: modprobe tun)", err)
	}
	if err != nil {
		return fmt.Errorf("opening /dev/net/tun: %w", err)
	}
	defer unix.Close(fd)
	ifr, err := unix.NewIfreq(cfg.Name)
	if err != nil {
		return err
	}
	flags := uint16(unix.IFF_TAP | unix.IFF_NO_PI | unix.IFF_VNET_HDR)
	if cfg.MultiQueue {
		flags |= unix.IFF_MULTI_QUEUE
	}
	ifr.SetUint16(flags)
	if err := unix.IoctlIfreq(fd, unix.TUNSETIFF, ifr); err != nil {
		if errors.Is(err, unix.EPERM) {
			return fmt.Errorf("TUNSETIFF: %w (creating a tap needs CAP_NET_ADMIN)", err)
		}
		return fmt.Errorf("TUNSETIFF: %w", err)
	}
	if cfg.Owner != 0 {
		if err := unix.IoctlSetInt(fd, unix.TUNSETOWNER, cfg.Owner); err != nil {
			return fmt.Errorf("TUNSETOWNER %d: %w", cfg.Owner, err)
		}
	}
	// Persistence last: until then, closing fd removes the device, so a
	// failure above leaves nothing behind.
	if err := unix.IoctlSetInt(fd, unix.TUNSETPERSIST, 1); err != nil {
		return fmt.Errorf("TUNSETPERSIST: %w", err)
	}
	return nil
}

func configureTap(c *netlink.Conn, index, mtu int, alias string) error {
	err := setLink(c, ifInfo{Index: int32(index), Flags: unix.IFF_UP, Change: unix.IFF_UP}, func(ae *netlink.AttributeEncoder) {
		if mtu != 0 {
			ae.Uint32(unix.IFLA_MTU, uint32(mtu))
		}
		ae.String(unix.IFLA_IFALIAS, alias)
	})
	if err != nil {
		return fmt.Errorf("setting mtu, alias and up: %w", err)
	}
	return nil
}

// Delete removes the tap name and its anti-spoof chain (see Guard). A tap that is already
// gone is success; an interface of that name that is not a tap is refused
// with an error wrapping ErrConflict.
func (h *Handle) Delete(ctx context.Context, name string) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	c, err := h.dial(unix.NETLINK_ROUTE)
	if err != nil {
		return fmt.Errorf("deleting tap %q: dialing rtnetlink: %w", name, err)
	}
	defer c.Close()
	var errs []error
	l, err := getLink(c, name, 0)
	switch {
	case isNotExist(err):
	case err != nil:
		errs = append(errs, fmt.Errorf("deleting tap %q: reading link: %w", name, err))
	case l.Kind != "tun":
		errs = append(errs, fmt.Errorf("deleting tap %q: %w: it is not a tap (kind %q)", name, ErrConflict, l.Kind))
	default:
		if err := delLink(c, l.Index); err != nil && !isNotExist(err) {
			errs = append(errs, fmt.Errorf("deleting tap %q: %w", name, err))
		}
	}
	// The rules go with the tap, even when the link was already gone.
	errs = append(errs, h.Unguard(ctx, name))
	return errors.Join(errs...)
}

// ListOwned returns the taps whose ifalias has the form
// "vmhost:<vm_id>:<index>", so that orphans (taps of VMs that no longer
// exist) can be found and deleted.
func (h *Handle) ListOwned(ctx context.Context) ([]Owned, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	c, err := h.dial(unix.NETLINK_ROUTE)
	if err != nil {
		return nil, fmt.Errorf("listing taps: dialing rtnetlink: %w", err)
	}
	defer c.Close()
	links, err := listLinks(c)
	if err != nil {
		return nil, fmt.Errorf("listing taps: %w", err)
	}
	var owned []Owned
	for _, l := range links {
		if l.Kind != "tun" {
			continue
		}
		vmID, index, ok := parseAlias(l.Alias)
		if !ok {
			continue
		}
		owned = append(owned, Owned{Name: l.Name, VMID: vmID, Index: index, Master: l.Master})
	}
	return owned, nil
}
