package tap

import (
	"bytes"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"

	"vmhost/internal/netnstest"
)

func TestMain(m *testing.M) {
	if os.Geteuid() != 0 {
		os.Exit(m.Run())
	}
	// Every privileged test works in a namespace of its own; prove that
	// none of what the tests make turned up in the caller's namespace.
	// Only the tests' own names count: other packages' tests may run at
	// the same time.
	before, err := rootNetState()
	if err != nil {
		fmt.Fprintln(os.Stderr, "reading root namespace:", err)
		os.Exit(1)
	}
	code := m.Run()
	after, err := rootNetState()
	if err != nil {
		fmt.Fprintln(os.Stderr, "reading root namespace:", err)
		os.Exit(1)
	}
	if after != before {
		fmt.Fprintf(os.Stderr, "tests left objects in the root network namespace:\nbefore:\n%s\nafter:\n%s\n", before, after)
		code = 1
	}
	os.Exit(code)
}

// testLinkNames are the interfaces the tests create (besides "vmh…" taps).
var testLinkNames = map[string]bool{
	"br0": true, "t0": true, "ta": true, "tb": true, "tc": true, "tg": true, "tr": true,
	"tguest": true, "tsrv": true, "town": true, "trb": true, "orphan7": true, "foreign0": true,
	"tbench": true,
}

// rootNetState lists the caller's namespace's links and bridge-family
// nftables tables that the tests could have made.
func rootNetState() (string, error) {
	c, err := netlink.Dial(unix.NETLINK_ROUTE, nil)
	if err != nil {
		return "", err
	}
	defer c.Close()
	links, err := listLinks(c)
	if err != nil {
		return "", err
	}
	var names []string
	for _, l := range links {
		if testLinkNames[l.Name] || strings.HasPrefix(l.Name, "vmh") {
			names = append(names, l.Name)
		}
	}
	slices.Sort(names)
	state := fmt.Sprintf("links: %v\n", names)
	if path, err := exec.LookPath("nft"); err == nil {
		out, err := exec.Command(path, "list", "tables", "bridge").CombinedOutput()
		if err != nil {
			return "", fmt.Errorf("nft list tables: %v: %s", err, out)
		}
		for _, line := range strings.Split(string(out), "\n") {
			if strings.HasPrefix(line, "table bridge "+GuardTable) || line == "table bridge batchtest" { // an agent's too
				state += line + "\n"
			}
		}
	}
	return state, nil
}

// testNS is a namespace with a Handle and a raw rtnetlink conn for setup.
type testNS struct {
	t  testing.TB
	fd int
	h  *Handle
	c  *netlink.Conn
}

func newTestNS(t testing.TB) *testNS {
	// The namespace, and every interface and nftables table in it, goes
	// away at the end of the test.
	fd := netnstest.New(t).FD
	h := New(&Config{NetNS: fd})
	c, err := h.dial(unix.NETLINK_ROUTE)
	if err != nil {
		t.Fatalf("dialing rtnetlink: %v", err)
	}
	t.Cleanup(func() { c.Close() })
	ns := &testNS{t: t, fd: fd, h: h, c: c}
	ns.up("lo")
	return ns
}

// run runs fn on a thread inside the namespace (for exec and tun fds).
func (ns *testNS) run(fn func() error) error { return runInNetNS(ns.fd, fn) }

func (ns *testNS) link(name string) link {
	ns.t.Helper()
	l, err := getLink(ns.c, name, 0)
	if err != nil {
		ns.t.Fatalf("reading link %q: %v", name, err)
	}
	return l
}

// addBridge creates a bridge and brings it up. vlanFiltering asks for
// IFLA_BR_VLAN_FILTERING; the error is returned for the caller to judge.
func (ns *testNS) addBridge(name string, vlanFiltering bool) error {
	req, err := linkMessage(unix.RTM_NEWLINK, netlink.Create|netlink.Excl|netlink.Acknowledge, ifInfo{}, func(ae *netlink.AttributeEncoder) {
		ae.String(unix.IFLA_IFNAME, name)
		ae.Nested(unix.IFLA_LINKINFO, func(nae *netlink.AttributeEncoder) error {
			nae.String(unix.IFLA_INFO_KIND, "bridge")
			if vlanFiltering {
				nae.Nested(unix.IFLA_INFO_DATA, func(dae *netlink.AttributeEncoder) error {
					dae.Uint8(unix.IFLA_BR_VLAN_FILTERING, 1)
					return nil
				})
			}
			return nil
		})
	})
	if err != nil {
		return err
	}
	if _, err := ns.c.Execute(req); err != nil {
		return err
	}
	ns.up(name)
	return nil
}

func (ns *testNS) mustBridge(name string) link {
	ns.t.Helper()
	if err := ns.addBridge(name, false); err != nil {
		ns.t.Fatalf("creating bridge %q: %v", name, err)
	}
	return ns.link(name)
}

func (ns *testNS) up(name string) {
	ns.t.Helper()
	l := ns.link(name)
	if err := setLink(ns.c, ifInfo{Index: int32(l.Index), Flags: unix.IFF_UP, Change: unix.IFF_UP}, nil); err != nil {
		ns.t.Fatalf("bringing %q up: %v", name, err)
	}
}

// addAddr gives a link an IPv4 address (RTM_NEWADDR).
func (ns *testNS) addAddr(name string, p netip.Prefix) {
	ns.t.Helper()
	l := ns.link(name)
	hdr := make([]byte, unix.SizeofIfAddrmsg)
	hdr[0] = unix.AF_INET
	hdr[1] = uint8(p.Bits())
	putNative32(hdr[4:8], uint32(l.Index))
	ae := netlink.NewAttributeEncoder()
	ae.Bytes(unix.IFA_LOCAL, p.Addr().AsSlice())
	ae.Bytes(unix.IFA_ADDRESS, p.Addr().AsSlice())
	attrs, err := ae.Encode()
	if err != nil {
		ns.t.Fatal(err)
	}
	req := netlink.Message{
		Header: netlink.Header{Type: unix.RTM_NEWADDR, Flags: netlink.Request | netlink.Create | netlink.Acknowledge},
		Data:   append(hdr, attrs...),
	}
	if _, err := ns.c.Execute(req); err != nil {
		ns.t.Fatalf("adding %v to %q: %v", p, name, err)
	}
}

func putNative32(b []byte, v uint32) {
	b[0], b[1], b[2], b[3] = byte(v), byte(v>>8), byte(v>>16), byte(v>>24)
}

// createTap creates a tap with the Handle and fails the test on error.
func (ns *testNS) createTap(name string, index int) {
	ns.t.Helper()
	if err := ns.h.Create(ns.t.Context(), TapConfig{Name: name, VMID: "vm-" + name, Index: index}); err != nil {
		ns.t.Fatalf("Create(%q) = %v", name, err)
	}
}

// waitForwarding waits until the bridge ports are forwarding. A tap gets
// its carrier when a guest attaches, and the bridge learns that through the
// kernel's link watch, which may take a second.
func (ns *testNS) waitForwarding(names ...string) {
	ns.t.Helper()
	const brStateForwarding = 3
	deadline := time.Now().Add(5 * time.Second)
	for _, name := range names {
		for {
			l := ns.link(name)
			if l.Master != 0 && l.PortState == brStateForwarding {
				break
			}
			if time.Now().After(deadline) {
				ns.t.Fatalf("port %q not forwarding after 5s (master %d, state %d)", name, l.Master, l.PortState)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
}

// guest is the guest end of a tap: the test reads and writes Ethernet frames
// through it as the VM's NIC would. Frames carry the 10-byte virtio-net
// header that IFF_VNET_HDR asks for.
type guest struct {
	t testing.TB
	f *os.File
}

const vnetHdrLen = 10

func (ns *testNS) guest(tap string) *guest {
	ns.t.Helper()
	var f *os.File
	err := ns.run(func() error {
		fd, err := unix.Open("/dev/net/tun", unix.O_RDWR|unix.O_CLOEXEC|unix.O_NONBLOCK, 0)
		if err != nil {
			return err
		}
		ifr, err := unix.NewIfreq(tap)
		if err != nil {
			unix.Close(fd)
			return err
		}
		ifr.SetUint16(unix.IFF_TAP | unix.IFF_NO_PI | unix.IFF_VNET_HDR)
		if err := unix.IoctlIfreq(fd, unix.TUNSETIFF, ifr); err != nil {
			unix.Close(fd)
			return fmt.Errorf("TUNSETIFF: %w", err)
		}
		f = os.NewFile(uintptr(fd), "tap-"+tap)
		return nil
	})
	if err != nil {
		ns.t.Fatalf("attaching to tap %q: %v", tap, err)
	}
	ns.t.Cleanup(func() { f.Close() })
	return &guest{t: ns.t, f: f}
}

func (g *guest) send(frame []byte) {
	g.t.Helper()
	buf := append(make([]byte, vnetHdrLen), frame...)
	if _, err := g.f.Write(buf); err != nil {
		g.t.Fatalf("writing frame into tap: %v", err)
	}
}

// recvUntil reads frames until one contains want or the deadline passes; it
// returns every frame read (without the virtio-net header) and whether want
// was seen.
func (g *guest) recvUntil(want []byte, wait time.Duration) ([][]byte, bool) {
	g.t.Helper()
	var frames [][]byte
	deadline := time.Now().Add(wait)
	buf := make([]byte, 65536)
	for {
		if err := g.f.SetReadDeadline(deadline); err != nil {
			g.t.Fatal(err)
		}
		n, err := g.f.Read(buf)
		if errors.Is(err, os.ErrDeadlineExceeded) {
			return frames, false
		}
		if err != nil {
			g.t.Fatalf("reading tap: %v", err)
		}
		if n < vnetHdrLen {
			continue
		}
		frame := bytes.Clone(buf[vnetHdrLen:n])
		frames = append(frames, frame)
		if bytes.Contains(frame, want) {
			return frames, true
		}
	}
}

// sawMarker reports whether any frame contains marker.
func sawMarker(frames [][]byte, marker []byte) bool {
	for _, f := range frames {
		if bytes.Contains(f, marker) {
			return true
		}
	}
	return false
}
