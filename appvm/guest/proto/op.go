package proto

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
)

// OpPort is the vsock port a guest agent of version 3 or later listens on
// for operation connections (exec, files, signal), one connection per
// operation, dialled by the host.
const OpPort = 1025

// FrameType is the first byte of a frame on an operation connection.
type FrameType byte

// Frame types. 0 to 5 are those of the API's interactive exec and mean the
// same; the others exist only between host and guest.
const (
	// FrameStdin (host): bytes for the process's standard input (or the
	// terminal).
	FrameStdin FrameType = 0
	// FrameStdout (guest): output of the process (with a TTY, the terminal).
	FrameStdout FrameType = 1
	// FrameStderr (guest): standard error of a process without a TTY.
	FrameStderr FrameType = 2
	// FrameResize (host): JSON [Resize], the terminal's new size.
	FrameResize FrameType = 3
	// FrameExit (guest): JSON [ExecExit], the last frame of an exec.
	FrameExit FrameType = 4
	// FrameStdinClosed (host): no more input (without a TTY the process
	// reads end of file; with one the terminal's end-of-file character,
	// ^D, is typed).
	FrameStdinClosed FrameType = 5

	// FrameRequest (host): JSON [Request], the first frame of a connection.
	FrameRequest FrameType = 16
	// FrameStarted (guest): JSON [ExecStarted], the exec'd process runs.
	FrameStarted FrameType = 17
	// FrameError (guest): JSON [OpError], the operation failed or was
	// refused; the last frame.
	FrameError FrameType = 18
	// FrameData (both): a chunk of a tar archive.
	FrameData FrameType = 19
	// FrameEnd (both): the archive is complete (empty payload).
	FrameEnd FrameType = 20
	// FrameDone (guest): JSON result of a put or a signal; the last frame.
	FrameDone FrameType = 21
)

// FrameHeaderSize is the size of a frame header: the type, three zero
// bytes, and the payload length as a 4-byte big-endian number.
const FrameHeaderSize = 8

// MaxPayload is the largest frame payload either side sends or accepts.
const MaxPayload = 64 << 10

// MaxExecTimeoutSecs bounds ExecRequest.TimeoutSecs.
const MaxExecTimeoutSecs = 3600

// ErrMalformedFrame reports a frame header whose padding bytes are not zero.
var ErrMalformedFrame = errors.New("malformed frame header")

// FrameConn reads and writes frames on an operation connection.
// WriteFrame is safe for concurrent use; ReadFrame must be called from one
// goroutine at a time.
type FrameConn struct {
	rw   io.ReadWriter
	wmu  sync.Mutex
	rhdr [FrameHeaderSize]byte
	rbuf []byte
}

// NewFrameConn wraps rw. Closing rw is the caller's job.
func NewFrameConn(rw io.ReadWriter) *FrameConn { return &FrameConn{rw: rw} }

// WriteFrame writes one frame; a payload above MaxPayload is refused.
func (c *FrameConn) WriteFrame(t FrameType, payload []byte) error {
	if len(payload) > MaxPayload {
		return fmt.Errorf("frame type %d: %d bytes: %w", t, len(payload), ErrFrameTooLarge)
	}
	var hdr [FrameHeaderSize]byte
	hdr[0] = byte(t)
	binary.BigEndian.PutUint32(hdr[4:], uint32(len(payload)))
	c.wmu.Lock()
	defer c.wmu.Unlock()
	var err error
	if conn, ok := c.rw.(net.Conn); ok && len(payload) > 0 {
		// One writev: no copy of the payload, no interleaving.
		bufs := net.Buffers{hdr[:], payload}
		_, err = bufs.WriteTo(conn)
	} else {
		_, err = c.rw.Write(append(hdr[:], payload...))
	}
	return err
}

// WriteJSON writes v as the JSON payload of a frame of type t.
func (c *FrameConn) WriteJSON(t FrameType, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	return c.WriteFrame(t, b)
}

// ReadFrame reads one frame. The payload is valid until the next call. A
// clean end of stream before a frame is io.EOF; a stream cut inside one is
// io.ErrUnexpectedEOF.
func (c *FrameConn) ReadFrame() (FrameType, []byte, error) {
	if _, err := io.ReadFull(c.rw, c.rhdr[:]); err != nil {
		return 0, nil, err
	}
	if c.rhdr[1] != 0 || c.rhdr[2] != 0 || c.rhdr[3] != 0 {
		return 0, nil, ErrMalformedFrame
	}
	n := binary.BigEndian.Uint32(c.rhdr[4:])
	if n > MaxPayload {
		return 0, nil, fmt.Errorf("frame type %d: %d bytes: %w", c.rhdr[0], n, ErrFrameTooLarge)
	}
	if cap(c.rbuf) < int(n) {
		c.rbuf = make([]byte, n, max(n, 4096))
	}
	b := c.rbuf[:n]
	if _, err := io.ReadFull(c.rw, b); err != nil {
		if err == io.EOF {
			err = io.ErrUnexpectedEOF
		}
		return 0, nil, err
	}
	return FrameType(c.rhdr[0]), b, nil
}

// Request is the first frame of an operation connection: exactly one of
// its members is set.
type Request struct {
	Exec     *ExecRequest     `json:"exec,omitempty"`
	GetFiles *GetFilesRequest `json:"get_files,omitempty"`
	PutFiles *PutFilesRequest `json:"put_files,omitempty"`
	Signal   *SignalRequest   `json:"signal,omitempty"`
}

// ExecRequest runs a process beside the workload: in the workload's root
// (chrooted as the workload is), with its environment (secret variables
// included) plus Env, as its user and in its working directory unless
// User or Workdir say otherwise.
type ExecRequest struct {
	Command []string `json:"command"`
	// Env holds KEY=VALUE items added to (or replacing in) the workload's
	// environment.
	Env     []string `json:"env,omitempty"`
	User    string   `json:"user,omitempty"`
	Workdir string   `json:"workdir,omitempty"`
	// TTY gives the process a terminal (a pseudo-terminal whose slave is
	// its controlling terminal, stdin, stdout and stderr) of Cols × Rows
	// (0 means 80 × 24).
	TTY  bool `json:"tty,omitempty"`
	Cols int  `json:"cols,omitempty"`
	Rows int  `json:"rows,omitempty"`
	// TimeoutSecs (1..MaxExecTimeoutSecs) after the start the process
	// group is killed with SIGKILL.
	TimeoutSecs int `json:"timeout_secs"`
}

// GetFilesRequest asks for a tar archive of Path (absolute, in the
// workload's root).
type GetFilesRequest struct {
	Path string `json:"path"`
}

// PutFilesRequest extracts the tar archive that follows (FrameData,
// FrameEnd) into the directory Path of the workload's root; the archive
// may hold at most MaxBytes bytes.
type PutFilesRequest struct {
	Path     string `json:"path"`
	MaxBytes int64  `json:"max_bytes"`
}

// SignalRequest delivers Signal (1..64) to the workload's process.
type SignalRequest struct {
	Signal int `json:"signal"`
}

// Resize is the payload of FrameResize.
type Resize struct {
	Cols int `json:"cols"`
	Rows int `json:"rows"`
}

// ExecStarted is the payload of FrameStarted.
type ExecStarted struct {
	PID int `json:"pid"`
}

// ExecExit is the payload of FrameExit: exactly one of ExitCode and Signal.
type ExecExit struct {
	ExitCode *int `json:"exit_code,omitempty"`
	Signal   int  `json:"signal,omitempty"`
	// TimedOut reports that the timeout killed the process (Signal 9).
	TimedOut bool `json:"timed_out,omitempty"`
}

// PutResult is the payload of FrameDone after a put.
type PutResult struct {
	// Members counts the archive's entries, Bytes their contents.
	Members int   `json:"members"`
	Bytes   int64 `json:"bytes"`
}

// Error codes of OpError.
const (
	// ErrBadRequest: the request (or the archive) breaks a rule; the
	// message names what. The host answers 400.
	ErrBadRequest = "bad_request"
	// ErrNotFound: the path does not exist in the guest. 404.
	ErrNotFound = "not_found"
	// ErrInvalidState: the guest cannot do it now (still starting, no
	// workload runs). 409.
	ErrInvalidState = "invalid_state"
	// ErrInternal: the guest failed. 500.
	ErrInternal = "internal"
)

// OpError is the payload of FrameError, and the error the host-side
// functions return for it.
type OpError struct {
	Code    string `json:"code"`
	Message string `json:"message"`
}

func (e *OpError) Error() string { return e.Message }

// Validate checks that exactly one member is set and that it is valid.
func (r *Request) Validate() error {
	n := 0
	var err error
	if r.Exec != nil {
		n++
		err = r.Exec.Validate()
	}
	if r.GetFiles != nil {
		n++
		err = checkOpPath("get_files", r.GetFiles.Path, true)
	}
	if r.PutFiles != nil {
		n++
		err = checkOpPath("put_files", r.PutFiles.Path, true)
		if err == nil && r.PutFiles.MaxBytes <= 0 {
			err = fmt.Errorf("put_files: max_bytes %d is not positive", r.PutFiles.MaxBytes)
		}
	}
	if r.Signal != nil {
		n++
		if r.Signal.Signal < 1 || r.Signal.Signal > 64 {
			err = fmt.Errorf("signal: %d is not in 1..64", r.Signal.Signal)
		}
	}
	if n != 1 {
		return fmt.Errorf("request: %d operations, want exactly one", n)
	}
	return err
}

// Validate checks the command, environment, working directory, terminal
// size and timeout.
func (r *ExecRequest) Validate() error {
	if len(r.Command) == 0 || r.Command[0] == "" {
		return errors.New("exec: empty command")
	}
	for _, e := range r.Env {
		k, _, ok := strings.Cut(e, "=")
		if !ok || !ValidEnvKey(k) {
			return fmt.Errorf("exec: env entry with key %q is not KEY=VALUE", k)
		}
	}
	if r.Workdir != "" {
		if err := checkOpPath("exec: workdir", r.Workdir, true); err != nil {
			return err
		}
	}
	if r.Cols < 0 || r.Cols > 0xffff || r.Rows < 0 || r.Rows > 0xffff {
		return fmt.Errorf("exec: terminal size %dx%d out of 0..65535", r.Cols, r.Rows)
	}
	if r.TimeoutSecs < 1 || r.TimeoutSecs > MaxExecTimeoutSecs {
		return fmt.Errorf("exec: timeout_secs %d out of 1..%d", r.TimeoutSecs, MaxExecTimeoutSecs)
	}
	return nil
}

// Validate checks that exactly one of ExitCode and Signal is set.
func (e *ExecExit) Validate() error {
	if (e.ExitCode == nil) == (e.Signal == 0) {
		return errors.New("exec exit: want exactly one of exit_code and signal")
	}
	if e.Signal < 0 || e.ExitCode != nil && (*e.ExitCode < 0 || *e.ExitCode > 255) {
		return errors.New("exec exit: exit_code or signal out of range")
	}
	return nil
}

// checkOpPath accepts absolute paths without empty, . or .. segments;
// with root, "/" too.
func checkOpPath(field, p string, root bool) error {
	if root && p == "/" {
		return nil
	}
	return checkPath(field, p)
}

// DecodeRequest decodes the payload of a FrameRequest strictly (an unknown
// member, as a newer host's operation, is an error) and validates it.
func DecodeRequest(b []byte) (*Request, error) {
	var r Request
	if err := decodeStrict(b, &r); err != nil {
		return nil, fmt.Errorf("decoding the request: %w", err)
	}
	if err := r.Validate(); err != nil {
		return nil, err
	}
	return &r, nil
}

// DecodeJSON decodes a frame payload strictly into v.
func DecodeJSON(b []byte, v any) error { return decodeStrict(b, v) }
