//go:build linux

package e2e

import (
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"vmhost/config"
)

// TestCrashInjection injects every failure the monitor knows into a VM of
// a real agent, through the simulators' control endpoints or by acting on
// the host, and reads the outcome through the API: state, failure_reason
// and the detection time (2 s; a hang within ping_timeout_secs +
// ping_interval_secs + 1 s), and that nothing of the VM keeps running. A
// guest panic sets guest_panicked_at and leaves the VM running.
func TestCrashInjection(t *testing.T) {
	s := startServer(t, serverOpts{edit: func(c *config.Config) {
		c.PingIntervalSecs, c.PingTimeoutSecs = 1, 1
		c.HostCPUs = 64
	}})
	f := newFixture(t)
	cases := []struct {
		id     string
		inject func(t *testing.T, v view)
		within time.Duration
		state  string
		kind   string
		cause  string
		code   string // "-" when absent
	}{
		{"crash", func(t *testing.T, v view) { s.sim("crash", "crash", `{"signal":11}`) }, 2 * time.Second, "failed", "process_signal", "ch_crash", "-"},
		{"killed", func(t *testing.T, v view) { syscall.Kill(v.PID, syscall.SIGKILL) }, 2 * time.Second, "failed", "process_signal", "ch_crash", "-"},
		{"poweroff", func(t *testing.T, v view) { s.sim("poweroff", "poweroff", "") }, 2 * time.Second, "stopped", "process_exit", "guest_shutdown", "0"},
		{"sockgone", func(t *testing.T, v view) {
			if err := os.Remove(s.runDir + "/vms/sockgone/ch.sock"); err != nil {
				t.Fatal(err)
			}
		}, 2 * time.Second, "failed", "socket_gone", "ch_crash", "-"},
		{"sockdead", func(t *testing.T, v view) {
			p := s.runDir + "/vms/sockdead/ch.sock"
			if err := os.Remove(p); err != nil {
				t.Fatal(err)
			}
			ln, err := net.Listen("unix", p)
			if err != nil {
				t.Fatal(err)
			}
			ln.(*net.UnixListener).SetUnlinkOnClose(false)
			ln.Close()
		}, 2 * time.Second, "failed", "socket_dead", "ch_crash", "-"},
		{"hang", func(t *testing.T, v view) { s.sim("hang", "hang", "") }, 3 * time.Second, "failed", "ping_timeout", "vmm_hang", "-"},
		{"nodisk", func(t *testing.T, v view) {
			if err := os.Remove(v.DiskPath); err != nil {
				t.Fatal(err)
			}
		}, 2 * time.Second, "failed", "disk_missing", "disk_missing", "-"},
		{"noqsd", func(t *testing.T, v view) { syscall.Kill(v.Disk.QSDPid, syscall.SIGKILL) }, 2 * time.Second, "failed", "missing_pid", "unknown", "-"},
	}
	for _, tc := range cases {
		s.create(f.body(tc.id, true, ""), http.StatusCreated)
	}
	for _, tc := range cases {
		t.Run(tc.id, func(t *testing.T) {
			v := s.waitDisplay(tc.id, "running", "running")
			start := time.Now()
			tc.inject(t, v)
			got := s.waitFor(tc.id, "the VM ended", func(v view) bool { return v.State != "running" })
			took := time.Since(start)
			t.Logf("%s noticed in %v", tc.id, took)
			if took > tc.within {
				t.Errorf("noticed after %v, want within %v", took, tc.within)
			}
			fr := got.FailureReason
			code := "-"
			if fr != nil && fr.Detail.Code != nil {
				code = fmt.Sprint(*fr.Detail.Code)
			}
			if got.State != tc.state || fr == nil || fr.Detail.Kind != tc.kind || fr.Cause != tc.cause || code != tc.code {
				t.Errorf("view %+v, failure %+v; want %s %s %s code %s", got, fr, tc.state, tc.kind, tc.cause, tc.code)
			}
			if got.PID != 0 {
				t.Errorf("pid %d after the end", got.PID)
			}
			deadline := time.Now().Add(10 * time.Second)
			for syscall.Kill(v.PID, 0) == nil || syscall.Kill(v.Disk.QSDPid, 0) == nil {
				if time.Now().After(deadline) {
					t.Fatalf("CH %d or QSD %d still running after the VM ended", v.PID, v.Disk.QSDPid)
				}
				time.Sleep(10 * time.Millisecond)
			}
		})
	}

	t.Run("panic", func(t *testing.T) {
		s.create(f.body("panic", true, ""), http.StatusCreated)
		s.waitDisplay("panic", "running", "running")
		s.sim("panic", "panic", `{"event":"panic"}`)
		deadline := time.Now().Add(2 * time.Second)
		for {
			_, b := s.do("GET", "/api/vms/panic", "")
			var v struct {
				State           string     `json:"state"`
				GuestPanickedAt *time.Time `json:"guest_panicked_at"`
			}
			json.Unmarshal(b, &v)
			if v.GuestPanickedAt != nil {
				if v.State != "running" || time.Since(*v.GuestPanickedAt).Abs() > 5*time.Second {
					t.Errorf("after a guest panic: %s", b)
				}
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("guest_panicked_at not set within 2s: %s", b)
			}
			time.Sleep(20 * time.Millisecond)
		}
		// The next boot clears it, and a failure_reason.
		if st := s.act("panic", "stop"); st != http.StatusNoContent {
			t.Fatalf("stop = %d", st)
		}
		if st := s.act("panic", "start"); st != http.StatusNoContent {
			t.Fatalf("start = %d", st)
		}
		s.waitDisplay("panic", "running", "running")
		if _, b := s.do("GET", "/api/vms/panic", ""); strings.Contains(string(b), "guest_panicked_at") || strings.Contains(string(b), "failure_reason") {
			t.Errorf("after a new boot: %s", b)
		}
	})
}
