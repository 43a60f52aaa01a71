package chsim_test

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"vmhost/internal/netnstest"
)

func netConfig(t testing.TB, p *simProc, tap string) string {
	cfg := minimalConfig(t, p.dir)
	return strings.TrimSuffix(cfg, "}") + fmt.Sprintf(`,"net":[{"tap":%q,"mac":"02:00:00:00:00:01","mtu":1500}]}`, tap)
}

// TestBootMissingTap fails like CH: vm.boot answers 500 and the VM stays Created.
func TestBootMissingTap(t *testing.T) {
	p := startSim(t)
	p.wantStatus("PUT", "/api/v1/vm.create", netConfig(t, p, "vmhnosuch0"), 204)
	data := p.wantStatus("PUT", "/api/v1/vm.boot", "", 500)
	chain := errorChain(t, data)
	if len(chain) < 3 || chain[1] != "The VM could not boot" || !strings.Contains(lastOf(chain), "vmhnosuch0") {
		t.Errorf("boot with a missing tap = %q", chain)
	}
	if s := p.state(); s != "Created" {
		t.Errorf("state = %s", s)
	}
	p.waitEvents("vm/booting")
	for _, ev := range p.eventsSoFar() {
		if ev.String() == "vm/booted" {
			t.Error("vm booted event after a failed boot")
		}
	}
}

// waitRunning waits for the tap's IFF_RUNNING (carrier while a queue is attached) to
// equal want. The kernel reports a lost carrier through linkwatch, which batches such
// events for up to a second.
func waitRunning(name string, want bool, when string) error {
	deadline := time.Now().Add(5 * time.Second)
	for {
		up, err := tapRunning(name)
		if err == nil && up == want {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s: running=%v, %v; want %v", when, up, err, want)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func htons(v uint16) uint16 { return v<<8 | v>>8 }

// createPersistentTap makes a tap that outlives its fd, as vmhost's tap package does.
func createPersistentTap(name string) error {
	fd, err := unix.Open("/dev/net/tun", unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	ifr, err := unix.NewIfreq(name)
	if err != nil {
		return err
	}
	ifr.SetUint16(unix.IFF_TAP | unix.IFF_NO_PI | unix.IFF_VNET_HDR)
	if err := unix.IoctlIfreq(fd, unix.TUNSETIFF, ifr); err != nil {
		return fmt.Errorf("TUNSETIFF: %w", err)
	}
	if err := unix.IoctlSetInt(fd, unix.TUNSETPERSIST, 1); err != nil {
		return fmt.Errorf("TUNSETPERSIST: %w", err)
	}
	// Bring it up, so that the kernel reports carrier (IFF_RUNNING) while a queue is
	// attached.
	s, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(s)
	if err := unix.IoctlIfreq(s, unix.SIOCGIFFLAGS, ifr); err != nil {
		return fmt.Errorf("SIOCGIFFLAGS: %w", err)
	}
	ifr.SetUint16(ifr.Uint16() | unix.IFF_UP)
	if err := unix.IoctlIfreq(s, unix.SIOCSIFFLAGS, ifr); err != nil {
		return fmt.Errorf("SIOCSIFFLAGS: %w", err)
	}
	return nil
}

func tapRunning(name string) (bool, error) {
	ifi, err := net.InterfaceByName(name)
	if err != nil {
		return false, err
	}
	return ifi.Flags&net.FlagRunning != 0, nil
}

// TestIntegrationTapAttach boots a VM whose net[] names a tap in a network namespace of
// the test's own, and checks through the kernel that the simulator holds the tap open
// while the VM runs and lets go when it stops.
func TestIntegrationTapAttach(t *testing.T) {
	// Everything that touches the namespace runs on its thread; the
	// simulator, started from that thread, inherits the namespace.
	ns := netnstest.New(t)
	netnstest.RequireTun(t)
	const tap = "vmhtap0"
	if err := ns.Run(func() error { return createPersistentTap(tap) }); err != nil {
		t.Fatalf("creating tap %s in the test's namespace: %v", tap, err)
	}
	inNS := ns.Run
	var p *simProc
	if err := inNS(func() error { p = startSimNoFatal(t); return nil }); err != nil {
		t.Fatal(err)
	}
	if p == nil {
		t.Fatal("simulator did not start")
	}
	p.wantStatus("PUT", "/api/v1/vm.create", netConfig(t, p, tap), 204)
	if err := inNS(func() error { return waitRunning(tap, false, "before boot") }); err != nil {
		t.Fatal(err)
	}
	p.wantStatus("PUT", "/api/v1/vm.boot", "", 204)
	var st struct{ Taps []string }
	json.Unmarshal(p.wantStatus("GET", "/sim/v1/status", "", 200), &st)
	if len(st.Taps) != 1 || st.Taps[0] != tap {
		t.Errorf("simulator taps = %v", st.Taps)
	}
	if err := inNS(func() error { return waitRunning(tap, true, "after boot") }); err != nil {
		t.Fatal(err)
	}

	// A DHCP ACK injected by the simulator travels the tap toward the guest
	// as a real frame: a packet socket on the tap sees it outgoing.
	var sock int
	if err := inNS(func() error {
		ifi, err := net.InterfaceByName(tap)
		if err != nil {
			return err
		}
		sock, err = unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, int(htons(unix.ETH_P_ALL)))
		if err != nil {
			return err
		}
		return unix.Bind(sock, &unix.SockaddrLinklayer{Protocol: htons(unix.ETH_P_ALL), Ifindex: ifi.Index})
	}); err != nil {
		t.Fatal(err)
	}
	defer unix.Close(sock)
	unix.SetsockoptTimeval(sock, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &unix.Timeval{Sec: 5})
	p.wantStatus("PUT", "/sim/v1/dhcp-ack", `{"ip":"10.9.0.23","server":"10.9.0.1","router":"10.9.0.1","lease":600}`, 204)
	// The kernel also sends its own frames (IPv6 DAD, MLD) out of a tap that came up:
	// look for the IPv4 UDP frame to port 68.
	var frame []byte
	for i := 0; i < 50 && frame == nil; i++ {
		buf := make([]byte, 2048)
		n, from, err := unix.Recvfrom(sock, buf, 0)
		if err != nil {
			t.Fatalf("no DHCP frame on the tap: %v", err)
		}
		if buf = buf[:n]; n > 14+20+8 && buf[12] == 8 && buf[13] == 0 && buf[14+9] == 17 && buf[14+20+2] == 0 && buf[14+20+3] == 68 {
			frame = buf
			if ll, ok := from.(*unix.SockaddrLinklayer); !ok || ll.Pkttype != unix.PACKET_OUTGOING {
				t.Errorf("DHCP frame source %+v, want a frame going out of the tap to the guest", from)
			}
		}
	}
	if frame == nil || len(frame) < 14+20+8+243 || !bytes.Equal(frame[0:6], []byte{2, 0, 0, 0, 0, 1}) {
		t.Fatalf("frame = % x", frame)
	}
	bootp := frame[14+20+8:]
	if bootp[0] != 2 || !bytes.Equal(bootp[16:20], []byte{10, 9, 0, 23}) || !bytes.Equal(bootp[28:34], []byte{2, 0, 0, 0, 0, 1}) ||
		!bytes.Equal(bootp[240:243], []byte{53, 1, 5}) {
		t.Errorf("BOOTP = % x, want an ACK for 10.9.0.23 to 02:00:00:00:00:01", bootp)
	}

	p.wantStatus("PUT", "/api/v1/vm.shutdown", "", 204)
	if err := inNS(func() error { return waitRunning(tap, false, "after shutdown") }); err != nil {
		t.Fatal(err)
	}
}

// TestRestoreReattachesTap: a restore in a new process opens the VM's tap by name again,
// as a boot does; the process that took the snapshot let go of it when it ended.
func TestRestoreReattachesTap(t *testing.T) {
	ns := netnstest.New(t)
	netnstest.RequireTun(t)
	const tap = "vmhtap1"
	if err := ns.Run(func() error { return createPersistentTap(tap) }); err != nil {
		t.Fatal(err)
	}
	start := func() *simProc {
		var p *simProc
		if err := ns.Run(func() error { p = startSimNoFatal(t); return nil }); err != nil || p == nil {
			t.Fatalf("starting the simulator: %v", err)
		}
		return p
	}
	p := start()
	p.wantStatus("PUT", "/api/v1/vm.create", netConfig(t, p, tap), 204)
	p.wantStatus("PUT", "/api/v1/vm.boot", "", 204)
	p.wantStatus("PUT", "/api/v1/vm.pause", "", 204)
	snap := filepath.Join(p.dir, "snap")
	os.Mkdir(snap, 0o700)
	p.wantStatus("PUT", "/api/v1/vm.snapshot", snapshotBody(snap), 204)
	p.wantStatus("PUT", "/api/v1/vmm.shutdown", "", 200)
	p.wait(t)
	if err := ns.Run(func() error { return waitRunning(tap, false, "after the suspend") }); err != nil {
		t.Fatal(err)
	}
	q := start()
	q.wantStatus("PUT", "/api/v1/vm.restore", fmt.Sprintf(`{"source_url":%q}`, "file://"+snap), 204)
	var st struct{ Taps []string }
	json.Unmarshal(q.wantStatus("GET", "/sim/v1/status", "", 200), &st)
	if len(st.Taps) != 1 || st.Taps[0] != tap {
		t.Errorf("taps after the restore = %v", st.Taps)
	}
	if err := ns.Run(func() error { return waitRunning(tap, true, "after the restore") }); err != nil {
		t.Fatal(err)
	}
}
