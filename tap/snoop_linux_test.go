package tap

import (
	"context"
	"errors"
	"io/fs"
	"net/netip"
	"testing"
	"time"
)

// TestIntegrationSnoop sends DHCP replies across a bridge toward a guest tap
// and checks that only a DHCPACK for the guest's MAC is learned.
func TestIntegrationSnoop(t *testing.T) {
	ns := newTestNS(t)
	ns.mustBridge("br0")
	for i, name := range []string{"tguest", "tsrv"} {
		ns.createTap(name, i)
		if err := ns.h.Attach(t.Context(), name, "br0", PortOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	g, srv := ns.guest("tguest"), ns.guest("tsrv")
	ns.waitForwarding("tguest", "tsrv")
	srvMAC := mustMAC("02:00:00:00:00:01")

	s, err := ns.h.Snoop("tguest", guestMAC)
	if err != nil {
		t.Fatalf("Snoop = %v", err)
	}
	defer s.Close()

	reply := func(msg []byte) []byte {
		return udpFrame(guestMAC, srvMAC, serverIP, bcastIP, 67, 68, msg)
	}
	offer := dhcpReply(dhcpOffer, guestMAC, netip.MustParseAddr("10.0.0.77"))
	foreignACK := dhcpReply(dhcpACK, otherMAC, netip.MustParseAddr("10.0.0.78"))
	malformed := dhcpReply(dhcpACK, guestMAC, netip.MustParseAddr("10.0.0.79"))[:200]
	for _, msg := range [][]byte{offer, foreignACK, malformed} {
		srv.send(reply(msg))
	}
	// An ACK the guest sends itself (a rogue server in the VM) travels away
	// from the guest and must not be learned either.
	g.send(udpFrame(srvMAC, guestMAC, serverIP, bcastIP, 67, 68, dhcpReply(dhcpACK, guestMAC, netip.MustParseAddr("10.0.0.80"))))
	srv.send(reply(dhcpReply(dhcpACK, guestMAC, netip.MustParseAddr("10.0.0.50"))))

	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
	defer cancel()
	b, err := s.Next(ctx)
	if err != nil {
		t.Fatalf("Next = %v", err)
	}
	if want := netip.MustParseAddr("10.0.0.50"); b.IP != want || b.Prefix != netip.MustParsePrefix("10.0.0.50/24") || b.Lease != time.Hour {
		t.Errorf("Next = %+v, want %v/24 for an hour (earlier replies must be ignored)", b, want)
	}
	// The guest did receive the frames: the snooper watched, not consumed.
	if _, ok := g.recvUntil([]byte{10, 0, 0, 50}, 2*time.Second); !ok {
		t.Errorf("guest did not receive the DHCPACK")
	}

	short, cancel2 := context.WithTimeout(t.Context(), 100*time.Millisecond)
	defer cancel2()
	if b, err := s.Next(short); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Next with nothing to learn = %+v, %v, want deadline exceeded", b, err)
	}

	// Deleting the tap ends the snooper with an error, not a hang.
	if err := ns.h.Delete(t.Context(), "tguest"); err != nil {
		t.Fatal(err)
	}
	gone, cancel3 := context.WithTimeout(t.Context(), 5*time.Second)
	defer cancel3()
	if b, err := s.Next(gone); err == nil || errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Next after the tap was deleted = %+v, %v, want the socket's error", b, err)
	}

	if _, err := ns.h.Snoop("absent", guestMAC); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("Snoop on a missing tap = %v, want fs.ErrNotExist", err)
	}
}
