package guest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"vmhost/appvm/guest/proto"
)

// dialOp opens an operation connection to the agent, as chsim's routing
// of the host's CONNECT does.
func (h *fakeHost) dialOp() net.Conn {
	h.t.Helper()
	c, err := net.Dial("unix", h.opsSock)
	if err != nil {
		h.t.Fatalf("dialing the agent's operation socket: %v", err)
	}
	h.t.Cleanup(func() { c.Close() })
	c.SetDeadline(time.Now().Add(60 * time.Second))
	return c
}

// exec runs req (timeout 30 s unless set) with stdin ("" closes the input
// at once).
func (h *fakeHost) exec(req *proto.ExecRequest, stdin string) (*proto.ExecExit, string, string, error) {
	h.t.Helper()
	if req.TimeoutSecs == 0 {
		req.TimeoutSecs = 30
	}
	var in io.Reader
	if stdin != "" {
		in = strings.NewReader(stdin)
	}
	var out, errOut bytes.Buffer
	exit, err := proto.Exec(context.Background(), h.dialOp(), req, in, &out, &errOut)
	return exit, out.String(), errOut.String(), err
}

// running starts an agent whose workload runs until stopped.
func running(t testing.TB, spec *proto.Spec, o agentOpts) (*fakeHost, *proto.Started) {
	t.Helper()
	if len(spec.Command) == 0 {
		spec.Command = sh("exec sleep 300")
	}
	spec.Keepalive = true
	h := startAgent(t, spec, o)
	st, ok := h.next().(*proto.Started)
	if !ok {
		t.Fatalf("want Started, got %#v", st)
	}
	return h, st
}

func wantOpError(t *testing.T, err error, code, text string) {
	t.Helper()
	var oe *proto.OpError
	if !errors.As(err, &oe) || oe.Code != code || !strings.Contains(oe.Message, text) {
		t.Fatalf("error = %v, want %s containing %q", err, code, text)
	}
}

func exitCode(e *proto.ExecExit) string {
	if e == nil {
		return "<nil>"
	}
	if e.ExitCode != nil {
		return "code " + strconv.Itoa(*e.ExitCode)
	}
	return fmt.Sprintf("signal %d timed_out %v", e.Signal, e.TimedOut)
}

// TestExecOneShot runs processes beside the workload: its environment
// (secret variables included) plus the request's, its working directory,
// exit codes, deaths by a signal, the timeout, standard input and its end,
// and the refusals before a start.
func TestExecOneShot(t *testing.T) {
	root := t.TempDir()
	h, _ := running(t, &proto.Spec{
		Env:       []string{"PLAIN=visible", "KEEP=k"},
		SecretEnv: []proto.SecretEnv{{Key: "TOKEN", Value: proto.NewSecret("secret-value-1")}},
		Workdir:   "/w",
	}, agentOpts{root: root})
	os.Mkdir(root+"/other", 0o755)
	tests := []struct {
		name, stdin          string
		req                  proto.ExecRequest
		exit, stdout, stderr string
	}{
		{name: "environment and workdir",
			req:  proto.ExecRequest{Command: sh(`echo "$PLAIN $KEEP $TOKEN $EXTRA"; pwd; echo err >&2; exit 7`), Env: []string{"PLAIN=over", "EXTRA=e"}},
			exit: "code 7", stdout: "over k secret-value-1 e\n" + root + "/w\n", stderr: "err\n"},
		{name: "workdir given", req: proto.ExecRequest{Command: []string{"pwd"}, Workdir: "/other"}, exit: "code 0", stdout: root + "/other\n"},
		{name: "killed by a signal", req: proto.ExecRequest{Command: sh(`echo bye; kill -TERM $$`)}, exit: "signal 15 timed_out false", stdout: "bye\n"},
		{name: "timeout", req: proto.ExecRequest{Command: sh(`echo start; exec sleep 60`), TimeoutSecs: 1}, exit: "signal 9 timed_out true", stdout: "start\n"},
		{name: "stdin", stdin: "hello\nworld\n", req: proto.ExecRequest{Command: []string{"cat"}}, exit: "code 0", stdout: "hello\nworld\n"},
		{name: "stdin closed at once", req: proto.ExecRequest{Command: []string{"wc", "-c"}}, exit: "code 0", stdout: "0\n"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			start := time.Now()
			exit, out, errOut, err := h.exec(&tt.req, tt.stdin)
			if err != nil {
				t.Fatal(err)
			}
			if got := exitCode(exit); got != tt.exit || out != tt.stdout || errOut != tt.stderr {
				t.Errorf("exit %s, stdout %q, stderr %q; want %s, %q, %q", got, out, errOut, tt.exit, tt.stdout, tt.stderr)
			}
			if tt.req.TimeoutSecs == 1 && time.Since(start) > 20*time.Second {
				t.Errorf("the timeout took %v", time.Since(start))
			}
		})
	}
	refusals := []struct {
		name string
		req  proto.ExecRequest
		want string
	}{
		{"command not found", proto.ExecRequest{Command: []string{"no-such-tool-xyz"}}, `"no-such-tool-xyz" not found`},
		{"missing workdir", proto.ExecRequest{Command: []string{"true"}, Workdir: "/nowhere"}, `workdir "/nowhere" is not a directory`},
		{"unknown user", proto.ExecRequest{Command: []string{"true"}, User: "ghost"}, `"ghost" not found`},
	}
	for _, tt := range refusals {
		t.Run(tt.name, func(t *testing.T) {
			_, _, _, err := h.exec(&tt.req, "")
			wantOpError(t, err, proto.ErrBadRequest, tt.want)
		})
	}
	if _, err := os.Stat(root + "/nowhere"); err == nil {
		t.Error("a refused exec created its working directory")
	}
}

// TestExecTTY gives the process a real terminal: tty names a /dev/pts
// device that is its controlling terminal, stty shows the requested size
// and a resize changes it, and the end of input is ^D.
func TestExecTTY(t *testing.T) {
	h, _ := running(t, &proto.Spec{}, agentOpts{})
	exit, out, _, err := h.exec(&proto.ExecRequest{Command: sh(`tty; stty size; echo ctty > /dev/tty`), TTY: true, Cols: 100, Rows: 30}, "")
	if err != nil {
		t.Fatal(err)
	}
	if !regexp.MustCompile(`^/dev/pts/\d+\r\n30 100\r\nctty\r\n$`).MatchString(out) || exitCode(exit) != "code 0" {
		t.Errorf("exit %s, output %q; want a /dev/pts name, 30 100 and a controlling terminal", exitCode(exit), out)
	}

	// Resize while it runs: the next stty sees the new size.
	s, err := proto.StartExec(h.dialOp(), &proto.ExecRequest{Command: sh(`stty size; read x; stty size; exit 3`), TTY: true, Cols: 100, Rows: 30, TimeoutSecs: 30})
	if err != nil {
		t.Fatal(err)
	}
	var term lockedBuffer
	done := make(chan *proto.ExecExit, 1)
	go func() {
		e, err := s.Wait(&term, io.Discard)
		if err != nil {
			t.Error(err)
		}
		done <- e
	}()
	eventually(t, "the first size", func() bool { return strings.Contains(term.String(), "30 100") })
	if err := s.Resize(120, 40); err != nil {
		t.Fatal(err)
	}
	s.Write([]byte("go\n"))
	e := <-done
	if exitCode(e) != "code 3" || !strings.HasSuffix(term.String(), "40 120\r\n") {
		t.Errorf("exit %s, terminal %q; want 40 120 after the resize and code 3", exitCode(e), term.String())
	}

	// The end of input is the terminal's end of file.
	exit, out, _, err = h.exec(&proto.ExecRequest{Command: []string{"cat"}, TTY: true}, "typed\n")
	if err != nil || exitCode(exit) != "code 0" || out != "typed\r\ntyped\r\n" {
		t.Errorf("cat on a terminal: exit %s, %v, output %q; want the echo and the copy, then ^D ending it", exitCode(exit), err, out)
	}
}

func eventually(t *testing.T, what string, ok func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !ok() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func gone(pid int) bool {
	st, _, err := procStat(pid)
	return errors.Is(err, os.ErrNotExist) || st == 'Z'
}

func fdCount(t *testing.T, pid int) int {
	t.Helper()
	ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	if err != nil {
		t.Fatal(err)
	}
	return len(ents)
}

// TestExecHostVanishes: a host that goes away mid-stream (the connection
// closes, or a malformed frame arrives) gets the process killed, with the
// children of its group and those that left it, and the agent keeps no
// descriptor of it.
func TestExecHostVanishes(t *testing.T) {
	h, _ := running(t, &proto.Spec{}, agentOpts{})
	agent := h.cmd.Process.Pid
	base := fdCount(t, agent)
	for _, how := range []string{"close", "malformed frame"} {
		t.Run(how, func(t *testing.T) {
			c := h.dialOp()
			s, err := proto.StartExec(c, &proto.ExecRequest{Command: sh(`sleep 300 & echo $!; setsid sleep 300 & echo $!; exec sleep 300`), TimeoutSecs: 300})
			if err != nil {
				t.Fatal(err)
			}
			var out lockedBuffer
			go s.Wait(&out, io.Discard)
			eventually(t, "the children's pids", func() bool { return strings.Count(out.String(), "\n") == 2 })
			pids := []int{s.PID()}
			for _, f := range strings.Fields(out.String()) {
				p, _ := strconv.Atoi(f)
				pids = append(pids, p)
			}
			if how == "close" {
				c.Close()
			} else {
				c.Write([]byte{0, 1, 0, 0, 0, 0, 0, 0})
			}
			for _, p := range pids {
				eventually(t, fmt.Sprintf("process %d to die", p), func() bool { return gone(p) })
			}
			eventually(t, "the agent's descriptors to be closed", func() bool { return fdCount(t, agent) == base })
		})
	}
}

// slowWriter takes output slowly and can hold it back entirely.
type slowWriter struct {
	n     int64
	pause chan chan struct{}
}

func (w *slowWriter) Write(p []byte) (int, error) {
	select {
	case resume := <-w.pause:
		<-resume
	default:
	}
	w.n += int64(len(p))
	if w.n%(1<<20) < int64(len(p)) {
		time.Sleep(5 * time.Millisecond)
	}
	return len(p), nil
}

func procField(t *testing.T, file, key string) int64 {
	t.Helper()
	b, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, key+":"); ok {
			n, err := strconv.ParseInt(strings.Fields(v)[0], 10, 64)
			if err != nil {
				t.Fatal(err)
			}
			return n
		}
	}
	t.Fatalf("no %s in %s", key, file)
	return 0
}

// TestExecBackPressure: 100 MiB from a fast producer to a slow host pass
// through the agent without it buffering them (its peak RSS stays far
// below), and while the host takes nothing the producer is held back (its
// written-bytes count stands still).
func TestExecBackPressure(t *testing.T) {
	const total = 100 << 20
	h, _ := running(t, &proto.Spec{}, agentOpts{})
	agent := h.cmd.Process.Pid
	// Reset the agent's peak RSS (VmHWM) to its current RSS.
	if err := os.WriteFile(fmt.Sprintf("/proc/%d/clear_refs", agent), []byte("5"), 0); err != nil {
		t.Skipf("cannot reset the peak RSS: %v", err)
	}
	rssBefore := procField(t, fmt.Sprintf("/proc/%d/status", agent), "VmRSS")
	s, err := proto.StartExec(h.dialOp(), &proto.ExecRequest{Command: []string{"head", "-c", strconv.Itoa(total), "/dev/zero"}, TimeoutSecs: 300})
	if err != nil {
		t.Fatal(err)
	}
	s.CloseStdin()
	w := &slowWriter{pause: make(chan chan struct{}, 1)}
	resume := make(chan struct{})
	w.pause <- resume
	done := make(chan *proto.ExecExit, 1)
	go func() {
		e, err := s.Wait(w, io.Discard)
		if err != nil {
			t.Error(err)
		}
		done <- e
	}()
	// The host takes nothing: once the pipe and the socket are full, the
	// producer writes no more.
	ioFile := fmt.Sprintf("/proc/%d/io", s.PID())
	time.Sleep(300 * time.Millisecond)
	w1 := procField(t, ioFile, "wchar")
	time.Sleep(500 * time.Millisecond)
	w2 := procField(t, ioFile, "wchar")
	close(resume)
	e := <-done
	peak := procField(t, fmt.Sprintf("/proc/%d/status", agent), "VmHWM")
	t.Logf("held back at %d bytes written (then %d); agent RSS %d kB before, peak %d kB while %d MiB passed", w1, w2, rssBefore, peak, total>>20)
	if exitCode(e) != "code 0" || w.n != total {
		t.Fatalf("exit %s after %d bytes, want code 0 after %d", exitCode(e), w.n, total)
	}
	if w1 != w2 || w1 >= 8<<20 {
		t.Errorf("the producer wrote %d then %d bytes while the host read nothing: not held back", w1, w2)
	}
	if grew := peak - rssBefore; grew > 32<<10 {
		t.Errorf("the agent's RSS grew by %d kB while passing %d MiB: it buffers", grew, total>>20)
	}
}

// TestExecOutputAfterTheEndReachesASlowHost: output still buffered when the
// process exits reaches a host that pauses longer than the drain's idle
// limit: the limit is for output nobody writes, not for a slow reader.
func TestExecOutputAfterTheEndReachesASlowHost(t *testing.T) {
	// Output the producer can always finish writing while the host reads
	// nothing: the pipe (64 KiB) and the socket (its default 208 KiB send
	// buffer, of which a stream of small writes gets about 180 KiB of
	// payload) hold it. 300,000 did not, when the agent's reads came in
	// small pieces: the producer then never ended.
	const total = 200000
	h, _ := running(t, &proto.Spec{}, agentOpts{})
	s, err := proto.StartExec(h.dialOp(), &proto.ExecRequest{Command: []string{"head", "-c", strconv.Itoa(total), "/dev/zero"}, TimeoutSecs: 60})
	if err != nil {
		t.Fatal(err)
	}
	s.CloseStdin()
	w := &slowWriter{pause: make(chan chan struct{}, 1)}
	resume := make(chan struct{})
	w.pause <- resume
	done := make(chan *proto.ExecExit, 1)
	go func() {
		e, err := s.Wait(w, io.Discard)
		if err != nil {
			t.Error(err)
		}
		done <- e
	}()
	eventually(t, "the producer's end", func() bool { return gone(s.PID()) })
	time.Sleep(execDrainIdle + 500*time.Millisecond)
	close(resume)
	if e := <-done; exitCode(e) != "code 0" || w.n != total {
		t.Errorf("exit %s after %d bytes, want code 0 after %d", exitCode(e), w.n, total)
	}
}

// BenchmarkExecTrue measures an exec of true through the agent's operation
// connection (request, start, exit, as the host's Exec does it) beside the
// fork and exec of true that a program on the same machine does, one of
// each per iteration, and reports both medians.
//
//	go test ./appvm/guest -run '^$' -bench ExecTrue -benchtime 200x
func BenchmarkExecTrue(b *testing.B) {
	h, _ := running(b, &proto.Spec{}, agentOpts{})
	trueBin, err := exec.LookPath("true")
	if err != nil {
		b.Skip("no true")
	}
	var viaAgent, direct []time.Duration
	b.ResetTimer()
	for range b.N {
		start := time.Now()
		c, err := net.Dial("unix", h.opsSock)
		if err != nil {
			b.Fatal(err)
		}
		exit, err := proto.Exec(context.Background(), c, &proto.ExecRequest{Command: []string{trueBin}, TimeoutSecs: 10}, nil, io.Discard, io.Discard)
		c.Close()
		if err != nil || exitCode(exit) != "code 0" {
			b.Fatalf("exec: %v, %s", err, exitCode(exit))
		}
		viaAgent = append(viaAgent, time.Since(start))
		start = time.Now()
		if err := exec.Command(trueBin).Run(); err != nil {
			b.Fatal(err)
		}
		direct = append(direct, time.Since(start))
	}
	b.StopTimer()
	b.ReportMetric(float64(median(viaAgent).Microseconds()), "agent-µs/exec")
	b.ReportMetric(float64(median(direct).Microseconds()), "fork-exec-µs/exec")
}

func median(d []time.Duration) time.Duration {
	s := slices.Clone(d)
	slices.Sort(s)
	return s[len(s)/2]
}

// countingWriter counts what the host managed to send.
type countingWriter struct {
	s *proto.ExecSession
	n atomic.Int64
}

func (w *countingWriter) Write(p []byte) (int, error) {
	n, err := w.s.Write(p)
	w.n.Add(int64(n))
	return n, err
}

// TestExecStdinBackPressure: input for a process that does not read stops
// being taken after a bounded amount (the agent's queue, the pipe and the
// socket), so a host cannot make the agent buffer without bound.
func TestExecStdinBackPressure(t *testing.T) {
	h, _ := running(t, &proto.Spec{}, agentOpts{})
	c := h.dialOp()
	s, err := proto.StartExec(c, &proto.ExecRequest{Command: sh(`sleep 2; cat > /dev/null`), TimeoutSecs: 60})
	if err != nil {
		t.Fatal(err)
	}
	w := &countingWriter{s: s}
	const total = 32 << 20
	sent := make(chan error, 1)
	go func() {
		_, err := io.Copy(w, io.LimitReader(zeros{}, total))
		if err == nil {
			err = s.CloseStdin()
		}
		sent <- err
	}()
	time.Sleep(time.Second)
	held := w.n.Load()
	t.Logf("taken while the process read nothing: %d bytes", held)
	if held >= 4<<20 {
		t.Errorf("the agent took %d bytes of input nobody read", held)
	}
	// Once the process reads, everything goes through.
	if err := <-sent; err != nil {
		t.Fatal(err)
	}
	if e, err := s.Wait(io.Discard, io.Discard); err != nil || exitCode(e) != "code 0" {
		t.Errorf("exit %s, %v", exitCode(e), err)
	}
}
