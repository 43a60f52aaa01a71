package chsim_test

import (
	"archive/tar"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"vmhost/appvm/guest/proto"
	"vmhost/chclient"
	"vmhost/chclient/chsim"
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
	agent, _ := simStatus(t, p)
	p.wantStatus("PUT", "/sim/v1/guest-agent", fmt.Sprintf(`{"signal":%d}`, syscall.SIGSTOP), 204)
	// A heartbeat the agent sent before it stopped may still be on its
	// way: only one sent after the agent was seen stopped counts.
	deadline := time.Now().Add(10 * time.Second)
	for procState(agent) != "T" {
		if time.Now().After(deadline) {
			t.Fatalf("the guest agent (pid %d) did not stop: state %q", agent, procState(agent))
		}
		time.Sleep(5 * time.Millisecond)
	}
	stoppedAt := time.Now()
	got := make(chan error, 1)
	go func() {
		for {
			m, err := conn.Recv()
			if err != nil {
				got <- err
				return
			}
			if hb, ok := m.(*proto.Heartbeat); ok && hb.At.After(stoppedAt) {
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

// bootAppVM boots an AppVM in the simulator and answers its agent's Hello with spec: the
// test is the host.
func bootAppVM(t *testing.T, p *simProc, spec *proto.Spec) (conn *proto.Conn, vsock string) {
	t.Helper()
	cfg, vsock := appVMConfig(t, p.dir)
	l, err := chclient.ListenVsock(vsock, proto.Port)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	p.wantStatus("PUT", "/api/v1/vm.create", cfg, 204)
	p.wantStatus("PUT", "/api/v1/vm.boot", "", 204)
	conn, hello := guestSession(t, l)
	if hello.V != proto.Version {
		t.Fatalf("hello = %+v, want version %d", hello, proto.Version)
	}
	spec.V = proto.Version
	spec.Network = proto.Network{Mode: proto.NetworkNone}
	if err := conn.Send(spec); err != nil {
		t.Fatal(err)
	}
	return conn, vsock
}

// TestGuestAgentOperationsThroughConnect: a host CONNECT to the agent's operation port on
// the hybrid vsock socket reaches the guest agent (OK <hostport> from 2^30, then the raw
// stream), carrying exec, files and signals; a port nobody listens on is refused.
func TestGuestAgentOperationsThroughConnect(t *testing.T) {
	p := startSim(t)
	conn, vsock := bootAppVM(t, p, &proto.Spec{Command: []string{"/bin/sh", "-c", "trap 'exit 9' USR1; echo ready; while :; do sleep 0.05; done"},
		SecretEnv: []proto.SecretEnv{{Key: "TOKEN", Value: proto.NewSecret("sim-secret")}}, Keepalive: true})
	recvUntil(t, conn, "log")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	dial := func() *chclient.VsockConn {
		t.Helper()
		c, err := chclient.DialVsock(ctx, vsock, proto.OpPort)
		if err != nil {
			t.Fatalf("CONNECT %d: %v", proto.OpPort, err)
		}
		t.Cleanup(func() { c.Close() })
		if c.HostPort < 1<<30 || c.HostPort >= 1<<31 {
			t.Errorf("host port %d outside [2^30, 2^31)", c.HostPort)
		}
		return c
	}
	var out, errOut strings.Builder
	exit, err := proto.Exec(ctx, dial(), &proto.ExecRequest{Command: []string{"/bin/sh", "-c", `read x; echo "$x $TOKEN"; echo e >&2; exit 4`}, TimeoutSecs: 30},
		strings.NewReader("in\n"), &out, &errOut)
	if err != nil || exit.ExitCode == nil || *exit.ExitCode != 4 || out.String() != "in sim-secret\n" || errOut.String() != "e\n" {
		t.Errorf("exec: %+v, %v, stdout %q, stderr %q", exit, err, out.String(), errOut.String())
	}

	if _, err := proto.PutFiles(ctx, dial(), "/", 1<<20, bytes.NewReader(tarOf(t, "hello.txt", "from the host"))); err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(filepath.Join(chsim.GuestRoot(vsock), "hello.txt")); err != nil || string(b) != "from the host" {
		t.Errorf("the file put into the guest root: %q, %v", b, err)
	}
	var tb bytes.Buffer
	if err := proto.GetFiles(ctx, dial(), "/hello.txt", &tb); err != nil || !bytes.Contains(tb.Bytes(), []byte("from the host")) {
		t.Errorf("files out: %v, %d bytes", err, tb.Len())
	}

	if err := proto.Signal(ctx, dial(), int(syscall.SIGUSR1)); err != nil {
		t.Fatal(err)
	}
	if ex := recvUntil2(t, conn, "exit").(*proto.Exit); ex.Code == nil || *ex.Code != 9 {
		t.Errorf("exit after the signal: %+v", ex)
	}

	if _, err := chclient.DialVsock(ctx, vsock, 7777); !errors.Is(err, chclient.ErrVsockRefused) {
		t.Errorf("CONNECT to a port nobody listens on: %v, want ErrVsockRefused", err)
	}
}

// recvUntil2 is recvUntil returning only the message.
func recvUntil2(t *testing.T, conn *proto.Conn, typ string) proto.Message {
	t.Helper()
	m, _ := recvUntil(t, conn, typ)
	return m
}

func tarOf(t *testing.T, name, body string) []byte {
	t.Helper()
	var b bytes.Buffer
	tw := tar.NewWriter(&b)
	if err := tw.WriteHeader(&tar.Header{Name: name, Typeflag: tar.TypeReg, Mode: 0o644, Size: int64(len(body))}); err != nil {
		t.Fatal(err)
	}
	tw.Write([]byte(body))
	tw.Close()
	return b.Bytes()
}

// processesNaming lists the live processes other than skip whose command line contains s.
func processesNaming(s string, skip int) map[int]string {
	out := map[int]string{}
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == skip || pid == os.Getpid() {
			continue
		}
		b, err := os.ReadFile("/proc/" + e.Name() + "/cmdline")
		if err != nil || !bytes.Contains(b, []byte(s)) {
			continue
		}
		out[pid] = string(bytes.ReplaceAll(b, []byte{0}, []byte{' '}))
	}
	return out
}

// forkingWorkload starts children, a child with a grandchild, one that leaves its session
// and an orphan, each a shell whose command line names marker.
const forkingWorkload = `M="$0"
sh -c 'while :; do sleep 1; done' "$M" &
sh -c 'sh -c "while :; do sleep 1; done" "$0" & wait' "$M" &
setsid sh -c 'while :; do sleep 1; done' "$M" &
( sh -c 'while :; do sleep 1; done' "$M" & )
echo ready
while :; do sleep 1; done`

// TestGuestEndsWithItsVM: however the VM ends, nothing of its guest stays: the agent, the
// workload, its children and grandchildren, one that left its session and an orphan are
// all gone once the simulator answers (or, killed outright, soon after).
func TestGuestEndsWithItsVM(t *testing.T) {
	ends := []struct {
		name string
		end  func(t *testing.T, p *simProc)
		// simGone: the simulator exits; sync: gone by the time end returns.
		simGone, sync bool
	}{
		{"vm.shutdown", func(t *testing.T, p *simProc) { p.wantStatus("PUT", "/api/v1/vm.shutdown", "", 204) }, false, true},
		{"vm.delete", func(t *testing.T, p *simProc) { p.wantStatus("PUT", "/api/v1/vm.delete", "", 204) }, false, true},
		{"paused, then vm.shutdown", func(t *testing.T, p *simProc) {
			p.wantStatus("PUT", "/api/v1/vm.pause", "", 204)
			p.wantStatus("PUT", "/api/v1/vm.shutdown", "", 204)
		}, false, true},
		{"vm.reboot", func(t *testing.T, p *simProc) { p.wantStatus("PUT", "/api/v1/vm.reboot", "", 204) }, false, true},
		{"vmm.shutdown", func(t *testing.T, p *simProc) { p.wantStatus("PUT", "/api/v1/vmm.shutdown", "", 200); p.wait(t) }, true, true},
		{"SIGTERM to the simulator", func(t *testing.T, p *simProc) { p.cmd.Process.Signal(syscall.SIGTERM); p.wait(t) }, true, true},
		{"SIGKILL to the simulator", func(t *testing.T, p *simProc) { p.cmd.Process.Kill(); p.wait(t) }, true, false},
	}
	for _, tt := range ends {
		t.Run(tt.name, func(t *testing.T) {
			p := startSim(t)
			conn, _ := bootAppVM(t, p, &proto.Spec{Entrypoint: []string{"/bin/sh", "-c", forkingWorkload}, Command: []string{"marker-" + p.dir}})
			recvUntil(t, conn, "log")
			sim := p.cmd.Process.Pid
			var before map[int]string
			deadline := time.Now().Add(10 * time.Second)
			// The agent, the workload, two children, a grandchild, the one in its own
			// session and the orphan.
			for before = processesNaming(p.dir, sim); len(before) < 7; before = processesNaming(p.dir, sim) {
				if time.Now().After(deadline) {
					t.Fatalf("the guest's processes did not all start: %v", before)
				}
				time.Sleep(20 * time.Millisecond)
			}
			tt.end(t, p)
			left := func() map[int]string {
				now := processesNaming(p.dir, sim)
				for pid := range now {
					if _, old := before[pid]; !old && !tt.simGone {
						delete(now, pid) // the agent of the next boot
					}
				}
				return now
			}
			if !tt.sync {
				deadline := time.Now().Add(10 * time.Second)
				for len(left()) > 0 && time.Now().Before(deadline) {
					time.Sleep(20 * time.Millisecond)
				}
			}
			if l := left(); len(l) > 0 {
				t.Errorf("left behind after %s (of %d):\n%v", tt.name, len(before), l)
			}
		})
	}
}

// procState is the state letter of /proc/pid/stat ("" when the process is gone).
func procState(pid int) string {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return ""
	}
	i := strings.LastIndexByte(string(b), ')')
	if f := strings.Fields(string(b[i+1:])); len(f) > 0 {
		return f[0]
	}
	return ""
}
