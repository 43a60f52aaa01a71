package qmp

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"strings"
	"testing"
	"time"
)

const greetingLine = `{"QMP": {"version": {"qemu": {"micro": 22, "minor": 2, "major": 7}, "package": "Debian"}, "capabilities": ["oob"]}}` + "\r\n"

// scriptedServer runs fn on the server end of a pipe after sending the
// greeting and answering qmp_capabilities. fn reads commands with next and
// writes raw lines with send.
func scriptedServer(t *testing.T, fn func(next func() map[string]any, send func(string))) *Client {
	t.Helper()
	cli, srv := net.Pipe()
	go func() {
		defer srv.Close()
		r := bufio.NewReader(srv)
		send := func(s string) { srv.Write([]byte(s)) }
		next := func() map[string]any {
			line, err := r.ReadBytes('\n')
			if err != nil {
				return nil
			}
			var m map[string]any
			if err := json.Unmarshal(line, &m); err != nil {
				return map[string]any{"bad": string(line)}
			}
			return m
		}
		send(greetingLine)
		caps := next()
		if caps == nil || caps["execute"] != "qmp_capabilities" {
			return
		}
		send(fmt.Sprintf(`{"return": {}, "id": %q}`+"\r\n", caps["id"]))
		fn(next, send)
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	c, err := New(ctx, cli)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func TestClientRouting(t *testing.T) {
	big := strings.Repeat("x", 200<<10) // beyond bufio.Scanner's 64 KiB cap
	c := scriptedServer(t, func(next func() map[string]any, send func(string)) {
		// Both commands in, whichever order they came: the event first,
		// then the answers, the version's (long) before the error.
		a, b := next(), next()
		if a["execute"] == "query-version" {
			a, b = b, a
		}
		send(`{"timestamp": {"seconds": 1700000000, "microseconds": 5}, "event": "BLOCK_EXPORT_DELETED", "data": {"id": "e1"}}` + "\r\n")
		send(fmt.Sprintf(`{"return": {"package": %q}, "id": %q}`+"\r\n", big, b["id"]))
		send(fmt.Sprintf(`{"error": {"class": "CommandNotFound", "desc": "The command %s has not been found"}, "id": %q}`+"\r\n", a["execute"], a["id"]))
		next() // a third command never answered: EOF must fail it
	})
	if c.Greeting().Version.QEMU.Major != 7 || c.Greeting().Capabilities[0] != "oob" {
		t.Errorf("greeting = %+v", c.Greeting())
	}
	ctx := context.Background()
	errc := make(chan error, 1)
	go func() { errc <- c.Execute(ctx, "no-such-command", nil, nil) }()
	v, err := c.QueryVersion(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if v.Package != big {
		t.Errorf("long return truncated to %d bytes", len(v.Package))
	}
	err = <-errc
	var qe *Error
	if !errors.As(err, &qe) || qe.Class != "CommandNotFound" || !strings.Contains(qe.Desc, "no-such-command") {
		t.Errorf("error = %v, want a *Error of class CommandNotFound", err)
	}
	ev := <-c.Events()
	if ev.Name != "BLOCK_EXPORT_DELETED" || string(ev.Data) != `{"id": "e1"}` || ev.Time.Unix() != 1700000000 {
		t.Errorf("event = %+v", ev)
	}
	err = c.Execute(ctx, "query-jobs", nil, nil)
	if !errors.Is(err, ErrClosed) {
		t.Errorf("call pending at EOF = %v, want ErrClosed", err)
	}
	if _, ok := <-c.Events(); ok {
		t.Error("Events still open after EOF")
	}
	if err := c.Execute(ctx, "query-jobs", nil, nil); !errors.Is(err, ErrClosed) {
		t.Errorf("call after EOF = %v, want ErrClosed", err)
	}
}

func TestClientContext(t *testing.T) {
	// The reply to the first command is held until the caller has given
	// up on it, however slow the machine: a reply racing the deadline
	// would test nothing.
	gaveUp := make(chan struct{})
	c := scriptedServer(t, func(next func() map[string]any, send func(string)) {
		first := next()
		<-gaveUp
		send(fmt.Sprintf(`{"return": {"late": true}, "id": %q}`+"\r\n", first["id"]))
		for cmd := next(); cmd != nil; cmd = next() {
			send(fmt.Sprintf(`{"return": {"late": false}, "id": %q}`+"\r\n", cmd["id"]))
		}
	})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Millisecond)
	defer cancel()
	if err := c.Execute(ctx, "query-version", nil, nil); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Execute past deadline = %v, want DeadlineExceeded", err)
	}
	close(gaveUp)
	// The late reply is dropped, not taken for the next command's.
	var got struct{ Late bool }
	if err := c.Execute(context.Background(), "query-version", nil, &got); err != nil {
		t.Fatalf("Execute after a late reply: %v (client: %v)", err, c.Err())
	}
	if got.Late {
		t.Error("the next command got the late reply of the one given up on")
	}
}

func TestNewRejectsNonQMP(t *testing.T) {
	cli, srv := net.Pipe()
	go func() {
		srv.Write([]byte("HTTP/1.1 400 Bad Request\r\n"))
		srv.Close()
	}()
	if _, err := New(context.Background(), cli); err == nil {
		t.Fatal("New succeeded on a non-QMP peer")
	}
	cli2, srv2 := net.Pipe()
	defer srv2.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	if _, err := New(ctx, cli2); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("New with a silent peer = %v, want DeadlineExceeded", err)
	}
}

func TestParseMessage(t *testing.T) {
	for _, tc := range []struct {
		line string
		kind messageKind
	}{
		{greetingLine, kindGreeting},
		{`{"return": {}, "id": "1"}` + "\r\n", kindReturn},
		{`{"return": [], "id": "2"}`, kindReturn},
		{`{"error": {"class": "GenericError", "desc": "x"}}`, kindError},
		{`{"event": "JOB_STATUS_CHANGE", "data": {"id": "j", "status": "null"}, "timestamp": {"seconds": 1, "microseconds": 2}}`, kindEvent},
		{`{"hello": 1}`, 0},
		{`[1,2]`, 0},
		{`{"return": {}`, 0},
	} {
		_, kind, err := parseMessage([]byte(tc.line))
		if kind != tc.kind || (err == nil) != (tc.kind != 0) {
			t.Errorf("parseMessage(%q) = kind %d, err %v; want kind %d", tc.line, kind, err, tc.kind)
		}
	}
}

// FuzzParseMessage checks that any line either fails to parse or yields a
// message whose kind survives a round trip through JSON.
func FuzzParseMessage(f *testing.F) {
	f.Add([]byte(greetingLine))
	f.Add([]byte(`{"return": {"id": "x"}, "id": "7"}`))
	f.Add([]byte(`{"error": {"class": "GenericError", "desc": "Parameter 'size' is missing"}, "id": 3}`))
	f.Add([]byte(`{"timestamp": {"seconds": 1, "microseconds": 2}, "event": "BLOCK_EXPORT_DELETED", "data": {"id": "root"}}`))
	f.Add([]byte(`{"return": null}`))
	f.Fuzz(func(t *testing.T, line []byte) {
		m, kind, err := parseMessage(line)
		if err != nil {
			if m != nil || kind != 0 {
				t.Fatalf("error %v with message %+v kind %d", err, m, kind)
			}
			return
		}
		b, err := json.Marshal(m)
		if err != nil {
			t.Fatalf("re-encoding %+v: %v", m, err)
		}
		_, kind2, err := parseMessage(b)
		if err != nil || kind2 != kind {
			t.Fatalf("round trip of %q: kind %d → %d, err %v (re-encoded %s)", line, kind, kind2, err, b)
		}
	})
}
