package appvm_test

import (
	"context"
	"errors"
	"net"
	"strings"
	"testing"
	"time"

	"vmhost/appvm"
	"vmhost/appvm/guest/proto"
	"vmhost/chclient"
	"vmhost/vm"
)

// TestSessionVolumeMounts plays the guest agent's side of Mount and
// Unmount against the host end (appvm.Guests): no guest connected (once
// the request stops waiting for one) and a version 1 guest are refused
// (409) with nothing sent; a version 2 guest gets the
// volume's mountpoint, PCI address and read-only flag, and its answers
// become success, a busy 409 naming the mountpoint, or a storage error;
// a connection that ends mid-request fails the request.
func TestSessionVolumeMounts(t *testing.T) {
	e, vms, apps := newEnv(t)
	req := baseReq()
	req.VMID = "m1"
	req.AutoBoot = ptr(false)
	req.DataVolumes = []appvm.DataVolumeRequest{{SizeGiB: 1, Mountpoint: "/var/lib/data"}}
	rec, guests := bootedWithoutGuest(t, e, vms, apps, &req)
	key := rec.Spec.Volumes[0]
	ctx := context.Background()
	wantState := func(err error, want ...string) {
		t.Helper()
		var se *vm.StateError
		if !errors.As(err, &se) {
			t.Fatalf("error %v (%T), want a *vm.StateError", err, err)
		}
		for _, w := range want {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("error %q lacks %q", err, w)
			}
		}
	}
	// Without a guest connected, the request waits for one (recovery runs
	// while agents reconnect), until its context ends.
	short, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	start := time.Now()
	wantState(guests.Mount(short, rec, key, "0000:00:06.0"), "not connected")
	cancel()
	if waited := time.Since(start); waited < 300*time.Millisecond {
		t.Errorf("a Mount without a guest connected gave up after %v, before its context ended", waited)
	}

	sock := chclient.VsockListenPath(vms.Layout().VsockSocket("m1"), proto.Port)
	connect := func(v int) (net.Conn, *proto.Conn) {
		t.Helper()
		c, err := net.Dial("unix", sock)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		conn := proto.NewConn(c)
		if err := conn.Send(&proto.Hello{V: v, AgentVersion: "t", BootID: "b"}); err != nil {
			t.Fatal(err)
		}
		c.SetReadDeadline(time.Now().Add(10 * time.Second))
		m, err := conn.Recv()
		if sp, ok := m.(*proto.Spec); err != nil || !ok || sp.V != v {
			t.Fatalf("answer to a v%d hello: %#v, %v", v, m, err)
		} else if len(sp.DataMounts) != 1 || sp.DataMounts[0] != (proto.DataMount{Device: "/dev/vdb", Mountpoint: "/var/lib/data"}) {
			t.Errorf("spec data mounts %+v", sp.DataMounts)
		}
		return c, conn
	}
	// retry covers the moment before the host takes a new connection.
	retry := func(f func() error) error {
		deadline := time.Now().Add(5 * time.Second)
		for {
			err := f()
			if err == nil || !strings.Contains(err.Error(), "not connected") && !strings.Contains(err.Error(), "version 1") || time.Now().After(deadline) {
				return err
			}
			time.Sleep(10 * time.Millisecond)
		}
	}

	old, _ := connect(1)
	deadline := time.Now().Add(5 * time.Second)
	var err error
	for {
		err = guests.Mount(ctx, rec, key, "0000:00:06.0")
		if !strings.Contains(err.Error(), "not connected") || time.Now().After(deadline) {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	wantState(err, "protocol version 1", "restart the AppVM")
	old.Close()

	nc, conn := connect(proto.Version)
	// answer plays the guest for one request: it checks what came and
	// answers with reply (nil: close the connection instead).
	answer := func(check func(proto.Message), reply func(seq uint64) *proto.MountResult) {
		go func() {
			m, err := conn.Recv()
			if err != nil {
				return
			}
			check(m)
			var seq uint64
			switch m := m.(type) {
			case *proto.Mount:
				seq = m.Seq
			case *proto.Unmount:
				seq = m.Seq
			}
			if r := reply(seq); r != nil {
				conn.Send(r)
			}
		}()
	}
	got := make(chan proto.Message, 1)
	answer(func(m proto.Message) { got <- m }, func(seq uint64) *proto.MountResult { return &proto.MountResult{Seq: seq} })
	if err := retry(func() error { return guests.Mount(ctx, rec, key, "0000:00:06.0") }); err != nil {
		t.Fatalf("mount: %v", err)
	}
	if m, ok := (<-got).(*proto.Mount); !ok || m.BDF != "0000:00:06.0" || m.Mountpoint != "/var/lib/data" || m.ReadOnly || m.Seq == 0 {
		t.Errorf("guest got %#v, want the volume's Mount", m)
	}

	answer(func(m proto.Message) { got <- m }, func(seq uint64) *proto.MountResult {
		return &proto.MountResult{Seq: seq, Error: "unmounting /var/lib/data: device or resource busy", Busy: true}
	})
	wantState(guests.Unmount(ctx, rec, key), "/var/lib/data", "busy", "stays attached")
	if m, ok := (<-got).(*proto.Unmount); !ok || m.Mountpoint != "/var/lib/data" {
		t.Errorf("guest got %#v, want the volume's Unmount", m)
	}

	answer(func(proto.Message) {}, func(seq uint64) *proto.MountResult {
		return &proto.MountResult{Seq: seq, Error: "mounting /dev/vdc at /var/lib/data: invalid argument"}
	})
	err = guests.Mount(ctx, rec, key, "0000:00:06.0")
	var he *vm.HostError
	if !errors.As(err, &he) || he.Kind != vm.HostStorage || !strings.Contains(err.Error(), "invalid argument") {
		t.Errorf("failed mount: %v (%T), want a storage HostError with the guest's cause", err, err)
	}

	// A stale answer (another Seq) is not taken for this request's; then
	// the guest goes away.
	answer(func(proto.Message) {}, func(seq uint64) *proto.MountResult { return &proto.MountResult{Seq: seq + 100} })
	go func() {
		time.Sleep(300 * time.Millisecond)
		conn.Send(&proto.Heartbeat{Seq: 1})
	}()
	appvm.MountTimeout = 500 * time.Millisecond
	defer func() { appvm.MountTimeout = 30 * time.Second }()
	err = guests.Unmount(ctx, rec, key)
	if !errors.As(err, &he) || !strings.Contains(err.Error(), "no answer within") {
		t.Errorf("unanswered unmount: %v, want no answer", err)
	}
	appvm.MountTimeout = 30 * time.Second
	answer(func(proto.Message) { nc.Close() }, func(uint64) *proto.MountResult { return nil })
	err = guests.Mount(ctx, rec, key, "0000:00:06.0")
	if !errors.As(err, &he) || !strings.Contains(err.Error(), "connection ended") {
		t.Errorf("mount cut by the guest's connection closing: %v", err)
	}
}
