package chsim_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"vmhost/chclient"
	"vmhost/chclient/chsim"
)

// The simulator runs as a separate process: the test binary re-executes itself with
// CHSIM_TEST_MAIN set, and TestMain hands the arguments to chsim.Main.
func TestMain(m *testing.M) {
	// The guest agent chsim starts inherits CHSIM_TEST_MAIN: check for it first.
	if os.Getenv(chsim.GuestAgentEnv) == "1" && len(os.Args) > 1 && os.Args[1] == "guest" {
		os.Exit(guestAgentMain(os.Args[2:]))
	}
	if os.Getenv("CHSIM_TEST_MAIN") == "1" {
		os.Exit(chsim.Main(os.Args[1:]))
	}
	os.Exit(m.Run())
}

type simProc struct {
	t      testing.TB
	dir    string
	sock   string
	events string
	log    string
	cmd    *exec.Cmd
	done   chan struct{}
	hc     *http.Client
	// timeout bounds one raw request; 0 means 10 s. A real guest's snapshot or restore
	// on a loaded machine needs longer.
	timeout time.Duration
}

// shortDir returns a directory whose paths fit a unix socket address (108 bytes).
func shortDir(t testing.TB) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "chsim")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

func startSim(t testing.TB, extra ...string) *simProc {
	t.Helper()
	p, err := startSimErr(t, extra...)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// startSimNoFatal is startSim for goroutines other than the test's; it returns nil on
// failure after logging why.
func startSimNoFatal(t testing.TB, extra ...string) *simProc {
	p, err := startSimErr(t, extra...)
	if err != nil {
		t.Error(err)
		return nil
	}
	return p
}

func startSimErr(t testing.TB, extra ...string) (*simProc, error) {
	dir := shortDir(t)
	p := &simProc{t: t, dir: dir, sock: filepath.Join(dir, "ch.sock"),
		events: filepath.Join(dir, "events"), log: filepath.Join(dir, "ch.log"), done: make(chan struct{})}
	args := append([]string{"--api-socket", "path=" + p.sock, "--event-monitor", "path=" + p.events,
		"--log-file", p.log, "-v"}, extra...)
	p.cmd = exec.Command(os.Args[0], args...)
	p.cmd.Env = append(os.Environ(), "CHSIM_TEST_MAIN=1", "GORACE="+strings.TrimSpace(os.Getenv("GORACE")+" atexit_sleep_ms=0"))
	p.cmd.Stderr = os.Stderr
	if err := p.cmd.Start(); err != nil {
		return nil, err
	}
	go func() { p.cmd.Wait(); close(p.done) }()
	t.Cleanup(func() {
		p.cmd.Process.Kill()
		<-p.done
	})
	deadline := time.Now().Add(10 * time.Second)
	for {
		if c, err := net.Dial("unix", p.sock); err == nil {
			c.Close()
			break
		}
		select {
		case <-p.done:
			return nil, fmt.Errorf("simulator exited early: %v", p.cmd.ProcessState)
		default:
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("simulator socket did not appear")
		}
		time.Sleep(5 * time.Millisecond)
	}
	p.hc = &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", p.sock)
	}}}
	t.Cleanup(p.hc.CloseIdleConnections)
	return p, nil
}

// raw sends one request as literal text and returns the parsed response with its headers
// exactly as sent.
func (p *simProc) raw(text string) (*http.Response, []byte) {
	p.t.Helper()
	c, err := net.Dial("unix", p.sock)
	if err != nil {
		p.t.Fatal(err)
	}
	defer c.Close()
	timeout := p.timeout
	if timeout == 0 {
		timeout = 10 * time.Second
	}
	c.SetDeadline(time.Now().Add(timeout))
	if _, err := io.WriteString(c, text); err != nil {
		p.t.Fatal(err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		p.t.Fatalf("reading response to %q: %v", strings.SplitN(text, "\r\n", 2)[0], err)
	}
	body, _ := io.ReadAll(resp.Body)
	return resp, body
}

// do sends method path with an optional body, with a correct Content-Length.
func (p *simProc) do(method, path, body string) (*http.Response, []byte) {
	p.t.Helper()
	req := fmt.Sprintf("%s %s HTTP/1.1\r\nHost: localhost\r\nContent-Length: %d\r\n", method, path, len(body))
	if body != "" {
		req += "Content-Type: application/json\r\n"
	}
	return p.raw(req + "\r\n" + body)
}

func (p *simProc) wantStatus(method, path, body string, want int) []byte {
	p.t.Helper()
	resp, data := p.do(method, path, body)
	if resp.StatusCode != want {
		p.t.Fatalf("%s %s = %d %s, want %d", method, path, resp.StatusCode, data, want)
	}
	return data
}

func (p *simProc) state() string {
	p.t.Helper()
	data := p.wantStatus("GET", "/api/v1/vm.info", "", 200)
	var info struct{ State string }
	if err := json.Unmarshal(data, &info); err != nil {
		p.t.Fatal(err)
	}
	return info.State
}

// eventsSoFar reads the whole event stream written until now.
func (p *simProc) eventsSoFar() []chclient.Event {
	p.t.Helper()
	f, err := os.Open(p.events)
	if err != nil {
		p.t.Fatal(err)
	}
	defer f.Close()
	var evs []chclient.Event
	r := chclient.NewEventReader(f)
	for {
		ev, err := r.Next()
		if errors.Is(err, io.EOF) {
			return evs
		}
		if err != nil {
			p.t.Fatal(err)
		}
		evs = append(evs, ev)
	}
}

// waitEvents waits until the stream contains want as a subsequence, and returns the stream.
func (p *simProc) waitEvents(want ...string) []chclient.Event {
	p.t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		evs := p.eventsSoFar()
		if containsSeq(evs, want) {
			return evs
		}
		if time.Now().After(deadline) {
			p.t.Fatalf("events = %v, want subsequence %v", evs, want)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func containsSeq(evs []chclient.Event, want []string) bool {
	i := 0
	for _, e := range evs {
		if i < len(want) && e.String() == want[i] {
			i++
		}
	}
	return i == len(want)
}

func (p *simProc) wait(t testing.TB) *os.ProcessState {
	t.Helper()
	select {
	case <-p.done:
		return p.cmd.ProcessState
	case <-time.After(10 * time.Second):
		t.Fatal("simulator did not exit")
		return nil
	}
}

func errorChain(t testing.TB, data []byte) []string {
	t.Helper()
	var chain []string
	if err := json.Unmarshal(data, &chain); err != nil {
		t.Fatalf("error body %q is not a JSON array of strings: %v", data, err)
	}
	return chain
}

func lastOf(chain []string) string {
	if len(chain) == 0 {
		return ""
	}
	return chain[len(chain)-1]
}

// minimalConfig is a bootable VM: a kernel that exists and one disk that exists.
func minimalConfig(t testing.TB, dir string) string {
	t.Helper()
	kernel := filepath.Join(dir, "vmlinux")
	disk := filepath.Join(dir, "root.img")
	for _, f := range []string{kernel, disk} {
		if err := os.WriteFile(f, []byte("x"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return fmt.Sprintf(`{"cpus":{"boot_vcpus":2,"max_vcpus":2},"memory":{"size":1073741824},`+
		`"payload":{"kernel":%q,"cmdline":"console=ttyS0"},"disks":[{"path":%q,"image_type":"Raw"}],`+
		`"console":{"mode":"Off"},"serial":{"mode":"Null"}}`, kernel, disk)
}

var _ = syscall.SIGTERM
var _ = bytes.NewReader
