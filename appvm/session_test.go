package appvm_test

import (
	"bytes"
	"context"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"vmhost/appvm"
	"vmhost/appvm/guest/proto"
	"vmhost/chclient"
	"vmhost/vm"
)

// TestSessionProtocol plays the guest agent's side against the host end:
// a connection that does not start with Hello gets nothing; Hello gets the
// Spec with the secret; heartbeats, lease, health, logs (secret scrubbed)
// and the exit land in the record and the view, and the exit is
// acknowledged; a resumed connection gets
// no Spec and carries the stop.
func TestSessionProtocol(t *testing.T) {
	e, vms, apps := newEnv(t)
	req := baseReq()
	req.VMID = "p1"
	req.AutoBoot = ptr(false)
	req.SecretEnv = secrets([]string{"TOKEN=hunter2-secret"})
	rec, guests := bootedWithoutGuest(t, e, vms, apps, &req)
	if err := guests.Stop(context.Background(), rec); err == nil {
		t.Error("Shutdown without a guest agent connection succeeded")
	}
	sock := chclient.VsockListenPath(vms.Layout().VsockSocket("p1"), proto.Port)
	dial := func() (net.Conn, *proto.Conn) {
		c, err := net.Dial("unix", sock)
		if err != nil {
			t.Fatal(err)
		}
		c.SetDeadline(time.Now().Add(10 * time.Second))
		return c, proto.NewConn(c)
	}

	c, conn := dial()
	if err := conn.Send(&proto.Heartbeat{Seq: 1}); err != nil {
		t.Fatal(err)
	}
	if m, err := conn.Recv(); err == nil {
		t.Fatalf("host answered %s to a connection without hello", m.Type())
	}
	c.Close()

	c, conn = dial()
	defer c.Close()
	if err := conn.Send(&proto.Hello{V: proto.Version, AgentVersion: "t", BootID: "b1"}); err != nil {
		t.Fatal(err)
	}
	m, err := conn.Recv()
	if err != nil {
		t.Fatal(err)
	}
	sp, ok := m.(*proto.Spec)
	if !ok || len(sp.SecretEnv) != 1 || sp.SecretEnv[0].Value.Reveal() != "hunter2-secret" || sp.Hostname != appvm.Hostname(rec) {
		t.Fatalf("spec = %+v", m)
	}
	code := 3
	for _, m := range []proto.Message{
		&proto.Heartbeat{Seq: 1, At: time.Now()},
		&proto.Lease{IP: "10.0.0.9", Prefix: 24, Gateway: "10.0.0.1", DNS: []string{"10.0.0.1"}, LeaseSecs: 600},
		&proto.Health{Status: proto.HealthUnhealthy, Streak: 3},
		&proto.Log{Stream: proto.Stdout, Data: []byte("token=hunter2-secret\n"), Seq: 1},
		&proto.Exit{Code: &code},
	} {
		if err := conn.Send(m); err != nil {
			t.Fatal(err)
		}
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		rec, _ = vms.Get(vm.ModeAppVM, "p1")
		if g := rec.AppVM.Guest; g != nil && g.ExitCode != nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("exit not recorded: %+v", rec.AppVM.Guest)
		}
		time.Sleep(10 * time.Millisecond)
	}
	// The exit and the log chunk are acknowledged (a version 3 guest):
	// one exit_ack, and a log_ack of its chunk once it is stored.
	var exitAcked, logAcked bool
	for !exitAcked || !logAcked {
		m, err := conn.Recv()
		if err != nil {
			t.Fatalf("acknowledgements: exit %v, log %v: %v", exitAcked, logAcked, err)
		}
		switch m := m.(type) {
		case *proto.ExitAck:
			exitAcked = true
		case *proto.LogAck:
			if m.Seq != 1 {
				t.Errorf("log_ack %d, want 1", m.Seq)
			}
			logAcked = true
		default:
			t.Fatalf("host sent %s after the exit", m.Type())
		}
	}
	v := apps.View(rec, vm.ViewOptions{}).AppVM
	if v.Lease == nil || v.Lease.IP != "10.0.0.9" || v.Lease.LeaseSecs != 600 || v.Lease.ReportedAt.IsZero() ||
		v.Health != "unhealthy" || v.HealthFailingStreak != 3 || v.WorkloadExitCode == nil || *v.WorkloadExitCode != 3 ||
		v.LastHeartbeatAt == nil || v.HeartbeatStale || v.LogStreamDetached {
		t.Errorf("view = %+v", v)
	}
	var logs bytes.Buffer
	if err := apps.Logs(context.Background(), "p1", appvm.LogQuery{Tail: 10}, &logs, func() {}); err != nil {
		t.Fatal(err)
	}
	if got := logs.String(); !strings.HasPrefix(got, `{"seq":1,"time":"`) || !strings.HasSuffix(got, `","stream":"stdout","data":"token=[redacted]\n"}`+"\n") {
		t.Errorf("workload log = %q", got)
	}

	// The connection breaks (a host agent restart would); the guest
	// resumes: no Spec, and the stop goes over the new connection.
	c.Close()
	c, conn = dial()
	defer c.Close()
	if err := conn.Send(&proto.Hello{V: proto.Version, AgentVersion: "t", BootID: "b1", Resume: true}); err != nil {
		t.Fatal(err)
	}
	got := make(chan proto.Message, 1)
	go func() {
		m, err := conn.Recv()
		if err != nil {
			close(got)
			return
		}
		got <- m
	}()
	select {
	case m := <-got:
		t.Fatalf("host sent %v after a resume hello", m)
	case <-time.After(200 * time.Millisecond):
	}
	deadline = time.Now().Add(5 * time.Second)
	for {
		err = guests.Stop(context.Background(), rec)
		if err == nil || time.Now().After(deadline) {
			break
		}
		time.Sleep(10 * time.Millisecond) // the host may not have taken the new connection yet
	}
	if err != nil {
		t.Fatal(err)
	}
	select {
	case m, ok := <-got:
		if !ok {
			t.Fatal("connection closed instead of a stop")
		}
		if _, isStop := m.(*proto.Stop); !isStop {
			t.Errorf("host sent %s, want stop", m.Type())
		}
	case <-time.After(5 * time.Second):
		t.Fatal("no stop arrived")
	}
}

// bootedWithoutGuest creates the AppVM of req and does what the engine
// does to boot it, except starting a VM: the host end serves a listener
// on the guest agent's port, and the test plays the agent.
func bootedWithoutGuest(t *testing.T, e *appEnv, vms *vm.Service, apps *appvm.Service, req *appvm.CreateRequest) (*vm.Record, *appvm.Guests) {
	t.Helper()
	if _, err := apps.Create(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	rec, _ := vms.Get(vm.ModeAppVM, req.VMID)
	bootGuest(t, e, vms, rec)
	t.Cleanup(func() { e.guests.End(rec.ID) })
	running(t, e, req.VMID) // as the engine records the boot
	return rec, e.guests
}

// bootGuest readies the host end of rec's boot as the engine does: a
// listener on the guest agent's port of its hybrid vsock, handed to
// Guests.Boot, which returns the initramfs.
func bootGuest(t *testing.T, e *appEnv, vms *vm.Service, rec *vm.Record) {
	t.Helper()
	sock := vms.Layout().VsockSocket(rec.ID)
	if err := os.MkdirAll(filepath.Dir(sock), 0o700); err != nil {
		t.Fatal(err)
	}
	l, err := chclient.ListenVsock(sock, e.guests.Port())
	if err != nil {
		t.Fatal(err)
	}
	initrd, err := e.guests.Boot(context.Background(), rec, "", l)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(initrd); err != nil {
		t.Errorf("the initramfs of the boot: %v", err)
	}
}

// running records AppVM id as running, as the engine does once it booted.
func running(t *testing.T, e *appEnv, id string) {
	t.Helper()
	if _, err := e.Records.Update(id, func(r *vm.Record) { r.State, r.DisplayState = vm.StateRunning, string(vm.StateRunning) }); err != nil {
		t.Fatal(err)
	}
}

// appvmView waits until the view of AppVM id satisfies cond.
func appvmView(t *testing.T, vms *vm.Service, apps *appvm.Service, id, what string, cond func(*appvm.AppvmView) bool) *appvm.AppvmView {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		rec, err := vms.Get(vm.ModeAppVM, id)
		if err != nil {
			t.Fatal(err)
		}
		v := apps.View(rec, vm.ViewOptions{}).AppVM
		if cond(&v) {
			return &v
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: %s did not happen; view %+v", id, what, v)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestSessionPerRunFields: a DHCP AppVM whose guest has its spec and no
// lease yet shows waiting_for dhcp_lease until the lease comes; health
// shows only while the AppVM runs; a new boot clears the previous run's
// workload end (exit code, signal, fatal) and health.
func TestSessionPerRunFields(t *testing.T) {
	e, vms, apps := newEnv(t)
	req := baseReq()
	req.VMID = "r1"
	req.AutoBoot = ptr(false)
	if _, err := apps.Create(context.Background(), &req); err != nil {
		t.Fatal(err)
	}
	rec, _ := vms.Get(vm.ModeAppVM, "r1")
	bootGuest(t, e, vms, rec)
	defer e.guests.End(rec.ID)
	running(t, e, "r1")
	if v := appvmView(t, vms, apps, "r1", "booted", func(*appvm.AppvmView) bool { return true }); v.WaitingFor != "" {
		t.Errorf("waiting_for %q before the guest agent said hello", v.WaitingFor)
	}
	sock := chclient.VsockListenPath(vms.Layout().VsockSocket("r1"), proto.Port)
	c, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	conn := proto.NewConn(c)
	if err := conn.Send(&proto.Hello{V: proto.Version, AgentVersion: "t", BootID: "b1"}); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Recv(); err != nil {
		t.Fatal(err)
	}
	appvmView(t, vms, apps, "r1", "waiting_for dhcp_lease", func(v *appvm.AppvmView) bool { return v.WaitingFor == appvm.WaitingForLease })
	send := func(ms ...proto.Message) {
		t.Helper()
		for _, m := range ms {
			if err := conn.Send(m); err != nil {
				t.Fatal(err)
			}
		}
	}
	send(&proto.Lease{IP: "10.0.0.9", Prefix: 24})
	appvmView(t, vms, apps, "r1", "lease shown, waiting over", func(v *appvm.AppvmView) bool { return v.Lease != nil && v.WaitingFor == "" })
	send(&proto.Health{Status: proto.HealthStarting}, &proto.Exit{Signal: 9})
	appvmView(t, vms, apps, "r1", "exit by signal 9", func(v *appvm.AppvmView) bool { return v.WorkloadExitSignal == 9 && v.Health == proto.HealthStarting })
	if _, err := e.Records.Update("r1", func(r *vm.Record) { r.State, r.DisplayState = vm.StateStopped, string(vm.StateStopped) }); err != nil {
		t.Fatal(err)
	}
	if v := appvmView(t, vms, apps, "r1", "stopped", func(*appvm.AppvmView) bool { return true }); v.Health != "" || v.WorkloadExitSignal != 9 {
		t.Errorf("stopped AppVM: health %q, workload_exit_signal %d; want no health, the last run's signal 9", v.Health, v.WorkloadExitSignal)
	}
	c.Close()
	e.guests.End(rec.ID)
	rec, _ = vms.Get(vm.ModeAppVM, "r1")
	bootGuest(t, e, vms, rec)
	running(t, e, "r1")
	if v := appvmView(t, vms, apps, "r1", "booted again", func(*appvm.AppvmView) bool { return true }); v.WorkloadExitSignal != 0 || v.WorkloadExitCode != nil ||
		v.WorkloadFatal != "" || v.Health != "" || v.Lease != nil {
		t.Errorf("a new boot shows the previous run's facts: %+v", v)
	}
}
