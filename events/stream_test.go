package events

import (
	"bufio"
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// sseEvent is one parsed Server-Sent Event, or a comment.
type sseEvent struct {
	id      string
	data    Event
	comment string
}

// readSSE parses the stream until n events (comments not counted) or the
// body ends.
func readSSE(t *testing.T, sc *bufio.Scanner, n int) []sseEvent {
	t.Helper()
	var out []sseEvent
	var cur sseEvent
	have, events := false, 0
	for events < n && sc.Scan() {
		line := sc.Text()
		switch {
		case line == "":
			if have {
				out = append(out, cur)
				if cur.comment == "" {
					events++
				}
			}
			cur, have = sseEvent{}, false
		case strings.HasPrefix(line, ": "):
			cur.comment, have = line[2:], true
		case strings.HasPrefix(line, "id: "):
			cur.id, have = line[4:], true
		case strings.HasPrefix(line, "data: "):
			if err := json.Unmarshal([]byte(line[6:]), &cur.data); err != nil {
				t.Fatalf("data line %q: %v", line, err)
			}
			have = true
		default:
			t.Fatalf("unexpected line %q", line)
		}
	}
	return out
}

func serve(t *testing.T, l *Log, o StreamOptions) *bufio.Scanner {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		l.Stream(r.Context(), w, o)
	}))
	t.Cleanup(srv.Close)
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	req, _ := http.NewRequestWithContext(ctx, "GET", srv.URL, nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { resp.Body.Close() })
	if ct := resp.Header.Get("Content-Type"); ct != "text/event-stream" {
		t.Fatalf("Content-Type %q", ct)
	}
	return bufio.NewScanner(resp.Body)
}

// TestStreamResumeAndFilter: a stream resumed after seq 2 gets events 3..
// of its VM only, each with id equal to its seq, and then live ones.
func TestStreamResumeAndFilter(t *testing.T) {
	l := open(t, t.TempDir(), 100)
	for i := range 6 {
		l.Publish(Event{Type: StateChanged, VMID: []string{"a", "b"}[i%2], State: "running"})
	}
	waitDurable(t, l, 6)
	sc := serve(t, l, StreamOptions{Since: 2, FromStart: true, VMID: "a"})
	got := readSSE(t, sc, 2)
	if len(got) != 2 || got[0].data.Seq != 3 || got[1].data.Seq != 5 {
		t.Fatalf("resumed from 2 for vm a: %+v", got)
	}
	for _, e := range got {
		if e.id != strconv.FormatUint(e.data.Seq, 10) || e.data.VMID != "a" {
			t.Fatalf("event %+v", e)
		}
	}
	l.Publish(Event{Type: Deleted, VMID: "b"})
	l.Publish(Event{Type: Deleted, VMID: "a"})
	got = readSSE(t, sc, 1)
	if len(got) != 1 || got[0].data.Seq != 8 || got[0].data.Type != Deleted {
		t.Fatalf("live event: %+v", got)
	}
}

// TestStreamFromNow: without a resume point the stream shows only events
// published after it started.
func TestStreamFromNow(t *testing.T) {
	l := open(t, t.TempDir(), 100)
	l.Publish(Event{Type: Created, VMID: "old"})
	waitDurable(t, l, 1)
	sc := serve(t, l, StreamOptions{})
	l.Publish(Event{Type: Created, VMID: "new"})
	got := readSSE(t, sc, 1)
	if len(got) != 1 || got[0].data.VMID != "new" {
		t.Fatalf("stream from now: %+v", got)
	}
}

// TestStreamResetForLostResumePoint: a resume point older than what is kept
// answers a reset first, whose id is the newest seq, then live events.
func TestStreamResetForLostResumePoint(t *testing.T) {
	l := open(t, t.TempDir(), 5)
	for range 17 {
		l.Publish(Event{Type: Created, VMID: "x"})
	}
	waitDurable(t, l, 17)
	sc := serve(t, l, StreamOptions{Since: 1, FromStart: true})
	l.Publish(Event{Type: Deleted, VMID: "x"})
	got := readSSE(t, sc, 2)
	if len(got) != 2 || got[0].data.Type != Reset || got[0].id != "17" || got[0].data.Message == "" {
		t.Fatalf("want a reset with id 17 first: %+v", got)
	}
	if got[1].data.Seq != 18 {
		t.Fatalf("after the reset: %+v", got[1])
	}
}

// TestStreamKeepAlive: an idle stream sends keep-alive comments.
func TestStreamKeepAlive(t *testing.T) {
	l := open(t, t.TempDir(), 100)
	sc := serve(t, l, StreamOptions{KeepAlive: 20 * time.Millisecond})
	got := readSSE(t, sc, 0)
	for len(got) < 2 && sc.Scan() {
		if line := sc.Text(); line != "" {
			got = append(got, sseEvent{comment: line})
		}
	}
	if len(got) != 2 || got[0].comment != ": keep-alive" || got[1].comment != ": keep-alive" {
		t.Fatalf("idle stream sent %+v, want two keep-alive comments", got)
	}
}

// stallWriter is a ResponseWriter whose writes block until released: a
// client that reads nothing.
type stallWriter struct {
	h       http.Header
	release chan struct{}
	once    sync.Once
	mu      sync.Mutex
	buf     strings.Builder
	blocked chan struct{}
}

func (w *stallWriter) Header() http.Header { return w.h }
func (w *stallWriter) WriteHeader(int)     {}
func (w *stallWriter) Write(p []byte) (int, error) {
	w.once.Do(func() { close(w.blocked) })
	<-w.release
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.buf.Write(p)
}
func (w *stallWriter) Flush() {}

// TestSlowClientNeverBlocksAndIsReset: while a client reads nothing, 40
// events are published without waiting for it (Keep 5); once it reads
// again it gets a reset and its stream ends.
func TestSlowClientNeverBlocksAndIsReset(t *testing.T) {
	l := open(t, t.TempDir(), 5)
	w := &stallWriter{h: http.Header{}, release: make(chan struct{}), blocked: make(chan struct{})}
	done := make(chan error, 1)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	l.Publish(Event{Type: Created, VMID: "a"})
	waitDurable(t, l, 1)
	go func() { done <- l.Stream(ctx, w, StreamOptions{FromStart: true}) }()
	<-w.blocked // the stream is stuck writing event 1
	published := make(chan struct{})
	go func() {
		for range 40 {
			l.Publish(Event{Type: StateChanged, VMID: "a", State: "running"})
		}
		close(published)
	}()
	select {
	case <-published:
	case <-time.After(5 * time.Second):
		t.Fatal("publishing blocked on a client that reads nothing")
	}
	waitDurable(t, l, 41)
	close(w.release)
	select {
	case err := <-done:
		if err == nil {
			t.Fatal("a client that fell behind was not cut")
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the stream of a client that fell behind did not end")
	}
	w.mu.Lock()
	out := w.buf.String()
	w.mu.Unlock()
	if !strings.Contains(out, `"type":"reset"`) || !strings.Contains(out, "id: 41\n") {
		t.Fatalf("no reset naming seq 41 in what the slow client got:\n%s", out)
	}
}
