//go:build linux

package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os/exec"
	"slices"
	"strings"
	"syscall"
	"testing"

	"vmhost/internal/netnstest"
	"vmhost/tap"
)

// TestTwoAgentsOneNamespace runs two agents (two vmhost serve processes
// with their own state directories) in one network namespace, each with
// VMs on the same bridge, one VM id used by both. Each agent is restarted
// twice (once after a clean exit, once after SIGKILL), one after the
// other: every tap and every nftables anti-spoof rule of both agents is
// there after each restart exactly as before (counted: taps with their
// marks and bridge, chains and rules per table, and the VMs' cgroups with
// the processes in them), and every VM still runs on its taps. Tap names,
// tables and cgroups carry each agent's id, so the VM id both use gets
// two taps and two cgroups.
func TestTwoAgentsOneNamespace(t *testing.T) {
	a := startServer(t, serverOpts{netns: true, confine: true})
	b := startServer(t, serverOpts{shareNetNS: a, confine: true})
	if a.agentID == b.agentID {
		t.Fatalf("both agents have id %s", a.agentID)
	}
	f := newFixture(t)
	ids := []string{"same", "solo"}
	for _, s := range []*server{a, b} {
		for _, id := range ids {
			s.create(f.body(id, true, `,"nets":[{},{"isolated":false}]`), http.StatusCreated)
		}
	}
	for _, s := range []*server{a, b} {
		for _, id := range ids {
			s.waitDisplay(id, "running", "running")
		}
	}
	before := hostNetwork(t, a, b)
	t.Logf("before the restarts: %d taps, %d chains, %d rules", len(before.taps), before.chains, before.rules)
	if want := 2 * len(ids) * 2; len(before.taps) != want {
		t.Fatalf("%d taps, want %d:\n%s", len(before.taps), want, strings.Join(before.taps, "\n"))
	}
	if before.chains != len(before.taps) || before.rules == 0 {
		t.Fatalf("%d anti-spoof chains with %d rules for %d taps", before.chains, before.rules, len(before.taps))
	}
	if want := 2 * len(ids); len(before.cgroups) != want {
		t.Fatalf("%d VM cgroups, want %d:\n%s", len(before.cgroups), want, strings.Join(before.cgroups, "\n"))
	}
	for round, how := range []string{"a clean exit", "SIGKILL"} {
		for _, s := range []*server{a, b} {
			if how == "SIGKILL" {
				s.kill()
			} else {
				s.term()
			}
			s.restart()
			after := hostNetwork(t, a, b)
			if !slices.Equal(after.cgroups, before.cgroups) {
				t.Errorf("round %d, agent %s restarted after %s: cgroups\n%s\nbefore:\n%s", round, s.agentID, how, strings.Join(after.cgroups, "\n"), strings.Join(before.cgroups, "\n"))
			}
			if !slices.Equal(after.taps, before.taps) || after.chains != before.chains || after.rules != before.rules || after.ruleset != before.ruleset {
				t.Errorf("round %d, agent %s restarted after %s: taps\n%s\n%d chains, %d rules; before:\n%s\n%d chains, %d rules",
					round, s.agentID, how, strings.Join(after.taps, "\n"), after.chains, after.rules, strings.Join(before.taps, "\n"), before.chains, before.rules)
			}
			if strings.Contains(s.stderr.String(), "deleted a tap") {
				t.Errorf("agent %s deleted a tap at restart:\n%s", s.agentID, s.stderr)
			}
			for _, o := range []*server{a, b} {
				for _, id := range ids {
					if v, ok := o.get(id); !ok || v.State != "running" || len(v.Nets) != 2 {
						t.Errorf("agent %s: VM %s after the restart: %+v", o.agentID, id, v)
					}
				}
			}
		}
	}
	// Each agent still manages its own: a delete removes its taps and
	// rules only.
	if st, body := a.do("DELETE", "/api/vms/same?force=true", ""); st != http.StatusNoContent {
		t.Fatalf("DELETE = %d %s", st, body)
	}
	end := hostNetwork(t, a, b)
	if len(end.taps) != len(before.taps)-2 || end.chains != before.chains-2 {
		t.Errorf("after deleting one VM of agent %s: taps\n%s\n%d chains", a.agentID, strings.Join(end.taps, "\n"), end.chains)
	}
	if len(end.cgroups) != len(before.cgroups)-1 || slices.ContainsFunc(end.cgroups, func(c string) bool { return strings.HasPrefix(c, a.agentID+" same ") }) {
		t.Errorf("after deleting VM same of agent %s: cgroups\n%s", a.agentID, strings.Join(end.cgroups, "\n"))
	}
	for _, n := range end.taps {
		if strings.Contains(n, b.agentID) {
			continue
		}
		if strings.Contains(n, ":same:") {
			t.Errorf("tap of the deleted VM left: %s", n)
		}
	}
}

// term stops the server with SIGTERM and waits for its clean exit.
func (s *server) term() {
	s.t.Helper()
	s.cmd.Process.Signal(syscall.SIGTERM)
	<-s.exited // the harness waits for it (waitExit)
	if st := s.cmd.ProcessState; !st.Success() {
		s.t.Fatalf("vmhost serve after SIGTERM: %v\n%s", st, s.stderr)
	}
}

// network is what the agents of one namespace have made there.
type network struct {
	taps          []string // "<name> <alias> master=<bridge ifindex>", sorted
	chains, rules int      // in the agents' anti-spoof tables
	ruleset       string   // those tables as nft lists them
	cgroups       []string // "<agent> <vm> <pids>" of each VM cgroup of the agents, sorted
}

// hostNetwork reads the taps (every vmhost tap, whoever marked it) and the
// anti-spoof tables of agents in their shared namespace.
func hostNetwork(t *testing.T, agents ...*server) network {
	t.Helper()
	s := agents[0]
	marked, err := tap.New(&tap.Config{NetNS: s.nsFD}).ListMarked(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	var n network
	for _, a := range agents {
		j := a.jailer()
		if j == nil {
			t.Fatalf("agent %s confines nothing", a.agentID)
		}
		for _, id := range a.cgroupVMs() {
			vm, err := j.VM(id, 1)
			if err != nil {
				t.Fatal(err)
			}
			pids, err := vm.Cgroup().Procs()
			if err != nil || len(pids) == 0 {
				t.Errorf("cgroup of agent %s's VM %s: pids %v, %v", a.agentID, id, pids, err)
			}
			slices.Sort(pids)
			n.cgroups = append(n.cgroups, fmt.Sprintf("%s %s %v", a.agentID, id, pids))
		}
	}
	slices.Sort(n.cgroups)
	for _, o := range marked {
		alias := tap.AgentAlias(o.Agent, o.VMID, o.Index)
		n.taps = append(n.taps, fmt.Sprintf("%s %s master=%d", o.Name, alias, o.Master))
		if o.Master == 0 {
			t.Errorf("tap %s (%s) is on no bridge", o.Name, alias)
		}
	}
	slices.Sort(n.taps)
	var tables []string
	for _, a := range agents {
		tables = append(tables, tap.GuardTableOf(a.agentID))
	}
	for _, table := range tables {
		var out []byte
		err := netnstest.RunIn(s.nsFD, func() error {
			var err error
			out, err = exec.Command("nft", "-j", "list", "table", "bridge", table).Output()
			return err
		})
		if err != nil {
			t.Fatalf("nft list table bridge %s: %v", table, err)
		}
		var doc struct {
			Nftables []map[string]json.RawMessage `json:"nftables"`
		}
		if err := json.Unmarshal(out, &doc); err != nil {
			t.Fatalf("nft -j: %v", err)
		}
		for _, o := range doc.Nftables {
			if _, ok := o["chain"]; ok {
				n.chains++
			}
			if r, ok := o["rule"]; ok {
				n.rules++
				// Rule handles are the kernel's: compare the rules without them.
				var rule map[string]json.RawMessage
				json.Unmarshal(r, &rule)
				delete(rule, "handle")
				b, _ := json.Marshal(rule)
				n.ruleset += string(b) + "\n"
			}
		}
	}
	return n
}
