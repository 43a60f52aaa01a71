//go:build linux

package e2e

import (
	"context"
	"os"
	"path"
	"path/filepath"
	"strings"
	"time"

	"vmhost/jail"
)

// jailer is the jail of the server's agent (its agent id from the state
// directory), for looking at the VMs' cgroups; nil without root.
func (s *server) jailer() *jail.Jailer {
	if os.Geteuid() != 0 {
		return nil
	}
	b, err := os.ReadFile(filepath.Join(s.stateDir, "agent_id"))
	if err != nil {
		return nil
	}
	j, err := jail.New(jail.DefaultConfig(), jail.Host{RunDir: s.runDir, AgentID: strings.TrimSpace(string(b))})
	if err != nil || !j.Enabled() {
		return nil
	}
	return j
}

// cgroupVMs lists the VMs that have a cgroup of the server's agent.
func (s *server) cgroupVMs() []string {
	j := s.jailer()
	if j == nil {
		return nil
	}
	ids, err := j.Leftovers()
	if err != nil {
		s.t.Errorf("listing the agent's cgroups: %v", err)
	}
	return ids
}

// removeCgroups kills what runs in the cgroups of the server's agent and
// removes them (VMs outlive the agent, so a test's VMs are still there
// when it ends).
func (s *server) removeCgroups() {
	j := s.jailer()
	if j == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	ids, _ := j.Leftovers()
	for _, id := range ids {
		if err := j.Destroy(ctx, id); err != nil {
			s.t.Logf("removing the cgroup of VM %s: %v", id, err)
		}
	}
	b, _ := os.ReadFile(filepath.Join(s.stateDir, "agent_id"))
	j.Layout().Cgroup(path.Join(jail.DefaultConfig().CgroupParent, strings.TrimSpace(string(b)))).Remove(ctx)
}
