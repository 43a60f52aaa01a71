package tap

import (
	"errors"
	"io/fs"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/mdlayher/netlink"
	"github.com/mdlayher/netlink/nltest"
	"golang.org/x/sys/unix"
)

func neighReply(state uint16, ip netip.Addr, mac net.HardwareAddr, updated uint32) netlink.Message {
	hdr := make([]byte, unix.SizeofNdMsg)
	hdr[0] = unix.AF_INET
	putNative32(hdr[4:8], 7)
	hdr[8], hdr[9] = byte(state), byte(state>>8)
	ae := netlink.NewAttributeEncoder()
	ae.Bytes(unix.NDA_DST, ip.AsSlice())
	if mac != nil {
		ae.Bytes(unix.NDA_LLADDR, mac)
	}
	ci := make([]byte, 16)
	putNative32(ci[8:12], updated)
	ae.Bytes(unix.NDA_CACHEINFO, ci)
	b, err := ae.Encode()
	if err != nil {
		panic(err)
	}
	return netlink.Message{Header: netlink.Header{Type: unix.RTM_NEWNEIGH}, Data: append(hdr, b...)}
}

func TestLastIPv4Choice(t *testing.T) {
	entries := []netlink.Message{
		neighReply(unix.NUD_STALE, netip.MustParseAddr("10.0.0.10"), guestMAC, 5000),
		neighReply(unix.NUD_REACHABLE, netip.MustParseAddr("10.0.0.11"), guestMAC, 300), // newest
		neighReply(unix.NUD_FAILED, netip.MustParseAddr("10.0.0.12"), guestMAC, 1),
		neighReply(unix.NUD_REACHABLE, netip.MustParseAddr("10.0.0.13"), otherMAC, 0),
		neighReply(unix.NUD_INCOMPLETE, netip.MustParseAddr("10.0.0.14"), nil, 0),
	}
	h := New(nil)
	h.dial = func(int) (*netlink.Conn, error) {
		return nltest.Dial(nltest.CheckRequest(
			[]netlink.HeaderType{unix.RTM_GETNEIGH}, []netlink.HeaderFlags{netlink.Request | netlink.Dump},
			func(reqs []netlink.Message) ([]netlink.Message, error) {
				if fam := reqs[0].Data[0]; fam != unix.AF_INET {
					t.Errorf("dump family %d, want AF_INET", fam)
				}
				// Multipart turns the last message into NLMSG_DONE.
				out := append(append([]netlink.Message(nil), entries...), netlink.Message{Data: make([]byte, 4)})
				for i := range out {
					out[i].Header.Sequence, out[i].Header.PID = reqs[0].Header.Sequence, reqs[0].Header.PID
				}
				return nltest.Multipart(out)
			})), nil
	}
	got, err := h.LastIPv4(t.Context(), guestMAC)
	if want := netip.MustParseAddr("10.0.0.11"); err != nil || got != want {
		t.Errorf("LastIPv4 = %v, %v, want %v", got, err, want)
	}
	if got, err := h.LastIPv4(t.Context(), mustMAC("02:00:00:00:00:99")); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("LastIPv4 of an unknown MAC = %v, %v, want fs.ErrNotExist", got, err)
	}
}

// TestIntegrationLastIPv4 lets a guest ARP for the host's bridge address, so
// the kernel learns its neighbour entry, and reads it back.
func TestIntegrationLastIPv4(t *testing.T) {
	ns := newTestNS(t)
	ns.mustBridge("br0")
	ns.addAddr("br0", netip.MustParsePrefix("10.0.0.1/24"))
	ns.createTap("tg", 0)
	if err := ns.h.Attach(t.Context(), "tg", "br0", PortOptions{}); err != nil {
		t.Fatal(err)
	}
	g := ns.guest("tg")
	ns.waitForwarding("tg")

	if _, err := ns.h.LastIPv4(t.Context(), guestMAC); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("LastIPv4 before any traffic = %v, want fs.ErrNotExist", err)
	}
	waitFor := func(want netip.Addr) {
		t.Helper()
		deadline := time.Now().Add(5 * time.Second)
		for {
			got, err := ns.h.LastIPv4(t.Context(), guestMAC)
			if err == nil && got == want {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("LastIPv4 = %v, %v, want %v", got, err, want)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	g.send(arpFrame(guestMAC, guestMAC, netip.MustParseAddr("10.0.0.10"), serverIP, nil))
	waitFor(netip.MustParseAddr("10.0.0.10"))
	// The guest moves to another address: the newer entry wins.
	time.Sleep(50 * time.Millisecond) // cache ages count in 10 ms ticks
	g.send(arpFrame(guestMAC, guestMAC, netip.MustParseAddr("10.0.0.11"), serverIP, nil))
	waitFor(netip.MustParseAddr("10.0.0.11"))
}
