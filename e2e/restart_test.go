//go:build linux

package e2e

import (
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"vmhost/config"
	"vmhost/internal/netnstest"
)

// kill ends the server with SIGKILL, as a crash would: nothing of its own
// shutdown runs, and its VMs keep running (they are in sessions of their
// own).
func (s *server) kill() {
	s.t.Helper()
	s.cmd.Process.Signal(syscall.SIGKILL)
	<-s.exited
}

// restart starts vmhost serve again on the same directories (in the same
// network namespace, when the server has one), with env added to the
// test's environment minus the crash hook's variables, and returns how long
// it took until the API answered.
//
// An agent killed while it was starting a child leaves that child, forked
// but not yet exec'd, holding a copy of the state directory's lock for a
// moment (close-on-exec closes it only at the exec): a start that finds
// the lock held is tried again, as systemd would.
func (s *server) restart(env ...string) time.Duration {
	s.t.Helper()
	s.checkRaces() // of the agent this one replaces
	start := time.Now()
	for try := 1; ; try++ {
		cmd := exec.Command(s.cmd.Path, s.cmd.Args[1:]...)
		for _, kv := range os.Environ() {
			if !strings.HasPrefix(kv, "VMHOST_TEST_STOP_") {
				cmd.Env = append(cmd.Env, kv)
			}
		}
		cmd.Env = append(cmd.Env, env...)
		s.stderr = new(syncBuffer)
		cmd.Stdout, cmd.Stderr = s.stderr, s.stderr
		cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
		var err error
		if s.nsFD > 0 {
			// A process starts in the namespace of the thread that forks it.
			err = netnstest.RunIn(s.nsFD, cmd.Start)
		} else {
			err = cmd.Start()
		}
		if err != nil {
			s.t.Fatal(err)
		}
		s.cmd = cmd
		s.waitExit()
		for {
			if st, _ := s.do("GET", "/api/vms", ""); st == http.StatusOK {
				return time.Since(start)
			}
			select {
			case <-s.exited:
				if try < 5 && strings.Contains(s.stderr.String(), "in use by another vmhost") {
					s.t.Logf("restart %d found the state directory still locked; trying again: %s", try, strings.TrimSpace(s.stderr.String()))
					time.Sleep(50 * time.Millisecond)
					break
				}
				s.t.Fatalf("vmhost serve exited at a restart; output:\n%s", s.stderr)
			default:
				if time.Since(start) > 20*time.Second {
					s.t.Fatalf("vmhost serve did not answer within 20s of a restart; output:\n%s%s", s.stderr, lockHolder(s.stderr.String()))
				}
				time.Sleep(5 * time.Millisecond)
				continue
			}
			break
		}
	}
}

// rawView returns the JSON view of id as served.
func (s *server) rawView(id string) string {
	s.t.Helper()
	st, b := s.do("GET", "/api/vms/"+id, "")
	if st != http.StatusOK {
		s.t.Fatalf("GET /api/vms/%s = %d %s", id, st, b)
	}
	return string(b)
}

// startTimes reads the recorded start time of the QSD of a view.
func qsdStart(t *testing.T, raw string) uint64 {
	t.Helper()
	var v struct {
		Disk struct {
			QSDStartTime uint64 `json:"qsd_start_time"`
		} `json:"disk"`
	}
	if err := json.Unmarshal([]byte(raw), &v); err != nil {
		t.Fatal(err)
	}
	return v.Disk.QSDStartTime
}

// TestRestartAdoptsRunningVMs kills the agent with SIGKILL while 50 VMs
// run, starts it again, and checks that every VM was adopted: same CH and
// QSD processes, byte-identical views, and still watched (a crash after
// the restart is noticed). The time from exec to the first API answer is
// logged; the bound asserted is generous (the target is 2 s).
func TestRestartAdoptsRunningVMs(t *testing.T) {
	n := 50
	if testing.Short() {
		n = 5
	}
	s := startServer(t, serverOpts{edit: func(c *config.Config) { c.HostCPUs, c.HostMemoryMB = 256, 1<<20 }})
	f := newFixture(t)
	ids := make([]string, n)
	var wg sync.WaitGroup
	sem := make(chan struct{}, 4)
	for i := range n {
		ids[i] = fmt.Sprintf("r%02d", i)
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			if st, b := s.do("POST", "/api/vms", f.body(ids[i], true, "")); st != http.StatusCreated {
				t.Errorf("create %s = %d %s", ids[i], st, b)
			}
		}()
	}
	wg.Wait()
	if t.Failed() {
		t.FailNow()
	}
	for _, id := range ids {
		s.waitDisplay(id, "running", "running")
	}
	paused := ids[len(ids)-1] // a paused VM is adopted as it is
	if st := s.act(paused, "pause"); st != http.StatusNoContent {
		t.Fatalf("pause = %d", st)
	}
	before := map[string]string{}
	for _, id := range ids {
		before[id] = s.rawView(id)
	}
	procs := len(s.children())
	s.kill()
	took := s.restart()
	t.Logf("agent restart with %d running VMs: %v from exec to the first API answer (target 2s)", n, took)
	if took > 10*time.Second {
		t.Errorf("restart took %v", took)
	}
	for _, id := range ids {
		v, _ := s.get(id)
		if got := s.rawView(id); got != before[id] {
			t.Errorf("%s view changed across the restart:\nbefore %s\nafter  %s", id, before[id], got)
		}
		if syscall.Kill(v.PID, 0) != nil || syscall.Kill(v.Disk.QSDPid, 0) != nil {
			t.Errorf("%s: processes %d/%d are gone", id, v.PID, v.Disk.QSDPid)
		}
	}
	if got := len(s.children()); got != procs {
		t.Errorf("%d VM processes after the restart, %d before", got, procs)
	}
	if st := s.act(paused, "resume"); st != http.StatusNoContent {
		t.Errorf("resume of a VM paused before the restart = %d", st)
	}
	// Still watched: a crash of an adopted CH is noticed.
	s.sim(ids[0], "crash", `{"signal":9}`)
	v := s.waitFor(ids[0], "failure after a crash", func(v view) bool { return v.State == "failed" })
	if fr := v.FailureReason; fr == nil || fr.Cause != "ch_crash" || fr.Detail.Kind != "missing_pid" {
		t.Errorf("crash of an adopted CH: %+v (an adopted CH's exit code cannot be read, and process_exit needs one)", fr)
	}
	if qsdStart(t, s.rawView(ids[1])) != qsdStart(t, before[ids[1]]) {
		t.Error("a QSD was restarted")
	}
}

// TestRestartEndsWhatDiedWhileDown: the CH of one VM is killed and another
// guest powers off while the agent is down; at restart the first is failed
// with missing_pid, the second stopped with guest_shutdown, and neither
// leaves a process behind.
func TestRestartEndsWhatDiedWhileDown(t *testing.T) {
	s := startServer(t, serverOpts{})
	f := newFixture(t)
	for _, id := range []string{"dead", "off"} {
		s.create(f.body(id, true, ""), http.StatusCreated)
		s.waitDisplay(id, "running", "running")
	}
	dead, _ := s.get("dead")
	s.kill()
	syscall.Kill(dead.PID, syscall.SIGKILL)
	s.sim("off", "poweroff", "")
	deadline := time.Now().Add(10 * time.Second)
	for syscall.Kill(dead.PID, 0) == nil && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	s.restart()
	v, _ := s.get("dead")
	if fr := v.FailureReason; v.State != "failed" || fr == nil || fr.Detail.Kind != "missing_pid" || fr.Cause != "ch_crash" {
		t.Errorf("VM whose CH died while the agent was down: %+v %+v", v, fr)
	}
	v, _ = s.get("off")
	if fr := v.FailureReason; v.State != "stopped" || fr == nil || fr.Cause != "guest_shutdown" {
		t.Errorf("VM whose guest powered off while the agent was down: %+v %+v", v, fr)
	}
	if pids := s.children(); len(pids) != 0 {
		t.Errorf("processes left: %v", pids)
	}
	// Both start again.
	for _, id := range []string{"dead", "off"} {
		if st := s.act(id, "start"); st != http.StatusNoContent {
			t.Errorf("start %s = %d", id, st)
		}
		v := s.waitDisplay(id, "running", "running")
		if v.FailureReason != nil {
			t.Errorf("%s: failure_reason kept after a successful boot: %+v", id, v.FailureReason)
		}
	}
}

var heldBy = regexp.MustCompile(`in use by another vmhost \(pid (\d+)\)`)

// lockHolder describes the process a refused start names as the holder
// of its directory lock, if any.
func lockHolder(out string) string {
	m := heldBy.FindStringSubmatch(out)
	if m == nil {
		return ""
	}
	cmd, _ := os.ReadFile("/proc/" + m[1] + "/cmdline")
	st, _ := os.ReadFile("/proc/" + m[1] + "/status")
	var holders []string
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		fds, _ := filepath.Glob("/proc/" + e.Name() + "/fd/*")
		for _, fd := range fds {
			if t, err := os.Readlink(fd); err == nil && strings.HasSuffix(t, "/vmhost.lock") {
				c, _ := os.ReadFile("/proc/" + e.Name() + "/cmdline")
				holders = append(holders, e.Name()+" "+strings.ReplaceAll(string(c), "\x00", " ")+" -> "+t)
			}
		}
	}
	return fmt.Sprintf("\nthe named holder %s: %q\n%s\nprocesses with a vmhost.lock open:\n%s", m[1], cmd, st, strings.Join(holders, "\n"))
}
