package tap

import (
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

// The benchmarks compare this package with the commands an operator would
// otherwise run (ip from iproute2, nft), in a namespace of their own.

func BenchmarkTapCreateDelete(b *testing.B) {
	ns := newTestNS(b)
	ctx := b.Context()
	cfg := TapConfig{Name: "tbench", VMID: "bench", MTU: 1400}
	for b.Loop() {
		if err := ns.h.Create(ctx, cfg); err != nil {
			b.Fatal(err)
		}
		if err := ns.h.Delete(ctx, cfg.Name); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkTapCreateDeleteIPCommand(b *testing.B) {
	ip, err := exec.LookPath("ip")
	if err != nil {
		b.Skip("ip (iproute2) not installed")
	}
	ns := newTestNS(b)
	run := func(args ...string) error {
		if out, err := exec.Command(ip, args...).CombinedOutput(); err != nil {
			return fmt.Errorf("ip %v: %v: %s", args, err, out)
		}
		return nil
	}
	b.ResetTimer()
	err = ns.run(func() error {
		for b.Loop() {
			if err := run("tuntap", "add", "dev", "tbench", "mode", "tap", "vnet_hdr"); err != nil {
				return err
			}
			if err := run("link", "set", "tbench", "mtu", "1400", "alias", "vmhost:bench:0", "up"); err != nil {
				return err
			}
			if err := run("link", "del", "tbench"); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		b.Fatal(err)
	}
}

func benchRule() GuardRule {
	return GuardRule{Tap: "tg", MAC: guestMAC, IPv4: netip.MustParseAddr("10.0.0.10"),
		IPv6: netip.MustParseAddr("fd00::10"), AllowedIPs: []netip.Prefix{netip.MustParsePrefix("10.9.0.0/24")}}
}

func BenchmarkGuardApply(b *testing.B) {
	ns := newTestNS(b)
	ctx := b.Context()
	r := benchRule()
	for b.Loop() {
		if err := ns.h.Guard(ctx, r); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkGuardApplyNftCommand loads the same rules with nft -f, as one
// transaction, the way a script would.
func BenchmarkGuardApplyNftCommand(b *testing.B) {
	nft, err := exec.LookPath("nft")
	if err != nil {
		b.Skip("nft not installed")
	}
	ns := newTestNS(b)
	script := `add table bridge vmhost
add chain bridge vmhost guard-tg { type filter hook prerouting priority filter; policy accept; }
flush chain bridge vmhost guard-tg
add rule bridge vmhost guard-tg iifname != "tg" return
add rule bridge vmhost guard-tg ether saddr != 02:00:00:00:00:0a drop
add rule bridge vmhost guard-tg arp saddr ether != 02:00:00:00:00:0a drop
add rule bridge vmhost guard-tg arp saddr ip 0.0.0.0 accept
add rule bridge vmhost guard-tg arp saddr ip 10.0.0.10 accept
add rule bridge vmhost guard-tg arp saddr ip 10.9.0.0/24 accept
add rule bridge vmhost guard-tg ip protocol udp udp sport 67 drop
add rule bridge vmhost guard-tg ip saddr 0.0.0.0 ip protocol udp udp sport 68 udp dport 67 accept
add rule bridge vmhost guard-tg ip saddr 10.0.0.10 accept
add rule bridge vmhost guard-tg ip saddr 10.9.0.0/24 accept
add rule bridge vmhost guard-tg ip6 saddr :: accept
add rule bridge vmhost guard-tg ip6 saddr fe80::/10 accept
add rule bridge vmhost guard-tg ip6 saddr fd00::10 accept
add rule bridge vmhost guard-tg drop
`
	path := filepath.Join(b.TempDir(), "guard.nft")
	if err := os.WriteFile(path, []byte(script), 0o600); err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	err = ns.run(func() error {
		for b.Loop() {
			if out, err := exec.Command(nft, "-f", path).CombinedOutput(); err != nil {
				return fmt.Errorf("nft -f: %v: %s", err, out)
			}
		}
		return nil
	})
	if err != nil {
		b.Fatal(err)
	}
}

func BenchmarkSnoopParse(b *testing.B) {
	frame := udpFrame(guestMAC, otherMAC, serverIP, bcastIP, 67, 68, dhcpReply(dhcpACK, guestMAC, netip.MustParseAddr("10.0.0.50")))
	for b.Loop() {
		p, err := dhcpPayload(frame)
		if err != nil {
			b.Fatal(err)
		}
		if _, err := ackBinding(p, guestMAC); err != nil {
			b.Fatal(err)
		}
	}
}
