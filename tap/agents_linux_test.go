package tap

import (
	"context"
	"errors"
	"io/fs"
	"net"
	"slices"
	"testing"
)

const (
	agentA = "aaaaaaaaaaaaaaaa"
	agentB = "bbbbbbbbbbbbbbbb"
)

// reapAs does what an agent's recovery does with ListMarked: delete its own
// taps that no record names, adopt the unmarked ones a record names, and
// leave everything else alone. records maps a VM id to its taps by index.
func reapAs(t *testing.T, h *Handle, records map[string][]string) (deleted, adopted []string) {
	t.Helper()
	ctx := t.Context()
	marked, err := h.ListMarked(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, o := range marked {
		taps := records[o.VMID]
		named := o.Index < len(taps) && taps[o.Index] == o.Name
		switch {
		case o.Whose == Mine && !named:
			if err := h.Delete(ctx, o.Name); err != nil {
				t.Fatalf("deleting orphan %s: %v", o.Name, err)
			}
			deleted = append(deleted, o.Name)
		case o.Whose == Unmarked && named:
			if err := h.Adopt(ctx, o.Name, o.VMID, o.Index); err != nil {
				t.Fatalf("adopting %s: %v", o.Name, err)
			}
			adopted = append(adopted, o.Name)
		}
	}
	return deleted, adopted
}

// TestIntegrationTwoAgents: two agents and an agent without an id make taps
// and anti-spoof chains in one namespace. Each agent's tap aliases and
// table carry its id; its ListOwned lists only its own; its reap deletes
// only its own orphans, adopts the unmarked tap its record names (and the
// next Guard moves that tap's chain into its table), and leaves the other
// agent's taps, rules and an unmarked stranger as they were.
func TestIntegrationTwoAgents(t *testing.T) {
	ns := newTestNS(t)
	ctx := t.Context()
	br := ns.mustBridge("br0")
	ha := New(&Config{NetNS: ns.fd, AgentID: agentA})
	hb := New(&Config{NetNS: ns.fd, AgentID: agentB})
	hu := ns.h // no agent id: the unmarked forms
	mac := net.HardwareAddr{0x52, 0x54, 0, 0, 0, 1}

	type tapOf struct {
		h    *Handle
		vmID string
	}
	taps := map[string]tapOf{ // by name
		Name("a1", 0): {ha, "a1"}, Name("a2", 0): {ha, "a2"},
		Name("b1", 0): {hb, "b1"}, Name("b2", 0): {hb, "b2"},
		Name("u1", 0): {hu, "u1"}, // an unmarked stranger
		Name("a3", 0): {hu, "a3"}, // unmarked, but agent A's record names it
	}
	for name, tt := range taps {
		if err := tt.h.Create(ctx, TapConfig{Name: name, VMID: tt.vmID}); err != nil {
			t.Fatalf("Create %s: %v", name, err)
		}
		if err := tt.h.Attach(ctx, name, "br0", PortOptions{Isolated: true}); err != nil {
			t.Fatal(err)
		}
		if err := tt.h.Guard(ctx, GuardRule{Tap: name, MAC: mac}); err != nil {
			t.Fatalf("Guard %s: %v", name, err)
		}
	}
	for name, tt := range taps {
		want := AgentAlias(tt.h.agent, tt.vmID, 0)
		if l := ns.link(name); l.Alias != want {
			t.Errorf("tap %s alias = %q, want %q", name, l.Alias, want)
		}
		if ok, err := ns.h.chainExists(GuardTableOf(tt.h.agent), guardChain(name)); err != nil || !ok {
			t.Errorf("chain of %s in table %s: %t, %v", name, GuardTableOf(tt.h.agent), ok, err)
		}
	}
	if GuardTableOf(agentA) != "vmhost-"+agentA {
		t.Errorf("agent A's table = %q", GuardTableOf(agentA))
	}

	marked, err := ha.ListMarked(ctx)
	if err != nil {
		t.Fatal(err)
	}
	wantWhose := map[string]Whose{Name("a1", 0): Mine, Name("a2", 0): Mine, Name("b1", 0): OtherAgent, Name("b2", 0): OtherAgent,
		Name("u1", 0): Unmarked, Name("a3", 0): Unmarked}
	if len(marked) != len(wantWhose) {
		t.Errorf("ListMarked = %+v, want %d taps", marked, len(wantWhose))
	}
	for _, o := range marked {
		if o.Whose != wantWhose[o.Name] || o.VMID != taps[o.Name].vmID || o.Master != br.Index || o.Agent != taps[o.Name].h.agent {
			t.Errorf("ListMarked has %+v; want whose %v, vm %s, agent %q", o, wantWhose[o.Name], taps[o.Name].vmID, taps[o.Name].h.agent)
		}
	}
	owned := func(h *Handle) []string {
		t.Helper()
		os, err := h.ListOwned(ctx)
		if err != nil {
			t.Fatal(err)
		}
		var names []string
		for _, o := range os {
			names = append(names, o.VMID)
		}
		slices.Sort(names)
		return names
	}
	for _, c := range []struct {
		h    *Handle
		want []string
	}{{ha, []string{"a1", "a2"}}, {hb, []string{"b1", "b2"}}, {hu, []string{"a3", "u1"}}} {
		if got := owned(c.h); !slices.Equal(got, c.want) {
			t.Errorf("ListOwned of agent %q = %v, want %v", c.h.agent, got, c.want)
		}
	}

	// Another agent's tap is never taken: not by Create, not by Adopt.
	if err := ha.Create(ctx, TapConfig{Name: Name("b1", 0), VMID: "b1"}); !errors.Is(err, ErrConflict) {
		t.Errorf("agent A creating agent B's tap = %v, want ErrConflict", err)
	}
	if err := ha.Adopt(ctx, Name("b1", 0), "b1", 0); !errors.Is(err, ErrConflict) {
		t.Errorf("agent A adopting agent B's tap = %v, want ErrConflict", err)
	}
	if err := ha.Adopt(ctx, Name("u1", 0), "other", 0); !errors.Is(err, ErrConflict) {
		t.Errorf("adopting an unmarked tap for another VM = %v, want ErrConflict", err)
	}
	if err := ha.Adopt(ctx, "vmhnothere", "x", 0); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("adopting a missing tap = %v, want fs.ErrNotExist", err)
	}
	if err := hu.Adopt(ctx, Name("u1", 0), "u1", 0); err == nil {
		t.Error("a handle without an agent id adopted a tap")
	}

	// Agent A reaps with records naming a1 and a3.
	deleted, adopted := reapAs(t, ha, map[string][]string{"a1": {Name("a1", 0)}, "a3": {Name("a3", 0)}})
	if !slices.Equal(deleted, []string{Name("a2", 0)}) || !slices.Equal(adopted, []string{Name("a3", 0)}) {
		t.Errorf("agent A's reap deleted %v and adopted %v; want [%s] and [%s]", deleted, adopted, Name("a2", 0), Name("a3", 0))
	}
	if l := ns.link(Name("a3", 0)); l.Alias != AgentAlias(agentA, "a3", 0) {
		t.Errorf("adopted tap alias = %q", l.Alias)
	}
	if err := ha.Adopt(ctx, Name("a3", 0), "a3", 0); err != nil {
		t.Errorf("adopting again = %v, want nil", err)
	}
	// The adopted tap stays guarded by its old chain until the next Guard
	// moves it into agent A's table.
	chainIn := func(table, tap string) bool {
		t.Helper()
		ok, err := ns.h.chainExists(table, guardChain(tap))
		if err != nil {
			t.Fatal(err)
		}
		return ok
	}
	if !chainIn(GuardTable, Name("a3", 0)) {
		t.Error("adoption removed the adopted tap's chain before a new one guards it")
	}
	if err := ha.Guard(ctx, GuardRule{Tap: Name("a3", 0), MAC: mac}); err != nil {
		t.Fatal(err)
	}
	if !chainIn(GuardTableOf(agentA), Name("a3", 0)) || chainIn(GuardTable, Name("a3", 0)) {
		t.Errorf("after Guard the adopted tap's chain is in A's table %t, in the unmarked table %t; want true, false",
			chainIn(GuardTableOf(agentA), Name("a3", 0)), chainIn(GuardTable, Name("a3", 0)))
	}

	// Agent B reaps with a record naming b1 only.
	deleted, adopted = reapAs(t, hb, map[string][]string{"b1": {Name("b1", 0)}})
	if !slices.Equal(deleted, []string{Name("b2", 0)}) || len(adopted) != 0 {
		t.Errorf("agent B's reap deleted %v and adopted %v; want [%s] and none", deleted, adopted, Name("b2", 0))
	}

	// What is left: each survivor with its alias, port and chain.
	survivors := map[string]string{ // tap → table of its chain
		Name("a1", 0): GuardTableOf(agentA), Name("a3", 0): GuardTableOf(agentA),
		Name("b1", 0): GuardTableOf(agentB), Name("u1", 0): GuardTable,
	}
	for name, table := range survivors {
		l := ns.link(name)
		want := AgentAlias(taps[name].h.agent, taps[name].vmID, 0)
		if name == Name("a3", 0) {
			want = AgentAlias(agentA, "a3", 0)
		}
		if l.Alias != want || l.Master != br.Index || !chainIn(table, name) {
			t.Errorf("after both reaps %s: alias %q, master %d, chain in %s %t; want %q, %d, true", name, l.Alias, l.Master, table, chainIn(table, name), want, br.Index)
		}
	}
	for _, gone := range []string{Name("a2", 0), Name("b2", 0)} {
		if _, err := ns.h.Port(ctx, gone); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("reaped tap %s: %v", gone, err)
		}
		for _, table := range []string{GuardTableOf(agentA), GuardTableOf(agentB), GuardTable} {
			if chainIn(table, gone) {
				t.Errorf("reaped tap %s left its chain in %s", gone, table)
			}
		}
	}

	// An unmarked tap re-created by its agent's Create is adopted too.
	if err := hu.Create(ctx, TapConfig{Name: Name("a4", 1), VMID: "a4", Index: 1}); err != nil {
		t.Fatal(err)
	}
	if err := ha.Create(ctx, TapConfig{Name: Name("a4", 1), VMID: "a4", Index: 1}); err != nil {
		t.Fatalf("agent A's Create over its unmarked tap = %v", err)
	}
	if l := ns.link(Name("a4", 1)); l.Alias != AgentAlias(agentA, "a4", 1) {
		t.Errorf("tap after Create over the unmarked one: alias %q", l.Alias)
	}
	// Delete takes the tap's chains in both tables.
	if err := hu.Guard(ctx, GuardRule{Tap: Name("a4", 1), MAC: mac}); err != nil {
		t.Fatal(err)
	}
	if err := ha.Delete(ctx, Name("a4", 1)); err != nil {
		t.Fatal(err)
	}
	if chainIn(GuardTable, Name("a4", 1)) {
		t.Error("Delete by the agent left the adopted tap's chain in the unmarked table")
	}
}

// TestIntegrationAgentBridge: a bridge an agent creates carries its id;
// RemoveBridge removes it only when it is that agent's and no interface is
// a port of it, and never a bridge the agent did not make.
func TestIntegrationAgentBridge(t *testing.T) {
	ns := newTestNS(t)
	ctx := context.Background()
	ha := New(&Config{NetNS: ns.fd, AgentID: agentA})
	hb := New(&Config{NetNS: ns.fd, AgentID: agentB})
	const dev = "vmhdevbr"
	if err := ha.CreateBridge(ctx, dev); err != nil {
		t.Fatal(err)
	}
	if l := ns.link(dev); l.Alias != BridgeAlias(agentA) || l.Flags&1 == 0 {
		t.Errorf("agent A's bridge: alias %q, flags %#x; want %q and up", l.Alias, l.Flags, BridgeAlias(agentA))
	}
	// Agent B uses it without taking it over.
	if err := hb.CreateBridge(ctx, dev); err != nil {
		t.Fatal(err)
	}
	if l := ns.link(dev); l.Alias != BridgeAlias(agentA) {
		t.Errorf("agent B's CreateBridge changed the alias to %q", l.Alias)
	}
	if ok, err := hb.RemoveBridge(ctx, dev); ok || err != nil {
		t.Errorf("agent B's RemoveBridge of A's bridge = %t, %v; want false, nil", ok, err)
	}
	if ok, err := ns.h.RemoveBridge(ctx, dev); ok || err != nil {
		t.Errorf("RemoveBridge without an agent id = %t, %v; want false, nil", ok, err)
	}
	// In use by a tap (a VM outliving the agent): kept.
	tap := Name("bridged", 0)
	if err := hb.Create(ctx, TapConfig{Name: tap, VMID: "bridged"}); err != nil {
		t.Fatal(err)
	}
	if err := hb.Attach(ctx, tap, dev, PortOptions{}); err != nil {
		t.Fatal(err)
	}
	if ok, err := ha.RemoveBridge(ctx, dev); ok || err != nil {
		t.Errorf("RemoveBridge of a bridge with a port = %t, %v; want false, nil", ok, err)
	}
	ns.link(dev) // still there
	if err := hb.Delete(ctx, tap); err != nil {
		t.Fatal(err)
	}
	if ok, err := ha.RemoveBridge(ctx, dev); !ok || err != nil {
		t.Errorf("RemoveBridge of the agent's unused bridge = %t, %v; want true, nil", ok, err)
	}
	if _, err := getLink(ns.c, dev, 0); !isNotExist(err) {
		t.Errorf("the bridge is still there: %v", err)
	}
	if ok, err := ha.RemoveBridge(ctx, dev); ok || err != nil {
		t.Errorf("RemoveBridge of a missing bridge = %t, %v; want false, nil", ok, err)
	}
	// The host's own bridge (no alias) is used and never removed.
	ns.mustBridge("br0")
	if err := ha.CreateBridge(ctx, "br0"); err != nil {
		t.Fatal(err)
	}
	if ok, err := ha.RemoveBridge(ctx, "br0"); ok || err != nil || ns.link("br0").Alias != "" {
		t.Errorf("RemoveBridge of the host's bridge = %t, %v (alias %q); want false, nil and no alias", ok, err, ns.link("br0").Alias)
	}
	// A bad agent id marks nothing.
	bad := New(&Config{NetNS: ns.fd, AgentID: "Not:An:Id"})
	if err := bad.CreateBridge(ctx, "vmhbad"); err == nil {
		t.Error("CreateBridge with a bad agent id succeeded")
	}
	if err := bad.Create(ctx, TapConfig{Name: "vmhbad", VMID: "x"}); err == nil {
		t.Error("Create with a bad agent id succeeded")
	}
}
