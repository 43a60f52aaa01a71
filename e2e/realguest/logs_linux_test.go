package realguest

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"vmhost/internal/netnstest"
)

// The guest operations that read, and vmhost run, on Debian's cloud
// kernel.

// logsSecretFile is a secret file whose content and lines the workload
// prints: the log must show [redacted] for each.
const logsSecretFile = "lane-file-secret-line-one\nlane-file-secret-line-two\n"

// logsWorkload prints the secret file (whole, then one line), then a tick
// a second from a loop that says its pid and keeps its counter only in
// memory (SIGUSR1 sets it to 1000: suspendAppVM's change after a
// snapshot), and prints what each TCP connection to port 7000 sends (the
// follow latency's probe).
const logsWorkload = `echo "key: $(cat /run/lane-logs.key)"; grep two /run/lane-logs.key
/bin/sh -c 'echo "tick loop $$"; i=0; trap "i=1000" USR1; while :; do echo "tick $i"; i=$((i+1)); sleep 1; done' &
while :; do /bin/busybox nc -l -p 7000; done`

// logChunk is one chunk of GET …/logs.
type logChunk struct {
	Seq    uint64 `json:"seq"`
	Stream string `json:"stream"`
	Data   string `json:"data"`
}

// output is AppVM id's workload output the log keeps (stdout and stderr
// together, in order), read through the API.
func (l *lane) output(id string) string {
	l.t.Helper()
	b := l.must("GET", "/api/appvm/vms/"+id+"/logs?tail=10000", "", http.StatusOK)
	var out strings.Builder
	dec := json.NewDecoder(bytes.NewReader(b))
	for dec.More() {
		var c logChunk
		if err := dec.Decode(&c); err != nil {
			l.t.Fatalf("decoding the workload log: %v", err)
		}
		out.WriteString(c.Data)
	}
	return out.String()
}

// lastTick is the number of the last "tick N" line of out, -1 without one.
func lastTick(out string) int {
	n := -1
	for _, line := range strings.Split(out, "\n") {
		var k int
		if _, err := fmt.Sscanf(line, "tick %d", &k); err == nil {
			n = k
		}
	}
	return n
}

// client runs a command of the vmhost client against the lane's agent.
func (l *lane) client(args ...string) *exec.Cmd {
	cmd := exec.Command(l.bin, args...)
	cmd.Env = append(os.Environ(), "VMHOST_API=unix:"+l.sock, "VMHOST_TOKEN="+l.token)
	return cmd
}

// appVMLogs: `vmhost appvm wait --for running` returns when the guest
// agent first reports; `vmhost appvm logs -f` shows lines printed after
// it began; a secret file's content and lines are [redacted] in the log;
// the follow latency (a line printed → the client) is measured; `vmhost
// run --rm` of the busybox image prints the guest's `uname -r` and exits
// 0.
func appVMLogs(l *lane, a artifacts) {
	t := l.t
	const id = "lane-logs"
	const prefix = "/api/appvm/vms"
	start := time.Now()
	req := map[string]any{
		"vm_id": id, "image_id": "busybox", "vcpus": 1, "memory_mb": 256, "disk_gib": 1, "network_id": "lane",
		"command":      []string{"/bin/sh", "-c", logsWorkload},
		"secret_files": []any{map[string]any{"path": "/run/lane-logs.key", "content": logsSecretFile}},
	}
	body, _ := json.Marshal(req)
	l.must("POST", prefix, string(body), http.StatusCreated)
	wait := l.client("appvm", "wait", id, "--for", "running", "--timeout", "5m", "-o", "json")
	out, err := wait.Output()
	if err != nil {
		t.Fatalf("vmhost appvm wait: %v: %s", err, out)
	}
	var waited struct {
		DisplayState string `json:"display_state"`
		AppVM        struct {
			LastHeartbeatAt *time.Time `json:"last_heartbeat_at"`
		} `json:"appvm"`
	}
	if err := json.Unmarshal(out, &waited); err != nil || waited.DisplayState != "running" || waited.AppVM.LastHeartbeatAt == nil {
		t.Fatalf("vmhost appvm wait --for running printed %s (%v): want the view at the guest agent's first report", out, err)
	}
	phase(t, "logs: wait --for running", start)

	// A follow from now on (--tail 0), begun once the workload has printed
	// a few ticks: it shows ticks printed after it began, none before.
	before := -1
	l.poll("the workload's ticks", 2*time.Minute, func() bool {
		before = lastTick(l.output(id))
		return before >= 2
	})
	follow := l.client("appvm", "logs", id, "-f", "--tail", "0")
	var followed syncBuffer
	follow.Stdout = &followed
	if err := follow.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { follow.Process.Kill(); follow.Wait() }()
	l.poll("a tick printed after vmhost appvm logs -f began", 2*time.Minute, func() bool { return lastTick(followed.String()) > before })
	if out := followed.String(); strings.Contains(out, "key: ") || strings.Contains(out, fmt.Sprintf("tick %d\n", before)) {
		t.Errorf("--tail 0 printed output from before the follow (tick %d was the last): %q", before, out)
	}
	phase(t, "logs: a line after logs -f began", start)

	logged := l.output(id)
	for _, line := range strings.Split(strings.TrimSpace(logsSecretFile), "\n") {
		if strings.Contains(logged, line) {
			t.Errorf("the workload log holds a line of the secret file:\n%s", logged)
		}
	}
	// The whole file (echo's newline ends it) and then its second line.
	if !strings.Contains(logged, "key: [redacted][redacted]\n") {
		t.Errorf("the workload log does not show the secret file's lines as [redacted]:\n%s", logged)
	}

	lat := l.followLatency(id, 15)
	slices.Sort(lat)
	t.Logf("log follow latency (workload print → API follower), real guest under TCG: median %v, min %v, max %v over %d probes",
		lat[len(lat)/2].Round(10*time.Microsecond), lat[0].Round(10*time.Microsecond), lat[len(lat)-1].Round(10*time.Microsecond), len(lat))
	phase(t, "logs: follow latency", start)
	suspendAppVM(l, id, start)
	l.deleteVM(prefix, id)

	// vmhost run: an AppVM as a command, its output on the command's.
	run := l.client("run", "--rm", "--name", "lane-run", "--image", "busybox", "--memory", "256", "--network", "lane",
		"--", "/bin/busybox", "uname", "-r")
	var stdout, stderr bytes.Buffer
	run.Stdout, run.Stderr = &stdout, &stderr
	if err := run.Run(); err != nil {
		t.Errorf("vmhost run: %v; stderr %q", err, stderr.String())
	}
	if want := filepath.Base(a.modules) + "\n"; stdout.String() != want {
		t.Errorf("vmhost run printed %q, want the guest's uname -r %q", stdout.String(), want)
	}
	if st, _ := l.do("GET", prefix+"/lane-run", ""); st != http.StatusNotFound {
		t.Errorf("vmhost run --rm left its AppVM: %d", st)
	}
	phase(t, "logs: vmhost run --rm uname -r", start)
}

// followLatency measures n times how long a line takes from the
// workload to a follower of the API: it sends "probe N" to the workload's
// port 7000 (which prints it) from the lane's namespace and times its
// arrival on GET …/logs?follow=true.
func (l *lane) followLatency(id string, n int) []time.Duration {
	t := l.t
	var ip string
	l.poll("the AppVM's DHCP lease", time.Minute, func() bool {
		var v struct {
			AppVM struct {
				Lease *struct {
					IP string `json:"ip"`
				} `json:"lease"`
			} `json:"appvm"`
		}
		json.Unmarshal(l.must("GET", "/api/appvm/vms/"+id, "", http.StatusOK), &v)
		if v.AppVM.Lease != nil {
			ip = v.AppVM.Lease.IP
		}
		return ip != ""
	})
	nsFD, err := syscall.Open("/var/run/netns/"+l.ns, syscall.O_RDONLY|syscall.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer syscall.Close(nsFD)
	dial := func() (net.Conn, error) {
		var c net.Conn
		err := netnstest.RunIn(nsFD, func() error {
			var err error
			c, err = net.DialTimeout("tcp", net.JoinHostPort(ip, "7000"), 5*time.Second)
			return err
		})
		return c, err
	}
	return measureFollow(t, l.streamLogs(id), dial, n)
}

// streamLogs opens GET …/logs?follow=true&tail=0 on AppVM id.
func (l *lane) streamLogs(id string) io.ReadCloser {
	req, _ := http.NewRequestWithContext(context.Background(), "GET", "http://vmhost/api/appvm/vms/"+id+"/logs?follow=true&tail=0", nil)
	req.Header.Set("Authorization", "Bearer "+l.token)
	c := &http.Client{Transport: l.hc.Transport} // no timeout: a stream
	resp, err := c.Do(req)
	if err != nil || resp.StatusCode != http.StatusOK {
		l.t.Fatalf("GET logs?follow=true: %v %v", resp, err)
	}
	return resp.Body
}

// measureFollow sends n probes through dial and returns, for each, the
// time from its send to its line on stream (an NDJSON follow).
func measureFollow(t interface {
	Fatalf(string, ...any)
	Helper()
}, stream io.ReadCloser, dial func() (net.Conn, error), n int) []time.Duration {
	t.Helper()
	defer stream.Close()
	arrived := make(chan string, 64)
	go func() {
		rd := bufio.NewReader(stream)
		for {
			line, err := rd.ReadBytes('\n')
			if err != nil {
				close(arrived)
				return
			}
			var c logChunk
			if json.Unmarshal(line, &c) == nil {
				for _, f := range strings.Fields(c.Data) {
					if strings.HasPrefix(f, "probe-") {
						arrived <- f
					}
				}
			}
		}
	}()
	var out []time.Duration
	for k := range n {
		probe := fmt.Sprintf("probe-%d", k)
		var c net.Conn
		deadline := time.Now().Add(30 * time.Second)
		for {
			var err error
			if c, err = dial(); err == nil {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("dialling the workload: %v", err)
			}
			time.Sleep(20 * time.Millisecond) // nc between two connections
		}
		sent := time.Now()
		c.Write([]byte(probe + "\n"))
		c.Close()
		timeout := time.After(30 * time.Second)
	wait:
		for {
			select {
			case got, ok := <-arrived:
				if !ok {
					t.Fatalf("the follow ended")
				}
				if got == probe {
					out = append(out, time.Since(sent))
					break wait
				}
			case <-timeout:
				t.Fatalf("%s did not arrive on the follow", probe)
			}
		}
		time.Sleep(100 * time.Millisecond)
	}
	return out
}

// syncBuffer is a bytes.Buffer a test may read while a process writes.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}
