package chsim_test

import (
	"encoding/json"
	"fmt"
	"net"
	"os"
	"runtime"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

func netConfig(t *testing.T, p *simProc, tap string) string {
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
	if os.Geteuid() != 0 {
		t.Skip("needs root to create a network namespace and a tap; run the tests as root")
	}
	if _, err := os.Stat("/dev/net/tun"); err != nil {
		t.Skipf("no /dev/net/tun: %v (try: modprobe tun)", err)
	}
	const tap = "vmhtap0"
	// Everything that touches the namespace runs on one locked thread, which is never
	// unlocked so it dies with the goroutine; the simulator, started from that thread,
	// inherits the namespace.
	var p *simProc
	errc := make(chan error, 1)
	step := make(chan func() error)
	go func() {
		runtime.LockOSThread()
		if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
			errc <- fmt.Errorf("unshare: %w", err)
			return
		}
		if err := createPersistentTap(tap); err != nil {
			errc <- fmt.Errorf("creating tap: %w", err)
			return
		}
		errc <- nil
		for f := range step {
			errc <- f()
		}
	}()
	if err := <-errc; err != nil {
		t.Skipf("cannot set up a network namespace with a tap: %v", err)
	}
	defer close(step)
	inNS := func(f func() error) error {
		step <- f
		return <-errc
	}
	if err := inNS(func() error { p = startSimNoFatal(t); return nil }); err != nil {
		t.Fatal(err)
	}
	if p == nil {
		t.Fatal("simulator did not start")
	}
	p.wantStatus("PUT", "/api/v1/vm.create", netConfig(t, p, tap), 204)
	if err := inNS(func() error {
		if up, err := tapRunning(tap); err != nil || up {
			return fmt.Errorf("before boot: running=%v, %v; want an idle tap", up, err)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	p.wantStatus("PUT", "/api/v1/vm.boot", "", 204)
	var st struct{ Taps []string }
	json.Unmarshal(p.wantStatus("GET", "/sim/v1/status", "", 200), &st)
	if len(st.Taps) != 1 || st.Taps[0] != tap {
		t.Errorf("simulator taps = %v", st.Taps)
	}
	if err := inNS(func() error {
		if up, err := tapRunning(tap); err != nil || !up {
			return fmt.Errorf("after boot: running=%v, %v; want the tap attached", up, err)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	p.wantStatus("PUT", "/api/v1/vm.shutdown", "", 204)
	if err := inNS(func() error {
		// The kernel reports a lost carrier through linkwatch, which batches such
		// events for up to a second.
		deadline := time.Now().Add(5 * time.Second)
		for {
			up, err := tapRunning(tap)
			if err == nil && !up {
				return nil
			}
			if time.Now().After(deadline) {
				return fmt.Errorf("after shutdown: running=%v, %v; want the tap released", up, err)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}); err != nil {
		t.Fatal(err)
	}
}
