package appvm_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
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

// TestSessionLogsAfterRestore plays a guest agent whose AppVM is restored
// from a snapshot with memory: the restored agent resumes with the Log
// numbering it had at the snapshot, behind what the host stored of the
// timeline the restore discarded. Its replay of the chunks unacknowledged
// at the snapshot is stored no second time, and its new chunks, whose
// numbers the discarded timeline used already, are all stored, after the
// discarded timeline's, in the logs API's order. A reconnect of the same
// timeline (a broken connection; a host agent restart, which reads the
// numbering back from the log) stores each chunk it resends once.
func TestSessionLogsAfterRestore(t *testing.T) {
	e, vms, apps := newEnv(t)
	req := baseReq()
	req.VMID = "rl"
	req.AutoBoot = ptr(false)
	rec, guests := bootedWithoutGuest(t, e, vms, apps, &req)
	sock := chclient.VsockListenPath(vms.Layout().VsockSocket("rl"), proto.Port)
	// guest connects as the agent of boot b1 does: a Hello (resuming with
	// the number of its last Log when logSeq is set), then msgs.
	guest := func(logSeq *uint64, msgs ...*proto.Log) net.Conn {
		t.Helper()
		var c net.Conn
		deadline := time.Now().Add(10 * time.Second)
		for {
			var err error
			if c, err = net.Dial("unix", sock); err == nil {
				break
			}
			if time.Now().After(deadline) {
				t.Fatal(err)
			}
			time.Sleep(10 * time.Millisecond) // the host end is not listening yet
		}
		t.Cleanup(func() { c.Close() })
		c.SetDeadline(time.Now().Add(10 * time.Second))
		conn := proto.NewConn(c)
		hello := &proto.Hello{V: proto.Version, AgentVersion: "t", BootID: "b1", Resume: logSeq != nil, LogSeq: logSeq}
		if err := conn.Send(hello); err != nil {
			t.Fatal(err)
		}
		if logSeq == nil {
			if m, err := conn.Recv(); err != nil {
				t.Fatal(err)
			} else if _, ok := m.(*proto.Spec); !ok {
				t.Fatalf("host sent %s, want the spec", m.Type())
			}
		}
		// The host's LogAcks are read and dropped, as they come.
		go func() {
			for {
				if _, err := conn.Recv(); err != nil {
					return
				}
			}
		}()
		for _, m := range msgs {
			if err := conn.Send(m); err != nil {
				t.Fatal(err)
			}
		}
		return c
	}
	out := func(seq uint64, data string) *proto.Log {
		return &proto.Log{Stream: proto.Stdout, Seq: seq, Data: []byte(data + "\n"), At: time.Now()}
	}
	errOut := func(seq uint64, data string) *proto.Log {
		return &proto.Log{Stream: proto.Stderr, Seq: seq, Data: []byte(data + "\n"), At: time.Now()}
	}
	// logs waits until the logs API's last chunk is last, then checks that
	// the log holds want, in that order, numbered from 1.
	logs := func(when string, want ...string) {
		t.Helper()
		var got []string
		deadline := time.Now().Add(10 * time.Second)
		for {
			var buf bytes.Buffer
			if err := apps.Logs(context.Background(), "rl", appvm.LogQuery{Tail: 100}, &buf, func() {}); err != nil {
				t.Fatal(err)
			}
			got = got[:0]
			sc := bufio.NewScanner(&buf)
			for n := uint64(1); sc.Scan(); n++ {
				var c appvm.LogChunk
				if err := json.Unmarshal(sc.Bytes(), &c); err != nil || c.Seq != n {
					t.Fatalf("%s: chunk %d of the logs API: %s (%v)", when, n, sc.Bytes(), err)
				}
				got = append(got, c.Stream+" "+strings.TrimSuffix(c.Data, "\n"))
			}
			if len(got) > 0 && got[len(got)-1] == want[len(want)-1] {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: the log never ended with %q: %q", when, want[len(want)-1], got)
			}
			time.Sleep(10 * time.Millisecond)
		}
		if strings.Join(got, "|") != strings.Join(want, "|") {
			t.Errorf("%s: the log holds\n%q\nwant\n%q", when, got, want)
		}
	}

	// Timeline A: chunks 1 to 4, then the snapshot (the guest's count is
	// 4, chunks 3 and 4 not acknowledged yet), then 5 and 6.
	c := guest(nil, out(1, "a1"), errOut(2, "a2"), out(3, "a3"), out(4, "a4"), out(5, "a5"), errOut(6, "a6"))
	logs("timeline A", "stdout a1", "stderr a2", "stdout a3", "stdout a4", "stdout a5", "stderr a6")
	// The connection breaks: the guest resumes with count 7, replays 5 and
	// 6 and goes on with 7.
	c.Close()
	c = guest(ptr(uint64(7)), out(5, "a5"), errOut(6, "a6"), out(7, "a7"))
	timelineA := []string{"stdout a1", "stderr a2", "stdout a3", "stdout a4", "stdout a5", "stderr a6", "stdout a7"}
	logs("a reconnect of timeline A", timelineA...)

	// A stop, the restore of the snapshot and a start: the engine serves
	// the restored guest (Guests.Resume); its agent resumes with count 4,
	// replays 3 and 4, and numbers its new output from 5: numbers that
	// timeline A used for both streams.
	c.Close()
	guests.End("rl")
	resume(t, e, vms, rec, guests.Resume)
	running(t, e, "rl")
	c = guest(ptr(uint64(4)), out(3, "a3"), out(4, "a4"), out(5, "b5"), out(6, "b6"), errOut(7, "b7"), out(8, "b8"))
	timelineB := append(timelineA, "stdout b5", "stdout b6", "stderr b7", "stdout b8")
	logs("after the restore", timelineB...)

	// The host agent restarts (it adopts the running AppVM and reads the
	// numbering back from the log): timeline B resumes with count 9 and
	// replays 7 to 9, the new one first stored now.
	c.Close()
	guests.End("rl")
	rec, _ = vms.Get(vm.ModeAppVM, "rl")
	resume(t, e, vms, rec, guests.Adopt)
	guest(ptr(uint64(9)), errOut(7, "b7"), out(8, "b8"), out(9, "b9"))
	logs("a host agent restart after the restore", append(timelineB, "stdout b9")...)
}

// resume serves rec's guest agent port again through serve (Guests.Resume
// for a start from saved state, Guests.Adopt for an agent restart), as
// the engine does.
func resume(t *testing.T, e *appEnv, vms *vm.Service, rec *vm.Record, serve func(context.Context, *vm.Record, net.Listener) error) {
	t.Helper()
	sock := vms.Layout().VsockSocket(rec.ID)
	if err := os.MkdirAll(filepath.Dir(sock), 0o700); err != nil {
		t.Fatal(err)
	}
	l, err := chclient.ListenVsock(sock, e.guests.Port())
	if err != nil {
		t.Fatal(err)
	}
	if err := serve(context.Background(), rec, l); err != nil {
		t.Fatal(err)
	}
}
