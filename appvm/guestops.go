package appvm

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"os"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"vmhost/appvm/guest/proto"
	"vmhost/internal/redact"
	"vmhost/vm"
)

// The guest operations of docs/api.md (Exec, Files, Signal): each is one
// operation connection to the guest agent's proto.OpPort, dialled through
// the engine (GuestDialer), after the AppVM was found running with a guest
// agent of protocol version 3 or later connected. What the process prints
// is redacted (the VM's secret values become "[redacted]") before it
// reaches an answer; a file archive goes out as the guest made it (secret
// files left out) and comes in only after the host checked all of it
// (proto.CheckTar) on a spooled copy.

// GuestDialer connects the host to a vsock port of an AppVM's guest. The
// engine implements it, through Cloud Hypervisor's hybrid vsock socket,
// which the engine owns; closing the connection is the caller's job.
type GuestDialer interface {
	DialGuest(ctx context.Context, id string, port uint32) (net.Conn, error)
}

// Limits of the guest operations.
const (
	// MaxExecOutputBytes bounds each stream of a one-shot exec's answer.
	MaxExecOutputBytes = 1 << 20
	// DefaultExecTimeoutSecs is an exec's timeout_secs when none is given.
	DefaultExecTimeoutSecs = 60
	// MaxExecUserBytes bounds an exec's user.
	MaxExecUserBytes = 256
	// MaxGuestPathBytes bounds a files path.
	MaxGuestPathBytes = 4096
)

// execTimeoutSlack is how long past its timeout the host waits for the
// guest agent to report an exec's end (the agent kills the process at the
// timeout and forwards what is left of its output for up to 10 s).
const execTimeoutSlack = 30 * time.Second

// heldOutputWait is how long an interactive exec's output that may begin
// a secret value is held back waiting for the rest (see ExecSession.Wait).
const heldOutputWait = 100 * time.Millisecond

// RefusedError is a guest operation the guest agent (or the host's check
// of an archive) refused as invalid: an unknown user, a missing working
// directory, a command that cannot start, an archive member that breaks a
// rule, a secret file's path. The API answers 400 with its message.
type RefusedError struct{ Msg string }

// Error gives the reason.
func (e *RefusedError) Error() string { return e.Msg }

// guestNotFound is a path the guest does not have (404); it matches
// fs.ErrNotExist.
type guestNotFound struct{ msg string }

func (e *guestNotFound) Error() string        { return e.msg }
func (e *guestNotFound) Is(target error) bool { return target == fs.ErrNotExist }

// ExecRequest is the body of POST /api/appvm/vms/{id}/exec.
type ExecRequest struct {
	Command []string `json:"command" decode:"required"`
	// Env holds KEY=VALUE items added to the workload's environment.
	Env     []string `json:"env,omitempty"`
	User    string   `json:"user,omitempty"`
	Workdir string   `json:"workdir,omitempty"`
	// Stdin is the whole input of a one-shot exec.
	Stdin       string  `json:"stdin,omitempty"`
	TimeoutSecs *uint32 `json:"timeout_secs,omitempty"`
	TTY         bool    `json:"tty,omitempty"`
	Interactive bool    `json:"interactive,omitempty"`
	// Cols and Rows size the terminal (tty only); 0 means 80 × 24.
	Cols uint32 `json:"cols,omitempty"`
	Rows uint32 `json:"rows,omitempty"`
}

// Upgrade reports whether the request asks for an interactive exec (the
// framed connection of an HTTP upgrade).
func (r *ExecRequest) Upgrade() bool { return r.Interactive || r.TTY }

// Validate applies the field rules (400 *vm.FieldError).
func (r *ExecRequest) Validate() error {
	switch {
	case len(r.Command) == 0:
		return bad("command", "must hold at least the program to run")
	case len(r.Command) > MaxCommandEntries:
		return bad("command", "at most %d entries, got %d", MaxCommandEntries, len(r.Command))
	case r.Command[0] == "":
		return bad("command[0]", "must name the program to run")
	}
	for i, a := range r.Command {
		if strings.IndexByte(a, 0) >= 0 {
			return bad(fmt.Sprintf("command[%d]", i), "contains NUL")
		}
	}
	if err := checkEnv("env", r.Env, map[string]string{}); err != nil {
		return err
	}
	if len(r.User) > MaxExecUserBytes || strings.ContainsAny(r.User, "\x00\n\r") {
		return bad("user", "at most %d bytes, without NUL or line breaks", MaxExecUserBytes)
	}
	if r.Workdir != "" && r.Workdir != "/" {
		if err := checkGuestPath(r.Workdir); err != nil {
			return bad("workdir", "%v", err)
		}
	}
	if r.TimeoutSecs != nil && (*r.TimeoutSecs < 1 || *r.TimeoutSecs > proto.MaxExecTimeoutSecs) {
		return bad("timeout_secs", "must be 1..%d, got %d", proto.MaxExecTimeoutSecs, *r.TimeoutSecs)
	}
	if !r.TTY && (r.Cols != 0 || r.Rows != 0) {
		return bad("cols", "cols and rows size a terminal: give them with tty")
	}
	if r.Cols > 0xffff || r.Rows > 0xffff {
		return bad("cols", "cols and rows must be 0..65535")
	}
	if r.Upgrade() && r.Stdin != "" {
		return bad("stdin", "an interactive exec takes its input in stdin frames, not in the body")
	}
	return nil
}

func (r *ExecRequest) timeoutSecs() int {
	if r.TimeoutSecs == nil {
		return DefaultExecTimeoutSecs
	}
	return int(*r.TimeoutSecs)
}

func (r *ExecRequest) proto() *proto.ExecRequest {
	return &proto.ExecRequest{Command: r.Command, Env: r.Env, User: r.User, Workdir: r.Workdir,
		TTY: r.TTY, Cols: int(r.Cols), Rows: int(r.Rows), TimeoutSecs: r.timeoutSecs()}
}

// ExecExit is how an exec's process ended: exit_code is its exit status,
// or 128 + the signal that killed it (as a shell reports it), and signal
// names that signal (absent when it exited). It is the payload of an
// interactive exec's exit frame.
type ExecExit struct {
	ExitCode int `json:"exit_code"`
	Signal   int `json:"signal,omitempty"`
}

// ExecResult is the answer of a one-shot exec.
type ExecResult struct {
	ExitCode int `json:"exit_code"`
	Signal   int `json:"signal,omitempty"`
	// Stdout and Stderr are the process's output, redacted, each cut at
	// MaxExecOutputBytes; Truncated reports a cut.
	Stdout     string `json:"stdout"`
	Stderr     string `json:"stderr"`
	Truncated  bool   `json:"truncated"`
	DurationMS int64  `json:"duration_ms"`
}

func execExit(e *proto.ExecExit) ExecExit {
	if e.ExitCode != nil {
		return ExecExit{ExitCode: *e.ExitCode}
	}
	return ExecExit{ExitCode: 128 + e.Signal, Signal: e.Signal}
}

// RedactArgs returns args with the secret values of AppVM id redacted, for
// what is logged of a request (the audit log's argv); args as they are
// when there is no such AppVM.
func (s *Service) RedactArgs(id string, args []string) []string {
	rec, err := s.Get(id)
	if err != nil {
		return args
	}
	return rec.Secrets.Redactor().Strings(args)
}

// agentVersion returns the protocol version of the guest agent of AppVM
// id, 0 when none is connected.
func (g *Guests) agentVersion(id string) int {
	ss := g.get(id)
	if ss == nil {
		return 0
	}
	ss.mu.Lock()
	defer ss.mu.Unlock()
	if ss.nc == nil {
		return 0
	}
	return ss.version
}

// opReady finds AppVM id and checks that it can take a guest operation:
// running (409 otherwise), its guest agent connected and of protocol
// version 3 or later (409 saying which is missing).
func (s *Service) opReady(id, what string) (*vm.Record, error) {
	rec, err := s.Get(id)
	if err != nil {
		return nil, err
	}
	if rec.State != vm.StateRunning {
		return nil, &vm.StateError{Msg: fmt.Sprintf("%s AppVM %q: it is not running (state %s)", what, id, rec.DisplayState)}
	}
	switch v := s.guests.agentVersion(id); {
	case v == 0:
		return nil, &vm.StateError{Msg: fmt.Sprintf("%s AppVM %q: its guest agent is not connected (the AppVM is still booting, or its agent lost the connection)", what, id)}
	case v < proto.Version3:
		return nil, &vm.StateError{Msg: fmt.Sprintf("%s AppVM %q: its guest agent speaks protocol version %d and has no exec, files or signals (it was booted by an older vmhost); stop and start the AppVM to boot the current guest agent", what, id, v)}
	}
	return rec, nil
}

// dialOp opens an operation connection to AppVM rec's guest agent.
func (s *Service) dialOp(ctx context.Context, rec *vm.Record, what string) (net.Conn, error) {
	if s.dialer == nil {
		return nil, &vm.HostError{Kind: vm.HostInternal, Op: what + " AppVM " + rec.ID, Err: errors.New("this agent has no guest dialer")}
	}
	c, err := s.dialer.DialGuest(ctx, rec.ID, proto.OpPort)
	if err != nil {
		return nil, &vm.HostError{Kind: vm.HostHypervisor, Op: what + " AppVM " + rec.ID + ": connecting to its guest agent", Err: err}
	}
	return c, nil
}

// opError turns what a guest operation returned into the errors the API
// maps: the guest's refusals to 400, 404 and 409, the rest to 500.
func opError(ctx context.Context, what, id string, err error) error {
	var oe *proto.OpError
	if errors.As(err, &oe) {
		switch oe.Code {
		case proto.ErrBadRequest:
			return &RefusedError{Msg: oe.Message}
		case proto.ErrNotFound:
			return &guestNotFound{msg: oe.Message}
		case proto.ErrInvalidState:
			return &vm.StateError{Msg: fmt.Sprintf("%s AppVM %q: %s", what, id, oe.Message)}
		}
	}
	if ctx.Err() != nil {
		return fmt.Errorf("%s AppVM %q: %w", what, id, err)
	}
	return &vm.HostError{Kind: vm.HostInternal, Op: what + " AppVM " + id, Err: err}
}

// Exec runs a one-shot exec (req not interactive) in AppVM id to its end
// and returns its result. Cancelling ctx (the client went away) kills the
// process.
func (s *Service) Exec(ctx context.Context, id string, req *ExecRequest) (*ExecResult, error) {
	if err := req.Validate(); err != nil {
		return nil, err
	}
	if req.Upgrade() {
		return nil, bad("interactive", "an interactive exec needs the upgrade (Connection: Upgrade, Upgrade: vmhost-exec)")
	}
	rec, err := s.opReady(id, "exec in")
	if err != nil {
		return nil, err
	}
	timeout := time.Duration(req.timeoutSecs())*time.Second + execTimeoutSlack
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	c, err := s.dialOp(ctx, rec, "exec in")
	if err != nil {
		return nil, err
	}
	defer c.Close()
	red := rec.Secrets.Redactor()
	var stdout, stderr capped
	outs, errs := red.NewStream(&stdout), red.NewStream(&stderr)
	var stdin io.Reader
	if req.Stdin != "" {
		stdin = strings.NewReader(req.Stdin)
	}
	start := time.Now()
	exit, err := proto.Exec(ctx, c, req.proto(), stdin, outs, errs)
	if err != nil {
		return nil, opError(ctx, "exec in", id, err)
	}
	outs.Flush()
	errs.Flush()
	e := execExit(exit)
	return &ExecResult{ExitCode: e.ExitCode, Signal: e.Signal, Stdout: stdout.String(), Stderr: stderr.String(),
		Truncated: stdout.cut || stderr.cut, DurationMS: time.Since(start).Milliseconds()}, nil
}

// capped keeps the first MaxExecOutputBytes written to it and notes that
// more came; it never fails, so the process is never held back.
type capped struct {
	b   []byte
	cut bool
}

func (c *capped) Write(p []byte) (int, error) {
	room := MaxExecOutputBytes - len(c.b)
	if len(p) <= room {
		c.b = append(c.b, p...)
		return len(p), nil
	}
	if !c.cut {
		c.cut = true
		keep := p[:room]
		// Cut before a character the cap splits, not inside it.
		for i := len(keep) - 1; i >= 0 && i >= len(keep)-utf8.UTFMax; i-- {
			if utf8.RuneStart(keep[i]) {
				if !utf8.FullRune(keep[i:]) {
					keep = keep[:i]
				}
				break
			}
		}
		c.b = append(c.b, keep...)
	}
	return len(p), nil
}

func (c *capped) String() string { return string(c.b) }

// ExecSession is an interactive exec whose process runs: the caller feeds
// its input (Write, CloseStdin, Resize), copies its output (Wait) and
// closes it, which kills a process that still runs.
type ExecSession struct {
	c     net.Conn
	s     *proto.ExecSession
	red   *redact.Set
	close sync.Once
}

// StartExec starts an interactive exec (req.Upgrade) in AppVM id. A
// refusal (the AppVM's state, the guest's: an unknown user, a command
// that cannot start) comes back here, before the caller answers 101. The
// session does not end with ctx: Close ends it.
func (s *Service) StartExec(ctx context.Context, id string, req *ExecRequest) (*ExecSession, error) {
	if err := req.Validate(); err != nil {
		return nil, err
	}
	if !req.Upgrade() {
		return nil, bad("interactive", "the upgrade is for an interactive exec (interactive or tty true)")
	}
	rec, err := s.opReady(id, "exec in")
	if err != nil {
		return nil, err
	}
	c, err := s.dialOp(ctx, rec, "exec in")
	if err != nil {
		return nil, err
	}
	stop := context.AfterFunc(ctx, func() { c.SetDeadline(time.Unix(1, 0)) })
	ps, err := proto.StartExec(c, req.proto())
	if !stop() {
		err = errors.Join(err, ctx.Err())
	}
	if err != nil {
		c.Close()
		return nil, opError(ctx, "exec in", id, err)
	}
	return &ExecSession{c: c, s: ps, red: rec.Secrets.Redactor()}, nil
}

// Write sends p to the process's input; it blocks while the process does
// not read it.
func (x *ExecSession) Write(p []byte) (int, error) { return x.s.Write(p) }

// CloseStdin ends the process's input.
func (x *ExecSession) CloseStdin() error { return x.s.CloseStdin() }

// Resize sets the terminal's size.
func (x *ExecSession) Resize(cols, rows int) error { return x.s.Resize(cols, rows) }

// Wait copies the process's output, redacted, to stdout and stderr as it
// comes (a writer that blocks holds the process back) and returns how it
// ended. Output that may begin a secret value is held back until the next
// output shows, or for heldOutputWait: an interactive stream must not
// stall on it, so a value typed at a terminal slower than that is echoed
// as typed. Writes to stdout and stderr never overlap.
func (x *ExecSession) Wait(stdout, stderr io.Writer) (*ExecExit, error) {
	var mu sync.Mutex
	outs := newHeldStream(x.red, stdout, &mu)
	errs := newHeldStream(x.red, stderr, &mu)
	exit, err := x.s.Wait(outs, errs)
	// Whatever is held goes out before the exit status.
	outs.end()
	errs.end()
	if err != nil {
		return nil, err
	}
	e := execExit(exit)
	return &e, nil
}

// Close ends the session: a process that still runs is killed by the
// guest agent (with its process group and descendants).
func (x *ExecSession) Close() error {
	var err error
	x.close.Do(func() { err = x.c.Close() })
	return err
}

// heldStream is a redacted output stream that lets held-back output go
// after heldOutputWait.
type heldStream struct {
	mu    *sync.Mutex
	st    *redact.Stream
	timer *time.Timer
	ended bool
}

func newHeldStream(red *redact.Set, w io.Writer, mu *sync.Mutex) *heldStream {
	h := &heldStream{mu: mu, st: red.NewStream(w)}
	h.timer = time.AfterFunc(time.Hour, h.flush)
	h.timer.Stop()
	return h
}

func (h *heldStream) Write(p []byte) (int, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	n, err := h.st.Write(p)
	if h.st.Held() > 0 {
		h.timer.Reset(heldOutputWait)
	}
	return n, err
}

func (h *heldStream) flush() {
	h.mu.Lock()
	defer h.mu.Unlock()
	if !h.ended {
		h.st.Flush()
	}
}

// end writes what is held; nothing is written after it.
func (h *heldStream) end() {
	h.timer.Stop()
	h.mu.Lock()
	defer h.mu.Unlock()
	if !h.ended {
		h.ended = true
		h.st.Flush()
	}
}

// checkFilesPath applies the rule of a files path: absolute, clean,
// without control characters, "/" allowed.
func checkFilesPath(p string) error {
	switch {
	case p == "":
		return bad("path", "the query parameter path is required")
	case len(p) > MaxGuestPathBytes:
		return bad("path", "at most %d bytes", MaxGuestPathBytes)
	case p == "/":
		return nil
	case !utf8.ValidString(p):
		return bad("path", "must be UTF-8 text")
	}
	if err := (&proto.Request{GetFiles: &proto.GetFilesRequest{Path: p}}).Validate(); err != nil {
		return bad("path", "must be an absolute, clean path without control characters")
	}
	return nil
}

// GetFiles writes the tar archive of path in AppVM id's workload root to
// w as the guest sends it (members relative to the path's parent, owners
// as numbers, secret files left out). A missing path is an error matching
// fs.ErrNotExist and a secret file's path a *RefusedError, both before
// anything is written to w; an error after that leaves w with a cut
// archive.
func (s *Service) GetFiles(ctx context.Context, id, path string, w io.Writer) error {
	if err := checkFilesPath(path); err != nil {
		return err
	}
	rec, err := s.opReady(id, "reading files of")
	if err != nil {
		return err
	}
	c, err := s.dialOp(ctx, rec, "reading files of")
	if err != nil {
		return err
	}
	defer c.Close()
	if err := proto.GetFiles(ctx, c, path, w); err != nil {
		return opError(ctx, "reading files of", id, err)
	}
	return nil
}

// PutFiles extracts the tar archive read from body into the directory dir
// of AppVM id's workload root. The whole archive is first read into an
// unlinked spool file and checked (proto.CheckTar: no absolute names, no
// "..", no link leaving dir, no device node, at most guest_file_max_bytes
// in all); one that breaks a rule is a *RefusedError and nothing reaches
// the guest. The guest checks each member again and moves the extracted
// archive into place only once all of it passed. A missing dir is an
// error matching fs.ErrNotExist.
func (s *Service) PutFiles(ctx context.Context, id, dir string, body io.Reader) error {
	if err := checkFilesPath(dir); err != nil {
		return err
	}
	if _, err := s.opReady(id, "copying files into"); err != nil {
		return err
	}
	max := s.vms.Config().GuestFileMaxBytes
	f, err := s.spool()
	if err != nil {
		return &vm.HostError{Kind: vm.HostStorage, Op: "copying files into AppVM " + id + ": spooling the archive", Err: err}
	}
	defer f.Close()
	tee := &teeReader{r: body, w: f}
	if err := proto.CheckTar(tee, dir, max); err != nil {
		var oe *proto.OpError
		switch {
		case tee.werr != nil:
			return &vm.HostError{Kind: vm.HostStorage, Op: "copying files into AppVM " + id + ": spooling the archive", Err: tee.werr}
		case errors.As(err, &oe):
			return &RefusedError{Msg: oe.Message}
		}
		return &RefusedError{Msg: "body: reading the archive failed: " + err.Error()}
	}
	if _, err := f.Seek(0, io.SeekStart); err != nil {
		return &vm.HostError{Kind: vm.HostStorage, Op: "copying files into AppVM " + id, Err: err}
	}
	// The AppVM may have stopped while the archive came in.
	rec, err := s.opReady(id, "copying files into")
	if err != nil {
		return err
	}
	c, err := s.dialOp(ctx, rec, "copying files into")
	if err != nil {
		return err
	}
	defer c.Close()
	if _, err := proto.PutFiles(ctx, c, dir, max, f); err != nil {
		return opError(ctx, "copying files into", id, err)
	}
	return nil
}

// spool returns a new unlinked read-write file in the layout's SpoolDir.
// It is named as a temp file (atomicfile.IsTemp) for the moment it has a
// name: what an agent killed in that moment leaves, the startup sweep
// removes.
func (s *Service) spool() (*os.File, error) {
	dir := s.vms.Layout().SpoolDir()
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	f, err := os.CreateTemp(dir, ".put.tar.tmp-*")
	if err != nil {
		return nil, err
	}
	if err := os.Remove(f.Name()); err != nil {
		f.Close()
		return nil, err
	}
	return f, nil
}

// teeReader copies what is read from r to w; a write error ends the
// reading and is kept in werr.
type teeReader struct {
	r    io.Reader
	w    io.Writer
	werr error
}

func (t *teeReader) Read(p []byte) (int, error) {
	n, err := t.r.Read(p)
	if n > 0 {
		if _, werr := t.w.Write(p[:n]); werr != nil {
			t.werr = werr
			return n, werr
		}
	}
	return n, err
}

// Signal delivers sig (1..64) to the workload of AppVM id; no running
// workload is a *vm.StateError.
func (s *Service) Signal(ctx context.Context, id string, sig int) error {
	if sig < 1 || sig > 64 {
		return bad("signal", "must be 1..64, got %d", sig)
	}
	rec, err := s.opReady(id, "signalling the workload of")
	if err != nil {
		return err
	}
	c, err := s.dialOp(ctx, rec, "signalling the workload of")
	if err != nil {
		return err
	}
	defer c.Close()
	if err := proto.Signal(ctx, c, sig); err != nil {
		return opError(ctx, "signalling the workload of", id, err)
	}
	return nil
}
