//go:build linux

package e2e

import (
	"encoding/json"
	"net/http"
	"testing"
	"time"

	"vmhost/chclient/chsim"
	"vmhost/internal/netnstest"
)

// facts is the guest-fact part of a view.
type facts struct {
	DiscoveredIPv4 string `json:"discovered_ipv4"`
	Nets           []struct {
		TapName         string `json:"tap_name"`
		MAC             string `json:"mac"`
		DHCPSnoopedIPv4 string `json:"dhcp_snooped_ipv4"`
	} `json:"nets"`
}

// waitSnooped sends DHCP ACKs for want out of the VM's tap toward the
// guest, as a DHCP server behind the bridge would, until the
// view shows it (the snooper starts with the VM's monitor; a guest's DHCP
// client retries too).
func (s *server) waitSnooped(t *testing.T, id, want string) facts {
	t.Helper()
	var f facts
	deadline := time.Now().Add(10 * time.Second)
	for {
		if err := json.Unmarshal([]byte(s.rawView(id)), &f); err != nil {
			t.Fatal(err)
		}
		if f.Nets[0].DHCPSnoopedIPv4 == want && f.DiscoveredIPv4 == want {
			return f
		}
		if time.Now().After(deadline) {
			t.Fatalf("view of %s: %+v, want %s snooped and discovered", id, f, want)
		}
		// As the DHCP server: the confined simulator may not send on the
		// tap itself (no CAP_NET_RAW).
		if err := netnstest.RunIn(s.nsFD, func() error {
			return chsim.SendDHCPAck(f.Nets[0].TapName, f.Nets[0].MAC, want, "10.9.0.1")
		}); err != nil {
			t.Fatalf("sending a DHCP ACK: %v", err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// TestIntegrationRestartKeepsGuestFacts: the address a DHCP server gave a
// guest, snooped on its tap, is in the view, survives an agent crash and
// restart (it is in the record), and a new lease after the restart is
// snooped again.
func TestIntegrationRestartKeepsGuestFacts(t *testing.T) {
	s := startServer(t, serverOpts{netns: true})
	f := newFixture(t)
	s.create(f.body("facts", true, `,"nets":[{}]`), http.StatusCreated)
	s.waitDisplay("facts", "running", "running")
	s.waitSnooped(t, "facts", "10.9.0.23")
	before := s.rawView("facts")
	s.kill()
	s.restart()
	if got := s.rawView("facts"); got != before {
		t.Errorf("view changed across the restart:\nbefore %s\nafter  %s", before, got)
	}
	s.waitSnooped(t, "facts", "10.9.0.42")
}
