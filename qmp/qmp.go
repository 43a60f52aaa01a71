// Package qmp is a client for the QEMU Machine Protocol as spoken by
// qemu-storage-daemon (QSD) 7.2, and the code that launches and controls
// one QSD per VM (LaunchQSD).
//
// A Client owns one connection to a QMP monitor. Dial connects to a unix
// socket; New builds a client on a connection the caller already has (tests
// pass one end of a net.Pipe or a fake). The client reads the greeting,
// negotiates capabilities, and then runs one reader goroutine that routes
// each line by its key: a "return" or "error" goes to the call whose id it
// echoes, an "event" goes to Events. Lines have no length limit. When the
// connection ends, every pending call fails with an error wrapping
// ErrClosed.
//
// Facts this package relies on (docs/ref/qsd-qmp-qcow2.md §2):
// messages end in \r\n, events may arrive before the return of the command
// that caused them, QSD has no SHUTDOWN event, and each monitor serves one
// client at a time, so keep one Client per QSD.
package qmp

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"vmhost/internal/nofollow"
)

// ErrClosed is wrapped by the errors of calls that could not complete
// because the connection ended or Close was called.
var ErrClosed = errors.New("qmp connection closed")

// eventBuffer is how many events Events holds for a slow reader before
// newer ones are dropped (and counted in DroppedEvents).
const eventBuffer = 256

// Error is an error reply from QEMU. Class is e.g. "GenericError",
// "CommandNotFound" or "DeviceNotFound"; Desc is QEMU's human-readable
// reason, the only place it says what went wrong (a missing image, a
// refused limit).
type Error struct {
	Class string `json:"class"`
	Desc  string `json:"desc"`
}

func (e *Error) Error() string { return e.Class + ": " + e.Desc }

// Event is an asynchronous QMP event.
type Event struct {
	Name string
	Data json.RawMessage // the "data" member, or nil
	Time time.Time       // QEMU's timestamp
}

// Greeting is what the server says first.
type Greeting struct {
	Version struct {
		QEMU struct {
			Major int `json:"major"`
			Minor int `json:"minor"`
			Micro int `json:"micro"`
		} `json:"qemu"`
		Package string `json:"package"`
	} `json:"version"`
	Capabilities []string `json:"capabilities"`
}

// message is one line from the server, by its keys.
type message struct {
	QMP       *Greeting       `json:"QMP,omitempty"`
	Return    json.RawMessage `json:"return,omitempty"`
	Error     *Error          `json:"error,omitempty"`
	Event     string          `json:"event,omitempty"`
	Data      json.RawMessage `json:"data,omitempty"`
	Timestamp *struct {
		Seconds      int64 `json:"seconds"`
		Microseconds int64 `json:"microseconds"`
	} `json:"timestamp,omitempty"`
	ID json.RawMessage `json:"id,omitempty"`
}

// messageKind says how a line is routed.
type messageKind int

const (
	kindGreeting messageKind = iota + 1
	kindReturn
	kindError
	kindEvent
)

// parseMessage decodes one server line and classifies it. A line that is
// not a JSON object, or holds none of the keys QMP defines, is an error.
func parseMessage(line []byte) (*message, messageKind, error) {
	line = bytes.TrimRight(line, "\r\n")
	var m message
	if err := json.Unmarshal(line, &m); err != nil {
		return nil, 0, fmt.Errorf("decoding qmp message %.200q: %w", line, err)
	}
	switch {
	case m.Error != nil:
		return &m, kindError, nil
	case m.Return != nil:
		return &m, kindReturn, nil
	case m.Event != "":
		return &m, kindEvent, nil
	case m.QMP != nil:
		return &m, kindGreeting, nil
	}
	return nil, 0, fmt.Errorf("qmp message %.200q has no return, error, event or QMP member", line)
}

// response is what a pending call receives.
type response struct {
	ret json.RawMessage
	err error
}

// Client is a connection to one QMP monitor. Its methods are safe for
// concurrent use; commands are written one at a time and their replies
// matched by id. Call Close when done.
type Client struct {
	conn     net.Conn
	greeting Greeting

	writeMu sync.Mutex

	mu       sync.Mutex
	pending  map[string]chan response
	watchers map[int]func(Event)
	nextW    int
	closeErr error // set once the reader stops
	nextID   atomic.Uint64

	events  chan Event
	dropped atomic.Uint64
	done    chan struct{}
}

// Dial connects to the QMP monitor at the unix socket path and negotiates
// capabilities. ctx bounds the connect and the handshake only.
func Dial(ctx context.Context, path string) (*Client, error) {
	// The socket is in a directory a confined VM owns: no link is followed.
	conn, err := nofollow.DialUnix(ctx, path)
	if err != nil {
		return nil, fmt.Errorf("dialing qmp socket %s: %w", path, err)
	}
	c, err := New(ctx, conn)
	if err != nil {
		return nil, fmt.Errorf("qmp handshake on %s: %w", path, err)
	}
	return c, nil
}

// New reads the greeting from conn, starts the reader and sends
// qmp_capabilities. ctx bounds the handshake. The client owns conn from
// then on: it is closed on failure, and by Close.
func New(ctx context.Context, conn net.Conn) (*Client, error) {
	r := bufio.NewReader(conn)
	greeting := make(chan error, 1)
	c := &Client{
		conn:     conn,
		pending:  map[string]chan response{},
		watchers: map[int]func(Event){},
		events:   make(chan Event, eventBuffer),
		done:     make(chan struct{}),
	}
	go func() {
		line, err := r.ReadBytes('\n')
		if err != nil {
			greeting <- fmt.Errorf("reading greeting: %w", err)
			return
		}
		m, kind, err := parseMessage(line)
		if err != nil {
			greeting <- err
			return
		}
		if kind != kindGreeting {
			greeting <- fmt.Errorf("first message is not a QMP greeting: %.200q", line)
			return
		}
		c.greeting = *m.QMP
		greeting <- nil
	}()
	select {
	case err := <-greeting:
		if err != nil {
			conn.Close()
			return nil, err
		}
	case <-ctx.Done():
		conn.Close()
		<-greeting
		return nil, fmt.Errorf("waiting for qmp greeting: %w", ctx.Err())
	}
	go c.read(r)
	if err := c.Execute(ctx, "qmp_capabilities", nil, nil); err != nil {
		conn.Close()
		<-c.done
		return nil, err
	}
	return c, nil
}

// Greeting returns the server's greeting.
func (c *Client) Greeting() Greeting { return c.greeting }

// Events delivers asynchronous events in arrival order. It is closed when
// the connection ends. If nobody reads it, events beyond a buffer of 256
// are dropped rather than stall command replies; DroppedEvents counts them.
func (c *Client) Events() <-chan Event { return c.events }

// DroppedEvents reports how many events were dropped because Events was full.
func (c *Client) DroppedEvents() uint64 { return c.dropped.Load() }

// Done is closed when the connection has ended.
func (c *Client) Done() <-chan struct{} { return c.done }

// Err reports why the connection ended, or nil while it is open.
func (c *Client) Err() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.closeErr
}

// Close closes the connection; pending calls fail with ErrClosed.
func (c *Client) Close() error {
	err := c.conn.Close()
	<-c.done
	if errors.Is(err, net.ErrClosed) {
		return nil
	}
	return err
}

// read is the one reader goroutine.
func (c *Client) read(r *bufio.Reader) {
	for {
		line, err := r.ReadBytes('\n')
		if len(bytes.TrimSpace(line)) > 0 && (err == nil || errors.Is(err, io.EOF)) {
			c.dispatch(line)
		}
		if err != nil {
			c.shutdown(err)
			return
		}
	}
}

// dispatch routes one line. Lines that do not parse, and replies whose id
// matches no call, are dropped: QMP never closes on bad input and neither
// do we.
func (c *Client) dispatch(line []byte) {
	m, kind, err := parseMessage(line)
	if err != nil {
		return
	}
	switch kind {
	case kindEvent:
		ev := Event{Name: m.Event, Data: m.Data}
		if m.Timestamp != nil {
			ev.Time = time.Unix(m.Timestamp.Seconds, m.Timestamp.Microseconds*1000)
		}
		c.mu.Lock()
		for _, w := range c.watchers {
			w(ev)
		}
		c.mu.Unlock()
		select {
		case c.events <- ev:
		default:
			c.dropped.Add(1)
		}
	case kindReturn, kindError:
		var id string
		if json.Unmarshal(m.ID, &id) != nil {
			return
		}
		c.mu.Lock()
		ch := c.pending[id]
		delete(c.pending, id)
		c.mu.Unlock()
		if ch == nil {
			return
		}
		if kind == kindError {
			ch <- response{err: m.Error}
		} else {
			ch <- response{ret: m.Return}
		}
	}
}

// shutdown fails every pending call and closes Events and Done.
func (c *Client) shutdown(cause error) {
	c.mu.Lock()
	if c.closeErr != nil {
		c.mu.Unlock()
		return
	}
	if errors.Is(cause, io.EOF) {
		cause = ErrClosed
	} else {
		cause = fmt.Errorf("%w: %w", ErrClosed, cause)
	}
	c.closeErr = cause
	pending := c.pending
	c.pending = nil
	c.mu.Unlock()
	c.conn.Close()
	for _, ch := range pending {
		ch <- response{err: cause}
	}
	close(c.events)
	close(c.done)
}

// watch calls fn, from the reader goroutine and under the client's lock,
// for every event until the returned func is called. fn must not block.
func (c *Client) watch(fn func(Event)) (stop func()) {
	c.mu.Lock()
	defer c.mu.Unlock()
	id := c.nextW
	c.nextW++
	c.watchers[id] = fn
	return func() {
		c.mu.Lock()
		delete(c.watchers, id)
		c.mu.Unlock()
	}
}

// command is what goes on the wire.
type command struct {
	Execute   string `json:"execute"`
	Arguments any    `json:"arguments,omitempty"`
	ID        string `json:"id"`
}

// Execute runs one command with the given arguments (nil for none) and
// decodes its return value into ret (nil to discard it). An error reply is
// a *Error, wrapped with the command name. If ctx ends first, Execute
// returns ctx's error; the command may still run.
func (c *Client) Execute(ctx context.Context, cmd string, args, ret any) error {
	return c.execute(ctx, cmd, args, ret, nil)
}

// GetFD hands f to QEMU under name (its getfd command, with f passed as
// SCM_RIGHTS ancillary data alongside it), for a later command to use as
// "fd:name" (a migration to a file). The connection must be a unix
// socket.
func (c *Client) GetFD(ctx context.Context, name string, f *os.File) error {
	return c.execute(ctx, "getfd", map[string]string{"fdname": name}, nil, f)
}

func (c *Client) execute(ctx context.Context, cmd string, args, ret any, f *os.File) error {
	var uc *net.UnixConn
	if f != nil {
		var ok bool
		if uc, ok = c.conn.(*net.UnixConn); !ok {
			return fmt.Errorf("qmp %s: passing a file needs a unix socket, not a %T", cmd, c.conn)
		}
	}
	id := strconv.FormatUint(c.nextID.Add(1), 10)
	b, err := json.Marshal(command{Execute: cmd, Arguments: args, ID: id})
	if err != nil {
		return fmt.Errorf("qmp %s: encoding arguments: %w", cmd, err)
	}
	b = append(b, '\n')
	ch := make(chan response, 1)
	c.mu.Lock()
	if c.pending == nil {
		err := c.closeErr
		c.mu.Unlock()
		return fmt.Errorf("qmp %s: %w", cmd, err)
	}
	c.pending[id] = ch
	c.mu.Unlock()
	forget := func() {
		c.mu.Lock()
		if c.pending != nil {
			delete(c.pending, id)
		}
		c.mu.Unlock()
	}

	c.writeMu.Lock()
	if dl, ok := ctx.Deadline(); ok {
		c.conn.SetWriteDeadline(dl)
	}
	if uc != nil {
		// The file goes with the command's first byte; QEMU keeps it for
		// the getfd that follows.
		var n int
		if n, _, err = uc.WriteMsgUnix(b, syscall.UnixRights(int(f.Fd())), nil); err == nil && n < len(b) {
			_, err = uc.Write(b[n:])
		}
	} else {
		_, err = c.conn.Write(b)
	}
	c.conn.SetWriteDeadline(time.Time{})
	c.writeMu.Unlock()
	if err != nil {
		forget()
		return fmt.Errorf("qmp %s: writing: %w", cmd, err)
	}

	select {
	case r := <-ch:
		if r.err != nil {
			return fmt.Errorf("qmp %s: %w", cmd, r.err)
		}
		if ret != nil {
			if err := json.Unmarshal(r.ret, ret); err != nil {
				return fmt.Errorf("qmp %s: decoding return %.200q: %w", cmd, r.ret, err)
			}
		}
		return nil
	case <-ctx.Done():
		forget()
		return fmt.Errorf("qmp %s: %w", cmd, ctx.Err())
	}
}
