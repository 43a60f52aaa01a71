package appvm_test

import (
	"bytes"
	"context"
	"encoding/json"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"vmhost/appvm"
	"vmhost/appvm/guest/proto"
	"vmhost/chclient"
	"vmhost/qcow2"
	"vmhost/vm"
	"vmhost/vm/vmtest"
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

// TestRestartWhenWorkloadExitsBeforeBootRecorded: a workload that exits
// before its boot is recorded (the guest agent is quicker than the
// engine's write of state running) is restarted all the same, once that
// boot is recorded stopped: on a first boot, whose record says created
// until then, and on a restart's boot, whose record still says stopped.
func TestRestartWhenWorkloadExitsBeforeBootRecorded(t *testing.T) {
	e := &appEnv{Env: vmtest.NewEnv(t)}
	logs := new(lockedLog)
	e.Logger = slog.New(slog.NewTextHandler(logs, nil))
	vms := e.Service(t)
	bin := filepath.Join(t.TempDir(), "vmhost")
	if err := os.WriteFile(bin, []byte("agent"), 0o755); err != nil {
		t.Fatal(err)
	}
	e.guests = appvm.NewGuests(appvm.GuestOptions{Records: e.Records, Config: e.Config, Layout: vms.Layout(),
		Now: func() time.Time { return e.Now }, Binary: bin, Logger: e.Logger})
	apps := appvm.New(appvm.Config{VMs: vms, Records: e.Records, Guests: e.guests, RootDisks: e.Host,
		Restart: appvm.RestartOptions{BaseDelay: 10 * time.Millisecond, StopWait: 30 * time.Second}})
	if err := apps.Catalog().Put(&appvm.Image{ID: "web", Status: appvm.StatusReady, CreatedAt: e.Now,
		Workload: vm.Workload{BuildDigest: "sha256:1a2b3c4d", SizeBytes: 1 << 30, Cmd: []string{"false"}}}); err != nil {
		t.Fatal(err)
	}
	if err := qcow2.Create(apps.Catalog().BuildFile("web", "sha256:1a2b3c4d"), 1<<30); err != nil {
		t.Fatal(err) // the build the root disk is an overlay of
	}
	req := baseReq()
	req.VMID = "early"
	req.AutoBoot = ptr(false)
	req.RestartPolicy = "on-failure"
	if _, err := apps.Create(context.Background(), &req); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.guests.End("early") })

	for restart := uint32(1); restart <= 2; restart++ {
		rec := e.Records.Get("early")
		before := rec.State
		e.guests.End("early") // as the engine's boot does first
		bootGuest(t, e, vms, rec)
		exitAtOnce(t, vms, "early")
		if cur := e.Records.Get("early"); cur.State != before || cur.AppVM.Guest.ExitCode == nil {
			t.Fatalf("boot %d: the exit was recorded with state %s, want it before the boot (%s)", restart, cur.State, before)
		}
		running(t, e, "early") // the boot's record write comes after the exit
		boots := strings.Count(e.Host.Transcript(), "boot early")
		// The guest powered off: the monitor records the VM stopped.
		if _, err := e.Records.Update("early", func(r *vm.Record) {
			r.State, r.DisplayState = vm.StateStopped, string(vm.StateStopped)
			r.FailureReason = &vm.FailureReason{DetectedAt: e.Now, Summary: "the guest powered off", Cause: "guest_shutdown",
				Detail: vm.FailureDetail{Kind: "process_exit"}}
		}); err != nil {
			t.Fatal(err)
		}
		deadline := time.Now().Add(20 * time.Second)
		for {
			cur := e.Records.Get("early")
			if cur.State == vm.StateRunning && cur.AppVM.Guest.RestartCount == restart {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("boot %d: no restart after the workload's early exit: state %s, restart_count %d; agent log:\n%s",
					restart, cur.State, cur.AppVM.Guest.RestartCount, logs)
			}
			time.Sleep(5 * time.Millisecond)
		}
		if got := strings.Count(e.Host.Transcript(), "boot early"); got != boots+1 {
			t.Fatalf("boot %d: %d boots by the restart, want 1; transcript:\n%s", restart, got-boots, e.Host.Transcript())
		}
		// The restart's boot ends as the fake host does not: the record
		// goes back to stopped, as before the real engine's next boot.
		if _, err := e.Records.Update("early", func(r *vm.Record) {
			r.State, r.DisplayState = vm.StateStopped, string(vm.StateStopped)
		}); err != nil {
			t.Fatal(err)
		}
	}
}

// exitAtOnce plays a guest agent of AppVM id whose workload exits 1 at
// once: Hello, the Spec, Exit; it returns once the exit is recorded.
func exitAtOnce(t *testing.T, vms *vm.Service, id string) {
	t.Helper()
	c, err := net.Dial("unix", chclient.VsockListenPath(vms.Layout().VsockSocket(id), proto.Port))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	conn := proto.NewConn(c)
	if err := conn.Send(&proto.Hello{V: proto.Version, AgentVersion: "t", BootID: "b"}); err != nil {
		t.Fatal(err)
	}
	if m, err := conn.Recv(); err != nil {
		t.Fatal(err)
	} else if _, ok := m.(*proto.Spec); !ok {
		t.Fatalf("host sent %s, want spec", m.Type())
	}
	code := 1
	if err := conn.Send(&proto.Exit{Code: &code}); err != nil {
		t.Fatal(err)
	}
	if m, err := conn.Recv(); err != nil {
		t.Fatal(err)
	} else if _, ok := m.(*proto.ExitAck); !ok {
		t.Fatalf("host sent %s after the exit, want exit_ack", m.Type())
	}
}
