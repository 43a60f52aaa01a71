package tap

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/mdlayher/netlink"
	"github.com/mdlayher/netlink/nltest"
	"golang.org/x/sys/unix"
)

// arpFrame builds an ARP request from (sha, sip) for tip, followed by marker
// as trailing padding, which the bridge forwards untouched.
func arpFrame(src, sha net.HardwareAddr, sip, tip netip.Addr, marker []byte) []byte {
	arp := make([]byte, 28)
	binary.BigEndian.PutUint16(arp[0:2], 1)      // ethernet
	binary.BigEndian.PutUint16(arp[2:4], 0x0800) // ipv4
	arp[4], arp[5] = 6, 4
	binary.BigEndian.PutUint16(arp[6:8], 1) // request
	copy(arp[8:14], sha)
	s, d := sip.As4(), tip.As4()
	copy(arp[14:18], s[:])
	copy(arp[24:28], d[:])
	return rawFrame(mustMAC("ff:ff:ff:ff:ff:ff"), src, 0x0806, append(arp, marker...))
}

// ipv6UDPFrame builds an IPv6/UDP frame from src carrying marker.
func ipv6UDPFrame(srcMAC net.HardwareAddr, src netip.Addr, marker []byte) []byte {
	udp := make([]byte, 8, 8+len(marker))
	binary.BigEndian.PutUint16(udp[0:2], 4000)
	binary.BigEndian.PutUint16(udp[2:4], 4001)
	binary.BigEndian.PutUint16(udp[4:6], uint16(8+len(marker)))
	udp = append(udp, marker...)
	h := make([]byte, 40)
	h[0] = 0x60
	binary.BigEndian.PutUint16(h[4:6], uint16(len(udp)))
	h[6], h[7] = 17, 64
	s, d := src.As16(), netip.MustParseAddr("ff02::1").As16()
	copy(h[8:24], s[:])
	copy(h[24:40], d[:])
	return rawFrame(mustMAC("33:33:00:00:00:01"), srcMAC, 0x86dd, append(h, udp...))
}

func udp4(srcMAC net.HardwareAddr, src netip.Addr, sport, dport uint16, marker []byte) []byte {
	return udpFrame(mustMAC("ff:ff:ff:ff:ff:ff"), srcMAC, src, bcastIP, sport, dport, marker)
}

// spoofBench is a bridge with a guarded guest tap and a receiving tap.
type spoofBench struct {
	ns       *testNS
	guest    *guest // on "tg", the guarded tap
	receiver *guest // on "tr"
	n        int
}

func newSpoofBench(t *testing.T) *spoofBench {
	ns := newTestNS(t)
	ns.mustBridge("br0")
	for i, name := range []string{"tg", "tr"} {
		ns.createTap(name, i)
		if err := ns.h.Attach(t.Context(), name, "br0", PortOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	b := &spoofBench{ns: ns, guest: ns.guest("tg"), receiver: ns.guest("tr")}
	ns.waitForwarding("tg", "tr")
	return b
}

// passes sends the frame that build makes from a fresh marker, then a
// sentinel frame the guard lets through, and reports whether the first frame
// reached the other side of the bridge before the sentinel did (frames on
// one path stay in order, so a frame not seen by then was dropped).
func (b *spoofBench) passes(t *testing.T, build func(marker []byte) []byte, sentinel func(marker []byte) []byte) bool {
	t.Helper()
	b.n++
	marker := fmt.Appendf(nil, "case-%03d-marker", b.n)
	sentinelMarker := fmt.Appendf(nil, "sentinel-%03d", b.n)
	b.guest.send(build(marker))
	b.guest.send(sentinel(sentinelMarker))
	frames, ok := b.receiver.recvUntil(sentinelMarker, 5*time.Second)
	if !ok {
		t.Fatalf("sentinel frame did not cross the bridge")
	}
	return sawMarker(frames, marker)
}

func nftList(t *testing.T, ns *testNS) string {
	t.Helper()
	nft, err := exec.LookPath("nft")
	if err != nil {
		t.Skip("needs nft (Debian package nftables) to read rules back")
	}
	var out []byte
	err = ns.run(func() error {
		var err error
		out, err = exec.Command(nft, "list", "table", "bridge", GuardTable).CombinedOutput()
		if err != nil {
			return fmt.Errorf("%v: %s", err, out)
		}
		return nil
	})
	if err != nil {
		t.Fatalf("nft list table: %v", err)
	}
	return string(out)
}

func TestIntegrationGuardStatic(t *testing.T) {
	b := newSpoofBench(t)
	ctx := t.Context()
	static4, static6 := netip.MustParseAddr("10.0.0.10"), netip.MustParseAddr("fd00::10")
	rule := GuardRule{Tap: "tg", MAC: guestMAC, IPv4: static4, IPv6: static6,
		AllowedIPs: []netip.Prefix{netip.MustParsePrefix("10.9.0.0/24"), netip.MustParsePrefix("fd09::/64")}}
	if err := b.ns.h.Guard(ctx, rule); err != nil {
		t.Fatalf("Guard = %v", err)
	}
	// Applying again replaces the rules rather than adding to them.
	if err := b.ns.h.Guard(ctx, rule); err != nil {
		t.Fatalf("second Guard = %v", err)
	}

	const wantRules = `table bridge vmhost {
	chain guard-tg {
		type filter hook prerouting priority filter; policy accept;
		iifname != "tg" return
		ether saddr != 02:00:00:00:00:0a drop
		arp saddr ether != 02:00:00:00:00:0a drop
		arp saddr ip 0.0.0.0 accept
		arp saddr ip 10.0.0.10 accept
		arp saddr ip 10.9.0.0/24 accept
		ip protocol udp udp sport 67 drop
		ip saddr 0.0.0.0 ip protocol udp udp sport 68 udp dport 67 accept
		ip saddr 10.0.0.10 accept
		ip saddr 10.9.0.0/24 accept
		ip6 saddr :: accept
		ip6 saddr fe80::/10 accept
		ip6 saddr fd00::10 accept
		ip6 saddr fd09::/64 accept
		drop
	}
}
`
	if got := nftList(t, b.ns); got != wantRules {
		t.Errorf("nft list table bridge vmhost:\n%s\nwant:\n%s", got, wantRules)
	}

	forgedMAC := mustMAC("02:00:00:00:00:66")
	genuine := func(m []byte) []byte { return udp4(guestMAC, static4, 4000, 4001, m) }
	tests := []struct {
		name  string
		frame func(m []byte) []byte
		want  bool
	}{
		{"genuine ipv4", genuine, true},
		{"forged source mac", func(m []byte) []byte { return udp4(forgedMAC, static4, 4000, 4001, m) }, false},
		{"forged source ip", func(m []byte) []byte { return udp4(guestMAC, netip.MustParseAddr("10.0.0.99"), 4000, 4001, m) }, false},
		{"allowed_ips address", func(m []byte) []byte { return udp4(guestMAC, netip.MustParseAddr("10.9.0.5"), 4000, 4001, m) }, true},
		{"outside allowed_ips", func(m []byte) []byte { return udp4(guestMAC, netip.MustParseAddr("10.9.1.5"), 4000, 4001, m) }, false},
		{"dhcp discover from 0.0.0.0", func(m []byte) []byte { return udp4(guestMAC, netip.IPv4Unspecified(), 68, 67, m) }, true},
		{"other udp from 0.0.0.0", func(m []byte) []byte { return udp4(guestMAC, netip.IPv4Unspecified(), 68, 53, m) }, false},
		{"dhcp server reply from guest", func(m []byte) []byte { return udp4(guestMAC, static4, 67, 68, m) }, false},
		{"arp for own address", func(m []byte) []byte { return arpFrame(guestMAC, guestMAC, static4, serverIP, m) }, true},
		{"arp probe", func(m []byte) []byte { return arpFrame(guestMAC, guestMAC, netip.IPv4Unspecified(), static4, m) }, true},
		{"arp for another address", func(m []byte) []byte {
			return arpFrame(guestMAC, guestMAC, netip.MustParseAddr("10.0.0.1"), netip.MustParseAddr("10.0.0.2"), m)
		}, false},
		{"arp with forged sender mac", func(m []byte) []byte { return arpFrame(guestMAC, forgedMAC, static4, serverIP, m) }, false},
		{"ipv6 static", func(m []byte) []byte { return ipv6UDPFrame(guestMAC, static6, m) }, true},
		{"ipv6 link-local", func(m []byte) []byte { return ipv6UDPFrame(guestMAC, netip.MustParseAddr("fe80::1"), m) }, true},
		{"ipv6 allowed prefix", func(m []byte) []byte { return ipv6UDPFrame(guestMAC, netip.MustParseAddr("fd09::77"), m) }, true},
		{"ipv6 forged", func(m []byte) []byte { return ipv6UDPFrame(guestMAC, netip.MustParseAddr("fd00::99"), m) }, false},
		{"ipv6 forged mac", func(m []byte) []byte { return ipv6UDPFrame(forgedMAC, static6, m) }, false},
		{"vlan tagged", func(m []byte) []byte {
			f := genuine(m)
			return append(append(bytes.Clone(f[:12]), 0x81, 0x00, 0x00, 0x2a), f[12:]...)
		}, false},
		{"other ethertype", func(m []byte) []byte { return rawFrame(mustMAC("ff:ff:ff:ff:ff:ff"), guestMAC, 0x88b5, m) }, false},
	}
	for _, tt := range tests {
		if got := b.passes(t, tt.frame, genuine); got != tt.want {
			t.Errorf("%s: crossed the bridge = %t, want %t", tt.name, got, tt.want)
		}
	}

	// Frames from the other, unguarded port are not touched.
	b.receiver.send(udp4(forgedMAC, netip.MustParseAddr("192.0.2.1"), 1, 2, []byte("from-unguarded")))
	if _, ok := b.guest.recvUntil([]byte("from-unguarded"), 5*time.Second); !ok {
		t.Errorf("a frame from an unguarded port was dropped")
	}

	// Deleting the tap takes its chain along; a second Delete and Unguard
	// are fine.
	if err := b.ns.h.Delete(ctx, "tg"); err != nil {
		t.Fatalf("Delete = %v", err)
	}
	if got := nftList(t, b.ns); strings.Contains(got, "guard-tg") {
		t.Errorf("chain left after Delete:\n%s", got)
	}
	if err := b.ns.h.Delete(ctx, "tg"); err != nil {
		t.Errorf("second Delete = %v", err)
	}
	if err := b.ns.h.Unguard(ctx, "tg"); err != nil {
		t.Errorf("Unguard of a removed chain = %v", err)
	}
}

// TestIntegrationGuardMaxAllowed applies the largest rule set a GuardRule
// may carry, which must fit one netlink batch.
func TestIntegrationGuardMaxAllowed(t *testing.T) {
	ns := newTestNS(t)
	allowed := make([]netip.Prefix, MaxAllowedIPs)
	for i := range allowed {
		a := netip.AddrFrom16([16]byte{0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, byte(i >> 8), byte(i)})
		allowed[i] = netip.PrefixFrom(a, 128)
	}
	r := GuardRule{Tap: "tg", MAC: guestMAC, IPv4: netip.MustParseAddr("10.0.0.10"), AllowedIPs: allowed}
	if err := ns.h.Guard(t.Context(), r); err != nil {
		t.Fatalf("Guard with %d allowed ips = %v", len(allowed), err)
	}
	if got := nftList(t, ns); !strings.Contains(got, "ip6 saddr fd00::ff accept") || strings.Count(got, "\n") < MaxAllowedIPs {
		t.Errorf("rules missing from the chain:\n%s", got)
	}
}

// TestIntegrationGuardDHCPBinding starts a guard with no pinned address,
// learns a binding by snooping, and re-applies the guard with it.
func TestIntegrationGuardDHCPBinding(t *testing.T) {
	b := newSpoofBench(t)
	ctx := t.Context()
	allowed := []netip.Prefix{netip.MustParsePrefix("10.9.0.5/32")}
	if err := b.ns.h.Guard(ctx, GuardRule{Tap: "tg", MAC: guestMAC, AllowedIPs: allowed}); err != nil {
		t.Fatalf("Guard = %v", err)
	}
	leased := netip.MustParseAddr("10.0.0.50")
	discover := func(m []byte) []byte { return udp4(guestMAC, netip.IPv4Unspecified(), 68, 67, m) }
	from := func(a netip.Addr) func([]byte) []byte {
		return func(m []byte) []byte { return udp4(guestMAC, a, 4000, 4001, m) }
	}
	if b.passes(t, from(leased), discover) {
		t.Errorf("before the binding, a frame from %v crossed the bridge", leased)
	}
	if b.passes(t, from(netip.MustParseAddr("10.9.0.5")), discover) {
		t.Errorf("before the binding, allowed_ips let a frame through (it must be inert)")
	}

	// FollowDHCP learns the binding and pins it in the guard.
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	bindings := make(chan Binding, 4)
	done := make(chan error, 1)
	go func() {
		rule := GuardRule{Tap: "tg", MAC: guestMAC, AllowedIPs: allowed}
		done <- b.ns.h.FollowDHCP(wctx, "tg", guestMAC, &rule, func(bnd Binding) { bindings <- bnd })
	}()
	ack := udpFrame(guestMAC, mustMAC("02:00:00:00:00:01"), serverIP, bcastIP, 67, 68, dhcpReply(dhcpACK, guestMAC, leased))
	// The snooper may not be listening yet: repeat the ACK, as a server
	// answering retransmitted requests would.
	var bnd Binding
	deadline := time.Now().Add(5 * time.Second)
	for got := false; !got; {
		if time.Now().After(deadline) {
			t.Fatal("FollowDHCP learned nothing in 5s")
		}
		b.receiver.send(ack)
		select {
		case bnd = <-bindings:
			got = true
		case err := <-done:
			t.Fatalf("FollowDHCP = %v", err)
		case <-time.After(100 * time.Millisecond):
		}
	}
	if bnd.IP != leased {
		t.Fatalf("learned binding %+v, want %v", bnd, leased)
	}
	genuine := from(leased)
	if !b.passes(t, from(leased), genuine) {
		t.Errorf("after the binding, a frame from %v was dropped", leased)
	}
	if !b.passes(t, from(netip.MustParseAddr("10.9.0.5")), genuine) {
		t.Errorf("after the binding, an allowed_ips frame was dropped")
	}
	if b.passes(t, from(netip.MustParseAddr("10.0.0.51")), genuine) {
		t.Errorf("after the binding, a frame from another address crossed the bridge")
	}
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Errorf("FollowDHCP after cancel = %v, want context.Canceled", err)
	}
}

func TestGuardValidation(t *testing.T) {
	h := New(nil)
	h.dial = func(int) (*netlink.Conn, error) { return nil, errors.New("must not dial") }
	bad := []GuardRule{
		{Tap: "", MAC: guestMAC},
		{Tap: "t0", MAC: mustMAC("01:00:5e:00:00:01")},
		{Tap: "t0", MAC: nil},
		{Tap: "t0", MAC: guestMAC, IPv4: netip.MustParseAddr("fd00::1")},
		{Tap: "t0", MAC: guestMAC, IPv6: netip.MustParseAddr("10.0.0.1")},
		{Tap: "t0", MAC: guestMAC, AllowedIPs: []netip.Prefix{{}}},
		{Tap: "t0", MAC: guestMAC, AllowedIPs: make([]netip.Prefix, MaxAllowedIPs+1)},
	}
	for _, r := range bad {
		if err := h.Guard(t.Context(), r); err == nil || strings.Contains(err.Error(), "must not dial") {
			t.Errorf("Guard(%+v) = %v, want a validation error", r, err)
		}
	}
}

// TestGuardMessages checks the batch framing and error handling on a fake
// nfnetlink conn.
func TestGuardMessages(t *testing.T) {
	var sent []netlink.Message
	failType := -1
	chainThere := true
	h := New(nil)
	h.dial = func(family int) (*netlink.Conn, error) {
		if family != unix.NETLINK_NETFILTER {
			return nil, fmt.Errorf("family %d", family)
		}
		return nltest.Dial(func(reqs []netlink.Message) ([]netlink.Message, error) {
			if len(reqs) == 0 {
				return nil, nil
			}
			if len(reqs) == 1 && int(reqs[0].Header.Type)&0xff == unix.NFT_MSG_GETCHAIN {
				if !chainThere {
					return nltest.Error(int(unix.ENOENT), reqs)
				}
				m := reqs[0]
				m.Header.Type = unix.NFNL_SUBSYS_NFTABLES<<8 | unix.NFT_MSG_NEWCHAIN
				return []netlink.Message{m}, nil
			}
			sent = reqs
			var replies []netlink.Message
			for _, r := range reqs {
				// Like nfnetlink: errors always, acks when asked.
				if r.Header.Type != unix.NFNL_MSG_BATCH_BEGIN && int(r.Header.Type)&0xff == failType {
					m, _ := nltest.Error(int(unix.ENOENT), []netlink.Message{r})
					replies = append(replies, m...)
				} else if r.Header.Flags&netlink.Acknowledge != 0 {
					m, _ := nltest.Error(0, []netlink.Message{r})
					replies = append(replies, m...)
				}
			}
			return replies, nil
		}), nil
	}
	r := GuardRule{Tap: "t0", MAC: guestMAC, IPv4: netip.MustParseAddr("10.0.0.10")}
	if err := h.Guard(t.Context(), r); err != nil {
		t.Fatalf("Guard = %v", err)
	}
	var types []string
	for _, m := range sent {
		types = append(types, fmt.Sprintf("%#x", uint16(m.Header.Type)))
	}
	// BATCH_BEGIN, NEWTABLE, NEWCHAIN, DELRULE (flush), NEWRULE x 11, BATCH_END.
	want := "0x10 0xa00 0xa03 0xa08" + strings.Repeat(" 0xa06", 11) + " 0x11"
	if got := strings.Join(types, " "); got != want {
		t.Errorf("batch types = %s, want %s", got, want)
	}
	if begin := sent[0].Data; !bytes.Equal(begin, []byte{unix.AF_UNSPEC, 0, 0, unix.NFNL_SUBSYS_NFTABLES}) {
		t.Errorf("batch begin nfgenmsg = %x, want res_id NFNL_SUBSYS_NFTABLES", begin)
	}
	for i, m := range sent[1 : len(sent)-1] {
		if m.Data[0] != unix.NFPROTO_BRIDGE {
			t.Errorf("message %#x family %d, want NFPROTO_BRIDGE", uint16(m.Header.Type), m.Data[0])
		}
		if ack := m.Header.Flags&netlink.Acknowledge != 0; ack != (i == len(sent)-3) {
			t.Errorf("message %d of the batch asks for an ack: %t, want only the last", i, ack)
		}
	}

	failType = unix.NFT_MSG_NEWRULE
	if err := h.Guard(t.Context(), r); !errors.Is(err, unix.ENOENT) {
		t.Errorf("Guard with a refused rule = %v, want ENOENT", err)
	}
	// The chain vanishes between the lookup and the delete: still done.
	failType = unix.NFT_MSG_DELCHAIN
	sent = nil
	if err := h.Unguard(t.Context(), "t0"); err != nil {
		t.Errorf("Unguard of a chain deleted meanwhile = %v, want nil", err)
	}
	if len(sent) != 3 || int(sent[1].Header.Type)&0xff != unix.NFT_MSG_DELCHAIN {
		t.Errorf("Unguard sent %d messages, want a batch with NFT_MSG_DELCHAIN", len(sent))
	}
	// No chain: no transaction at all.
	chainThere = false
	sent = nil
	if err := h.Unguard(t.Context(), "t0"); err != nil || sent != nil {
		t.Errorf("Unguard of a missing chain = %v after sending %d messages, want nil and none", err, len(sent))
	}
}

// TestIntegrationNftBatchError checks that an error in the middle of a batch
// is reported (not hidden by the ack of the last message) and that nothing
// of the batch stays.
func TestIntegrationNftBatchError(t *testing.T) {
	ns := newTestNS(t)
	must := func(m netlink.Message, err error) netlink.Message {
		if err != nil {
			t.Fatal(err)
		}
		return m
	}
	msgs := []netlink.Message{
		must(newTableMsg(unix.NFPROTO_BRIDGE, "batchtest")),
		must(newRuleMsg(unix.NFPROTO_BRIDGE, "batchtest", "nochain", []expr{verdict(nfDrop)})),
		must(newBaseChainMsg(unix.NFPROTO_BRIDGE, "batchtest", "c", nfBrPreRouting, nfBrPriFilter)),
	}
	if err := ns.h.nftTransact(msgs); !errors.Is(err, unix.ENOENT) {
		t.Fatalf("batch with a rule for a missing chain = %v, want ENOENT", err)
	}
	if exists, err := ns.h.chainExists("batchtest", "c"); err != nil || exists {
		t.Errorf("chain of an aborted batch exists = %t, %v, want false", exists, err)
	}
}
