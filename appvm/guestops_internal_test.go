package appvm

import (
	"bytes"
	"net"
	"strings"
	"sync"
	"testing"
	"time"
	"unicode/utf8"

	"vmhost/appvm/guest/proto"
	"vmhost/internal/redact"
)

// TestCappedCutsWholeCharacters: the cap keeps the first bytes and cuts
// before a character it would split.
func TestCappedCutsWholeCharacters(t *testing.T) {
	var c capped
	c.Write([]byte(strings.Repeat("a", MaxExecOutputBytes-1)))
	c.Write([]byte("é and more"))
	if len(c.b) != MaxExecOutputBytes-1 || !c.cut || !utf8.Valid(c.b) {
		t.Errorf("kept %d bytes, cut %v, valid %v", len(c.b), c.cut, utf8.Valid(c.b))
	}
	var d capped
	d.Write([]byte("short"))
	if d.String() != "short" || d.cut {
		t.Errorf("%q %v", d.String(), d.cut)
	}
}

// syncWriter records writes and signals each.
type syncWriter struct {
	mu    sync.Mutex
	b     bytes.Buffer
	wrote chan struct{}
}

func (w *syncWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	w.b.Write(p)
	w.mu.Unlock()
	select {
	case w.wrote <- struct{}{}:
	default:
	}
	return len(p), nil
}

func (w *syncWriter) String() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.String()
}

// TestExecSessionHoldsThenLets: an interactive exec's output that may
// begin a secret value is held back, and goes out by itself after a
// moment when nothing completes it; a value cut across frames is
// redacted.
func TestExecSessionHoldsThenLets(t *testing.T) {
	host, guest := net.Pipe()
	defer host.Close()
	red := redact.New("PLANTED-secret")
	out := &syncWriter{wrote: make(chan struct{}, 16)}
	guestDone := make(chan error, 1)
	go func() {
		fc := proto.NewFrameConn(guest)
		defer guest.Close()
		if _, _, err := fc.ReadFrame(); err != nil { // the request
			guestDone <- err
			return
		}
		fc.WriteJSON(proto.FrameStarted, proto.ExecStarted{PID: 7})
		fc.WriteFrame(proto.FrameStdout, []byte("a PLANTED-"))
		fc.WriteFrame(proto.FrameStdout, []byte("secret b\n$ PLANT"))
		// Nothing completes "PLANT": it must reach the client anyway.
		deadline := time.After(5 * time.Second)
		for !strings.HasSuffix(out.String(), "PLANT") {
			select {
			case <-out.wrote:
			case <-deadline:
				guestDone <- nil
				return
			}
		}
		code := 0
		fc.WriteJSON(proto.FrameExit, proto.ExecExit{ExitCode: &code})
		guestDone <- nil
	}()
	ps, err := proto.StartExec(host, &proto.ExecRequest{Command: []string{"sh"}, TTY: true, TimeoutSecs: 60})
	if err != nil {
		t.Fatal(err)
	}
	x := &ExecSession{c: host, s: ps, red: red}
	exit, err := x.Wait(out, out)
	if err != nil {
		t.Fatalf("Wait: %v (output %q)", err, out.String())
	}
	if exit.ExitCode != 0 || out.String() != "a [redacted] b\n$ PLANT" {
		t.Errorf("exit %+v, output %q", exit, out.String())
	}
	if err := <-guestDone; err != nil {
		t.Fatal(err)
	}
}
