package cli

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"mime"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"
)

// Reconnection of `vmhost events`: the first retry waits retryFirst (or
// what the server's retry: field says), doubling up to retryMax while
// connections fail; a connection that delivered an event resets it. A
// stream silent for longer than idleLimit (the server comments every 15 s)
// is taken as dead and reconnected.
const (
	retryFirst = time.Second
	retryMax   = 30 * time.Second
	idleLimit  = 45 * time.Second
)

// event is the part of an event's data (docs/api.md, Events) the table shows.
type event struct {
	Seq          int64  `json:"seq"`
	Time         string `json:"time"`
	Type         string `json:"type"`
	VMID         string `json:"vm_id"`
	Mode         string `json:"mode"`
	State        string `json:"state"`
	DisplayState string `json:"display_state"`
}

// eventsCmd follows GET /api/events until interrupted, resuming after the
// last event seen (Last-Event-ID) whenever the stream drops.
func (e *env) eventsCmd(args []string) error {
	var vmID, since string
	var filters labelFilters
	pos, err := e.parse("events", args, func(fs *flag.FlagSet) {
		fs.StringVar(&vmID, "vm", "", "only the events of this VM id")
		fs.Var(&filters, "label", "only the events of VMs with this label (KEY=VALUE or KEY; repeatable: all must match)")
		fs.StringVar(&since, "since", "", "resume after this event seq (default: from now on)")
	})
	if err != nil {
		return err
	}
	if len(pos) != 0 {
		return usageError("events: unexpected argument %q", pos[0])
	}
	if since != "" {
		if _, err := strconv.ParseUint(since, 10, 64); err != nil {
			return usageError("events: --since %q: want an event seq", since)
		}
	}
	if err := e.connect(); err != nil {
		return err
	}
	f := &follower{env: e, vmID: vmID, labels: filters, lastID: since, retry: retryFirst}
	return f.run()
}

type follower struct {
	*env
	vmID   string
	labels labelFilters
	lastID string
	retry  time.Duration // the server's retry:, or retryFirst
	header bool
}

func (f *follower) run() error {
	delay := f.retry
	for {
		got, err := f.follow()
		if f.ctx.Err() != nil {
			return nil // interrupted: a normal end
		}
		var ae *APIError
		if errors.As(err, &ae) && ae.Status/100 == 4 {
			return err // the key, the filter or the route is wrong: retrying will not help
		}
		if got {
			delay = f.retry
		}
		msg := "stream ended"
		if err != nil {
			msg = err.Error()
		}
		fmt.Fprintf(f.stderr, "vmhost events: %s; reconnecting in %v\n", msg, delay)
		select {
		case <-f.ctx.Done():
			return nil
		case <-time.After(delay):
		}
		delay = min(2*delay, retryMax)
	}
}

// follow reads one connection's events; got reports whether any came.
func (f *follower) follow() (got bool, err error) {
	ctx, cancel := context.WithCancel(f.ctx)
	defer cancel()
	q := url.Values{}
	if f.vmID != "" {
		q.Set("vm_id", f.vmID)
	}
	if len(f.labels) > 0 {
		q["label"] = f.labels
	}
	path := "/api/events"
	if len(q) > 0 {
		path += "?" + q.Encode()
	}
	hdr := http.Header{"Accept": {"text/event-stream"}, "Cache-Control": {"no-cache"}}
	if f.lastID != "" {
		hdr.Set("Last-Event-ID", f.lastID)
	}
	resp, err := f.client.send(ctx, "GET", path, nil, hdr)
	if err != nil {
		return false, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
		return false, parseAPIError(resp.StatusCode, b)
	}
	if mt, _, _ := mime.ParseMediaType(resp.Header.Get("Content-Type")); mt != "text/event-stream" {
		return false, fmt.Errorf("GET %s answered %q, not an event stream", path, resp.Header.Get("Content-Type"))
	}
	idle := time.AfterFunc(idleLimit, cancel)
	defer idle.Stop()
	r := bufio.NewReader(resp.Body)
	var id string
	var data strings.Builder
	haveID := false
	for {
		line, err := r.ReadString('\n')
		if err != nil {
			if ctx.Err() != nil && f.ctx.Err() == nil {
				return got, fmt.Errorf("no data for %v", idleLimit)
			}
			if errors.Is(err, io.EOF) {
				return got, nil
			}
			return got, err
		}
		idle.Reset(idleLimit)
		line = strings.TrimSuffix(strings.TrimSuffix(line, "\n"), "\r")
		if line == "" { // dispatch
			if haveID {
				f.lastID = id
			}
			if data.Len() > 0 {
				got = true
				f.print(strings.TrimSuffix(data.String(), "\n"))
			}
			data.Reset()
			haveID = false
			continue
		}
		if strings.HasPrefix(line, ":") {
			continue // a keep-alive comment
		}
		field, value, _ := strings.Cut(line, ":")
		value = strings.TrimPrefix(value, " ")
		switch field {
		case "id":
			id, haveID = value, true
		case "data":
			data.WriteString(value)
			data.WriteByte('\n')
		case "retry":
			if ms, err := strconv.Atoi(value); err == nil && ms > 0 {
				f.retry = time.Duration(ms) * time.Millisecond
			}
		}
	}
}

// print shows one event: its data line unchanged with -o json, else one
// line of fixed columns.
func (f *follower) print(data string) {
	if f.opts.output == "json" {
		fmt.Fprintln(f.stdout, data)
		return
	}
	var ev event
	if err := json.Unmarshal([]byte(data), &ev); err != nil {
		fmt.Fprintf(f.stdout, "? %s\n", data)
		return
	}
	if !f.header {
		f.header = true
		fmt.Fprintf(f.stdout, "%-8s %-20s %-22s %-5s %-24s %-10s %s\n", "SEQ", "TIME", "TYPE", "MODE", "VM", "STATE", "DISPLAY STATE")
	}
	if ev.Type == "reset" {
		fmt.Fprintf(f.stdout, "%-8d %-20s %-22s (events before this point are gone: re-list the VMs)\n", ev.Seq, ev.Time, ev.Type)
		return
	}
	t := ev.Time
	if ts, err := time.Parse(time.RFC3339Nano, ev.Time); err == nil {
		t = ts.UTC().Format(time.RFC3339)
	}
	fmt.Fprintf(f.stdout, "%-8d %-20s %-22s %-5s %-24s %-10s %s\n", ev.Seq, t, ev.Type, dash(ev.Mode), dash(ev.VMID), dash(ev.State), dash(ev.DisplayState))
}

func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}
