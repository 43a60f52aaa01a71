package events

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"strconv"
	"time"

	"vmhost/labels"
)

// Stream knobs: KeepAlive between comments when nothing happens,
// WriteTimeout for each write to a client (one that reads nothing for that
// long is cut), and BatchMax events read from the log at a time.
const (
	KeepAlive    = 15 * time.Second
	WriteTimeout = 30 * time.Second
	BatchMax     = 256
)

// StreamOptions say where a stream starts and what it shows.
type StreamOptions struct {
	// Since is the seq the client saw last; with FromStart false the
	// stream starts after the newest event instead.
	Since     uint64
	FromStart bool
	// VMID, when set, shows only that VM's events.
	VMID string
	// Labels, when set, shows only the events whose VM's labels (as the
	// event carries them) it matches.
	Labels labels.Selector
	// KeepAlive overrides the constant (tests); 0 means KeepAlive.
	KeepAlive time.Duration
}

// ParseResume reads the resume point of a request: the Last-Event-ID
// header (an EventSource reconnecting), else ?since=. ok is false when
// neither is given.
func ParseResume(r *http.Request) (seq uint64, ok bool, err error) {
	v := r.Header.Get("Last-Event-ID")
	name := "Last-Event-ID"
	if v == "" {
		v, name = r.URL.Query().Get("since"), "since"
	}
	if v == "" {
		return 0, false, nil
	}
	seq, err = strconv.ParseUint(v, 10, 64)
	if err != nil {
		return 0, false, errors.New(name + ": " + strconv.Quote(v) + " is not an event seq (a non-negative integer)")
	}
	return seq, true, nil
}

// Stream writes the log's events to w as Server-Sent Events until the
// request's context ends, a write fails or stalls past WriteTimeout, the
// client falls out of what is kept, or the log closes. Each event is
// "id: <seq>" and "data: <json>"; a resume point that is no longer kept
// gets a reset event first (with the newest seq as its id, so a client
// reconnecting after it resumes from there), and a client that falls
// behind what is kept gets a reset and is cut. w must support flushing.
func (l *Log) Stream(ctx context.Context, w http.ResponseWriter, o StreamOptions) error {
	if o.KeepAlive <= 0 {
		o.KeepAlive = KeepAlive
	}
	rc := http.NewResponseController(w)
	h := w.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-store")
	h.Set("X-Accel-Buffering", "no") // proxies must not hold events back
	w.WriteHeader(http.StatusOK)
	bw := bufio.NewWriterSize(w, 16<<10)
	flush := func() error {
		if err := rc.SetWriteDeadline(time.Now().Add(WriteTimeout)); err != nil && !errors.Is(err, http.ErrNotSupported) {
			return err
		}
		if err := bw.Flush(); err != nil {
			return err
		}
		return rc.Flush()
	}

	cursor := o.Since
	if !o.FromStart {
		cursor = l.Last()
	}
	if _, reset, _ := l.After(cursor, 0); reset {
		cursor = l.Last()
		writeReset(bw, cursor, l.now(), "the resume point is no longer kept: list the VMs again")
	}
	if err := flush(); err != nil {
		return err
	}
	keepAlive := time.NewTimer(o.KeepAlive)
	defer keepAlive.Stop()
	for {
		entries, reset, changed := l.After(cursor, BatchMax)
		if reset {
			writeReset(bw, l.Last(), l.now(), "this client fell behind what is kept: list the VMs again")
			flush()
			return errors.New("event stream client fell behind")
		}
		wrote := false
		for _, e := range entries {
			cursor = e.Seq
			if o.VMID != "" && e.VMID != o.VMID || !o.Labels.Matches(e.Labels) {
				continue
			}
			bw.WriteString("id: ")
			bw.WriteString(strconv.FormatUint(e.Seq, 10))
			bw.WriteString("\ndata: ")
			bw.Write(e.JSON)
			bw.WriteString("\n\n")
			wrote = true
		}
		if wrote {
			if err := flush(); err != nil {
				return err
			}
			keepAlive.Reset(o.KeepAlive)
		}
		if len(entries) == BatchMax {
			continue
		}
		select {
		case <-ctx.Done():
			return nil
		case <-changed:
			if l.isClosed() {
				return nil
			}
		case <-keepAlive.C:
			bw.WriteString(": keep-alive\n\n")
			if err := flush(); err != nil {
				return err
			}
			keepAlive.Reset(o.KeepAlive)
		}
	}
}

func writeReset(bw *bufio.Writer, seq uint64, now time.Time, msg string) {
	line, _ := json.Marshal(Event{Seq: seq, Time: now.UTC(), Type: Reset, Message: msg})
	bw.WriteString("id: ")
	bw.WriteString(strconv.FormatUint(seq, 10))
	bw.WriteString("\ndata: ")
	bw.Write(line)
	bw.WriteString("\n\n")
}

func (l *Log) isClosed() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.closed
}
