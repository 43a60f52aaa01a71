package chclient_test

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"vmhost/chclient"
	"vmhost/chclient/chsim"
)

// The test binary doubles as the simulator and as small helper processes: TestMain looks at
// CHCLIENT_TEST_MODE and runs that instead of the tests.
func TestMain(m *testing.M) {
	switch os.Getenv("CHCLIENT_TEST_MODE") {
	case "":
		os.Exit(m.Run())
	case "chsim":
		os.Exit(chsim.Main(os.Args[1:]))
	case "fail-early":
		// A CH that rejects its arguments: a message on stderr and in its log, exit 1.
		for i, a := range os.Args {
			if a == "--log-file" && i+1 < len(os.Args) {
				os.WriteFile(os.Args[i+1], []byte("Error: parsing --cpus: boom-in-log\n"), 0o600)
			}
		}
		fmt.Fprintln(os.Stderr, "Error: starting VMM: boom-on-stderr")
		os.Exit(1)
	case "orphan":
		// Start the simulator in its own session and exit, so the simulator is not a child
		// of the test process (as after an agent restart); print its pid.
		cmd := exec.Command(os.Args[0], os.Args[1:]...)
		cmd.Env = append(os.Environ(), "CHCLIENT_TEST_MODE=chsim")
		cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
		if err := cmd.Start(); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		fmt.Println(cmd.Process.Pid)
		os.Exit(0)
	default:
		fmt.Fprintln(os.Stderr, "unknown CHCLIENT_TEST_MODE")
		os.Exit(2)
	}
}

// childEnv is the environment for helper processes. A race-enabled binary sleeps a second
// at exit by default; the helpers skip that.
func childEnv(extra ...string) []string {
	env := append(os.Environ(), "GORACE="+strings.TrimSpace(os.Getenv("GORACE")+" atexit_sleep_ms=0"))
	return append(env, extra...)
}

// shortDir returns a directory whose paths fit a unix socket address.
func shortDir(t testing.TB) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "chc")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

type fixture struct {
	dir, sock, events, log, vsock, serial string
}

func newFixture(t testing.TB) fixture {
	dir := shortDir(t)
	return fixture{dir: dir, sock: filepath.Join(dir, "ch.sock"), events: filepath.Join(dir, "events"),
		log: filepath.Join(dir, "ch.log"), vsock: filepath.Join(dir, "vsock.sock"), serial: filepath.Join(dir, "console.sock")}
}

func (f fixture) config(extra ...string) chclient.LaunchConfig {
	return chclient.LaunchConfig{
		Binary: os.Args[0], APISocket: f.sock, EventMonitor: f.events, LogFile: f.log,
		VsockSocket: f.vsock, SerialSocket: f.serial,
		// The simulator would run `<binary> guest` as the AppVM guest agent
		// for a config with vsock and an initramfs; the binary here is this
		// test, which is no guest agent, so its early exit would power the
		// simulated guest off mid-test.
		ExtraArgs: append([]string{"-v", "--sim-no-guest-agent"}, extra...),
		Env:       childEnv("CHCLIENT_TEST_MODE=chsim"),
	}
}

// launchSim starts the simulator through Launch and stops it at the end of the test.
func launchSim(t testing.TB, extra ...string) (fixture, *chclient.Process) {
	t.Helper()
	f := newFixture(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	p, err := chclient.Launch(ctx, f.config(extra...))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		p.Signal(syscall.SIGKILL)
		<-p.Done()
		p.Close()
	})
	return f, p
}

func ctxT(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func touch(t testing.TB, path string) string {
	t.Helper()
	if err := os.WriteFile(path, []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

var _ = strconv.Itoa

// simHTTP is a plain HTTP client on the simulator's socket, for /sim/v1/ calls.
func simHTTP(f fixture) *http.Client {
	return &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", f.sock)
	}}}
}

// simPut calls a /sim/v1/ action and fails the test unless it answers 204.
func simPut(t testing.TB, f fixture, action, body string) {
	t.Helper()
	req, _ := http.NewRequest("PUT", "http://x/sim/v1/"+action, strings.NewReader(body))
	resp, err := simHTTP(f).Do(req)
	if err != nil {
		t.Fatalf("sim %s: %v", action, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 204 {
		data, _ := io.ReadAll(resp.Body)
		t.Fatalf("sim %s = %d %s", action, resp.StatusCode, data)
	}
}
