package tap

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"
)

// Create makes a persistent tap as cfg describes, sets its MTU and alias
// (AgentAlias of the Handle's agent) and brings it up. Creating a tap that
// already exists with the same settings (alias, owner, queue mode) only
// reapplies MTU and state, and succeeds; so does an existing tap with the
// unmarked alias of the same VM and index, which an agent's Handle marks
// as its own (adoption, as Adopt). An existing interface of that name with
// other settings (another agent's tap included) gives an error wrapping
// ErrConflict. If a step after creation fails, the new tap is deleted
// again.
func (h *Handle) Create(ctx context.Context, cfg TapConfig) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if err := h.checkAgent(); err != nil {
		return fmt.Errorf("creating tap %q: %w", cfg.Name, err)
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
	alias := AgentAlias(h.agent, cfg.VMID, cfg.Index)

	c, err := h.dial(unix.NETLINK_ROUTE)
	if err != nil {
		return fmt.Errorf("creating tap %q: dialing rtnetlink: %w", cfg.Name, err)
	}
	defer c.Close()

	existing, err := getLink(c, cfg.Name, 0)
	switch {
	case err == nil:
		want := alias
		if h.agent != "" && existing.Alias == Alias(cfg.VMID, cfg.Index) {
			want = existing.Alias // adopted: configureTap marks it
		}
		if err := sameTap(existing, cfg, want); err != nil {
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

// SetOwner makes uid the owner of the existing tap name (TUNSETOWNER; 0
// makes it root's, which only privileged processes use anyway): a process of that uid may then attach to it without
// CAP_NET_ADMIN, as a confined VM's Cloud Hypervisor does. It attaches to
// the tap to do so, so no other process may hold it (a single-queue tap
// in use answers EBUSY).
func (h *Handle) SetOwner(ctx context.Context, name string, uid int) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if err := validName(name); err != nil {
		return fmt.Errorf("setting the owner of tap: %w", err)
	}
	c, err := h.dial(unix.NETLINK_ROUTE)
	if err != nil {
		return fmt.Errorf("setting the owner of tap %q: dialing rtnetlink: %w", name, err)
	}
	l, err := getLink(c, name, 0)
	c.Close()
	if err != nil {
		return fmt.Errorf("setting the owner of tap %q: %w", name, err)
	}
	if l.Kind != "tun" {
		return fmt.Errorf("setting the owner of tap %q: %w: it is not a tap (kind %q)", name, ErrConflict, l.Kind)
	}
	err = h.inNetNS(func() error {
		fd, err := unix.Open("/dev/net/tun", unix.O_RDWR|unix.O_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("opening /dev/net/tun: %w", err)
		}
		defer unix.Close(fd)
		ifr, err := unix.NewIfreq(name)
		if err != nil {
			return err
		}
		// TUNSETIFF attaches to an existing tap only with its own queue
		// mode: a multi-queue one needs the flag.
		flags := uint16(unix.IFF_TAP | unix.IFF_NO_PI | unix.IFF_VNET_HDR)
		ifr.SetUint16(flags)
		err = unix.IoctlIfreq(fd, unix.TUNSETIFF, ifr)
		if errors.Is(err, unix.EINVAL) {
			ifr.SetUint16(flags | unix.IFF_MULTI_QUEUE)
			err = unix.IoctlIfreq(fd, unix.TUNSETIFF, ifr)
		}
		if err != nil {
			return fmt.Errorf("TUNSETIFF: %w", err)
		}
		// An owner cannot be unset (the kernel refuses an invalid uid):
		// root's is as good as none.
		owner := uid
		if err := unix.IoctlSetInt(fd, unix.TUNSETOWNER, owner); err != nil {
			return fmt.Errorf("TUNSETOWNER %d: %w", uid, err)
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("setting the owner of tap %q: %w", name, err)
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

// ListOwned returns the taps this Handle's agent made: those whose ifalias
// is "vmhost:<agent_id>:<vm_id>:<index>" with its AgentID, or, for a
// Handle without one, the unmarked "vmhost:<vm_id>:<index>". So a caller
// that deletes every listed tap its records do not name (orphans) never
// touches another agent's taps or unmarked ones. ListMarked lists them
// all.
func (h *Handle) ListOwned(ctx context.Context) ([]Owned, error) {
	all, err := h.ListMarked(ctx)
	if err != nil {
		return nil, err
	}
	want := Mine
	if h.agent == "" {
		want = Unmarked
	}
	owned := all[:0]
	for _, o := range all {
		if o.Whose == want {
			owned = append(owned, o)
		}
	}
	return owned, nil
}

// ListMarked returns every tap with a vmhost ifalias of either form, each
// with Whose it is: this agent's (reap it if no record names it), another
// agent's (never touch it), or unmarked (adopt it if a record names it,
// else never touch it).
func (h *Handle) ListMarked(ctx context.Context) ([]Owned, error) {
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
	var marked []Owned
	for _, l := range links {
		if l.Kind != "tun" {
			continue
		}
		a, ok := parseTapAlias(l.Alias)
		if !ok {
			continue
		}
		marked = append(marked, Owned{Name: l.Name, VMID: a.vmID, Index: a.index, Master: l.Master,
			Agent: a.agent, Whose: whose(h.agent, a.agent)})
	}
	return marked, nil
}

// Adopt marks the unmarked tap name, whose ifalias must be
// "vmhost:<vmID>:<index>", as this Handle's agent's: its alias becomes
// "vmhost:<agent_id>:<vmID>:<index>". Call it for a tap one of the agent's
// records names (made before the agent had an id). A tap already marked
// as the agent's for the same VM and index is success. A tap marked by
// another agent, for another VM or index, or an interface that is not a
// tap is refused with an error wrapping ErrConflict; a missing one with an
// error wrapping fs.ErrNotExist. Its anti-spoof chain, if any, stays in
// the unmarked table (guarding it still) until the next Guard moves it to
// the agent's table, or Delete removes it.
func (h *Handle) Adopt(ctx context.Context, name, vmID string, index int) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if h.agent == "" {
		return fmt.Errorf("adopting tap %q: the handle has no agent id to mark it with", name)
	}
	if err := h.checkAgent(); err != nil {
		return fmt.Errorf("adopting tap %q: %w", name, err)
	}
	if err := validName(name); err != nil {
		return fmt.Errorf("adopting tap: %w", err)
	}
	c, err := h.dial(unix.NETLINK_ROUTE)
	if err != nil {
		return fmt.Errorf("adopting tap %q: dialing rtnetlink: %w", name, err)
	}
	defer c.Close()
	l, err := getLink(c, name, 0)
	if isNotExist(err) {
		return fmt.Errorf("adopting tap %q: %w", name, &notExist{msg: "no such interface"})
	}
	if err != nil {
		return fmt.Errorf("adopting tap %q: reading link: %w", name, err)
	}
	mine := AgentAlias(h.agent, vmID, index)
	switch {
	case l.Kind != "tun":
		return fmt.Errorf("adopting tap %q: %w: it is not a tap (kind %q)", name, ErrConflict, l.Kind)
	case l.Alias == mine:
		return nil
	case l.Alias != Alias(vmID, index):
		return fmt.Errorf("adopting tap %q: %w: alias %q, want the unmarked %q", name, ErrConflict, l.Alias, Alias(vmID, index))
	}
	if err := setLink(c, ifInfo{Index: int32(l.Index)}, func(ae *netlink.AttributeEncoder) {
		ae.String(unix.IFLA_IFALIAS, mine)
	}); err != nil {
		return fmt.Errorf("adopting tap %q: setting alias: %w", name, err)
	}
	return nil
}
