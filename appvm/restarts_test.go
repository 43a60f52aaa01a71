package appvm_test

import (
	"context"
	"strings"
	"testing"

	"vmhost/vm"
)

// TestFinishRestarts: an AppVM whose restart an agent's death cut short is
// booted if it does not run (stopped or failed by the restart's stop); one
// that runs a boot other than the one the restart replaced, or the same
// boot on a spec that is not pending (a redeploy rolled back before its
// stop), is left running. Each ends with no restart recorded, and nothing
// else is asked of the host.
func TestFinishRestarts(t *testing.T) {
	e, vms, apps := newEnv(t)
	ctx := context.Background()
	type tc struct {
		id    string
		state vm.State
		boot  uint64 // CH start time of the running boot; 0: none
		of    uint64
		spec  bool // spec_pending
	}
	cases := []tc{
		{id: "stopped", state: vm.StateStopped, of: 7},
		{id: "failed", state: vm.StateFailed, of: 7},
		{id: "newboot", state: vm.StateRunning, boot: 8, of: 7, spec: true},
		{id: "rolledback", state: vm.StateRunning, boot: 7, of: 7},
	}
	for _, c := range cases {
		req := baseReq()
		req.VMID = c.id
		req.AutoBoot = ptr(false)
		if _, err := apps.Create(ctx, &req); err != nil {
			t.Fatal(err)
		}
		if _, err := e.Records.Update(c.id, func(r *vm.Record) {
			r.State, r.DisplayState = c.state, string(c.state)
			if c.boot != 0 {
				r.Runtime = &vm.Runtime{CH: &vm.CHRuntime{Pid: 1, StartTime: c.boot}}
			}
			r.AppVM.SpecPending = c.spec
			r.AppVM.Restart = &vm.Restart{Of: c.of}
		}); err != nil {
			t.Fatal(err)
		}
	}
	before := len(e.Host.Calls())
	apps.FinishRestarts(ctx)
	apps.Wait()
	calls := e.Host.Calls()[before:]
	got := strings.Join(calls, "\n")
	for _, want := range []string{"boot stopped", "boot failed"} {
		if !strings.Contains(got, want) {
			t.Errorf("host calls:\n%s\nwant %q", got, want)
		}
	}
	if len(calls) != 2 {
		t.Errorf("host calls:\n%s\nwant only the two boots", got)
	}
	for _, c := range cases {
		rec, err := vms.Get(vm.ModeAppVM, c.id)
		if err != nil {
			t.Fatal(err)
		}
		if rec.AppVM.Restart != nil || rec.State != vm.StateRunning {
			t.Errorf("%s after FinishRestarts: %s, restart %+v; want running, no restart recorded", c.id, rec.State, rec.AppVM.Restart)
		}
	}
}
