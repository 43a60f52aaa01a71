package tap

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"time"

	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"
)

// ifname pads an interface name to IFNAMSIZ, as meta iifname loads it.
func ifname(name string) []byte {
	b := make([]byte, unix.IFNAMSIZ)
	copy(b, name)
	return b
}

// Header offsets the rules read.
const (
	llBase = unix.NFT_PAYLOAD_LL_HEADER
	nhBase = unix.NFT_PAYLOAD_NETWORK_HEADER
	thBase = unix.NFT_PAYLOAD_TRANSPORT_HEADER
)

var (
	etherARP  = []byte{0x08, 0x06}
	etherIPv4 = []byte{0x08, 0x00}
	etherIPv6 = []byte{0x86, 0xdd}
)

func etherTypeIs(t []byte) []expr {
	return []expr{payloadLoad(llBase, 12, 2), cmp(unix.NFT_CMP_EQ, t)}
}

// prefixMatch matches the address loaded in register 1 against p.
func prefixMatch(p netip.Prefix) []expr {
	addr := p.Addr().AsSlice()
	if p.Bits() == len(addr)*8 {
		return []expr{cmp(unix.NFT_CMP_EQ, addr)}
	}
	m := net.CIDRMask(p.Bits(), len(addr)*8)
	return []expr{mask(m), cmp(unix.NFT_CMP_EQ, addr)}
}

// guardPrefixes returns the IPv4 and IPv6 sources a rule lets through.
func guardPrefixes(r GuardRule) (v4, v6 []netip.Prefix) {
	v6 = []netip.Prefix{
		netip.MustParsePrefix("::/128"),    // duplicate address detection
		netip.MustParsePrefix("fe80::/10"), // link-local: neighbour discovery
	}
	if r.IPv6.IsValid() {
		v6 = append(v6, netip.PrefixFrom(r.IPv6, 128))
	}
	if !r.IPv4.IsValid() {
		return nil, v6
	}
	v4 = append(v4, netip.PrefixFrom(r.IPv4, 32))
	for _, p := range r.AllowedIPs {
		if p.Addr().Is4() {
			v4 = append(v4, p)
		} else {
			v6 = append(v6, p)
		}
	}
	return v4, v6
}

// guardExprs returns the rules of a tap's chain, in order.
func guardExprs(r GuardRule) [][]expr {
	v4, v6 := guardPrefixes(r)
	seq := func(parts ...[]expr) []expr {
		var out []expr
		for _, p := range parts {
			out = append(out, p...)
		}
		return out
	}
	one := func(e ...expr) []expr { return e }
	rules := [][]expr{
		// Frames from other ports are not this chain's business.
		one(metaLoad(unix.NFT_META_IIFNAME), cmp(unix.NFT_CMP_NEQ, ifname(r.Tap)), verdict(nftReturn)),
		one(payloadLoad(llBase, 6, 6), cmp(unix.NFT_CMP_NEQ, r.MAC), verdict(nfDrop)),
		// ARP: the sender hardware address must be the VM's too.
		seq(etherTypeIs(etherARP), one(payloadLoad(nhBase, 8, 6), cmp(unix.NFT_CMP_NEQ, r.MAC), verdict(nfDrop))),
	}
	// ARP probes (sender 0.0.0.0) and ARP for the VM's own addresses.
	for _, p := range append([]netip.Prefix{netip.MustParsePrefix("0.0.0.0/32")}, v4...) {
		rules = append(rules, seq(etherTypeIs(etherARP), one(payloadLoad(nhBase, 14, 4)), prefixMatch(p), one(verdict(nfAccept))))
	}
	// A guest answering DHCP would poison other VMs' snooped bindings.
	rules = append(rules,
		seq(etherTypeIs(etherIPv4), one(
			payloadLoad(nhBase, 9, 1), cmp(unix.NFT_CMP_EQ, []byte{unix.IPPROTO_UDP}),
			payloadLoad(thBase, 0, 2), cmp(unix.NFT_CMP_EQ, []byte{0, dhcpServerPt}),
			verdict(nfDrop))),
		// DHCP discovery and requests before the guest has an address.
		seq(etherTypeIs(etherIPv4), one(
			payloadLoad(nhBase, 12, 4), cmp(unix.NFT_CMP_EQ, []byte{0, 0, 0, 0}),
			payloadLoad(nhBase, 9, 1), cmp(unix.NFT_CMP_EQ, []byte{unix.IPPROTO_UDP}),
			payloadLoad(thBase, 0, 4), cmp(unix.NFT_CMP_EQ, []byte{0, dhcpClientPt, 0, dhcpServerPt}),
			verdict(nfAccept))),
	)
	for _, p := range v4 {
		rules = append(rules, seq(etherTypeIs(etherIPv4), one(payloadLoad(nhBase, 12, 4)), prefixMatch(p), one(verdict(nfAccept))))
	}
	for _, p := range v6 {
		rules = append(rules, seq(etherTypeIs(etherIPv6), one(payloadLoad(nhBase, 8, 16)), prefixMatch(p), one(verdict(nfAccept))))
	}
	// Anything else from the tap: other sources, other ethertypes, and
	// VLAN-tagged frames, whose inner headers the rules above cannot see.
	return append(rules, one(verdict(nfDrop)))
}

func validGuardRule(r GuardRule) (GuardRule, error) {
	if err := validName(r.Tap); err != nil {
		return r, err
	}
	if len(r.MAC) != 6 || r.MAC[0]&1 != 0 {
		return r, fmt.Errorf("mac %v is not a unicast ethernet address", r.MAC)
	}
	r.IPv4 = r.IPv4.Unmap()
	if r.IPv4.IsValid() && !r.IPv4.Is4() {
		return r, fmt.Errorf("ipv4 %v is not an IPv4 address", r.IPv4)
	}
	if r.IPv6.IsValid() && (!r.IPv6.Is6() || r.IPv6.Is4In6()) {
		return r, fmt.Errorf("ipv6 %v is not an IPv6 address", r.IPv6)
	}
	if len(r.AllowedIPs) > MaxAllowedIPs {
		return r, fmt.Errorf("%d allowed ips, more than %d", len(r.AllowedIPs), MaxAllowedIPs)
	}
	allowed := make([]netip.Prefix, 0, len(r.AllowedIPs))
	for _, p := range r.AllowedIPs {
		if !p.IsValid() {
			return r, fmt.Errorf("allowed ip %v is not valid", p)
		}
		if p.Addr().Is4In6() {
			p = netip.PrefixFrom(p.Addr().Unmap(), p.Bits()-96)
		}
		allowed = append(allowed, p.Masked())
	}
	r.AllowedIPs = allowed
	return r, nil
}

// Guard installs or replaces the anti-spoof chain of r.Tap in the Handle's
// table (GuardTableOf its agent): the table and chain are created if
// missing, and the chain's rules are swapped in one transaction, so a
// guest is never unguarded in between. Call it again with the learned
// address when DHCP snooping reports a binding. The tap need not exist
// yet. An agent's Handle then removes the tap's chain from the unmarked
// table, where it is left when the tap was adopted (Adopt).
func (h *Handle) Guard(ctx context.Context, r GuardRule) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if err := h.checkAgent(); err != nil {
		return fmt.Errorf("guarding tap %q: %w", r.Tap, err)
	}
	r, err := validGuardRule(r)
	if err != nil {
		return fmt.Errorf("guarding tap %q: %w", r.Tap, err)
	}
	table, chain := h.guardTable(), guardChain(r.Tap)
	msgs := make([]netlink.Message, 0, 16)
	add := func(m netlink.Message, err error) error {
		msgs = append(msgs, m)
		return err
	}
	err = errors.Join(
		add(newTableMsg(unix.NFPROTO_BRIDGE, table)),
		add(newBaseChainMsg(unix.NFPROTO_BRIDGE, table, chain, nfBrPreRouting, nfBrPriFilter)),
		add(flushChainMsg(unix.NFPROTO_BRIDGE, table, chain)),
	)
	for _, exprs := range guardExprs(r) {
		err = errors.Join(err, add(newRuleMsg(unix.NFPROTO_BRIDGE, table, chain, exprs)))
	}
	if err != nil {
		return fmt.Errorf("guarding tap %q: encoding rules: %w", r.Tap, err)
	}
	if err := h.nftTransact(msgs); err != nil {
		return fmt.Errorf("guarding tap %q: %w", r.Tap, err)
	}
	if h.agent != "" {
		// The new chain guards the tap now: an adopted tap's old one goes.
		if err := h.deleteChain(GuardTable, chain); err != nil {
			return fmt.Errorf("guarding tap %q: removing its chain from the unmarked table: %w", r.Tap, err)
		}
	}
	return nil
}

// Unguard removes the anti-spoof chain of tap from the Handle's table (and,
// for an agent's Handle, from the unmarked table, where an adopted tap's
// may still be). A chain or table that is not there is success.
func (h *Handle) Unguard(ctx context.Context, tap string) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	tables := []string{h.guardTable()}
	if h.agent != "" {
		tables = append(tables, GuardTable)
	}
	for _, table := range tables {
		if err := h.deleteChain(table, guardChain(tap)); err != nil {
			return fmt.Errorf("unguarding tap %q: %w", tap, err)
		}
	}
	return nil
}

// deleteChain deletes a bridge-family chain; one that is not there (or
// whose table is not) is success.
func (h *Handle) deleteChain(table, chain string) error {
	// A plain lookup first: a batch costs a commit (milliseconds) even when
	// it only fails, and most taps being deleted have no guard.
	exists, err := h.chainExists(table, chain)
	if err != nil || !exists {
		return err
	}
	m, err := delChainMsg(unix.NFPROTO_BRIDGE, table, chain)
	if err != nil {
		return err
	}
	if err := h.nftTransact([]netlink.Message{m}); err != nil && !isNotExist(err) {
		return fmt.Errorf("deleting chain %s of table %s: %w", chain, table, err)
	}
	return nil
}

// chainExists reports whether a bridge-family chain exists
// (NFT_MSG_GETCHAIN).
func (h *Handle) chainExists(table, chain string) (bool, error) {
	c, err := h.dial(unix.NETLINK_NETFILTER)
	if err != nil {
		return false, fmt.Errorf("dialing nfnetlink: %w", err)
	}
	defer c.Close()
	req, err := getChainMsg(unix.NFPROTO_BRIDGE, table, chain)
	if err != nil {
		return false, err
	}
	_, err = c.Execute(req)
	switch {
	case isNotExist(err):
		return false, nil
	case errors.Is(err, unix.EOPNOTSUPP), errors.Is(err, unix.EAFNOSUPPORT), errors.Is(err, unix.EPROTONOSUPPORT):
		// No nf_tables in this kernel: no guard can exist.
		return false, nil
	case err != nil:
		return false, fmt.Errorf("looking up chain %s: %w", chain, err)
	}
	return true, nil
}

// nftTransact sends msgs as one nf_tables batch, which the kernel applies
// all or nothing. Only the last message asks for an ack: the kernel reports
// errors of any message anyway, in order, and one ack per rule would
// overflow the socket's receive buffer on a long chain. So the first error,
// or else the last ack, settles the outcome.
func (h *Handle) nftTransact(msgs []netlink.Message) error {
	if len(msgs) == 0 {
		return nil
	}
	c, err := h.dial(unix.NETLINK_NETFILTER)
	if err != nil {
		return fmt.Errorf("dialing nfnetlink: %w", err)
	}
	defer c.Close()
	for i := range msgs {
		msgs[i].Header.Flags &^= netlink.Acknowledge
	}
	msgs[len(msgs)-1].Header.Flags |= netlink.Acknowledge
	sent, err := c.SendMessages(batch(msgs))
	if err != nil {
		return err
	}
	last := sent[len(sent)-2].Header.Sequence // before BATCH_END
	// A kernel that stops answering must not hang the caller forever. Fake
	// conns in tests have no deadlines, hence the ignored error.
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	for {
		replies, err := c.Receive()
		if err != nil {
			return err
		}
		for _, r := range replies {
			if r.Header.Type == netlink.Error && r.Header.Sequence == last {
				return nil
			}
		}
	}
}
