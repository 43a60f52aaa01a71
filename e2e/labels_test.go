//go:build linux

package e2e

import (
	"encoding/json"
	"fmt"
	"maps"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"vmhost/config"
)

// hostInfo is the part of GET /api/host the tests read.
type hostInfo struct {
	AgentID string `json:"agent_id"`
	Version string `json:"version"`
	BootID  string `json:"boot_id"`
	CPUs    struct {
		Online, Allocatable, Used uint64
	} `json:"cpus"`
	MemoryMB struct {
		Total, Allocatable, Used uint64
	} `json:"memory_mb"`
	VMs      map[string]int `json:"vms"`
	Features []string       `json:"features"`
}

func (s *server) host() hostInfo {
	s.t.Helper()
	st, b := s.do("GET", "/api/host", "")
	if st != http.StatusOK {
		s.t.Fatalf("GET /api/host = %d %s", st, b)
	}
	var h hostInfo
	if err := json.Unmarshal(b, &h); err != nil {
		s.t.Fatal(err)
	}
	return h
}

// labelsOf reads the labels of VM id.
func (s *server) labelsOf(id string) map[string]string {
	s.t.Helper()
	var v struct {
		Labels map[string]string `json:"labels"`
	}
	if err := json.Unmarshal([]byte(s.rawView(id)), &v); err != nil {
		s.t.Fatal(err)
	}
	return v.Labels
}

// listByLabel lists the classic VMs that ?label= filters keep.
func (s *server) listByLabel(filters ...string) []string {
	s.t.Helper()
	st, b := s.do("GET", "/api/vms?"+url.Values{"label": filters}.Encode(), "")
	if st != http.StatusOK {
		s.t.Fatalf("GET /api/vms?label=%q = %d %s", filters, st, b)
	}
	var l struct {
		VMs []struct {
			ID string `json:"id"`
		} `json:"vms"`
	}
	if err := json.Unmarshal(b, &l); err != nil {
		s.t.Fatal(err)
	}
	ids := []string{}
	for _, v := range l.VMs {
		ids = append(ids, v.ID)
	}
	return ids
}

// TestLabelsAndHostAcrossAgentKill: against a real agent, labels set at
// create and by an edit are in the record: after the agent is killed with
// SIGKILL and started again, the view shows them, the list filters by them
// and the VM's next events carry them (followed with `vmhost events
// --label`). GET /api/host names the agent by the id in <state>/agent_id,
// keeps it across the restart, and its allocatable − used is what
// admission admits: one vCPU or MiB more is 409 CAPACITY_CONFLICT.
func TestLabelsAndHostAcrossAgentKill(t *testing.T) {
	s := startServer(t, serverOpts{edit: func(c *config.Config) { c.HostCPUs, c.HostMemoryMB = 4, 4096 }})
	f := newFixture(t)
	s.create(f.body("lab1", true, `,"labels":{"team":"infra","job":"j-1"}`), http.StatusCreated)
	s.waitDisplay("lab1", "running", "running")
	if st, b := s.do("PATCH", "/api/vms/lab1/labels", `{"job":null,"alloc":"a-1"}`); st != http.StatusOK {
		t.Fatalf("PATCH labels = %d %s", st, b)
	}
	want := map[string]string{"team": "infra", "alloc": "a-1"}

	id, err := os.ReadFile(s.stateDir + "/agent_id")
	if err != nil {
		t.Fatal(err)
	}
	h := s.host()
	if h.AgentID != strings.TrimSpace(string(id)) || h.Version != "dev" || h.BootID == "" {
		t.Errorf("GET /api/host: agent_id %q, version %q, boot_id %q; want %q from <state>/agent_id, dev, the host's", h.AgentID, h.Version, h.BootID, id)
	}
	if h.CPUs.Online != 4 || h.CPUs.Allocatable != 16 || h.CPUs.Used != 1 || h.MemoryMB.Allocatable != 4096 || h.MemoryMB.Used != 128 || h.VMs["running"] != 1 {
		t.Errorf("GET /api/host = %+v, want 4 CPUs, 16 allocatable, 1 used; 4096 MiB allocatable, 128 used; 1 running", h)
	}

	s.kill()
	s.restart()
	if got := s.labelsOf("lab1"); !maps.Equal(got, want) {
		t.Errorf("labels after the agent's kill and restart = %v, want %v", got, want)
	}
	for _, tt := range []struct {
		filters []string
		want    []string
	}{
		{[]string{"team=infra", "alloc=a-1"}, []string{"lab1"}},
		{[]string{"alloc"}, []string{"lab1"}},
		{[]string{"job"}, []string{}},
	} {
		if got := s.listByLabel(tt.filters...); !slices.Equal(got, tt.want) {
			t.Errorf("list ?label=%q after the restart = %v, want %v", tt.filters, got, tt.want)
		}
	}
	if h2 := s.host(); h2.AgentID != h.AgentID || h2.CPUs.Used != 1 || h2.MemoryMB.Used != 128 {
		t.Errorf("GET /api/host after the restart = %+v, want the same agent and the same use", h2)
	}

	// Admission's numbers: what is left fits, one more does not.
	h = s.host()
	left := h.CPUs.Allocatable - h.CPUs.Used
	over := f.body("cpu-over", false, "")
	over = strings.Replace(over, `"vcpus":1`, fmt.Sprintf(`"vcpus":%d`, left+1), 1)
	if st, b := s.do("POST", "/api/vms", over); st != http.StatusConflict || !strings.Contains(string(b), "CAPACITY_CONFLICT") {
		t.Errorf("create of %d vCPUs with %d left = %d %s, want 409 CAPACITY_CONFLICT", left+1, left, st, b)
	}
	fit := strings.Replace(f.body("cpu-fit", false, ""), `"vcpus":1`, fmt.Sprintf(`"vcpus":%d`, left), 1)
	s.create(fit, http.StatusCreated)
	h = s.host()
	if h.CPUs.Used != h.CPUs.Allocatable {
		t.Errorf("cpus after filling = %+v", h.CPUs)
	}
	if st, b := s.do("DELETE", "/api/vms/cpu-fit", ""); st != http.StatusNoContent {
		t.Fatalf("delete cpu-fit = %d %s", st, b)
	}
	h = s.host()
	memLeft := h.MemoryMB.Allocatable - h.MemoryMB.Used
	over = strings.Replace(f.body("mem-over", false, ""), `"memory_mb":128`, fmt.Sprintf(`"memory_mb":%d`, memLeft+1), 1)
	if st, b := s.do("POST", "/api/vms", over); st != http.StatusConflict || !strings.Contains(string(b), "CAPACITY_CONFLICT") {
		t.Errorf("create of %d MiB with %d left = %d %s, want 409 CAPACITY_CONFLICT", memLeft+1, memLeft, st, b)
	}
	s.create(strings.Replace(f.body("mem-fit", false, ""), `"memory_mb":128`, fmt.Sprintf(`"memory_mb":%d`, memLeft), 1), http.StatusCreated)

	// The VM's events, before and after the restart, carry its labels;
	// the stream filtered by them shows its events only.
	if st := s.act("lab1", "stop"); st != http.StatusNoContent {
		t.Fatalf("stop = %d", st)
	}
	s.waitDisplay("lab1", "stopped", "stopped")
	out := new(syncBuffer)
	cli := exec.Command(vmhostBin, "events", "-o", "json", "--since", "0", "--label", "team=infra")
	cli.Env = append(os.Environ(), "VMHOST_API=unix:"+s.sock, "VMHOST_TOKEN="+s.token)
	cli.Stdout, cli.Stderr = out, out
	if err := cli.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { cli.Process.Signal(syscall.SIGTERM); cli.Wait() }()
	type ev struct {
		Type   string            `json:"type"`
		VMID   string            `json:"vm_id"`
		State  string            `json:"state"`
		Labels map[string]string `json:"labels"`
	}
	stopped := func(e ev) bool { return e.Type == "state_changed" && e.State == "stopped" }
	var evs []ev
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		evs = nil
		for _, line := range strings.Split(out.String(), "\n") {
			var e ev
			if json.Unmarshal([]byte(line), &e) == nil && e.Type != "" {
				evs = append(evs, e)
			}
		}
		if slices.ContainsFunc(evs, stopped) || time.Now().After(deadline) {
			break
		}
	}
	if len(evs) == 0 {
		t.Fatalf("the filtered stream sent nothing:\n%s", out)
	}
	if evs[0].Type != "created" || !maps.Equal(evs[0].Labels, map[string]string{"team": "infra", "job": "j-1"}) {
		t.Errorf("first event of the filtered stream = %+v, want lab1 created with its create's labels\n%s", evs, out)
	}
	for _, e := range evs {
		if e.VMID != "lab1" || e.Labels["team"] != "infra" {
			t.Errorf("the stream filtered by team=infra sent %+v", e)
		}
	}
	if i := slices.IndexFunc(evs, stopped); i < 0 || !maps.Equal(evs[i].Labels, want) {
		t.Errorf("the filtered stream has no event of lab1's stop with %v (set before the restart)\n%s", want, out)
	}
}

// TestCrashDuringLabelEdit kills the agent with SIGKILL while a labels
// edit is in flight, 50 times at spread-out moments: after each restart
// the record loads, its labels are those before the edit or after it
// (never a mix, never lost), an edit that was answered 200 is there, and
// no temp file of the record write is left.
func TestCrashDuringLabelEdit(t *testing.T) {
	n := 50
	if testing.Short() {
		n = 5
	}
	s := startServer(t, serverOpts{})
	f := newFixture(t)
	s.create(f.body("lab", false, `,"labels":{"gen":"0","keep":"me"}`), http.StatusCreated)
	prev := "0"
	applied, answered := 0, 0
	for i := 1; i <= n; i++ {
		gen := fmt.Sprint(i)
		done := make(chan int, 1)
		go func() {
			st, _ := s.do("PATCH", "/api/vms/lab/labels", `{"gen":"`+gen+`","old":null}`)
			done <- st
		}()
		time.Sleep(time.Duration(i%10) * 300 * time.Microsecond)
		s.kill()
		st := <-done
		s.restart()
		got := s.labelsOf("lab")
		switch {
		case got["keep"] != "me" || len(got) != 2:
			t.Fatalf("kill %d: labels %v, want gen and keep=me only", i, got)
		case got["gen"] != prev && got["gen"] != gen:
			t.Fatalf("kill %d: gen=%q, want the one before (%s) or the edit's (%s)", i, got["gen"], prev, gen)
		case st == http.StatusOK && got["gen"] != gen:
			t.Fatalf("kill %d: the edit was answered 200 but gen=%q after the restart, want %s", i, got["gen"], gen)
		}
		if st == http.StatusOK {
			answered++
		}
		if got["gen"] == gen {
			applied++
		}
		prev = got["gen"]
		if temps, _ := filepath.Glob(s.stateDir + "/vms/.*.tmp-*"); len(temps) > 0 {
			t.Fatalf("kill %d: temp files left in the records' directory: %v", i, temps)
		}
	}
	t.Logf("%d kills during a labels edit: %d edits stored (%d answered before the kill), %d lost with the agent", n, applied, answered, n-applied)
}
