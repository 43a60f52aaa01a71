package tap

import (
	"bytes"
	"errors"
	"io/fs"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"vmhost/internal/netnstest"
)

func TestName(t *testing.T) {
	tests := []struct {
		vmID  string
		index int
	}{
		{"web-1", 0},
		{"3f2c8a4e-9b1d-4c55-8e0f-6d7a1b2c3d4e", 3},
		{strings.Repeat("a", 64), 12345},
		{"x", 999999999},
		{"x", 9999},
		{"x", 10000},
		{"x", -1},
		{"x", int(^uint(0) >> 1)},
	}
	seen := map[string]bool{}
	for _, tt := range tests {
		name := Name(tt.vmID, tt.index)
		if err := validName(name); err != nil {
			t.Errorf("Name(%q, %d) = %q: %v", tt.vmID, tt.index, name, err)
		}
		if !strings.HasPrefix(name, "vmh") {
			t.Errorf("Name(%q, %d) = %q, want prefix vmh", tt.vmID, tt.index, name)
		}
		if again := Name(tt.vmID, tt.index); again != name {
			t.Errorf("Name(%q, %d) not stable: %q then %q", tt.vmID, tt.index, name, again)
		}
		seen[name] = true
	}
	if len(seen) != len(tests) {
		t.Errorf("Name gave %d distinct names for %d inputs", len(seen), len(tests))
	}
	if Name("a", 1) == Name("b", 1) || Name("a", 1) == Name("a", 2) || Name("a", 10000) == Name("a", 10001) {
		t.Errorf("Name collides for different inputs: %q %q %q", Name("a", 1), Name("b", 1), Name("a", 2))
	}
}

func TestParseAlias(t *testing.T) {
	const agent = "0123456789abcdef"
	tests := []struct {
		alias string
		want  tapAlias
		ok    bool
	}{
		{"vmhost:web-1:0", tapAlias{vmID: "web-1", index: 0}, true},
		{"vmhost:a.b_c:12", tapAlias{vmID: "a.b_c", index: 12}, true},
		{Alias("x", 7), tapAlias{vmID: "x", index: 7}, true},
		{AgentAlias(agent, "x", 7), tapAlias{agent: agent, vmID: "x", index: 7}, true},
		{"vmhost:" + agent + ":web-1:3", tapAlias{agent: agent, vmID: "web-1", index: 3}, true},
		{AgentAlias("", "x", 7), tapAlias{vmID: "x", index: 7}, true},
		{"vmhost::1", tapAlias{}, false},
		{"vmhost:web", tapAlias{}, false},
		{"vmhost:A-B:x:1", tapAlias{}, false}, // not an agent id
		{"vmhost:a:b:c:1", tapAlias{}, false},
		{"vmhost:" + agent + "::1", tapAlias{}, false},
		{"vmhost:web:-1", tapAlias{}, false},
		{"vmhost:web:+1", tapAlias{}, false},
		{"vmhost:web:01", tapAlias{}, false},
		{"vmhost:web:x", tapAlias{}, false},
		{BridgeAlias(agent), tapAlias{}, false},
		{"other:web:1", tapAlias{}, false},
		{"", tapAlias{}, false},
	}
	for _, tt := range tests {
		got, ok := parseTapAlias(tt.alias)
		if got != tt.want || ok != tt.ok {
			t.Errorf("parseTapAlias(%q) = %+v, %t, want %+v, %t", tt.alias, got, ok, tt.want, tt.ok)
		}
	}
}

func TestIntegrationTapLifecycle(t *testing.T) {
	ns := newTestNS(t)
	ctx := t.Context()
	br := ns.mustBridge("br0")

	cfg := TapConfig{Name: Name("vm1", 0), MTU: 1400, VMID: "vm1", Index: 0}
	if err := ns.h.Create(ctx, cfg); err != nil {
		t.Fatalf("Create(%+v) = %v", cfg, err)
	}
	l := ns.link(cfg.Name)
	if l.Kind != "tun" || l.TunType != unix.IFF_TAP || !l.VnetHdr || !l.Persist {
		t.Errorf("tap %q: kind %q type %d vnet_hdr %t persist %t, want tun tap with vnet_hdr, persistent",
			cfg.Name, l.Kind, l.TunType, l.VnetHdr, l.Persist)
	}
	if l.MTU != 1400 {
		t.Errorf("tap mtu = %d, want 1400", l.MTU)
	}
	if l.Flags&unix.IFF_UP == 0 {
		t.Errorf("tap flags %#x, want IFF_UP", l.Flags)
	}
	if want := "vmhost:vm1:0"; l.Alias != want {
		t.Errorf("tap alias = %q, want %q", l.Alias, want)
	}

	// The same request again is success and changes nothing.
	if err := ns.h.Create(ctx, cfg); err != nil {
		t.Errorf("second Create = %v, want nil", err)
	}
	// The same name for another VM is a conflict.
	other := cfg
	other.VMID = "vm2"
	if err := ns.h.Create(ctx, other); !errors.Is(err, ErrConflict) {
		t.Errorf("Create with another alias = %v, want ErrConflict", err)
	}
	other = cfg
	other.MultiQueue = true
	if err := ns.h.Create(ctx, other); !errors.Is(err, ErrConflict) {
		t.Errorf("Create with another queue mode = %v, want ErrConflict", err)
	}
	withOwner := TapConfig{Name: "town", VMID: "vm3", Owner: 1000}
	if err := ns.h.Create(ctx, withOwner); err != nil {
		t.Fatalf("Create with owner = %v", err)
	}
	if l := ns.link("town"); l.Owner != 1000 {
		t.Errorf("tap owner = %d, want 1000", l.Owner)
	}
	if err := ns.h.Create(ctx, withOwner); err != nil {
		t.Errorf("second Create with owner = %v, want nil", err)
	}
	withOwner.Owner = 0
	if err := ns.h.Create(ctx, withOwner); !errors.Is(err, ErrConflict) {
		t.Errorf("Create with another owner = %v, want ErrConflict", err)
	}
	if err := ns.h.Delete(ctx, "town"); err != nil {
		t.Fatal(err)
	}
	// A bridge is not a tap.
	if err := ns.h.Create(ctx, TapConfig{Name: "br0", VMID: "vm1"}); !errors.Is(err, ErrConflict) {
		t.Errorf("Create over a bridge = %v, want ErrConflict", err)
	}

	for _, iso := range []bool{true, false, true} {
		if err := ns.h.Attach(ctx, cfg.Name, "br0", PortOptions{Isolated: iso}); err != nil {
			t.Fatalf("Attach(isolated=%t) = %v", iso, err)
		}
		p, err := ns.h.Port(ctx, cfg.Name)
		if err != nil {
			t.Fatalf("Port = %v", err)
		}
		if p.Master != br.Index || p.Isolated != iso || !p.Up || p.MTU != 1400 || p.Alias != "vmhost:vm1:0" {
			t.Errorf("Port after Attach(isolated=%t) = %+v, want master %d, isolated %t, up, mtu 1400", iso, p, br.Index, iso)
		}
	}
	if err := ns.h.AttachIndex(ctx, cfg.Name, br.Index, PortOptions{}); err != nil {
		t.Fatalf("AttachIndex = %v", err)
	}
	if p, _ := ns.h.Port(ctx, cfg.Name); p.Master != br.Index || p.Isolated {
		t.Errorf("Port after AttachIndex = %+v, want master %d, not isolated", p, br.Index)
	}

	// vlan_tag on a bridge without VLAN filtering is metadata: no error.
	if err := ns.h.Attach(ctx, cfg.Name, "br0", PortOptions{VLAN: 42}); err != nil {
		t.Errorf("Attach with VLAN on a non-filtering bridge = %v, want nil", err)
	}

	// A tap left behind by a VM shows up as owned; foreign taps do not.
	if err := ns.h.Create(ctx, TapConfig{Name: "orphan7", VMID: "gone-vm", Index: 2}); err != nil {
		t.Fatal(err)
	}
	if err := ns.run(func() error { return makeTap(TapConfig{Name: "foreign0"}) }); err != nil {
		t.Fatal(err)
	}
	owned, err := ns.h.ListOwned(ctx)
	if err != nil {
		t.Fatalf("ListOwned = %v", err)
	}
	want := map[string]Owned{
		cfg.Name:  {Name: cfg.Name, VMID: "vm1", Index: 0, Master: br.Index, Whose: Unmarked},
		"orphan7": {Name: "orphan7", VMID: "gone-vm", Index: 2, Whose: Unmarked},
	}
	if len(owned) != len(want) {
		t.Errorf("ListOwned = %+v, want %d taps", owned, len(want))
	}
	for _, o := range owned {
		if o != want[o.Name] {
			t.Errorf("ListOwned has %+v, want %+v", o, want[o.Name])
		}
	}

	for i := range 2 {
		if err := ns.h.Delete(ctx, "orphan7"); err != nil {
			t.Errorf("Delete #%d = %v, want nil", i+1, err)
		}
	}
	if _, err := ns.h.Port(ctx, "orphan7"); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("Port of a deleted tap = %v, want fs.ErrNotExist", err)
	}
	if err := ns.h.Delete(ctx, "br0"); !errors.Is(err, ErrConflict) {
		t.Errorf("Delete of a bridge = %v, want ErrConflict", err)
	}
}

// TestIntegrationCreateRollback makes the kernel refuse the alias (longer
// than IFALIASZ) after the tap exists, and checks that it is removed again.
func TestIntegrationCreateRollback(t *testing.T) {
	ns := newTestNS(t)
	err := ns.h.Create(t.Context(), TapConfig{Name: "trb", VMID: strings.Repeat("v", 300)})
	if err == nil {
		t.Fatal("Create with a 300-byte vm id = nil, want the kernel's refusal")
	}
	if _, perr := ns.h.Port(t.Context(), "trb"); !errors.Is(perr, fs.ErrNotExist) {
		t.Errorf("after a failed Create (%v), the tap is still there (%v)", err, perr)
	}
}

func TestIntegrationAttachRefusals(t *testing.T) {
	ns := newTestNS(t)
	ctx := t.Context()
	ns.createTap("t0", 0)
	if err := ns.h.Attach(ctx, "t0", "nobr", PortOptions{}); !errors.Is(err, fs.ErrNotExist) || !strings.Contains(err.Error(), "bridge nobr does not exist") {
		t.Errorf("Attach to a missing bridge = %v, want fs.ErrNotExist naming the bridge", err)
	}
	if err := ns.h.AttachIndex(ctx, "t0", 9999, PortOptions{}); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("AttachIndex to a missing bridge = %v, want fs.ErrNotExist", err)
	}
	if err := ns.h.Attach(ctx, "t0", "lo", PortOptions{}); !errors.Is(err, ErrNotBridge) {
		t.Errorf("Attach to lo = %v, want ErrNotBridge", err)
	}
	ns.mustBridge("br0")
	if err := ns.h.Attach(ctx, "missing", "br0", PortOptions{}); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("Attach of a missing tap = %v, want fs.ErrNotExist", err)
	}
	if err := ns.h.Attach(ctx, "t0", "br0", PortOptions{VLAN: 4095}); err == nil {
		t.Errorf("Attach with VLAN 4095 = nil, want an error")
	}
	if p, _ := ns.h.Port(ctx, "t0"); p.Master != 0 {
		t.Errorf("refused attaches left the tap on bridge %d", p.Master)
	}
}

// TestIntegrationCheckBridge: what a create's preflight asks of a network's
// bridge, answered as Attach would fail.
func TestIntegrationCheckBridge(t *testing.T) {
	ns := newTestNS(t)
	ctx := t.Context()
	if err := ns.h.CheckBridge(ctx, "nobr"); !errors.Is(err, fs.ErrNotExist) || err.Error() != "bridge nobr does not exist" {
		t.Errorf("CheckBridge of a missing bridge = %v, want fs.ErrNotExist naming it", err)
	}
	if err := ns.h.CheckBridge(ctx, "lo"); !errors.Is(err, ErrNotBridge) {
		t.Errorf("CheckBridge(lo) = %v, want ErrNotBridge", err)
	}
	ns.mustBridge("br0")
	if err := ns.h.CheckBridge(ctx, "br0"); err != nil {
		t.Errorf("CheckBridge(br0) = %v", err)
	}
}

// TestIntegrationIsolation proves port isolation with traffic: guests on two
// isolated ports cannot reach each other, guests on ordinary ports can.
func TestIntegrationIsolation(t *testing.T) {
	netnstest.RequireRoot(t)
	for _, isolated := range []bool{false, true} {
		t.Run(map[bool]string{false: "open", true: "isolated"}[isolated], func(t *testing.T) {
			ns := newTestNS(t)
			ctx := t.Context()
			ns.mustBridge("br0")
			for i, name := range []string{"ta", "tb", "tc"} {
				ns.createTap(name, i)
				// tc is never isolated: it is the witness that frames flow.
				iso := isolated && name != "tc"
				if err := ns.h.Attach(ctx, name, "br0", PortOptions{Isolated: iso}); err != nil {
					t.Fatal(err)
				}
			}
			a, b, c := ns.guest("ta"), ns.guest("tb"), ns.guest("tc")
			ns.waitForwarding("ta", "tb", "tc")
			macA := mustMAC("02:00:00:00:00:0a")
			bcast := mustMAC("ff:ff:ff:ff:ff:ff")
			marker := []byte("isolation-probe")
			a.send(rawFrame(bcast, macA, 0x88b5, marker))
			// The bridge floods to tb and tc in one pass: once tc has the
			// frame, tb has it too, or never will.
			if _, ok := c.recvUntil(marker, 5*time.Second); !ok {
				t.Fatalf("witness port did not get the broadcast")
			}
			frames, _ := b.recvUntil(marker, 300*time.Millisecond)
			if got := sawMarker(frames, marker); got == isolated {
				t.Errorf("isolated=%t: frame reached the other port = %t", isolated, got)
			}
			// Unicast too.
			marker2 := []byte("isolation-unicast")
			macB := mustMAC("02:00:00:00:00:0b")
			b.send(rawFrame(bcast, macB, 0x88b5, []byte("learn-b"))) // bridge learns macB on tb
			a.send(rawFrame(macB, macA, 0x88b5, marker2))
			frames, _ = b.recvUntil(marker2, 500*time.Millisecond)
			if got := bytes.Contains(bytes.Join(frames, nil), marker2); got == isolated {
				t.Errorf("isolated=%t: unicast reached the other port = %t", isolated, got)
			}
		})
	}
}

// SetOwner gives an existing tap (one made before VMs were confined) to a
// VM's uid, single- or multi-queue, and refuses a missing tap or a bridge.
func TestIntegrationSetOwner(t *testing.T) {
	ns := newTestNS(t)
	ctx := t.Context()
	for _, mq := range []bool{false, true} {
		cfg := TapConfig{Name: "tset", VMID: "vm1", MultiQueue: mq}
		if err := ns.h.Create(ctx, cfg); err != nil {
			t.Fatal(err)
		}
		if err := ns.h.SetOwner(ctx, "tset", 1000042); err != nil {
			t.Fatalf("SetOwner (multi-queue %t) = %v", mq, err)
		}
		if l := ns.link("tset"); l.Owner != 1000042 || l.MultiQueue != mq {
			t.Errorf("tap owner %d, multi-queue %t; want 1000042, %t", l.Owner, l.MultiQueue, mq)
		}
		// Creating it again for that owner is the same tap.
		cfg.Owner = 1000042
		if err := ns.h.Create(ctx, cfg); err != nil {
			t.Errorf("Create with the new owner = %v", err)
		}
		if err := ns.h.Delete(ctx, "tset"); err != nil {
			t.Fatal(err)
		}
	}
	if err := ns.h.SetOwner(ctx, "tgone", 1000042); err == nil {
		t.Error("SetOwner of a missing tap succeeded")
	}
	if _, err := getLink(ns.c, "tgone", 0); !isNotExist(err) {
		t.Errorf("after SetOwner of a missing tap: %v, want it still missing", err)
	}
	ns.mustBridge("br0")
	if err := ns.h.SetOwner(ctx, "br0", 1000042); !errors.Is(err, ErrConflict) {
		t.Errorf("SetOwner of a bridge = %v, want ErrConflict", err)
	}
}
