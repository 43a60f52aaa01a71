//go:build linux

package e2e

import (
	"errors"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// vmhostRun is one `vmhost run` of the real binary against s.
type vmhostRun struct {
	cmd            *exec.Cmd
	stdout, stderr *syncBuffer
	done           chan struct{}
	err            error
}

func (s *server) clientEnv() []string {
	return append(os.Environ(), "VMHOST_API=unix:"+s.sock, "VMHOST_TOKEN="+s.token)
}

func (s *server) startRun(t *testing.T, args ...string) *vmhostRun {
	t.Helper()
	r := &vmhostRun{stdout: new(syncBuffer), stderr: new(syncBuffer), done: make(chan struct{})}
	r.cmd = exec.Command(vmhostBin, append([]string{"run"}, args...)...)
	r.cmd.Env = s.clientEnv()
	r.cmd.Stdout, r.cmd.Stderr = r.stdout, r.stderr
	if err := r.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { r.err = r.cmd.Wait(); close(r.done) }()
	t.Cleanup(func() {
		r.cmd.Process.Kill()
		<-r.done
	})
	return r
}

// wait waits for the run to end and returns its exit status.
func (r *vmhostRun) wait(t *testing.T, timeout time.Duration) int {
	t.Helper()
	select {
	case <-r.done:
	case <-time.After(timeout):
		t.Fatalf("vmhost run did not end within %v; stdout %q, stderr %q", timeout, r.stdout, r.stderr)
	}
	var xe *exec.ExitError
	if errors.As(r.err, &xe) {
		return xe.ExitCode()
	}
	if r.err != nil {
		t.Fatal(r.err)
	}
	return 0
}

// waitStdout waits until the run printed want on its stdout.
func (r *vmhostRun) waitStdout(t *testing.T, want string) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for !strings.Contains(r.stdout.String(), want) {
		select {
		case <-r.done:
			t.Fatalf("vmhost run ended before printing %q: %v; stdout %q, stderr %q", want, r.err, r.stdout, r.stderr)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("vmhost run did not print %q; stdout %q, stderr %q", want, r.stdout, r.stderr)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// gone checks that AppVM id left nothing: no record, no directories, no
// processes.
func (s *server) gone(t *testing.T, id string) {
	t.Helper()
	if st, b := s.do("GET", "/api/appvm/vms/"+id, ""); st != http.StatusNotFound {
		t.Errorf("AppVM %s after --rm: %d %s", id, st, b)
	}
	for _, p := range []string{s.stateDir + "/vms/" + id, s.stateDir + "/vms/" + id + ".json", s.runDir + "/vms/" + id} {
		if _, err := os.Stat(p); !os.IsNotExist(err) {
			t.Errorf("%s is left after --rm: %v", p, err)
		}
	}
	for _, pid := range s.children() {
		cmd, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
		if strings.Contains(string(cmd), "/vms/"+id+"/") {
			t.Errorf("process %d is left after --rm: %q", pid, cmd)
		}
	}
}

var runWorkloads = map[string]string{
	"ok":       `echo to-stdout; echo to-stderr >&2; echo second-stdout; exit 0`,
	"three":    `echo failing; echo why >&2; exit 3`,
	"killed":   `echo dying; kill -KILL $$`,
	"trap":     `trap 'echo got TERM; exit 7' TERM; echo ready; while :; do sleep 0.1; done`,
	"stubborn": `trap 'echo ignoring TERM' TERM; echo ready; while :; do sleep 0.1; done`,
	"ticks":    `i=0; while [ $i -lt 150 ]; do echo "tick $i"; i=$((i+1)); sleep 0.1; done; exit 5`,
}

// TestRunExitStatus: the workload's stdout and stderr arrive on the
// command's own, in order, and its end is the command's exit status: 0,
// 3, and 128 + 9 for a workload killed by SIGKILL; a command after --
// replaces the image's; --rm leaves nothing behind.
func TestRunExitStatus(t *testing.T) {
	s := startAppVMServer(t, runWorkloads)
	for _, tc := range []struct {
		image, name  string
		args         []string
		code         int
		stdout, errs string
	}{
		{"ok", "run-ok", nil, 0, "to-stdout\nsecond-stdout\n", "to-stderr\n"},
		{"three", "run-three", nil, 3, "failing\n", "why\n"},
		{"killed", "run-killed", nil, 128 + 9, "dying\n", ""},
		{"ok", "run-args", []string{"--", "/bin/sh", "-c", `echo "$0 from the command line"; exit 4`, "custom"}, 4, "custom from the command line\n", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := s.startRun(t, append([]string{"--rm", "--name", tc.name, "--image", tc.image, "--memory", "128", "--ip", "10.80.0.20/24", "--gateway", "10.80.0.1"}, tc.args...)...)
			if code := r.wait(t, 90*time.Second); code != tc.code {
				t.Errorf("exit status %d, want %d; stderr %q", code, tc.code, r.stderr)
			}
			if got := r.stdout.String(); got != tc.stdout {
				t.Errorf("stdout %q, want %q", got, tc.stdout)
			}
			if got := r.stderr.String(); !strings.HasPrefix(got, tc.errs) {
				t.Errorf("stderr %q, want it to start with %q", got, tc.errs)
			}
			s.gone(t, tc.name)
		})
	}
}

// TestRunSIGTERM: SIGTERM to vmhost run shuts the AppVM down gracefully:
// the workload gets SIGTERM and its exit status is the command's; one
// that ignores it is killed after its stop grace (128 + 9). The AppVM
// stays, stopped, and is not restarted.
func TestRunSIGTERM(t *testing.T) {
	s := startAppVMServer(t, runWorkloads)
	for _, tc := range []struct {
		image string
		code  int
		says  string
	}{
		{"trap", 7, "got TERM\n"},
		{"stubborn", 128 + 9, "ignoring TERM\n"},
	} {
		t.Run(tc.image, func(t *testing.T) {
			id := "term-" + tc.image
			r := s.startRun(t, "--name", id, "--image", tc.image, "--memory", "128", "--stop-grace", "2", "--restart", "always", "--ip", "10.80.0.21/24", "--gateway", "10.80.0.1")
			r.waitStdout(t, "ready\n")
			r.cmd.Process.Signal(syscall.SIGTERM)
			if code := r.wait(t, 60*time.Second); code != tc.code {
				t.Errorf("exit status %d, want %d; stderr %q", code, tc.code, r.stderr)
			}
			if got := r.stdout.String(); got != "ready\n"+tc.says {
				t.Errorf("stdout %q", got)
			}
			v := s.appvmGet(id)
			if v.State != "stopped" {
				t.Errorf("after the run: %s", v.raw)
			}
			time.Sleep(1500 * time.Millisecond) // past the first restart backoff
			if v := s.appvmGet(id); v.State != "stopped" || v.AppVM.RestartCount != 0 {
				t.Errorf("a shutdown by vmhost run was restarted: %s", v.raw)
			}
		})
	}
}

// TestRunKilledThenAttach: SIGKILL of vmhost run leaves the AppVM running
// (its restart policy decides what comes next); a second vmhost run of
// the same --name attaches to it instead of failing, prints its output
// from then on and exits with its status.
func TestRunKilledThenAttach(t *testing.T) {
	s := startAppVMServer(t, runWorkloads)
	first := s.startRun(t, "--name", "tk", "--image", "ticks", "--memory", "128", "--ip", "10.80.0.22/24", "--gateway", "10.80.0.1")
	first.waitStdout(t, "tick 3\n")
	first.cmd.Process.Kill()
	first.wait(t, 10*time.Second)
	if v := s.appvmGet("tk"); v.State != "running" {
		t.Fatalf("the AppVM after vmhost run was killed: %s", v.raw)
	}
	second := s.startRun(t, "--rm", "--name", "tk", "--image", "ticks", "--memory", "128")
	if code := second.wait(t, 90*time.Second); code != 5 {
		t.Errorf("exit status %d, want 5; stderr %q", code, second.stderr)
	}
	out := second.stdout.String()
	if !strings.HasSuffix(out, "tick 149\n") || strings.Contains(out, "tick 0\n") {
		t.Errorf("the attached run printed %q", out)
	}
	if !strings.Contains(second.stderr.String(), "attached to AppVM tk") {
		t.Errorf("stderr %q", second.stderr)
	}
	s.gone(t, "tk")
	// Another image under the same name is refused, not attached.
	r := s.startRun(t, "--name", "other", "--image", "trap", "--memory", "128", "--ip", "10.80.0.23/24", "--gateway", "10.80.0.1")
	r.waitStdout(t, "ready\n")
	wrong := s.startRun(t, "--name", "other", "--image", "ok")
	if code := wrong.wait(t, 30*time.Second); code != 125 || !strings.Contains(wrong.stderr.String(), "exists with image trap") {
		t.Errorf("a run of another image under a used name: %d %q", code, wrong.stderr)
	}
}

// TestRunUnderASupervisor runs vmhost run the way a process supervisor
// does: in a unit of its own under systemd when systemd is this machine's
// init (systemd-run --scope), else under a small supervisor process (a
// shell) that starts it, sends SIGTERM once the workload is up, and
// reports the exit status it reads.
func TestRunUnderASupervisor(t *testing.T) {
	s := startAppVMServer(t, runWorkloads)
	dir := t.TempDir()
	out := filepath.Join(dir, "out")
	launcher := ""
	if comm, _ := os.ReadFile("/proc/1/comm"); strings.TrimSpace(string(comm)) == "systemd" {
		if p, err := exec.LookPath("systemd-run"); err == nil {
			launcher = p + " --scope --quiet --collect "
		}
	}
	if launcher == "" {
		t.Log("init is not systemd: the supervisor is a shell")
	}
	script := fmt.Sprintf(`%s%q run --rm --name sup --image trap --memory 128 --ip 10.80.0.24/24 --gateway 10.80.0.1 >%q 2>%q.err &
pid=$!
while ! grep -qs ready %q; do sleep 0.05; done # out may not exist yet
kill -TERM $pid
wait $pid
echo "status=$?"
`, launcher, vmhostBin, out, out, out)
	sup := exec.Command("/bin/sh", "-c", script)
	sup.Env = s.clientEnv()
	got, err := sup.CombinedOutput()
	if err != nil {
		t.Fatalf("supervisor: %v: %s", err, got)
	}
	printed, _ := os.ReadFile(out)
	if strings.TrimSpace(string(got)) != "status=7" || string(printed) != "ready\ngot TERM\n" {
		t.Errorf("the supervisor read %q; the run printed %q", got, printed)
	}
	s.gone(t, "sup")
}
