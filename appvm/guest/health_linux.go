package guest

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strconv"
	"syscall"
	"time"

	"vmhost/appvm/guest/proto"
)

// Health-check defaults for zero fields, as in Docker.
const (
	defaultHealthInterval = 30 * time.Second
	defaultHealthTimeout  = 30 * time.Second
	defaultHealthRetries  = 3
)

// healthChecker runs a workload's health check. The status starts as
// "starting"; a passing check makes it "healthy" and resets the failing
// streak; a failing check adds to the streak, except while the status is
// still "starting" within the start period; the status turns "unhealthy"
// once the streak reaches the retries. A Health message goes out when the
// checker starts and whenever the status or the streak changes.
type healthChecker struct {
	a       *agent
	hc      *proto.Healthcheck
	w       *workload
	workdir string

	interval, timeout, startPeriod time.Duration
	retries                        int

	status string
	streak int
}

func newHealthChecker(a *agent, hc *proto.Healthcheck, w *workload, workdir string) *healthChecker {
	h := &healthChecker{a: a, hc: hc, w: w, workdir: workdir,
		interval:    time.Duration(hc.IntervalSecs) * time.Second,
		timeout:     time.Duration(hc.TimeoutSecs) * time.Second,
		startPeriod: time.Duration(hc.StartPeriodSecs) * time.Second,
		retries:     hc.Retries,
		status:      proto.HealthStarting,
	}
	if h.interval == 0 {
		h.interval = defaultHealthInterval
	}
	if h.timeout == 0 {
		h.timeout = defaultHealthTimeout
	}
	if h.retries == 0 {
		h.retries = defaultHealthRetries
	}
	return h
}

func (h *healthChecker) run(ctx context.Context) {
	h.a.send(&proto.Health{Status: h.status})
	t := time.NewTicker(h.interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		ok, output := h.check(ctx)
		if ctx.Err() != nil {
			return
		}
		if msg := h.record(ok, output, time.Since(h.w.started)); msg != nil {
			h.a.send(msg)
		}
	}
}

// record applies one result; it returns the message to send, or nil when
// nothing changed.
func (h *healthChecker) record(ok bool, output string, sinceStart time.Duration) *proto.Health {
	status, streak := h.status, h.streak
	switch {
	case ok:
		status, streak = proto.HealthHealthy, 0
	case status == proto.HealthStarting && sinceStart < h.startPeriod:
		// Failures while the workload is still starting don't count.
	default:
		streak++
		if streak >= h.retries {
			status = proto.HealthUnhealthy
		}
	}
	if status == h.status && streak == h.streak {
		return nil
	}
	h.status, h.streak = status, streak
	if len(output) > proto.MaxHealthOutput {
		output = output[:proto.MaxHealthOutput]
	}
	return &proto.Health{Status: status, Streak: streak, Output: output}
}

// check runs one probe within the timeout.
func (h *healthChecker) check(ctx context.Context) (bool, string) {
	ctx, cancel := context.WithTimeout(ctx, h.timeout)
	defer cancel()
	switch h.hc.Type {
	case proto.CheckExec:
		return h.checkExec(ctx)
	case proto.CheckHTTP:
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, h.hc.URL, nil)
		if err != nil {
			return false, err.Error()
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return false, err.Error()
		}
		io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<16))
		resp.Body.Close()
		return resp.StatusCode >= 200 && resp.StatusCode < 400, "HTTP " + resp.Status
	case proto.CheckTCP:
		host := h.hc.Host
		if host == "" {
			host = "127.0.0.1"
		}
		var d net.Dialer
		c, err := d.DialContext(ctx, "tcp", net.JoinHostPort(host, strconv.Itoa(h.hc.Port)))
		if err != nil {
			return false, err.Error()
		}
		c.Close()
		return true, "connected"
	}
	return false, fmt.Sprintf("unknown check type %q", h.hc.Type)
}

// checkExec runs the check command like the workload (root, user, env) and
// kills its process group on timeout.
func (h *healthChecker) checkExec(ctx context.Context) (bool, string) {
	cmd, err := h.a.command(h.hc.Command, h.w.env, h.workdir, h.w.acc)
	if err != nil {
		return false, err.Error()
	}
	r, w, err := os.Pipe()
	if err != nil {
		return false, err.Error()
	}
	defer r.Close()
	cmd.Stdout, cmd.Stderr = w, w
	pid, status, err := h.a.reaper.start(cmd)
	w.Close()
	if err != nil {
		return false, err.Error()
	}
	out := make(chan string, 1)
	go func() {
		b, _ := io.ReadAll(io.LimitReader(r, proto.MaxHealthOutput))
		out <- string(b)
	}()
	var ws syscall.WaitStatus
	select {
	case ws = <-status:
	case <-ctx.Done():
		h.a.reaper.signalGroup(pid, syscall.SIGKILL)
		<-status
		r.SetReadDeadline(time.Now())
		return false, fmt.Sprintf("timed out after %v", h.timeout)
	}
	// A child left behind may hold the pipe open: don't wait for it long.
	r.SetReadDeadline(time.Now().Add(100 * time.Millisecond))
	output := <-out
	return ws.Exited() && ws.ExitStatus() == 0, output
}
