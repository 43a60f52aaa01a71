package chsim_test

import (
	"encoding/json"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"vmhost/appvm/guest/proto"
	"vmhost/chclient"
)

// appVMConfig is minimalConfig plus an initramfs and a vsock device: what makes chsim
// run the guest agent.
func appVMConfig(t testing.TB, dir string) (cfg, vsock string) {
	t.Helper()
	initrd := filepath.Join(dir, "initramfs")
	if err := os.WriteFile(initrd, []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	vsock = filepath.Join(dir, "vsock.sock")
	cfg = strings.TrimSuffix(minimalConfig(t, dir), "}")
	cfg = strings.Replace(cfg, `"cmdline":"console=ttyS0"`, fmt.Sprintf(`"cmdline":"console=ttyS0","initramfs":%q`, initrd), 1)
	cfg += fmt.Sprintf(`,"vsock":{"cid":3,"socket":%q}}`, vsock)
	return cfg, vsock
}

// guestSession accepts the agent's connection on the hybrid vsock listener and reads
// its Hello.
func guestSession(t testing.TB, l *net.UnixListener) (*proto.Conn, *proto.Hello) {
	t.Helper()
	l.SetDeadline(time.Now().Add(10 * time.Second))
	c, err := l.Accept()
	if err != nil {
		t.Fatalf("the guest agent did not connect: %v", err)
	}
	t.Cleanup(func() { c.Close() })
	c.SetDeadline(time.Now().Add(20 * time.Second))
	conn := proto.NewConn(c)
	m, err := conn.Recv()
	if err != nil {
		t.Fatal(err)
	}
	h, ok := m.(*proto.Hello)
	if !ok {
		t.Fatalf("first message = %T, want Hello", m)
	}
	return conn, h
}

// recvUntil reads messages until one of type typ arrives, returning it and what came
// before.
func recvUntil(t testing.TB, conn *proto.Conn, typ string) (proto.Message, []proto.Message) {
	t.Helper()
	var before []proto.Message
	for {
		m, err := conn.Recv()
		if err != nil {
			t.Fatalf("waiting for %s: %v (got %d messages)", typ, err, len(before))
		}
		if m.Type() == typ {
			return m, before
		}
		before = append(before, m)
	}
}

func simStatus(t testing.TB, p *simProc) (pid int, state string) {
	t.Helper()
	var st struct {
		State string `json:"state"`
		Pid   int    `json:"guest_agent_pid"`
	}
	if err := json.Unmarshal(p.wantStatus("GET", "/sim/v1/status", "", 200), &st); err != nil {
		t.Fatal(err)
	}
	return st.Pid, st.State
}

// TestGuestAgentRunsWorkloadAndPowersOff: at boot chsim starts the real guest agent, which
// dials the host through the hybrid vsock listener, runs the workload, reports its output
// and exit, and once the host acknowledges the exit powers the VM off (the simulator exits
// 0).
func TestGuestAgentRunsWorkloadAndPowersOff(t *testing.T) {
	p := startSim(t, "--sim-guest-heartbeat", "100ms")
	cfg, vsock := appVMConfig(t, p.dir)
	l, err := chclient.ListenVsock(vsock, proto.Port)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	p.wantStatus("PUT", "/api/v1/vm.create", cfg, 204)
	p.wantStatus("PUT", "/api/v1/vm.boot", "", 204)
	conn, hello := guestSession(t, l)
	if hello.Resume || hello.BootID == "" {
		t.Errorf("hello = %+v, want a fresh boot", hello)
	}
	if pid, _ := simStatus(t, p); pid == 0 {
		t.Error("status shows no guest agent pid")
	}
	spec := &proto.Spec{V: proto.Version, Command: []string{"/bin/sh", "-c", "echo out-$X; pwd; exit 3"},
		Env: []string{"X=42"}, Network: proto.Network{Mode: proto.NetworkNone}, Workdir: "/w"}
	if err := conn.Send(spec); err != nil {
		t.Fatal(err)
	}
	m, before := recvUntil(t, conn, "exit")
	if ex := m.(*proto.Exit); ex.Code == nil || *ex.Code != 3 {
		t.Errorf("exit = %+v, want code 3", ex)
	}
	var out, types string
	for _, b := range before {
		types += b.Type() + " "
		if lg, ok := b.(*proto.Log); ok {
			out += string(lg.Data)
		}
	}
	if !strings.Contains(types, "heartbeat") || !strings.Contains(types, "started") {
		t.Errorf("messages before exit: %s; want heartbeat and started", types)
	}
	wantDir := filepath.Join(vsock+".root", "w")
	if out != "out-42\n"+wantDir+"\n" {
		t.Errorf("workload output %q, want %q", out, "out-42\n"+wantDir+"\n")
	}
	// A version 2 guest powers off once the host has recorded the end.
	if err := conn.Send(&proto.ExitAck{}); err != nil {
		t.Fatal(err)
	}
	if st := p.wait(t); st.ExitCode() != 0 {
		t.Errorf("simulator exit = %v, want 0 (guest poweroff)", st)
	}
	p.waitEvents("vm/shutdown", "vmm/shutdown")
}

// TestGuestAgentStoppedWithVMAndRestartedByReboot: vm.shutdown kills the agent and its
// workload; a reboot starts a new agent (a new boot id).
func TestGuestAgentStoppedWithVMAndRestartedByReboot(t *testing.T) {
	p := startSim(t)
	cfg, vsock := appVMConfig(t, p.dir)
	l, err := chclient.ListenVsock(vsock, proto.Port)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	p.wantStatus("PUT", "/api/v1/vm.create", cfg, 204)
	p.wantStatus("PUT", "/api/v1/vm.boot", "", 204)
	conn, h1 := guestSession(t, l)
	if err := conn.Send(&proto.Spec{V: proto.Version, Command: []string{"sleep", "300"}, Network: proto.Network{Mode: proto.NetworkNone}}); err != nil {
		t.Fatal(err)
	}
	st, _ := recvUntil(t, conn, "started")
	workload := st.(*proto.Started).PID
	agent1, _ := simStatus(t, p)

	p.wantStatus("PUT", "/api/v1/vm.reboot", "", 204)
	_, h2 := guestSession(t, l)
	if h2.BootID == h1.BootID || h2.Resume {
		t.Errorf("after reboot hello = %+v, want a new boot (first %s)", h2, h1.BootID)
	}
	agent2, _ := simStatus(t, p)
	if agent2 == 0 || agent2 == agent1 {
		t.Errorf("agent pid after reboot = %d, before %d: want a new agent", agent2, agent1)
	}
	waitGone(t, agent1)
	waitGone(t, workload)

	p.wantStatus("PUT", "/api/v1/vm.shutdown", "", 204)
	waitGone(t, agent2)
	if pid, state := simStatus(t, p); pid != 0 || state != "Created" {
		t.Errorf("after shutdown: agent pid %d, state %s; want 0, Created", pid, state)
	}
}

// TestGuestAgentSignalLeavesVMRunning: SIGSTOP through /sim/v1/guest-agent silences the
// agent (no heartbeats) while the VM stays running.
func TestGuestAgentSignalLeavesVMRunning(t *testing.T) {
	p := startSim(t, "--sim-guest-heartbeat", "50ms")
	cfg, vsock := appVMConfig(t, p.dir)
	l, err := chclient.ListenVsock(vsock, proto.Port)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	p.wantStatus("PUT", "/api/v1/vm.create", cfg, 204)
	p.wantStatus("PUT", "/api/v1/vm.boot", "", 204)
	conn, _ := guestSession(t, l)
	if err := conn.Send(&proto.Spec{V: proto.Version, Command: []string{"sleep", "300"}, Network: proto.Network{Mode: proto.NetworkNone}}); err != nil {
		t.Fatal(err)
	}
	recvUntil(t, conn, "heartbeat")
	p.wantStatus("PUT", "/sim/v1/guest-agent", fmt.Sprintf(`{"signal":%d}`, syscall.SIGSTOP), 204)
	got := make(chan error, 1)
	go func() {
		for {
			m, err := conn.Recv()
			if err != nil {
				got <- err
				return
			}
			if m.Type() == "heartbeat" {
				got <- nil
				return
			}
		}
	}()
	select {
	case err := <-got:
		t.Fatalf("a heartbeat (or error %v) arrived from a stopped agent", err)
	case <-time.After(500 * time.Millisecond):
	}
	if _, state := simStatus(t, p); state != "Running" {
		t.Errorf("state = %s, want Running", state)
	}
	p.wantStatus("PUT", "/sim/v1/guest-agent", fmt.Sprintf(`{"signal":%d}`, syscall.SIGCONT), 204)
	select {
	case err := <-got:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("no heartbeat after SIGCONT")
	}
}

// TestNoGuestAgentFlag: --sim-no-guest-agent boots the same AppVM without an agent.
func TestNoGuestAgentFlag(t *testing.T) {
	p := startSim(t, "--sim-no-guest-agent")
	cfg, _ := appVMConfig(t, p.dir)
	p.wantStatus("PUT", "/api/v1/vm.create", cfg, 204)
	p.wantStatus("PUT", "/api/v1/vm.boot", "", 204)
	if pid, _ := simStatus(t, p); pid != 0 {
		t.Errorf("guest agent pid %d with --sim-no-guest-agent", pid)
	}
}

func waitGone(t testing.TB, pid int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		// A zombie awaiting its parent's wait counts as gone.
		if err != nil || strings.Contains(string(b), ") Z ") {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("process %d still alive", pid)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
