package api

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"
	"sync/atomic"
	"time"

	"vmhost/appvm"
	"vmhost/appvm/guest/proto"
)

// The guest operations (docs/api.md, Exec, Files, Signal): exec, files in
// and out, and a signal to the workload, each carried out by appvm over an
// operation connection to the guest agent. An interactive exec takes over
// the HTTP connection (101 Switching Protocols to vmhost-exec) and frames
// the process's input and output on it both ways: 1 byte type, 3 zero
// bytes, the payload's length as 4 bytes big-endian, the payload (at most
// proto.MaxPayload bytes); the types are proto's FrameStdin to
// FrameStdinClosed, which the guest agent speaks too.

// ExecUpgrade is the protocol an interactive exec upgrades to.
const ExecUpgrade = "vmhost-exec"

// execAppVM answers POST /api/appvm/vms/{id}/exec.
func (s *Server) execAppVM(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	var req appvm.ExecRequest
	if _, ok := s.decodeBody(w, r, MaxBodyBytes, &req); !ok {
		return
	}
	// The audit log names the command (its secret values redacted), never
	// its input or output.
	noteArgv(r, s.apps.RedactArgs(id, req.Command))
	upgrade := wantsUpgrade(r)
	switch {
	case req.Upgrade() && !upgrade:
		writeError(w, http.StatusBadRequest, CodeBadRequest, "interactive: an interactive exec (interactive or tty true) needs the headers Connection: Upgrade and Upgrade: "+ExecUpgrade)
		return
	case upgrade && !req.Upgrade():
		writeError(w, http.StatusBadRequest, CodeBadRequest, "interactive: the upgrade to "+ExecUpgrade+" is for an interactive exec: set interactive or tty")
		return
	}
	if _, err := s.apps.Get(id); err != nil {
		writeError(w, http.StatusNotFound, CodeNotFound, "no AppVM has this id")
		return
	}
	if upgrade {
		s.execInteractive(w, r, id, &req)
		return
	}
	ctx, cancel := s.streamContext(r)
	defer cancel()
	res, err := s.apps.Exec(ctx, id, &req)
	if err != nil {
		if r.Context().Err() != nil {
			return // the client went away: its process was killed
		}
		if s.streamsCtx.Err() != nil {
			writeError(w, http.StatusInternalServerError, CodeInternal, "the agent is shutting down: the exec was ended")
			return
		}
		s.fail(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, res)
}

// streamContext is r's context, ended also by CloseStreams (the agent's
// shutdown), for requests that may last long.
func (s *Server) streamContext(r *http.Request) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithCancel(r.Context())
	stop := context.AfterFunc(s.streamsCtx, cancel)
	return ctx, func() { stop(); cancel() }
}

// wantsUpgrade reports whether r asks to upgrade to vmhost-exec
// (Connection: Upgrade and Upgrade: vmhost-exec, in any case).
func wantsUpgrade(r *http.Request) bool {
	return headerHasToken(r.Header, "Connection", "upgrade") && headerHasToken(r.Header, "Upgrade", ExecUpgrade)
}

func headerHasToken(h http.Header, name, token string) bool {
	for _, v := range h.Values(name) {
		for _, t := range strings.Split(v, ",") {
			if strings.EqualFold(strings.TrimSpace(t), token) {
				return true
			}
		}
	}
	return false
}

// execInteractive starts the exec, then answers 101 and relays frames
// until the process ends (the exit frame, then the connection closes), the
// client goes away or breaks the framing (the process is killed), or the
// agent shuts down.
func (s *Server) execInteractive(w http.ResponseWriter, r *http.Request, id string, req *appvm.ExecRequest) {
	sess, err := s.apps.StartExec(r.Context(), id, req)
	if err != nil {
		s.fail(w, r, err)
		return
	}
	defer sess.Close()
	conn, brw, err := http.NewResponseController(w).Hijack()
	if err != nil {
		s.fail(w, r, fmt.Errorf("taking over the connection for an interactive exec: %w", err))
		return
	}
	defer conn.Close()
	noteStatus(r, http.StatusSwitchingProtocols)
	// A session may last the exec's whole timeout: none of the server's
	// deadlines (the body's read deadline among them) applies to it.
	conn.SetDeadline(time.Time{})
	stop := context.AfterFunc(s.streamsCtx, func() { conn.Close(); sess.Close() })
	defer stop()
	if _, err := io.WriteString(conn, "HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: "+ExecUpgrade+"\r\n\r\n"); err != nil {
		return
	}
	var rw io.ReadWriter = conn
	if brw.Reader.Buffered() > 0 {
		// Frames the client sent right behind its request.
		rw = struct {
			io.Reader
			io.Writer
		}{brw.Reader, conn}
	}
	fc := proto.NewFrameConn(rw)
	inputDone := make(chan struct{})
	var ended atomic.Bool // the process ended: the input's end is ours
	go func() {
		defer close(inputDone)
		if err := relayInput(fc, sess); err != nil && !ended.Load() {
			s.log.Info("interactive exec: the client's side ended", "id", id, "err", err)
		}
		// The client is gone or broke the framing: the process is killed,
		// which ends Wait below.
		sess.Close()
	}()
	exit, err := sess.Wait(frameWriter{fc, proto.FrameStdout}, frameWriter{fc, proto.FrameStderr})
	if err == nil {
		err = fc.WriteJSON(proto.FrameExit, exit)
	}
	if err != nil {
		s.log.Info("interactive exec ended without an exit status", "id", id, "err", err)
	}
	ended.Store(true)
	conn.Close()
	<-inputDone
}

// errClientFrame is a frame the client may not send, or a malformed one.
var errClientFrame = errors.New("a frame the client may not send")

// relayInput passes the client's frames to the process until the client
// goes away (io.EOF), sends something invalid, or the process ends.
func relayInput(fc *proto.FrameConn, sess *appvm.ExecSession) error {
	stdinOpen := true
	for {
		t, p, err := fc.ReadFrame()
		if err != nil {
			return err
		}
		switch t {
		case proto.FrameStdin:
			if !stdinOpen {
				return fmt.Errorf("stdin after stdin closed: %w", errClientFrame)
			}
			if _, err := sess.Write(p); err != nil {
				return err
			}
		case proto.FrameStdinClosed:
			if stdinOpen {
				stdinOpen = false
				if err := sess.CloseStdin(); err != nil {
					return err
				}
			}
		case proto.FrameResize:
			var rs proto.Resize
			if err := proto.DecodeJSON(p, &rs); err != nil {
				return fmt.Errorf("resize: %v: %w", err, errClientFrame)
			}
			if err := sess.Resize(rs.Cols, rs.Rows); err != nil {
				return err
			}
		default:
			return fmt.Errorf("type %d: %w", t, errClientFrame)
		}
	}
}

// frameWriter writes output as frames of type t, split at
// proto.MaxPayload.
type frameWriter struct {
	fc *proto.FrameConn
	t  proto.FrameType
}

func (f frameWriter) Write(p []byte) (int, error) {
	n := 0
	for len(p) > 0 {
		chunk := p[:min(len(p), proto.MaxPayload)]
		if err := f.fc.WriteFrame(f.t, chunk); err != nil {
			return n, err
		}
		n += len(chunk)
		p = p[len(chunk):]
	}
	return n, nil
}

// getFiles answers GET /api/appvm/vms/{id}/files?path=…: the archive as
// the guest sends it. A failure after the first bytes cuts the answer
// (the connection is aborted), so a client never takes a truncated
// archive for a whole one.
func (s *Server) getFiles(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	if _, err := s.apps.Get(id); err != nil {
		writeError(w, http.StatusNotFound, CodeNotFound, "no AppVM has this id")
		return
	}
	ctx, cancel := s.streamContext(r)
	defer cancel()
	tw := &tarAnswer{w: w}
	err := s.apps.GetFiles(ctx, id, r.URL.Query().Get("path"), tw)
	switch {
	case err != nil && tw.started:
		s.log.Warn("copying files out of an AppVM failed midway; the answer is cut", "id", id, "err", err)
		panic(http.ErrAbortHandler)
	case err != nil:
		s.fail(w, r, err)
	case !tw.started:
		tw.start()
	}
}

// tarAnswer answers 200 application/x-tar at the first byte.
type tarAnswer struct {
	w       http.ResponseWriter
	started bool
}

func (t *tarAnswer) start() {
	t.started = true
	t.w.Header().Set("Content-Type", "application/x-tar")
	t.w.WriteHeader(http.StatusOK)
}

func (t *tarAnswer) Write(p []byte) (int, error) {
	if !t.started {
		t.start()
	}
	return t.w.Write(p)
}

// putFiles answers PUT /api/appvm/vms/{id}/files?path=…: 204 once the
// archive is extracted. The body may be large: it must keep coming (no
// pause longer than the body read timeout), but has no overall deadline.
func (s *Server) putFiles(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	if _, err := s.apps.Get(id); err != nil {
		writeError(w, http.StatusNotFound, CodeNotFound, "no AppVM has this id")
		return
	}
	if max := s.vms.Config().GuestFileMaxBytes; r.ContentLength > max {
		w.Header().Set("Connection", "close")
		writeError(w, http.StatusBadRequest, CodeBadRequest, fmt.Sprintf("the archive exceeds %d bytes (guest_file_max_bytes)", max))
		return
	}
	ctx, cancel := s.streamContext(r)
	defer cancel()
	body := &idleBody{r: r.Body, rc: http.NewResponseController(w), idle: s.bodyTimeout}
	err := s.apps.PutFiles(ctx, id, r.URL.Query().Get("path"), body)
	body.done()
	if err != nil {
		if body.n > 0 {
			// The rest of a refused body is not worth reading.
			w.Header().Set("Connection", "close")
		}
		if errors.Is(err, os.ErrDeadlineExceeded) || body.timedOut {
			writeError(w, http.StatusBadRequest, CodeBadRequest, fmt.Sprintf("body: nothing received for %v", s.bodyTimeout))
			return
		}
		s.fail(w, r, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// idleBody reads a request body with a deadline that moves with each read:
// a client may take as long as it needs, but not pause longer than idle.
type idleBody struct {
	r        io.Reader
	rc       *http.ResponseController
	idle     time.Duration
	n        int64
	timedOut bool
}

func (b *idleBody) Read(p []byte) (int, error) {
	b.rc.SetReadDeadline(time.Now().Add(b.idle))
	n, err := b.r.Read(p)
	b.n += int64(n)
	if errors.Is(err, os.ErrDeadlineExceeded) {
		b.timedOut = true
	}
	return n, err
}

// done lifts the deadline once the body is in.
func (b *idleBody) done() {
	if !b.timedOut {
		b.rc.SetReadDeadline(time.Time{})
	}
}

// signalRequest is the body of POST /api/appvm/vms/{id}/signal: a name
// ("SIGHUP", "HUP") or a number 1..64.
type signalRequest struct {
	Signal json.RawMessage `json:"signal" decode:"required"`
}

// signalAppVM answers POST /api/appvm/vms/{id}/signal.
func (s *Server) signalAppVM(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	var req signalRequest
	if _, ok := s.decodeBody(w, r, MaxBodyBytes, &req); !ok {
		return
	}
	var name string
	var num json.Number
	switch {
	case json.Unmarshal(req.Signal, &name) == nil:
	case json.Unmarshal(req.Signal, &num) == nil && !strings.ContainsAny(string(num), ".eE"):
		name = string(num)
	default:
		writeDecodeError(w, &DecodeError{Path: "signal", Msg: "expected a signal name (string) or number (integer)"})
		return
	}
	sig, err := appvm.ParseSignal("signal", name)
	if err != nil {
		s.fail(w, r, err)
		return
	}
	if _, err := s.apps.Get(id); err != nil {
		writeError(w, http.StatusNotFound, CodeNotFound, "no AppVM has this id")
		return
	}
	if err := s.apps.Signal(r.Context(), id, sig); err != nil {
		s.fail(w, r, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}
