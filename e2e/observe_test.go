//go:build linux

package e2e

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"vmhost/config"
	"vmhost/metrics/metricstest"
)

// TestEventsSurviveAgentKill: `vmhost events` follows the stream while 100
// changes happen (50 creates, each created + display_state_changed); the
// agent is killed with SIGKILL after the first 50 events and restarted.
// The client reconnects with the last seq it saw and ends up with all 100,
// in order, no seq twice, and exactly what the agent's log holds.
func TestEventsSurviveAgentKill(t *testing.T) {
	s := startServer(t, serverOpts{edit: func(c *config.Config) { c.HostCPUs, c.HostMemoryMB = 64, 64<<10 }})
	f := newFixture(t)
	out := new(syncBuffer)
	cli := exec.Command(vmhostBin, "events", "-o", "json", "--since", "0")
	cli.Env = append(os.Environ(), "VMHOST_API=unix:"+s.sock, "VMHOST_TOKEN="+s.token)
	cli.Stdout, cli.Stderr = out, out
	if err := cli.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { cli.Process.Signal(syscall.SIGTERM); cli.Wait() }()

	create := func(from, to int) {
		for i := from; i < to; i++ {
			s.create(f.body(fmt.Sprintf("ev%02d", i), false, ""), 201)
		}
	}
	create(0, 25)
	s.kill()
	s.restart()
	create(25, 50)

	type ev struct {
		Seq  uint64 `json:"seq"`
		Type string `json:"type"`
		VMID string `json:"vm_id"`
	}
	parse := func() (evs []ev) {
		for _, line := range strings.Split(out.String(), "\n") {
			var e ev
			if json.Unmarshal([]byte(line), &e) == nil && e.Seq > 0 {
				evs = append(evs, e)
			}
		}
		return evs
	}
	deadline := time.Now().Add(30 * time.Second)
	for len(parse()) < 100 && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	got := parse()
	var want []string
	for i := range 50 {
		id := fmt.Sprintf("ev%02d", i)
		want = append(want, "created "+id, "display_state_changed "+id)
	}
	var seen []string
	for i, e := range got {
		if i > 0 && e.Seq <= got[i-1].Seq {
			t.Fatalf("seq %d after %d: out of order or twice\n%s", e.Seq, got[i-1].Seq, out)
		}
		seen = append(seen, e.Type+" "+e.VMID)
	}
	if strings.Join(seen, "\n") != strings.Join(want, "\n") {
		t.Fatalf("the client saw\n%s\nwant\n%s\nclient output:\n%s", strings.Join(seen, "\n"), strings.Join(want, "\n"), out)
	}
	if !strings.Contains(out.String(), "reconnecting") {
		t.Errorf("the client never lost its stream: the kill did not happen mid-stream?\n%s", out)
	}
	// The log itself: what the client has is what the agent kept.
	evs, err := os.ReadFile(s.stateDir + "/events/events.jsonl")
	if err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(string(evs), "\n"); n != 100 {
		t.Errorf("the event log holds %d events, want 100", n)
	}
}

// TestMetricsFromRunningVM: /metrics of a real agent shows a running VM's
// Cloud Hypervisor counters (moved by the simulated guest), its state, and
// passes promtool check metrics.
func TestMetricsFromRunningVM(t *testing.T) {
	s := startServer(t, serverOpts{})
	f := newFixture(t)
	s.create(f.body("met", true, ""), 201)
	s.waitDisplay("met", "running", "running")
	s.sim("met", "counters", `{"device":"_disk0","counters":{"read_bytes":4096,"write_ops":7}}`)
	st, body := s.do("GET", "/metrics", "")
	if st != 200 {
		t.Fatalf("GET /metrics = %d %s", st, body)
	}
	for _, want := range []string{
		`vmhost_vm_block_read_bytes_total{vm_id="met",mode="vm",device="_disk0"} 4096`,
		`vmhost_vm_block_write_ops_total{vm_id="met",mode="vm",device="_disk0"} 7`,
		`vmhost_vm_state{vm_id="met",mode="vm",state="running"} 1`,
		"vmhost_scrape_errors_total 0\n",
	} {
		if !strings.Contains(string(body), want) {
			t.Errorf("no %q in\n%s", want, body)
		}
	}
	metricstest.Check(t, body)
}
