//go:build linux

package e2e

import (
	"context"
	"net/http"
	"strings"
	"testing"

	"vmhost/tap"
)

// ownedTaps lists the taps in the server's namespace that carry its
// agent's id.
func (s *server) ownedTaps(t *testing.T) []tap.Owned {
	t.Helper()
	owned, err := s.taps.ListOwned(context.Background())
	if err != nil {
		t.Fatalf("listing taps: %v", err)
	}
	return owned
}

// TestIntegrationTapsAndSeed creates a cloud-init VM with two interfaces
// on the server's bridge and boots it: chsim opens the taps (it refuses
// taps that do not exist), the ports are isolated, and delete removes the
// taps and nothing else.
func TestIntegrationTapsAndSeed(t *testing.T) {
	s := startServer(t, serverOpts{netns: true})
	f := newFixture(t)
	body := f.body("net", true, `,"nets":[{"ipv4":{"address":"192.0.2.10/24","gateway":"192.0.2.1"},"rate_limit_mbps":100,"allowed_ips":["198.51.100.0/24"]},{"isolated":false,"spoof_guard":false,"vlan_tag":7}],`+
		`"cloud_init":{"ssh_authorized_keys":["ssh-ed25519 AAAAC3Nza e2e@test"],"password":"e2e-secret"}`)
	v := s.create(body, http.StatusCreated)
	s.waitDisplay("net", "running", "running")
	if len(v.Nets) != 2 {
		t.Fatalf("nets = %+v", v.Nets)
	}
	owned := s.ownedTaps(t)
	if len(owned) != 2 {
		t.Fatalf("owned taps = %+v, want 2", owned)
	}
	ctx := context.Background()
	for i, n := range v.Nets {
		p, err := s.taps.Port(ctx, n.TapName)
		if err != nil {
			t.Fatalf("tap %s: %v", n.TapName, err)
		}
		if p.Master == 0 {
			t.Errorf("tap %s is on no bridge", n.TapName)
		}
		if want := i == 0; p.Isolated != want {
			t.Errorf("tap %s isolated = %t, want %t (network policy, then the per-NIC override)", n.TapName, p.Isolated, want)
		}
		if n.Bridge != s.bridge {
			t.Errorf("net %d bridge = %q", i, n.Bridge)
		}
	}
	if !exists(s.stateDir + "/vms/net/seed.img") {
		t.Error("no seed image")
	}
	if st, b := s.do("GET", "/api/vms/net", ""); st != 200 || strings.Contains(string(b), "e2e-secret") {
		t.Errorf("view = %d, or it leaks the password: %s", st, b)
	}
	if st, b := s.do("DELETE", "/api/vms/net?force=true", ""); st != http.StatusNoContent {
		t.Fatalf("DELETE = %d %s", st, b)
	}
	checkGone(t, s, "net")
	if owned := s.ownedTaps(t); len(owned) != 0 {
		t.Errorf("taps left after delete: %+v", owned)
	}
	// The bridge is the host's: it must still be there.
	if _, err := s.taps.Port(ctx, s.bridge); err != nil {
		t.Errorf("bridge %s after delete: %v", s.bridge, err)
	}
}

// TestIntegrationStartRecreatesTaps: a host reboot removes every tap while
// the records keep them; starting a stopped VM afterwards makes its taps
// again, on their bridge with their policy, and boots.
func TestIntegrationStartRecreatesTaps(t *testing.T) {
	s := startServer(t, serverOpts{netns: true})
	f := newFixture(t)
	v := s.create(f.body("rb", true, `,"nets":[{},{"isolated":false}]`), http.StatusCreated)
	s.waitDisplay("rb", "running", "running")
	if st := s.act("rb", "stop"); st != http.StatusNoContent {
		t.Fatalf("stop = %d", st)
	}
	ctx := context.Background()
	for _, n := range v.Nets { // what a reboot does to them
		if err := s.taps.Delete(ctx, n.TapName); err != nil {
			t.Fatal(err)
		}
	}
	if owned := s.ownedTaps(t); len(owned) != 0 {
		t.Fatalf("taps still there: %+v", owned)
	}
	if st := s.act("rb", "start"); st != http.StatusNoContent {
		t.Fatalf("start = %d", st)
	}
	s.waitDisplay("rb", "running", "running")
	for i, n := range v.Nets {
		p, err := s.taps.Port(ctx, n.TapName)
		if err != nil {
			t.Fatalf("tap %s after start: %v", n.TapName, err)
		}
		if want := i == 0; p.Master == 0 || p.Isolated != want {
			t.Errorf("tap %s: on bridge %d, isolated %t; want on the bridge, isolated %t", n.TapName, p.Master, p.Isolated, want)
		}
	}
}

// TestIntegrationMissingBridge: the default network's bridge does not
// exist, so a create with an interface is refused before anything is made
// (400 naming the network, its bridge and how to make it): no record, no
// files, no taps, no processes; a retry with the same id works once the
// bridge exists.
func TestIntegrationMissingBridge(t *testing.T) {
	s := startServer(t, serverOpts{netns: true, noBridge: true})
	f := newFixture(t)
	body := f.body("nobr", true, `,"cloud_init":{"ssh_authorized_keys":["ssh-ed25519 AAAAC3Nza e2e@test"]}`)
	st, b := s.do("POST", "/api/vms", body)
	want := `cloud_init: network \"default\"'s bridge ` + s.bridge + ` does not exist on this host: create it (ip link add ` + s.bridge + ` type bridge`
	if st != http.StatusBadRequest || !strings.Contains(string(b), `"code":"BAD_REQUEST"`) || !strings.Contains(string(b), want) {
		t.Fatalf("POST = %d %s, want 400 BAD_REQUEST saying %s", st, b, want)
	}
	checkGone(t, s, "nobr")
	if owned := s.ownedTaps(t); len(owned) != 0 {
		t.Errorf("taps made for a refused create: %+v", owned)
	}
	if err := s.taps.CreateBridge(context.Background(), s.bridge); err != nil {
		t.Fatal(err)
	}
	s.create(body, http.StatusCreated)
	s.waitDisplay("nobr", "running", "running")
}
