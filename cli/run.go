package cli

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// `vmhost run` (docs/cli.md): an AppVM as a command, for a supervisor that
// runs commands (a systemd unit, Nomad's raw_exec, a CI runner).

// Exit statuses of `vmhost run` that are not the workload's own.
const (
	// runFailed: the workload did not run to an end of its own (the
	// create was refused, the VM failed, the workload could not start,
	// the AppVM was deleted, the API failed).
	runFailed = 125
	// runKilled: the AppVM stopped without its workload reporting an end
	// (a hard stop): the workload was killed with it (128 + SIGKILL).
	runKilled = 128 + 9
)

// exitStatus is an end of a command with a status of its own (vmhost
// appvm exec, vmhost run), which vmhost exits with; msg, when set, is
// printed on stderr.
type exitStatus struct {
	code int
	msg  string
}

func (e *exitStatus) Error() string {
	if e.msg == "" {
		return fmt.Sprintf("exit status %d", e.code)
	}
	return fmt.Sprintf("exit status %d: %s", e.code, e.msg)
}

// listFlag is a repeatable string flag.
type listFlag []string

func (l *listFlag) String() string     { return strings.Join(*l, ",") }
func (l *listFlag) Set(v string) error { *l = append(*l, v); return nil }

// runView is the part of an AppVM view `vmhost run` reads.
type runView struct {
	ID            string `json:"id"`
	Mode          string `json:"mode"`
	State         string `json:"state"`
	FailureReason *struct {
		Summary string `json:"summary"`
	} `json:"failure_reason"`
	AppVM *struct {
		ImageID            string `json:"image_id"`
		WorkloadExitCode   *int   `json:"workload_exit_code"`
		WorkloadExitSignal int    `json:"workload_exit_signal"`
		WorkloadFatal      string `json:"workload_fatal"`
	} `json:"appvm"`
}

// runCmd runs `vmhost run [--rm] [--name ID] --image IMAGE [create flags]
// [-- CMD ARGS…]`: it creates the AppVM (or attaches to the one of that
// name: a run whose command was killed comes back to it), prints the
// workload's stdout and stderr on its own as they come, turns the first
// SIGINT or SIGTERM into a graceful shutdown (the workload gets SIGTERM,
// then SIGKILL after its stop grace) and a second into a stop, and ends
// with the workload's exit status (128 + the signal when a signal ended
// it). --rm deletes the AppVM at the end.
func (e *env) runCmd(args []string) error {
	var (
		rm                                  bool
		name, image, restart, workdir, user string
		network, hostname, ip, gateway      string
		vcpus, memoryMB, diskGiB, stopGrace int
		envs, secretEnvs                    listFlag
	)
	pos, err := e.parse("run", args, func(fs *flag.FlagSet) {
		fs.BoolVar(&rm, "rm", false, "delete the AppVM when the workload has ended")
		fs.StringVar(&name, "name", "", "the AppVM's id (default: run- and random hex); an AppVM of that id is attached to")
		fs.StringVar(&image, "image", "", "the AppVM image to run (required)")
		fs.IntVar(&vcpus, "vcpus", 1, "vCPUs")
		fs.IntVar(&memoryMB, "memory", 256, "memory in MiB")
		fs.IntVar(&diskGiB, "disk-gib", 0, "root disk size in GiB (default: the image's size)")
		fs.Var(&envs, "env", "KEY=VALUE added to the workload's environment (repeatable)")
		fs.Var(&secretEnvs, "secret-env", "KEY=VALUE sent only to the guest (repeatable)")
		fs.StringVar(&restart, "restart", "no", "restart policy: no, on-failure or always")
		fs.IntVar(&stopGrace, "stop-grace", 0, "seconds between SIGTERM and SIGKILL at a shutdown (default: the agent's)")
		fs.StringVar(&workdir, "workdir", "", "working directory (default: the image's)")
		fs.StringVar(&user, "user", "", "user (default: the image's)")
		fs.StringVar(&network, "network", "", "host network (default: the default network)")
		fs.StringVar(&hostname, "hostname", "", "hostname")
		fs.StringVar(&ip, "ip", "", "a static IPv4 address with its prefix length, ADDR/PREFIX (default: DHCP)")
		fs.StringVar(&gateway, "gateway", "", "the static address's gateway (with --ip)")
	})
	if err != nil {
		return err
	}
	if image == "" {
		return usageError("run: --image is required")
	}
	body := createBody{ImageID: image, Vcpus: vcpus, MemoryMB: memoryMB, DiskGiB: diskGiB, Command: pos, Env: envs,
		SecretEnv: secretEnvs, RestartPolicy: restart, Workdir: workdir, User: user, NetworkID: network, Hostname: hostname,
		StopGraceSecs: stopGrace}
	if ip != "" || gateway != "" {
		addr, plen, ok := strings.Cut(ip, "/")
		n, err := strconv.Atoi(plen)
		if !ok || err != nil || gateway == "" {
			return usageError("run: --ip ADDR/PREFIX and --gateway GW go together")
		}
		body.IP, body.Prefix, body.Gateway = addr, &n, gateway
	}
	if err := e.connect(); err != nil {
		return err
	}
	id := name
	if id == "" {
		b := make([]byte, 6)
		rand.Read(b)
		id = "run-" + hex.EncodeToString(b)
	}
	// The requests of a run outlive the first signal (which ends e.ctx):
	// it asks for a shutdown, and the run goes on to the workload's end.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	r := &runner{env: e, ctx: ctx, id: id, path: "/api/appvm/vms/" + url.PathEscape(id)}
	body.VMID = id
	attached, err := r.create(image, body)
	if err != nil {
		return &exitStatus{code: runFailed, msg: err.Error()}
	}
	code, msg := r.follow(attached)
	if rm {
		if _, _, err := e.client.do(ctx, "DELETE", r.path+"?force=true", nil); err != nil && !isStatus(err, http.StatusNotFound) {
			msg = strings.TrimSpace(msg + "\nremoving the AppVM: " + err.Error())
			if code == 0 {
				code = runFailed
			}
		}
	}
	if code == 0 && msg == "" {
		return nil
	}
	return &exitStatus{code: code, msg: msg}
}

// createBody is the create request `vmhost run` sends.
type createBody struct {
	VMID          string   `json:"vm_id"`
	ImageID       string   `json:"image_id"`
	Vcpus         int      `json:"vcpus"`
	MemoryMB      int      `json:"memory_mb"`
	DiskGiB       int      `json:"disk_gib"`
	Command       []string `json:"command,omitempty"`
	Env           []string `json:"env,omitempty"`
	SecretEnv     []string `json:"secret_env,omitempty"`
	RestartPolicy string   `json:"restart_policy,omitempty"`
	Workdir       string   `json:"workdir,omitempty"`
	User          string   `json:"user,omitempty"`
	NetworkID     string   `json:"network_id,omitempty"`
	IP            string   `json:"ip,omitempty"`
	Prefix        *int     `json:"prefix,omitempty"`
	Gateway       string   `json:"gateway,omitempty"`
	Hostname      string   `json:"hostname,omitempty"`
	StopGraceSecs int      `json:"stop_grace_secs,omitempty"`
}

// runner is one `vmhost run`.
type runner struct {
	*env
	ctx  context.Context
	id   string
	path string
}

// create creates the AppVM, booted; an AppVM of that id already there is
// attached to instead (started first when it does not run): attached is
// then true.
func (r *runner) create(image string, body createBody) (attached bool, err error) {
	if body.DiskGiB == 0 {
		_, b, err := r.client.do(r.ctx, "GET", "/api/appvm/images/"+url.PathEscape(image), nil)
		if err != nil {
			return false, fmt.Errorf("reading image %s: %w", image, err)
		}
		var im struct {
			SizeBytes int64 `json:"size_bytes"`
		}
		json.Unmarshal(b, &im)
		body.DiskGiB = max(1, int((im.SizeBytes+(1<<30)-1)>>30))
	}
	data, _ := json.Marshal(body)
	_, _, err = r.client.do(r.ctx, "POST", "/api/appvm/vms", data)
	if err == nil {
		return false, nil
	}
	var ae *APIError
	if !errors.As(err, &ae) || ae.Code != "ALREADY_EXISTS" {
		return false, err
	}
	v, err := r.view()
	if err != nil {
		return false, err
	}
	if v.Mode != "appvm" || v.AppVM == nil {
		return false, fmt.Errorf("%s is a classic VM", r.id)
	}
	if v.AppVM.ImageID != image {
		return false, fmt.Errorf("AppVM %s exists with image %s, not %s", r.id, v.AppVM.ImageID, image)
	}
	if v.State != "running" && v.State != "paused" {
		if _, _, err := r.client.do(r.ctx, "POST", r.path+"/start", nil); err != nil {
			return false, fmt.Errorf("starting AppVM %s: %w", r.id, err)
		}
	}
	fmt.Fprintf(r.stderr, "vmhost run: attached to AppVM %s\n", r.id)
	return true, nil
}

func (r *runner) view() (*runView, error) {
	_, b, err := r.client.do(r.ctx, "GET", r.path, nil)
	if err != nil {
		return nil, err
	}
	var v runView
	if err := json.Unmarshal(b, &v); err != nil {
		return nil, fmt.Errorf("decoding the AppVM: %w", err)
	}
	return &v, nil
}

// follow prints the workload's output until its end and returns the
// run's exit status and what to say on stderr. Output from the start of
// the log for a new AppVM, from now on for one attached to.
func (r *runner) follow(attached bool) (int, string) {
	logs := &logFollower{env: r.env, path: r.path + "/logs", query: url.Values{}, follow: true}
	if attached {
		// From now on: the seq of the last chunk kept is where to start.
		var last lastChunk
		l := &logFollower{env: &env{ctx: r.ctx, stdout: io.Discard, stderr: io.Discard, client: r.client, opts: r.opts},
			path: r.path + "/logs", query: url.Values{"tail": {"1"}}, onChunk: last.take}
		if err := l.once(r.ctx, nil); err != nil {
			return runFailed, "reading the workload log: " + err.Error()
		}
		logs.last, logs.seen = last.seq, true
	} else {
		logs.last, logs.seen = 0, true
	}
	logCtx, stopLogs := context.WithCancel(r.ctx)
	logsDone := make(chan error, 1)
	go func() { logsDone <- logs.run(logCtx) }()

	ended := make(chan waitEnd, 1)
	go func() { ended <- r.waitEnd() }()
	var signals chan os.Signal
	interrupted := r.env.ctx.Done()
	var end waitEnd
	for done := false; !done; {
		select {
		case end = <-ended:
			done = true
		case <-interrupted:
			// The first SIGINT or SIGTERM: a graceful shutdown; a second
			// one stops the AppVM at once.
			interrupted = nil
			signals = make(chan os.Signal, 1)
			signal.Notify(signals, os.Interrupt, syscall.SIGTERM)
			defer signal.Stop(signals)
			r.shutdown()
		case <-signals:
			signals = nil
			fmt.Fprintf(r.stderr, "vmhost run: stopping AppVM %s now\n", r.id)
			if _, _, err := r.client.do(r.ctx, "POST", r.path+"/stop", nil); err != nil {
				fmt.Fprintf(r.stderr, "vmhost run: stopping AppVM %s: %v\n", r.id, err)
			}
		}
	}
	// The workload's output is all stored before its end is recorded:
	// what the follow has not printed yet is read to its end.
	stopLogs()
	<-logsDone
	logs.follow = false
	if err := logs.once(r.ctx, nil); err != nil {
		fmt.Fprintf(r.stderr, "vmhost run: reading the rest of the workload log: %v\n", err)
	}
	return end.code, end.msg
}

// lastChunk keeps the seq of the last chunk a log read printed.
type lastChunk struct{ seq uint64 }

func (l *lastChunk) take(c logChunk) { l.seq = c.Seq }

// shutdown asks for the graceful shutdown of the AppVM (its workload gets
// SIGTERM, then SIGKILL after its stop grace); one not running yet is
// stopped.
func (r *runner) shutdown() {
	fmt.Fprintf(r.stderr, "vmhost run: shutting down AppVM %s (SIGTERM to the workload, SIGKILL after its stop grace)\n", r.id)
	_, _, err := r.client.do(r.ctx, "POST", r.path+"/shutdown", nil)
	var ae *APIError
	if errors.As(err, &ae) && ae.Code == "INVALID_STATE" {
		_, _, err = r.client.do(r.ctx, "POST", r.path+"/stop", nil)
	}
	if err != nil && !isStatus(err, http.StatusConflict) {
		fmt.Fprintf(r.stderr, "vmhost run: shutting down AppVM %s: %v\n", r.id, err)
	}
}

// waitEnd is how a run ends: its exit status and what to say.
type waitEnd struct {
	code int
	msg  string
}

// waitEnd waits until the AppVM stops, fails or is deleted (GET …/wait,
// asked again while it times out, and after a dropped connection) and
// returns how the run ends.
func (r *runner) waitEnd() waitEnd {
	delay := retryFirst
	for {
		st, b, err := r.client.do(r.ctx, "GET", r.path+"/wait?for=stopped,failed,deleted&timeout_secs=600", nil)
		switch {
		case err == nil && st == http.StatusNoContent:
			return waitEnd{runFailed, fmt.Sprintf("AppVM %s was deleted", r.id)}
		case err == nil:
			var v runView
			if err := json.Unmarshal(b, &v); err != nil {
				return waitEnd{runFailed, "decoding the AppVM: " + err.Error()}
			}
			return endOf(&v)
		case isStatus(err, http.StatusRequestTimeout):
			continue
		case isStatus(err, http.StatusNotFound):
			return waitEnd{runFailed, fmt.Sprintf("AppVM %s was deleted", r.id)}
		}
		var ae *APIError
		if errors.As(err, &ae) && ae.Status/100 == 4 {
			return waitEnd{runFailed, err.Error()}
		}
		// The agent went away (a restart): ask again.
		fmt.Fprintf(r.stderr, "vmhost run: waiting for AppVM %s: %v; asking again in %v\n", r.id, err, delay)
		time.Sleep(delay)
		delay = min(2*delay, retryMax)
	}
}

// endOf is the end of a run whose AppVM stopped or failed, from its view.
func endOf(v *runView) waitEnd {
	if a := v.AppVM; a != nil {
		switch {
		case a.WorkloadExitCode != nil:
			return waitEnd{code: *a.WorkloadExitCode}
		case a.WorkloadExitSignal != 0:
			return waitEnd{code: 128 + a.WorkloadExitSignal}
		case a.WorkloadFatal != "":
			return waitEnd{runFailed, "the workload could not start: " + a.WorkloadFatal}
		}
	}
	why := ""
	if v.FailureReason != nil {
		why = ": " + v.FailureReason.Summary
	}
	if v.State == "failed" {
		return waitEnd{runFailed, fmt.Sprintf("AppVM %s failed%s", v.ID, why)}
	}
	return waitEnd{runKilled, fmt.Sprintf("AppVM %s stopped before its workload ended%s", v.ID, why)}
}

func isStatus(err error, status int) bool {
	var ae *APIError
	return errors.As(err, &ae) && ae.Status == status
}
