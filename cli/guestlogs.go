package cli

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"
)

// The guest operations that read: `vmhost {vm|appvm} wait`, `vmhost
// {vm|appvm} console-log` and `vmhost appvm logs` (docs/cli.md).

// maxWaitPerRequest is the longest timeout_secs one wait request may ask
// (the API's bound); a longer --timeout asks again.
const maxWaitPerRequest = 600 * time.Second

// guestReadCmd runs `vmhost vm|appvm wait|console-log|logs …`.
func (e *env) guestReadCmd(family, prefix string, args []string) error {
	sub := args[0]
	name := family + " " + sub
	var states, streamName string
	var timeout time.Duration
	var follow bool
	var tail int
	var tailBytes int64
	var since string
	pos, err := e.parse(name, args[1:], func(fs *flag.FlagSet) {
		switch sub {
		case "wait":
			fs.StringVar(&states, "for", "", "display states to wait for, comma-separated (running, stopped, failed, deleted, …)")
			fs.DurationVar(&timeout, "timeout", 60*time.Second, "how long to wait")
		case "console-log":
			fs.BoolVar(&follow, "f", false, "follow: go on with what the guest prints until interrupted or the VM is deleted")
			fs.Int64Var(&tailBytes, "tail-bytes", 64<<10, "start with the last N bytes kept")
		case "logs":
			fs.BoolVar(&follow, "f", false, "follow: go on with the output that comes until interrupted or the AppVM is deleted")
			fs.IntVar(&tail, "tail", 100, "start with the last N chunks (at most 10000)")
			fs.StringVar(&since, "since", "", "start after the chunk of this seq instead")
			fs.StringVar(&streamName, "stream", "", "stdout or stderr only")
		}
	})
	if err != nil {
		return err
	}
	if len(pos) != 1 {
		return usageError("%s: want one VM id", name)
	}
	id := pos[0]
	switch sub {
	case "wait":
		if states == "" {
			return usageError("%s: --for is required (for example --for running)", name)
		}
		if timeout <= 0 {
			return usageError("%s: --timeout %v must be positive", name, timeout)
		}
		if err := e.connect(); err != nil {
			return err
		}
		return e.wait(prefix, id, states, timeout)
	case "console-log":
		if tailBytes < 0 {
			return usageError("%s: --tail-bytes %d is negative", name, tailBytes)
		}
		if err := e.connect(); err != nil {
			return err
		}
		q := url.Values{"tail_bytes": {strconv.FormatInt(tailBytes, 10)}}
		if follow {
			q.Set("follow", "true")
		}
		return e.copyStream(prefix+"/"+url.PathEscape(id)+"/console?"+q.Encode(), e.stdout)
	}
	if family != "appvm" {
		return usageError("%s: logs are an AppVM's (vmhost appvm logs)", name)
	}
	q := url.Values{}
	if since != "" {
		if _, err := strconv.ParseUint(since, 10, 64); err != nil {
			return usageError("%s: --since %q: want a chunk seq", name, since)
		}
		q.Set("since_seq", since)
	} else {
		q.Set("tail", strconv.Itoa(tail))
	}
	if streamName != "" {
		q.Set("stream", streamName)
	}
	if err := e.connect(); err != nil {
		return err
	}
	l := &logFollower{env: e, path: prefix + "/" + url.PathEscape(id) + "/logs", query: q, follow: follow}
	return l.run(e.ctx)
}

// wait asks GET …/wait until a state asked for comes, the VM is deleted
// (with deleted asked), or timeout passes: each request asks at most the
// API's bound, and a 408 before the deadline asks again.
func (e *env) wait(prefix, id, states string, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		left := time.Until(deadline)
		secs := int(min(left, maxWaitPerRequest).Round(time.Second) / time.Second)
		secs = max(secs, 1)
		path := fmt.Sprintf("%s/%s/wait?for=%s&timeout_secs=%d", prefix, url.PathEscape(id), url.QueryEscape(states), secs)
		st, b, err := e.client.do(e.ctx, "GET", path, nil)
		var ae *APIError
		if errors.As(err, &ae) && ae.Status == http.StatusRequestTimeout && time.Until(deadline) > time.Second {
			continue
		}
		if err != nil {
			return err
		}
		if st == http.StatusNoContent {
			e.done(id + ": deleted")
			return nil
		}
		return e.printVM(b)
	}
}

// copyStream copies the body of GET path to w as it comes, until it ends
// or the command is interrupted.
func (e *env) copyStream(path string, w io.Writer) error {
	resp, err := e.client.send(e.ctx, "GET", path, nil, nil)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
		return parseAPIError(resp.StatusCode, b)
	}
	buf := make([]byte, 32<<10)
	for {
		n, err := resp.Body.Read(buf)
		if n > 0 {
			if _, werr := w.Write(buf[:n]); werr != nil {
				return werr
			}
		}
		if err == io.EOF {
			return nil
		}
		if err != nil {
			if e.ctx.Err() != nil {
				return nil // interrupted: a normal end
			}
			return err
		}
	}
}

// logChunk is one chunk of GET /api/appvm/vms/{id}/logs.
type logChunk struct {
	Seq    uint64 `json:"seq"`
	Stream string `json:"stream"`
	Data   string `json:"data"`
}

// logFollower prints an AppVM's workload output: each chunk's data on
// the command's stdout or stderr as the chunk's stream says (-o json: the
// NDJSON lines as they are), in order per stream. Following, it
// reconnects after a dropped connection (an agent restart) and resumes
// after the last chunk it printed, so nothing is printed twice.
type logFollower struct {
	*env
	path   string
	query  url.Values
	follow bool
	// last is the seq of the last chunk printed; seen whether any was.
	last uint64
	seen bool
	// onChunk, when set, is told each chunk printed (vmhost run).
	onChunk func(logChunk)
}

// run prints until the stream ends (not following), the AppVM is
// deleted or ctx ends. Following, an answer that ends (the agent shut
// down) or a connection that fails is taken up again after the last
// chunk printed; an AppVM that is gone then (404) is a normal end.
func (l *logFollower) run(ctx context.Context) error {
	delay := retryFirst
	connected := false
	for {
		err := l.once(ctx, &connected)
		if ctx.Err() != nil {
			return nil
		}
		if !l.follow {
			return err
		}
		var ae *APIError
		switch {
		case errors.As(err, &ae) && ae.Status == http.StatusNotFound && connected:
			return nil // deleted
		case errors.As(err, &ae) && ae.Status/100 == 4:
			return err
		case err == nil:
			// The answer ended with the AppVM still there, or gone: ask
			// again at once to know which.
			continue
		}
		fmt.Fprintf(l.stderr, "vmhost: the log stream ended (%v); reconnecting in %v\n", err, delay)
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(delay):
		}
		delay = min(2*delay, retryMax)
	}
}

// once reads one connection's chunks; nil when the answer ended. It sets
// *connected once an answer was 200.
func (l *logFollower) once(ctx context.Context, connected *bool) error {
	q := url.Values{}
	for k, v := range l.query {
		q[k] = v
	}
	if l.seen {
		q.Del("tail")
		q.Set("since_seq", strconv.FormatUint(l.last, 10))
	}
	if l.follow {
		q.Set("follow", "true")
	}
	resp, err := l.client.send(ctx, "GET", l.path+"?"+q.Encode(), nil, nil)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
		return parseAPIError(resp.StatusCode, b)
	}
	if connected != nil {
		*connected = true
	}
	r := bufio.NewReaderSize(resp.Body, 64<<10)
	for {
		line, err := r.ReadBytes('\n')
		if len(line) > 0 && line[len(line)-1] == '\n' {
			var c logChunk
			if jerr := json.Unmarshal(line, &c); jerr != nil {
				return fmt.Errorf("decoding a log chunk: %w", jerr)
			}
			l.last, l.seen = c.Seq, true
			if l.opts.output == "json" {
				l.stdout.Write(line)
			} else if c.Stream == "stderr" {
				io.WriteString(l.stderr, c.Data)
			} else {
				io.WriteString(l.stdout, c.Data)
			}
			if l.onChunk != nil {
				l.onChunk(c)
			}
			continue
		}
		if err == io.EOF {
			if len(line) > 0 {
				return io.ErrUnexpectedEOF
			}
			return nil
		}
		if err != nil {
			return err
		}
	}
}

// isGuestRead reports whether sub is one of guestReadCmd's subcommands.
func isGuestRead(sub string) bool {
	return strings.Contains(" wait console-log logs ", " "+sub+" ")
}
