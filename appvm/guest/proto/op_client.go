package proto

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"time"
)

// The host side of operation connections. Each function takes a fresh
// connection to the guest agent's OpPort (through Cloud Hypervisor's hybrid
// vsock: chclient.DialVsock(ctx, <vsock socket>, OpPort)) and uses it for
// one operation; closing it is the caller's job. A refusal or failure the
// guest reports is an *OpError; anything else is the transport's error or a
// protocol violation. Closing the connection mid-operation abandons it: the
// guest kills an exec'd process (and its process group) and discards a
// partial put.

// ErrNoExit reports a connection that ended before the exec's exit status.
var ErrNoExit = errors.New("the guest agent ended the exec without an exit status")

// ExecSession is the host end of one exec.
type ExecSession struct {
	c   net.Conn
	fc  *FrameConn
	pid int
}

// StartExec sends req on c and waits until the process runs. A refusal
// (unknown user, missing working directory, command not found, the guest
// still starting) is an *OpError.
func StartExec(c net.Conn, req *ExecRequest) (*ExecSession, error) {
	if err := req.Validate(); err != nil {
		return nil, err
	}
	fc := NewFrameConn(c)
	if err := fc.WriteJSON(FrameRequest, &Request{Exec: req}); err != nil {
		return nil, fmt.Errorf("sending the exec request: %w", err)
	}
	t, p, err := fc.ReadFrame()
	if err != nil {
		return nil, fmt.Errorf("waiting for the exec to start: %w", err)
	}
	switch t {
	case FrameStarted:
		var st ExecStarted
		if err := DecodeJSON(p, &st); err != nil {
			return nil, fmt.Errorf("decoding the exec start: %w", err)
		}
		return &ExecSession{c: c, fc: fc, pid: st.PID}, nil
	case FrameError:
		return nil, decodeOpError(p)
	}
	return nil, fmt.Errorf("waiting for the exec to start: unexpected frame type %d", t)
}

// PID is the process's pid in the guest.
func (s *ExecSession) PID() int { return s.pid }

// Write sends p as standard input, in frames of at most MaxPayload bytes.
// It blocks while the guest does not take input (back-pressure).
func (s *ExecSession) Write(p []byte) (int, error) {
	n := 0
	for len(p) > 0 {
		chunk := p[:min(len(p), MaxPayload)]
		if err := s.fc.WriteFrame(FrameStdin, chunk); err != nil {
			return n, err
		}
		n += len(chunk)
		p = p[len(chunk):]
	}
	return n, nil
}

// CloseStdin says that no more input follows.
func (s *ExecSession) CloseStdin() error { return s.fc.WriteFrame(FrameStdinClosed, nil) }

// Resize sets the terminal's size (with a TTY; the guest ignores it
// otherwise).
func (s *ExecSession) Resize(cols, rows int) error {
	if cols < 0 || cols > 0xffff || rows < 0 || rows > 0xffff {
		return fmt.Errorf("terminal size %dx%d out of 0..65535", cols, rows)
	}
	return s.fc.WriteJSON(FrameResize, &Resize{Cols: cols, Rows: rows})
}

// Wait writes the process's output to stdout and stderr as it arrives (a
// writer that blocks holds the guest back) and returns its exit status. An
// error from a writer ends Wait; the caller then closes the connection,
// which kills the process.
func (s *ExecSession) Wait(stdout, stderr io.Writer) (*ExecExit, error) {
	for {
		t, p, err := s.fc.ReadFrame()
		if err == io.EOF {
			return nil, ErrNoExit
		}
		if err != nil {
			return nil, err
		}
		switch t {
		case FrameStdout, FrameStderr:
			w := stdout
			if t == FrameStderr {
				w = stderr
			}
			if _, err := w.Write(p); err != nil {
				return nil, err
			}
		case FrameExit:
			var e ExecExit
			if err := DecodeJSON(p, &e); err != nil {
				return nil, fmt.Errorf("decoding the exit status: %w", err)
			}
			if err := e.Validate(); err != nil {
				return nil, err
			}
			return &e, nil
		case FrameError:
			return nil, decodeOpError(p)
		default:
			return nil, fmt.Errorf("exec: unexpected frame type %d", t)
		}
	}
}

// Exec runs req to its end: it copies stdin (nil: none) and then closes
// the input, and writes the output to stdout and stderr as Wait does.
// Cancelling ctx abandons the process.
func Exec(ctx context.Context, c net.Conn, req *ExecRequest, stdin io.Reader, stdout, stderr io.Writer) (*ExecExit, error) {
	defer bindContext(ctx, c)()
	s, err := StartExec(c, req)
	if err != nil {
		return nil, contextError(ctx, err)
	}
	go func() {
		if stdin != nil {
			if _, err := io.Copy(s, stdin); err != nil {
				return
			}
		}
		s.CloseStdin()
	}()
	exit, err := s.Wait(stdout, stderr)
	return exit, contextError(ctx, err)
}

// GetFiles writes the tar archive of path in the workload's root to w as it
// arrives. A missing path is an *OpError with code ErrNotFound, a secret
// file one with ErrBadRequest. An error after some of the archive was
// written leaves w with a truncated archive.
func GetFiles(ctx context.Context, c net.Conn, path string, w io.Writer) error {
	defer bindContext(ctx, c)()
	req := &Request{GetFiles: &GetFilesRequest{Path: path}}
	if err := req.Validate(); err != nil {
		return err
	}
	fc := NewFrameConn(c)
	if err := fc.WriteJSON(FrameRequest, req); err != nil {
		return contextError(ctx, fmt.Errorf("sending the request: %w", err))
	}
	for {
		t, p, err := fc.ReadFrame()
		if err == io.EOF {
			err = io.ErrUnexpectedEOF
		}
		if err != nil {
			return contextError(ctx, fmt.Errorf("receiving the archive: %w", err))
		}
		switch t {
		case FrameData:
			if _, err := w.Write(p); err != nil {
				return err
			}
		case FrameEnd:
			return nil
		case FrameError:
			return decodeOpError(p)
		default:
			return fmt.Errorf("receiving the archive: unexpected frame type %d", t)
		}
	}
}

// PutFiles sends the tar archive read from r to be extracted into the
// directory dir of the workload's root, with a cap of maxBytes. The guest
// checks every member (see TarChecker) and writes nothing unless the whole
// archive passes; a broken rule is an *OpError with code ErrBadRequest, a
// missing directory one with ErrNotFound.
func PutFiles(ctx context.Context, c net.Conn, dir string, maxBytes int64, r io.Reader) (*PutResult, error) {
	defer bindContext(ctx, c)()
	req := &Request{PutFiles: &PutFilesRequest{Path: dir, MaxBytes: maxBytes}}
	if err := req.Validate(); err != nil {
		return nil, err
	}
	fc := NewFrameConn(c)
	if err := fc.WriteJSON(FrameRequest, req); err != nil {
		return nil, contextError(ctx, fmt.Errorf("sending the request: %w", err))
	}
	type answer struct {
		res *PutResult
		err error
	}
	answers := make(chan answer, 1)
	go func() {
		t, p, err := fc.ReadFrame()
		switch {
		case err == io.EOF:
			err = io.ErrUnexpectedEOF
		case err != nil:
		case t == FrameDone:
			var res PutResult
			if err = DecodeJSON(p, &res); err == nil {
				answers <- answer{res: &res}
				return
			}
		case t == FrameError:
			err = decodeOpError(p)
		default:
			err = fmt.Errorf("unexpected frame type %d", t)
		}
		answers <- answer{err: err}
	}()
	sendErr := sendArchive(fc, r)
	if sendErr != nil {
		// The guest may have refused the archive and closed the
		// connection: its reason beats the broken pipe.
		select {
		case a := <-answers:
			if a.err != nil {
				return nil, contextError(ctx, a.err)
			}
		case <-time.After(5 * time.Second):
		}
		c.Close()
		return nil, contextError(ctx, sendErr)
	}
	a := <-answers
	return a.res, contextError(ctx, a.err)
}

// sendArchive copies r as FrameData frames and ends with FrameEnd.
func sendArchive(fc *FrameConn, r io.Reader) error {
	buf := make([]byte, MaxPayload)
	for {
		n, err := io.ReadFull(r, buf)
		if n > 0 {
			if werr := fc.WriteFrame(FrameData, buf[:n]); werr != nil {
				return werr
			}
		}
		if err == io.EOF || err == io.ErrUnexpectedEOF {
			return fc.WriteFrame(FrameEnd, nil)
		}
		if err != nil {
			return fmt.Errorf("reading the archive: %w", err)
		}
	}
}

// Signal delivers sig (1..64) to the workload. No running workload is an
// *OpError with code ErrInvalidState.
func Signal(ctx context.Context, c net.Conn, sig int) error {
	defer bindContext(ctx, c)()
	req := &Request{Signal: &SignalRequest{Signal: sig}}
	if err := req.Validate(); err != nil {
		return err
	}
	fc := NewFrameConn(c)
	if err := fc.WriteJSON(FrameRequest, req); err != nil {
		return contextError(ctx, fmt.Errorf("sending the request: %w", err))
	}
	t, p, err := fc.ReadFrame()
	if err != nil {
		return contextError(ctx, fmt.Errorf("waiting for the answer: %w", err))
	}
	switch t {
	case FrameDone:
		return nil
	case FrameError:
		return decodeOpError(p)
	}
	return fmt.Errorf("signal: unexpected frame type %d", t)
}

func decodeOpError(p []byte) error {
	var e OpError
	if err := DecodeJSON(p, &e); err != nil || e.Code == "" {
		return fmt.Errorf("decoding the guest's error %q: %v", p, err)
	}
	return &e
}

// bindContext makes ctx's end fail c's pending and future I/O; the
// returned function undoes it.
func bindContext(ctx context.Context, c net.Conn) func() {
	stop := context.AfterFunc(ctx, func() { c.SetDeadline(time.Unix(1, 0)) })
	return func() { stop() }
}

// contextError prefers ctx's error once it ended.
func contextError(ctx context.Context, err error) error {
	if err != nil && ctx.Err() != nil {
		return fmt.Errorf("%w (%w)", ctx.Err(), err)
	}
	return err
}
