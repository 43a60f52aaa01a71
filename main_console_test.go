package main

import (
	"bytes"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"vmhost/cli"
	"vmhost/console"
)

// TestConsoleAttachName: the client dials the socket the agent listens
// on, and reads its answers.
func TestConsoleAttachName(t *testing.T) {
	if cli.ConsoleAttachName != console.AttachName {
		t.Errorf("cli dials %q, the agent listens on %q", cli.ConsoleAttachName, console.AttachName)
	}
	if cli.ConsoleAttachOK != console.AttachOK || cli.ConsoleAttachError != console.AttachError {
		t.Errorf("cli reads answers %q and %q, the agent sends %q and %q", cli.ConsoleAttachOK, cli.ConsoleAttachError, console.AttachOK, console.AttachError)
	}
}

// TestConsoleCommand attaches `vmhost console` (stdin and stdout pipes) to
// a VM of a real agent running the CH simulator, whose serial port echoes
// input: what is typed comes back, the agent's console.log keeps it too,
// and Ctrl-] q detaches. A VM that is not there, or not running, is said
// so.
func TestConsoleCommand(t *testing.T) {
	cwd, runDir, s := consoleAgent(t)

	cmd := exec.Command(binary(t), "console", "c1", "--run-dir", runDir)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	out := &lockedBuffer{}
	var errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = out, &errb
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			cmd.Process.Kill()
			<-done
		}
	})
	// The client may connect before or after its first write reaches
	// the keeper: type until the echo shows.
	waitFor(t, func() bool {
		io.WriteString(stdin, "echo-me-1\r")
		return strings.Contains(out.String(), "echo-me-1")
	}, "the echo of what was typed")
	io.WriteString(stdin, "\x1dq")
	if err := <-done; err != nil {
		t.Errorf("vmhost console = %v, want exit 0 after Ctrl-] q; stderr:\n%s", err, errb.String())
	}
	if !strings.Contains(errb.String(), "detach with Ctrl-] then q") || !strings.Contains(errb.String(), "detached") {
		t.Errorf("console stderr = %q", errb.String())
	}
	logPath := filepath.Join(runDir, "vms", "c1", "console.log")
	waitFor(t, func() bool {
		b, _ := os.ReadFile(logPath)
		return strings.Contains(string(b), "echo-me-1")
	}, "the echo in console.log")

	for _, tt := range []struct{ id, want string }{
		{"nope", `no VM "nope" on this host`},
		{"c2", "the VM is not running"},
		{"../x", "is not a VM id"},
	} {
		_, errOut, code := vmhost(t, cwd, "console", tt.id, "--run-dir", runDir)
		if code == 0 || !strings.Contains(errOut, tt.want) {
			t.Errorf("vmhost console %s = %d, %q; want %q", tt.id, code, errOut, tt.want)
		}
	}
	_, errOut, code := vmhost(t, cwd, "console", "c1", "--run-dir", filepath.Join(cwd, "elsewhere"))
	if code != 1 || !strings.Contains(errOut, "no agent run directory") {
		t.Errorf("vmhost console with a wrong run dir = %d, %q", code, errOut)
	}

	// The agent stops; the VM runs on (KillMode=process), with nobody
	// keeping its console until the next agent adopts it.
	token := devToken(t, s)
	if code := s.stop(t, syscall.SIGTERM); code != 0 {
		t.Fatalf("agent exit code = %d", code)
	}
	_, errOut, code = vmhost(t, cwd, "console", "c1", "--run-dir", runDir)
	if code != 1 || !strings.Contains(errOut, "the VM runs but no agent keeps its console") {
		t.Errorf("vmhost console with the agent stopped = %d, %q", code, errOut)
	}
	s2 := startServer(t, cwd, "--dev", "--listen", "127.0.0.1:0", "--run-dir", runDir)
	t.Cleanup(func() { s2.deleteVM(t, token, "c1"); s2.deleteVM(t, token, "c2") })
	// The new agent keeps c1's console once it adopted c1: when its
	// start is over, not when it logs that it serves.
	s2.waitReady(t)
	cmd2 := exec.Command(binary(t), "console", "c1", "--run-dir", runDir)
	stdin2, _ := cmd2.StdinPipe()
	out2 := &lockedBuffer{}
	var errb2 bytes.Buffer
	cmd2.Stdout, cmd2.Stderr = out2, &errb2
	if err := cmd2.Start(); err != nil {
		t.Fatal(err)
	}
	done2 := make(chan error, 1)
	go func() { done2 <- cmd2.Wait() }()
	waitFor(t, func() bool {
		select {
		case err := <-done2:
			t.Fatalf("vmhost console after the agent restarted ended before the echo: %v; stderr:\n%s", err, errb2.String())
		default:
		}
		io.WriteString(stdin2, "after-restart\r")
		return strings.Contains(out2.String(), "after-restart")
	}, "the echo through the adopting agent")
	io.WriteString(stdin2, "\x1dq")
	if err := <-done2; err != nil {
		t.Errorf("vmhost console after the agent restarted = %v; stderr:\n%s", err, errb2.String())
	}
}

// consoleAgent starts an agent (dev mode, simulators) with a running VM c1
// and a created one c2, and returns its directory and run directory.
func consoleAgent(t *testing.T) (cwd, runDir string, s *server) {
	t.Helper()
	cwd, err := os.MkdirTemp("", "vh") // short: the run dir holds sockets
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(cwd) })
	runDir = filepath.Join(cwd, "run")
	s = startServer(t, cwd, "--dev", "--listen", "127.0.0.1:0", "--run-dir", runDir)
	token := devToken(t, s)
	t.Cleanup(func() { s.deleteVM(t, token, "c1"); s.deleteVM(t, token, "c2") })
	c, base := s.client()
	for _, body := range []string{vmBody(t, cwd, "c1", true), vmBody(t, cwd, "c2", false)} {
		req, _ := http.NewRequest("POST", base+"/api/vms", strings.NewReader(body))
		req.Header.Set("Authorization", "Bearer "+token)
		resp, err := c.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusCreated {
			t.Fatalf("create = %d", resp.StatusCode)
		}
	}
	return cwd, runDir, s
}
