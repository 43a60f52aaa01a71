package appvm_test

import (
	"bytes"
	"encoding/json"
	"testing"
	"time"

	"vmhost/vm"
)

// TestIntegrationNextRestartAt: while the restart policy's backoff waits,
// the stopped AppVM's view says when it boots again; the boot clears it.
// A restart recorded as due when the agent stopped (RecoverRestarts at the
// next start) still happens, as the restart it was waiting for.
func TestIntegrationNextRestartAt(t *testing.T) {
	h := newHost(t)
	h.image("fail", "exit 3", nil)
	req := baseCreate("fail")
	req["restart_policy"] = "on-failure"
	id := h.create(req)
	var next time.Time
	h.waitFor(id, "stopped with next_restart_at", 30*time.Second, func(v appView) bool {
		var n struct {
			AppVM struct {
				NextRestartAt *time.Time `json:"next_restart_at"`
			} `json:"appvm"`
		}
		json.Unmarshal(v.raw, &n)
		if v.State == "stopped" && n.AppVM.NextRestartAt != nil {
			next = *n.AppVM.NextRestartAt
			return true
		}
		return false
	})
	v := h.waitFor(id, "restarted", 30*time.Second, func(v appView) bool { return v.AppVM.RestartCount >= 1 && v.State == "running" })
	if bytes.Contains(v.raw, []byte("next_restart_at")) {
		t.Errorf("next_restart_at shown on a running AppVM: %s", v.raw)
	}
	if at := v.AppVM.LastRestartAt; at == nil || at.Before(next.Add(-time.Millisecond)) {
		t.Errorf("restarted at %v, before the announced %v", at, next)
	}

	// An agent stopped during a backoff: the record says a restart is due.
	h.image("idle", "exec sleep 300", nil)
	req = baseCreate("idle")
	req["auto_boot"] = false
	req["restart_policy"] = "always"
	id = h.create(req)
	due := time.Now().UTC().Add(200 * time.Millisecond)
	if _, err := h.recs.Update(id, func(r *vm.Record) {
		r.AppVM.Guest = &vm.AppVMGuest{RestartCount: 2, NextRestartAt: &due}
		r.State, r.DisplayState = vm.StateStopped, string(vm.StateStopped)
	}); err != nil {
		t.Fatal(err)
	}
	h.apps.RecoverRestarts()
	v = h.waitFor(id, "booted by the recovered restart", 30*time.Second, func(v appView) bool { return v.State == "running" })
	if v.AppVM.RestartCount != 3 || v.AppVM.LastRestartAt == nil || v.AppVM.LastRestartAt.Before(due.Add(-time.Millisecond)) {
		t.Errorf("recovered restart: count %d at %v, want 3 at or after %v", v.AppVM.RestartCount, v.AppVM.LastRestartAt, due)
	}
}
