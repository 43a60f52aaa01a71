package guest

import (
	"context"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"vmhost/appvm/guest/proto"
	"vmhost/internal/netnstest"
)

// run runs a command (in the test's namespace) and returns its output.
func run(t *testing.T, name string, args ...string) string {
	t.Helper()
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
	return string(out)
}

func TestIntegrationStaticNetwork(t *testing.T) {
	netnstest.Enter(t)
	// A veth pair stands in for the guest NIC (dummy is not built in every kernel).
	run(t, "ip", "link", "add", "d0", "type", "veth", "peer", "name", "d1")
	run(t, "ip", "link", "set", "d1", "up")
	n := proto.Network{Mode: proto.NetworkStatic, Interface: "d0", IP: "10.1.2.3", Prefix: 24, Gateway: "10.1.2.1"}
	for i := 0; i < 2; i++ { // the second run finds everything in place
		if l, err := applyNetwork(context.Background(), n, "", nil); err != nil || l != nil {
			t.Fatalf("applyNetwork #%d = %v, %v", i, l, err)
		}
	}
	if addr := run(t, "ip", "-4", "-o", "addr", "show", "dev", "d0"); !strings.Contains(addr, "inet 10.1.2.3/24 brd 10.1.2.255") {
		t.Errorf("address of d0: %s", addr)
	}
	if route := run(t, "ip", "-4", "route", "show", "default"); !strings.Contains(route, "default via 10.1.2.1 dev d0") {
		t.Errorf("default route: %q", route)
	}
	if link := run(t, "ip", "-o", "link", "show", "lo"); !strings.Contains(link, "UP") {
		t.Errorf("lo is not up: %s", link)
	}
}

// TestIntegrationNoNetwork: an AppVM without a network (mode none) gets
// its loopback up and nothing else: no interface is looked for, none is
// touched, no lease comes back.
func TestIntegrationNoNetwork(t *testing.T) {
	netnstest.Enter(t)
	run(t, "ip", "link", "add", "d0", "type", "veth", "peer", "name", "d1")
	l, err := applyNetwork(context.Background(), proto.Network{Mode: proto.NetworkNone}, "host1", nil)
	if err != nil || l != nil {
		t.Fatalf("applyNetwork(none) = %v, %v", l, err)
	}
	if link := run(t, "ip", "-o", "link", "show", "lo"); !strings.Contains(link, "UP") {
		t.Errorf("lo is not up: %s", link)
	}
	if link := run(t, "ip", "-o", "link", "show", "d0"); strings.Contains(link, ",UP") {
		t.Errorf("an interface was brought up: %s", link)
	}
	// In a guest, mode none waits for no interface to appear.
	vs := &vmSystem{deviceWait: time.Hour}
	if _, err := vs.configureNetwork(context.Background(), proto.Network{Mode: proto.NetworkNone, Interface: "eth9"}, "", nil); err != nil {
		t.Errorf("a guest without a network = %v", err)
	}
}

// TestIntegrationDHCPNoServer: on a network where no DHCP server answers
// (dev mode's bridge), the client gives up when its time is up, saying so,
// and the workload is not left waiting for ever.
func TestIntegrationDHCPNoServer(t *testing.T) {
	netnstest.Enter(t)
	run(t, "ip", "link", "add", "d0", "type", "veth", "peer", "name", "d1")
	run(t, "ip", "link", "set", "d0", "up")
	run(t, "ip", "link", "set", "d1", "up")
	ifi, err := net.InterfaceByName("d0")
	if err != nil {
		t.Fatal(err)
	}
	c, err := newDHCPClient(ifi, "h")
	if err != nil {
		t.Fatal(err)
	}
	defer c.conn.Close()
	c.attempt = 50 * time.Millisecond
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	if _, err := c.obtain(ctx); err == nil || !strings.Contains(err.Error(), "dhcp on d0: no DHCP server answered within") {
		t.Errorf("obtain with no server = %v", err)
	}
}

// TestFullIDMap: the agent switches users only where every id maps to
// itself; the simulator's rootless namespace maps one.
func TestFullIDMap(t *testing.T) {
	for m, want := range map[string]bool{
		"         0          0 4294967295\n": true,
		"0 1000 1\n":                         false,
		"0 0 65536\n":                        false,
		"":                                   false,
	} {
		if got := fullIDMap(m); got != want {
			t.Errorf("fullIDMap(%q) = %v, want %v", m, got, want)
		}
	}
}

// dhcpServer puts v1, the peer of the guest's v0, into a second namespace
// and runs dnsmasq there.
func dhcpServer(t *testing.T) {
	t.Helper()
	dnsmasq, err := exec.LookPath("dnsmasq")
	if err != nil {
		if _, err := os.Stat("/usr/sbin/dnsmasq"); err != nil {
			t.Skip("dnsmasq not installed (apt-get install dnsmasq-base)")
		}
		dnsmasq = "/usr/sbin/dnsmasq"
	}
	run(t, "ip", "link", "add", "v0", "address", "02:00:00:00:00:42", "type", "veth", "peer", "name", "v1")
	holder := exec.Command("sleep", "600")
	holder.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWNET}
	if err := holder.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { holder.Process.Kill(); holder.Wait() })
	pid := strconv.Itoa(holder.Process.Pid)
	run(t, "ip", "link", "set", "v1", "netns", pid)
	in := func(args ...string) { run(t, "nsenter", append([]string{"-t", pid, "-n"}, args...)...) }
	in("ip", "link", "set", "lo", "up")
	in("ip", "addr", "add", "10.99.0.1/24", "dev", "v1")
	in("ip", "link", "set", "v1", "up")
	dir := t.TempDir()
	srv := exec.Command("nsenter", "-t", pid, "-n", dnsmasq, "--no-daemon", "--conf-file=/dev/null", "--port=0",
		"--user=root", "--interface=v1", "--bind-interfaces",
		"--dhcp-range=10.99.0.50,10.99.0.60,255.255.255.0,1h",
		"--dhcp-host=02:00:00:00:00:42,10.99.0.55,leasedname",
		"--dhcp-option=option:router,10.99.0.1",
		"--dhcp-option=option:dns-server,10.99.0.1,10.99.0.2",
		"--dhcp-option=option:domain-search,test.lan,corp.test.lan",
		"--domain=test.lan",
		"--dhcp-leasefile="+filepath.Join(dir, "leases"), "--pid-file="+filepath.Join(dir, "pid"))
	logs := &lockedBuffer{}
	srv.Stderr = logs
	if err := srv.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		srv.Process.Kill()
		srv.Wait()
		if t.Failed() {
			t.Logf("dnsmasq:\n%s", logs.String())
		}
	})
}

func TestIntegrationDHCP(t *testing.T) {
	netnstest.Enter(t)
	dhcpServer(t)
	// No report func: no background renewal, the test renews by hand below.
	lease, err := applyNetwork(context.Background(), proto.Network{Mode: proto.NetworkDHCP, Interface: "v0"}, "vm-1", nil)
	if err != nil {
		t.Fatal(err)
	}
	want := &proto.Lease{IP: "10.99.0.55", Prefix: 24, Gateway: "10.99.0.1", DNS: []string{"10.99.0.1", "10.99.0.2"},
		Search: []string{"test.lan", "corp.test.lan"}, LeaseSecs: 3600, Hostname: "leasedname"}
	if !reflect.DeepEqual(lease, want) {
		t.Errorf("lease = %+v\nwant %+v", lease, want)
	}
	if addr := run(t, "ip", "-4", "-o", "addr", "show", "dev", "v0"); !strings.Contains(addr, "inet 10.99.0.55/24") {
		t.Errorf("address of v0: %s", addr)
	}
	if route := run(t, "ip", "-4", "route", "show", "default"); !strings.Contains(route, "default via 10.99.0.1 dev v0") {
		t.Errorf("default route: %q", route)
	}

	// A renewal: REQUEST with ciaddr, as renewLoop sends it.
	ifi, err := net.InterfaceByName("v0")
	if err != nil {
		t.Fatal(err)
	}
	c, err := newDHCPClient(ifi, "vm-1")
	if err != nil {
		t.Fatal(err)
	}
	defer c.conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	ack, err := c.exchange(ctx, c.message(dhcpRequest, netip.MustParseAddr("10.99.0.55"), netip.Addr{}, netip.Addr{}), dhcpAck)
	if err != nil || ack.msgType != dhcpAck || ack.lease.IP != "10.99.0.55" || ack.lease.LeaseSecs != 3600 {
		t.Errorf("renewal = %+v, %v; want an ACK of 10.99.0.55 for 3600 s", ack, err)
	}
}

// TestIntegrationAgentDHCP runs the whole agent with --network in a
// namespace: the lease reaches the host and the guest's resolv.conf.
func TestIntegrationAgentDHCP(t *testing.T) {
	netnstest.Enter(t)
	dhcpServer(t)
	h := startAgent(t, &proto.Spec{Command: sh("cat /etc/hostname"), Network: proto.Network{Mode: proto.NetworkDHCP}}, agentOpts{args: []string{"--network"}})
	m := h.next()
	l, ok := m.(*proto.Lease)
	if !ok || l.IP != "10.99.0.55" || l.Hostname != "leasedname" {
		t.Fatalf("first message = %#v, want the lease", m)
	}
	h.waitExit()
	b, err := os.ReadFile(filepath.Join(h.root, "etc/resolv.conf"))
	if want := "search test.lan corp.test.lan\nnameserver 10.99.0.1\nnameserver 10.99.0.2\n"; err != nil || string(b) != want {
		t.Errorf("resolv.conf = %q, %v; want %q", b, err, want)
	}
	b, err = os.ReadFile(filepath.Join(h.root, "etc/hosts"))
	if err != nil || !strings.Contains(string(b), "10.99.0.55\tleasedname\n") {
		t.Errorf("hosts = %q, %v", b, err)
	}
}

func TestDecodeSearch(t *testing.T) {
	// RFC 3397 §2 example, with a compression pointer to offset 0 plus 4.
	data := []byte{
		3, 'e', 'n', 'g', 4, 'a', 'c', 'm', 'e', 3, 'c', 'o', 'm', 0,
		4, 'm', 'a', 'r', 'k', 0xc0, 4,
		0xc0, 0x40, // out of range: stops decoding
	}
	got := decodeSearch(data)
	want := []string{"eng.acme.com", "mark.acme.com"}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("decodeSearch = %q, want %q", got, want)
	}
	loop := []byte{0xc0, 0}
	if got := decodeSearch(loop); len(got) != 0 {
		t.Errorf("decodeSearch(pointer loop) = %q", got)
	}
}

func TestParseDHCPRejects(t *testing.T) {
	mac := net.HardwareAddr{2, 0, 0, 0, 0, 1}
	c := &dhcpClient{ifi: &net.Interface{HardwareAddr: mac}, xid: 7}
	req := c.message(dhcpDiscover, netip.Addr{}, netip.Addr{}, netip.Addr{})
	if _, err := parseDHCP(req, 7, mac); err == nil {
		t.Error("parseDHCP accepted a BOOTREQUEST")
	}
	reply := append([]byte(nil), req...)
	reply[0] = 2
	copy(reply[16:], []byte{10, 0, 0, 5})
	if _, err := parseDHCP(reply, 8, mac); err == nil {
		t.Error("parseDHCP accepted another xid")
	}
	r, err := parseDHCP(reply, 7, mac)
	if err != nil || r.lease.IP != "10.0.0.5" || r.msgType != dhcpDiscover {
		t.Errorf("parseDHCP = %+v, %v", r, err)
	}
	if _, err := parseDHCP(reply[:250], 7, mac); err == nil {
		t.Error("parseDHCP accepted a truncated option")
	}
}

// TestIntegrationAgentStopDuringDHCP: a Stop while the guest waits for a
// DHCP lease (no server answers) ends the wait: the agent powers off at
// once, well before the lease wait's own timeout, and the workload never
// starts.
func TestIntegrationAgentStopDuringDHCP(t *testing.T) {
	netnstest.Enter(t)
	run(t, "ip", "link", "add", "v0", "type", "veth", "peer", "name", "v1")
	run(t, "ip", "link", "set", "v1", "up")
	marker := filepath.Join(t.TempDir(), "started")
	h := startAgent(t, &proto.Spec{Command: sh("touch " + marker), Network: proto.Network{Mode: proto.NetworkDHCP, Interface: "v0"}},
		agentOpts{args: []string{"--network"}})
	time.Sleep(1500 * time.Millisecond) // a DISCOVER or two go unanswered
	start := time.Now()
	if err := h.conn.Send(&proto.Stop{}); err != nil {
		t.Fatal(err)
	}
	if code := h.waitAgent(); code != ExitPoweroff {
		t.Errorf("agent exit status = %d, want %d", code, ExitPoweroff)
	}
	took := time.Since(start)
	t.Logf("stopped %v after the Stop", took)
	if took > dhcpTimeout/2 {
		t.Errorf("the agent ended %v after the Stop: the lease wait did not honour it", took)
	}
	for _, m := range h.messages() {
		switch m.(type) {
		case *proto.Started, *proto.Lease, *proto.Fatal:
			t.Errorf("message %#v after a Stop during the lease wait", m)
		}
	}
	if _, err := os.Stat(marker); err == nil {
		t.Error("the workload ran")
	}
}
