package vm

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"vmhost/tap"
)

func TestViewGuestFacts(t *testing.T) {
	s := newTestService(t)
	size := uint32(2)
	rec := &Record{ID: "vm1", Mode: ModeVM, State: StateRunning, DisplayState: "running", PID: 4242,
		Spec: Spec{VMID: "vm1", Vcpus: 1, MemoryMB: 256, Disk: &DiskSpec{BasePath: "/img/base.qcow2", SizeGiB: &size},
			Nets: []NetSpec{{Bridge: "br0"}, {Bridge: "br0"}}},
		Base: &BaseImage{Path: "/img/base.qcow2", VirtualSizeBytes: 1 << 30},
		NICs: []NIC{
			{MAC: "02:00:00:00:00:01", Tap: "vmh1", LastObservedIPv4: "10.0.0.9"},
			{MAC: "02:00:00:00:00:02", Tap: "vmh2", DHCPSnoopedIPv4: "10.0.0.7", LastObservedIPv4: "10.0.0.8"},
		},
		Runtime: &Runtime{
			CH:  &CHRuntime{Pid: 4242, StartTime: 99, APISocket: "/r/ch.sock"},
			QSD: &QSDRuntime{Pid: 4343, StartTime: 77, QMPSocket: "/r/qsd.qmp", RootSocket: "/r/root.vhost"},
		},
	}
	v := s.View(rec, ViewOptions{})
	if v.PID != 4242 {
		t.Errorf("pid = %d, want the recorded 4242", v.PID)
	}
	if v.DiscoveredIPv4 != "10.0.0.7" {
		t.Errorf("discovered_ipv4 = %q, want the snooped 10.0.0.7 before any observed address", v.DiscoveredIPv4)
	}
	if n := v.Nets[0]; n.DHCPSnoopedIPv4 != "" || n.LastObservedIPv4 != "10.0.0.9" {
		t.Errorf("nets[0] facts = %q, %q", n.DHCPSnoopedIPv4, n.LastObservedIPv4)
	}
	if n := v.Nets[1]; n.DHCPSnoopedIPv4 != "10.0.0.7" || n.LastObservedIPv4 != "10.0.0.8" {
		t.Errorf("nets[1] facts = %q, %q", n.DHCPSnoopedIPv4, n.LastObservedIPv4)
	}
	d := v.Disk
	want := VolumeRef{Backend: "qsd", Pid: 4343, StartTime: 77, BlkSocket: "/r/root.vhost", QMPSocket: "/r/qsd.qmp"}
	if d == nil || d.Runtime == nil || *d.Runtime != want || d.QSDPid != 4343 || d.QSDStartTime != 77 ||
		d.QSDBlkSocket != "/r/root.vhost" || d.QSDQMPSocket != "/r/qsd.qmp" {
		t.Fatalf("disk = %+v", d)
	}
	var enc bytes.Buffer
	e := json.NewEncoder(&enc)
	e.SetEscapeHTML(false)
	if err := e.Encode(v); err != nil {
		t.Fatal(err)
	}
	got := strings.TrimSuffix(enc.String(), "\n")
	for _, key := range []string{`"qsd_pid":4343`, `"runtime":{"backend":"qsd","pid":4343,"start_time":77,"blk_socket":"/r/root.vhost","qmp_socket":"/r/qsd.qmp"}`,
		`"discovered_ipv4":"10.0.0.7"`, `"last_observed_ipv4":"10.0.0.9"`, `"pid":4242`} {
		if !strings.Contains(got, key) {
			t.Errorf("view lacks %s", key)
		}
	}

	// Without processes and facts, none of it appears.
	rec.Runtime, rec.PID, rec.NICs[0], rec.NICs[1] = nil, 0, NIC{MAC: "02:00:00:00:00:01", Tap: "vmh1"}, NIC{MAC: "02:00:00:00:00:02", Tap: "vmh2"}
	got = string(encodeView(s.View(rec, ViewOptions{})))
	for _, key := range []string{"qsd_", `"runtime"`, "discovered_ipv4", "last_observed_ipv4", "dhcp_snooped_ipv4", `"pid"`} {
		if strings.Contains(got, key) {
			t.Errorf("view of a VM without processes or facts has %s: %s", key, got)
		}
	}
}

// tapsTestHost is a Host whose taps live in a test's network namespace.
type tapsTestHost struct {
	NoHost
	h *tap.Handle
}

func (h tapsTestHost) tapHandle() *tap.Handle { return h.h }

// testNetNS creates a network namespace on a locked thread and returns its
// fd and a function that runs f on that thread (so processes it starts
// live in the namespace). The thread ends with the test.
func testNetNS(t *testing.T) (int, func(f func() error) error) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root for a network namespace, taps and packet sockets; run the tests as root")
	}
	if _, err := os.Stat("/dev/net/tun"); err != nil {
		t.Skipf("no /dev/net/tun: %v (try: modprobe tun)", err)
	}
	step := make(chan func() error)
	errc := make(chan error)
	var fd int
	go func() {
		runtime.LockOSThread() // never unlocked: the thread dies with the goroutine
		if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
			errc <- err
			return
		}
		var err error
		fd, err = unix.Open("/proc/thread-self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0)
		errc <- err
		for f := range step {
			errc <- f()
		}
	}()
	if err := <-errc; err != nil {
		t.Skipf("cannot create a network namespace: %v", err)
	}
	t.Cleanup(func() { close(step); unix.Close(fd) })
	return fd, func(f func() error) error { step <- f; return <-errc }
}

// TestIntegrationGuestFacts snoops a DHCP ACK that chsim injects on a real
// tap, reads a neighbour entry, and keeps the observed address after the
// entry is gone.
func TestIntegrationGuestFacts(t *testing.T) {
	fd, inNS := testNetNS(t)
	h := tap.New(&tap.Config{NetNS: fd})
	ctx := context.Background()
	nic := NIC{MAC: "02:00:00:00:00:01", Tap: TapName("vm1", 0)}
	if err := h.Create(ctx, tap.TapConfig{Name: nic.Tap, VMID: "vm1", Index: 0}); err != nil {
		t.Fatal(err)
	}
	s := newTestService(t)
	s.o.Host = tapsTestHost{h: h}
	s.mon.factsEvery = 100 * time.Millisecond
	r := startVMWith(t, s, "vm1", vmOpts{nics: []NIC{nic}, launch: inNS})
	s.watch(r.id, r.ch, r.qsd)

	// A DHCP server on the host side answers the guest: the ACK leaves the
	// host through the tap. The snooper starts with the monitor,
	// asynchronously; a guest's DHCP client retries, and so does this test.
	var rec *Record
	for i := 0; ; i++ {
		// The simulator sends the ACK out of the tap toward the guest, as a
		// DHCP server behind the bridge would.
		r.sim(t, "dhcp-ack", `{"ip":"10.9.0.23","server":"10.9.0.1"}`)
		time.Sleep(200 * time.Millisecond)
		if rec = s.reg.get(r.id); rec.NICs[0].DHCPSnoopedIPv4 == "10.9.0.23" {
			break
		}
		if i == 25 {
			t.Fatalf("dhcp_snooped_ipv4 = %q after 5s of ACKs; logs:\n%s", rec.NICs[0].DHCPSnoopedIPv4, s.logs)
		}
	}
	if v := s.View(rec, ViewOptions{}); v.DiscoveredIPv4 != "10.9.0.23" || v.Nets[0].DHCPSnoopedIPv4 != "10.9.0.23" {
		t.Errorf("view: discovered %q, nets[0] snooped %q", v.DiscoveredIPv4, v.Nets[0].DHCPSnoopedIPv4)
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
	rec, _ = waitRecord(t, s, r.id, 2*time.Second, "last_observed_ipv4", func(r *Record) bool { return r.NICs[0].LastObservedIPv4 == "10.9.0.50" })
	if v := s.View(rec, ViewOptions{}); v.DiscoveredIPv4 != "10.9.0.23" || v.Nets[0].LastObservedIPv4 != "10.9.0.50" {
		t.Errorf("view: discovered %q (want the snooped address first), nets[0] observed %q", v.DiscoveredIPv4, v.Nets[0].LastObservedIPv4)
	}
	if err := inNS(func() error { return ipCmd("neigh", "del", "10.9.0.50", "dev", nic.Tap) }); err != nil {
		t.Fatal(err)
	}
	time.Sleep(500 * time.Millisecond) // several polls
	if got := s.reg.get(r.id).NICs[0].LastObservedIPv4; got != "10.9.0.50" {
		t.Errorf("last_observed_ipv4 after the neighbour entry expired = %q, want it kept", got)
	}
}
