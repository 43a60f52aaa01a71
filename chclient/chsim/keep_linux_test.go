package chsim_test

import (
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"testing"
	"time"

	"vmhost/appvm/guest/proto"
	"vmhost/chclient"
)

var countLine = regexp.MustCompile(`count (\d+)\n`)

// countsUntil reads the workload's output until it printed count n or more, and returns
// the counts seen.
func countsUntil(t *testing.T, conn *proto.Conn, n int) []int {
	t.Helper()
	var got []int
	for {
		m, err := conn.Recv()
		if err != nil {
			t.Fatalf("waiting for count %d: %v (saw %v)", n, err, got)
		}
		lg, ok := m.(*proto.Log)
		if !ok {
			continue
		}
		for _, c := range countLine.FindAllStringSubmatch(string(lg.Data), -1) {
			v, _ := strconv.Atoi(c[1])
			got = append(got, v)
		}
		if len(got) > 0 && got[len(got)-1] >= n {
			return got
		}
	}
}

// TestGuestAgentKeptAcrossSuspend: a process-mode guest whose state is saved while paused,
// and whose VMM then exits, is kept frozen (its agent and its workload, which holds a
// counter only in memory); the VMM that restores the state adopts it, and at the resume
// the agent redials with resume and the workload goes on counting with the same pid, no
// boot in between. The VMM's end halts it as usual; and a kept guest whose saved state is
// removed is ended by its keeper, leaving no process.
func TestGuestAgentKeptAcrossSuspend(t *testing.T) {
	p1 := startSim(t, "--sim-guest-heartbeat", "100ms")
	cfg, vsock := appVMConfig(t, p1.dir)
	l, err := chclient.ListenVsock(vsock, proto.Port)
	if err != nil {
		t.Fatal(err)
	}
	p1.wantStatus("PUT", "/api/v1/vm.create", cfg, 204)
	p1.wantStatus("PUT", "/api/v1/vm.boot", "", 204)
	l.SetDeadline(time.Now().Add(10 * time.Second))
	raw, err := l.Accept()
	if err != nil {
		t.Fatalf("the guest agent did not connect: %v", err)
	}
	conn := proto.NewConn(raw)
	m, err := conn.Recv()
	hello, ok := m.(*proto.Hello)
	if err != nil || !ok {
		t.Fatalf("first message %v %v, want a hello", m, err)
	}
	spec := &proto.Spec{V: proto.Version, Network: proto.Network{Mode: proto.NetworkNone},
		Command: []string{"/bin/sh", "-c", "i=0; while :; do i=$((i+1)); echo count $i; sleep 0.05; done"}}
	if err := conn.Send(spec); err != nil {
		t.Fatal(err)
	}
	st, _ := recvUntil(t, conn, "started")
	workload := st.(*proto.Started).PID
	before := countsUntil(t, conn, 3)
	agent, _ := simStatus(t, p1)

	// Suspend: pause, save, the VMM exits; the host end goes away too.
	saved := filepath.Join(p1.dir, "saved")
	os.Mkdir(saved, 0o700)
	p1.wantStatus("PUT", "/api/v1/vm.pause", "", 204)
	p1.wantStatus("PUT", "/api/v1/vm.snapshot", `{"destination_url":"file://`+saved+`"}`, 204)
	p1.wantStatus("PUT", "/api/v1/vmm.shutdown", "", 200)
	p1.wait(t)
	// The host end goes (vmhost ends its session at a suspend): a process-mode agent's
	// connection runs straight to the host, so the host's close is its reset.
	l.Close()
	raw.Close()
	time.Sleep(200 * time.Millisecond) // a frozen workload counts nothing meanwhile
	for _, pid := range []int{agent, workload} {
		if s := procState(pid); s != "T" {
			t.Fatalf("pid %d (agent %d, workload %d) after the suspend: state %q, want kept stopped (T)", pid, agent, workload, s)
		}
	}

	p2 := startSim(t, "--sim-guest-heartbeat", "100ms")
	l2, err := chclient.ListenVsock(vsock, proto.Port)
	if err != nil {
		t.Fatal(err)
	}
	defer l2.Close()
	p2.wantStatus("PUT", "/api/v1/vm.restore", `{"source_url":"file://`+saved+`"}`, 204)
	if pid, state := simStatus(t, p2); pid != agent || state != "Paused" {
		t.Fatalf("after the restore: agent %d (was %d), state %s", pid, agent, state)
	}
	if s := procState(workload); s != "T" {
		t.Errorf("the workload runs before the resume: state %q", s)
	}
	p2.wantStatus("PUT", "/api/v1/vm.resume", "", 204)
	conn2, hello2 := guestSession(t, l2)
	if !hello2.Resume || hello2.BootID != hello.BootID {
		t.Errorf("after the resume hello = %+v, want a resume of boot %s", hello2, hello.BootID)
	}
	st2, _ := recvUntil(t, conn2, "started")
	if pid := st2.(*proto.Started).PID; pid != workload {
		t.Errorf("the workload after the resume is pid %d, want %d", pid, workload)
	}
	// The agent replays the output the host has not acknowledged, then the counter goes
	// on: one run of 1, 2, 3, … with no restart in it.
	after := countsUntil(t, conn2, before[len(before)-1]+3)
	for i := 1; i < len(after); i++ {
		if after[i] != after[i-1]+1 {
			t.Errorf("counts before the suspend %v, after %v: want the counter to go on", before, after)
			break
		}
	}
	for _, e := range p2.eventsSoFar() {
		if e.Source == "vm" && e.Event == "booted" {
			t.Error("the restored VM booted")
		}
	}

	// Suspended again, then the saved state removed: the keeper ends the guest.
	saved2 := filepath.Join(p2.dir, "saved2")
	os.Mkdir(saved2, 0o700)
	p2.wantStatus("PUT", "/api/v1/vm.pause", "", 204)
	p2.wantStatus("PUT", "/api/v1/vm.snapshot", `{"destination_url":"file://`+saved2+`"}`, 204)
	p2.wantStatus("PUT", "/api/v1/vmm.shutdown", "", 200)
	p2.wait(t)
	if s := procState(agent); s != "T" {
		t.Fatalf("agent after the second suspend: %q, want kept", s)
	}
	// The first state names the same agent, but the agent went on since: removing it
	// alone keeps the guest (the keeper holds the second state).
	if err := os.RemoveAll(saved); err != nil {
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond)
	if s := procState(agent); s != "T" {
		t.Fatalf("agent with its state still saved: %q, want kept", s)
	}
	if err := os.RemoveAll(saved2); err != nil {
		t.Fatal(err)
	}
	waitGone(t, agent)
	waitGone(t, workload)
}

// TestGuestAgentNotKeptWhenRunOn: a snapshot taken while paused, followed by a resume,
// keeps nothing: the VMM's end halts the agent as ever (its state diverged), and a restore
// of that snapshot starts the agent afresh with the guest root as saved.
func TestGuestAgentNotKeptWhenRunOn(t *testing.T) {
	p1 := startSim(t, "--sim-guest-heartbeat", "100ms")
	cfg, vsock := appVMConfig(t, p1.dir)
	l, err := chclient.ListenVsock(vsock, proto.Port)
	if err != nil {
		t.Fatal(err)
	}
	p1.wantStatus("PUT", "/api/v1/vm.create", cfg, 204)
	p1.wantStatus("PUT", "/api/v1/vm.boot", "", 204)
	conn, hello := guestSession(t, l)
	spec := &proto.Spec{V: proto.Version, Network: proto.Network{Mode: proto.NetworkNone}, Workdir: "/w",
		Command: []string{"/bin/sh", "-c", "echo saved > mark; sleep 300"}}
	if err := conn.Send(spec); err != nil {
		t.Fatal(err)
	}
	recvUntil(t, conn, "started")
	agent, _ := simStatus(t, p1)
	root := vsock + ".root"
	deadline := time.Now().Add(10 * time.Second)
	for procState(agent) != "" {
		if b, _ := os.ReadFile(filepath.Join(root, "w", "mark")); string(b) == "saved\n" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the workload wrote no mark")
		}
		time.Sleep(20 * time.Millisecond)
	}
	saved := filepath.Join(p1.dir, "saved")
	os.Mkdir(saved, 0o700)
	p1.wantStatus("PUT", "/api/v1/vm.pause", "", 204)
	p1.wantStatus("PUT", "/api/v1/vm.snapshot", `{"destination_url":"file://`+saved+`"}`, 204)
	p1.wantStatus("PUT", "/api/v1/vm.resume", "", 204)
	os.WriteFile(filepath.Join(root, "w", "mark"), []byte("changed\n"), 0o644)
	p1.wantStatus("PUT", "/api/v1/vmm.shutdown", "", 200)
	p1.wait(t)
	l.Close()
	waitGone(t, agent)

	p2 := startSim(t, "--sim-guest-heartbeat", "100ms")
	l2, err := chclient.ListenVsock(vsock, proto.Port)
	if err != nil {
		t.Fatal(err)
	}
	defer l2.Close()
	p2.wantStatus("PUT", "/api/v1/vm.restore", `{"source_url":"file://`+saved+`","resume":true}`, 204)
	_, hello2 := guestSession(t, l2)
	if hello2.Resume || hello2.BootID == hello.BootID {
		t.Errorf("hello after restoring a state the guest ran on from = %+v, want a fresh agent", hello2)
	}
	if b, _ := os.ReadFile(filepath.Join(root, "w", "mark")); string(b) != "saved\n" {
		t.Errorf("the guest root after the restore has mark %q, want the saved one", b)
	}
}
