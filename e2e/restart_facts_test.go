package e2e

import (
	"encoding/binary"
	"encoding/json"
	"net"
	"net/http"
	"runtime"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// sendDHCPAck transmits, in the server's network namespace, a DHCPACK
// giving mac the address ip out of the tap, as a DHCP server behind the
// bridge would.
func (s *server) sendDHCPAck(t *testing.T, tapName, mac string, ip [4]byte) {
	t.Helper()
	hw, err := net.ParseMAC(mac)
	if err != nil {
		t.Fatal(err)
	}
	msg := make([]byte, 240) // BOOTP reply: op, htype, hlen, yiaddr, chaddr, magic
	msg[0], msg[1], msg[2] = 2, 1, 6
	copy(msg[16:20], ip[:])
	copy(msg[28:34], hw)
	copy(msg[236:240], []byte{99, 130, 83, 99})
	msg = append(msg, 53, 1, 5, 54, 4, 10, 9, 0, 1, 51, 4, 0, 0, 0x0e, 0x10, 1, 4, 255, 255, 255, 0, 255)
	udp := make([]byte, 8, 8+len(msg))
	binary.BigEndian.PutUint16(udp[0:2], 67)
	binary.BigEndian.PutUint16(udp[2:4], 68)
	binary.BigEndian.PutUint16(udp[4:6], uint16(8+len(msg)))
	udp = append(udp, msg...)
	iph := make([]byte, 20)
	iph[0], iph[8], iph[9] = 0x45, 64, 17
	binary.BigEndian.PutUint16(iph[2:4], uint16(20+len(udp)))
	copy(iph[12:16], []byte{10, 9, 0, 1})
	copy(iph[16:20], []byte{255, 255, 255, 255})
	var sum uint32
	for i := 0; i < 20; i += 2 {
		sum += uint32(binary.BigEndian.Uint16(iph[i : i+2]))
	}
	for sum > 0xffff {
		sum = sum&0xffff + sum>>16
	}
	binary.BigEndian.PutUint16(iph[10:12], ^uint16(sum))
	frame := append(append([]byte{}, hw...), 2, 0, 0, 0, 0, 0xfe, 8, 0)
	frame = append(append(frame, iph...), udp...)
	errc := make(chan error)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread ends with the goroutine
		if err := unix.Setns(s.nsFD, unix.CLONE_NEWNET); err != nil {
			errc <- err
			return
		}
		ifi, err := net.InterfaceByName(tapName)
		if err != nil {
			errc <- err
			return
		}
		fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			errc <- err
			return
		}
		defer unix.Close(fd)
		errc <- unix.Sendto(fd, frame, 0, &unix.SockaddrLinklayer{Ifindex: ifi.Index, Halen: 6,
			Addr: [8]byte{hw[0], hw[1], hw[2], hw[3], hw[4], hw[5]}})
	}()
	if err := <-errc; err != nil {
		t.Fatalf("sending a DHCP ACK on %s: %v", tapName, err)
	}
}

// facts is the guest-fact part of a view.
type facts struct {
	DiscoveredIPv4 string `json:"discovered_ipv4"`
	Nets           []struct {
		TapName         string `json:"tap_name"`
		MAC             string `json:"mac"`
		DHCPSnoopedIPv4 string `json:"dhcp_snooped_ipv4"`
	} `json:"nets"`
}

// waitSnooped sends ACKs for ip until the view shows it (the snooper
// starts with the VM's monitor; a guest's DHCP client retries too).
func (s *server) waitSnooped(t *testing.T, id string, ip [4]byte, want string) facts {
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
		s.sendDHCPAck(t, f.Nets[0].TapName, f.Nets[0].MAC, ip)
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
	s.waitSnooped(t, "facts", [4]byte{10, 9, 0, 23}, "10.9.0.23")
	before := s.rawView("facts")
	s.kill()
	s.restart()
	if got := s.rawView("facts"); got != before {
		t.Errorf("view changed across the restart:\nbefore %s\nafter  %s", before, got)
	}
	s.waitSnooped(t, "facts", [4]byte{10, 9, 0, 42}, "10.9.0.42")
}
