package engine

import (
	"context"
	"fmt"
	"os/exec"
	"strings"
	"testing"
	"time"

	"vmhost/internal/netnstest"
	"vmhost/tap"
	"vmhost/vm/record"
)

// testNetNS returns a fresh network namespace's fd and a function that
// runs f on its thread (so processes f starts live in the namespace).
func testNetNS(t *testing.T) (int, func(f func() error) error) {
	t.Helper()
	netnstest.RequireTun(t)
	ns := netnstest.New(t)
	return ns.FD, ns.Run
}

// TestIntegrationGuestFacts snoops a DHCP ACK that chsim injects on a real
// tap, reads a neighbour entry, and keeps the observed address after the
// entry is gone.
func TestIntegrationGuestFacts(t *testing.T) {
	fd, inNS := testNetNS(t)
	h := tap.New(&tap.Config{NetNS: fd})
	ctx := context.Background()
	nic := record.NIC{MAC: "02:00:00:00:00:01", Tap: record.TapName("vm1", 0)}
	if err := h.Create(ctx, tap.TapConfig{Name: nic.Tap, VMID: "vm1", Index: 0}); err != nil {
		t.Fatal(err)
	}
	s := newTestService(t)
	s.o.Taps = h
	s.mon.factsEvery = 100 * time.Millisecond
	r := startVMWith(t, s, "vm1", vmOpts{nics: []record.NIC{nic}, launch: inNS})
	s.watch(r.id, r.ch, r.qsd)

	// A DHCP server on the host side answers the guest: the ACK leaves the
	// host through the tap. The snooper starts with the monitor,
	// asynchronously; a guest's DHCP client retries, and so does this test.
	var rec *record.Record
	for i := 0; ; i++ {
		// The simulator sends the ACK out of the tap toward the guest, as a
		// DHCP server behind the bridge would.
		r.sim(t, "dhcp-ack", `{"ip":"10.9.0.23","server":"10.9.0.1"}`)
		time.Sleep(200 * time.Millisecond)
		if rec = s.recs.Get(r.id); rec.NICs[0].DHCPSnoopedIPv4 == "10.9.0.23" {
			break
		}
		if i == 25 {
			t.Fatalf("dhcp_snooped_ipv4 = %q after 5s of ACKs; logs:\n%s", rec.NICs[0].DHCPSnoopedIPv4, s.logs)
		}
	}
	if d := record.DiscoveredIPv4(rec.NICs); d != "10.9.0.23" {
		t.Errorf("discovered_ipv4 %q, want the snooped address", d)
	}

	ipCmd := func(args ...string) error {
		if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
			return fmt.Errorf("ip %s: %v: %s", strings.Join(args, " "), err, out)
		}
		return nil
	}
	if _, err := exec.LookPath("ip"); err != nil {
		t.Skip("ip (iproute2) not installed: cannot add a neighbour entry")
	}
	if err := inNS(func() error {
		return ipCmd("neigh", "replace", "10.9.0.50", "lladdr", nic.MAC, "dev", nic.Tap, "nud", "stale")
	}); err != nil {
		t.Fatal(err)
	}
	rec, _ = waitRecord(t, s, r.id, 2*time.Second, "last_observed_ipv4", func(r *record.Record) bool { return r.NICs[0].LastObservedIPv4 == "10.9.0.50" })
	if d := record.DiscoveredIPv4(rec.NICs); d != "10.9.0.23" || rec.NICs[0].LastObservedIPv4 != "10.9.0.50" {
		t.Errorf("discovered_ipv4 %q (want the snooped address first), nets[0] observed %q", d, rec.NICs[0].LastObservedIPv4)
	}
	if err := inNS(func() error { return ipCmd("neigh", "del", "10.9.0.50", "dev", nic.Tap) }); err != nil {
		t.Fatal(err)
	}
	time.Sleep(500 * time.Millisecond) // several polls
	if got := s.recs.Get(r.id).NICs[0].LastObservedIPv4; got != "10.9.0.50" {
		t.Errorf("last_observed_ipv4 after the neighbour entry expired = %q, want it kept", got)
	}
}
