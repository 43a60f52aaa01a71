package chclient

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"syscall"
	"time"
)

// Event is one record of CH's event-monitor stream.
type Event struct {
	// Timestamp is the time since the CH process started.
	Timestamp  time.Duration
	Source     string            // "vmm", "vm", "virtio-device", "guest", …
	Event      string            // "booted", "activated", "panic", …
	Properties map[string]string // nil when CH wrote null
}

// String formats the event as "source/event" plus its properties.
func (e Event) String() string {
	if len(e.Properties) == 0 {
		return e.Source + "/" + e.Event
	}
	return fmt.Sprintf("%s/%s %v", e.Source, e.Event, e.Properties)
}

type rawEvent struct {
	Timestamp *struct {
		Secs  uint64 `json:"secs"`
		Nanos uint32 `json:"nanos"`
	} `json:"timestamp"`
	Source     *string           `json:"source"`
	Event      *string           `json:"event"`
	Properties map[string]string `json:"properties"`
}

// MalformedEventError is a record of the stream that is not an event. The reader has
// skipped it; the next call continues with the record after it.
type MalformedEventError struct {
	Offset int64 // byte offset of the record in the stream
	Err    error
}

// Error names the offset and the decoding problem.
func (e *MalformedEventError) Error() string {
	return fmt.Sprintf("malformed event at offset %d: %v", e.Offset, e.Err)
}

// Unwrap returns the decoding error.
func (e *MalformedEventError) Unwrap() error { return e.Err }

// EventReader splits CH's event stream: pretty-printed JSON objects separated by blank
// lines (one compact object per line is accepted too). It is not safe for concurrent use.
type EventReader struct {
	r   io.Reader
	buf []byte
	off int64 // stream offset of buf[0]
	// Skip, when set, is asked about each whole event in its raw bytes
	// before it is decoded, and an event it reports true for is passed
	// over: a reader that wants a few kinds of event replays a long stream
	// without decoding the rest. It is a hint: only events read up to the
	// blank line that ends them are asked about, and one decoded before
	// its blank line arrived (or in compact form) is returned anyway.
	Skip func(raw []byte) bool
}

// readChunk is how much a read asks for at a time. The buffer exists only
// while a read or an unfinished event needs it: a reader idle at the end
// of its stream (one per running VM) holds no memory.
const readChunk = 8 << 10

// NewEventReader reads events from r, starting at the beginning of the stream.
func NewEventReader(r io.Reader) *EventReader {
	return &EventReader{r: r}
}

// Offset returns how many bytes of the stream the events returned so far (and any skipped
// records) span. A reader resumed there with ReadEventsFrom continues after them.
func (er *EventReader) Offset() int64 { return er.off }

// Next returns the next complete event. When the underlying reader is at its end it returns
// io.EOF and keeps an unfinished event buffered: a later call, after more data arrived (a
// file CH is still writing), completes it. A record that cannot be decoded yields a
// *MalformedEventError and is skipped.
func (er *EventReader) Next() (Event, error) {
	for {
		ev, ok, err := er.parse()
		if ok || err != nil {
			return ev, err
		}
		if cap(er.buf)-len(er.buf) < readChunk {
			er.buf = append(make([]byte, 0, len(er.buf)+readChunk), er.buf...)
		}
		n, rerr := er.r.Read(er.buf[len(er.buf):cap(er.buf)])
		er.buf = er.buf[:len(er.buf)+n]
		if n > 0 {
			continue
		}
		if len(er.buf) == 0 {
			er.buf = nil
		}
		if rerr == nil {
			continue
		}
		return Event{}, rerr
	}
}

// parse takes one event off the buffer if a whole one is there.
func (er *EventReader) parse() (Event, bool, error) {
	var i int
	for {
		trimmed := bytes.TrimLeft(er.buf, " \t\r\n")
		er.off += int64(len(er.buf) - len(trimmed))
		er.buf = trimmed
		if len(er.buf) == 0 {
			return Event{}, false, nil
		}
		// CH ends every event with a blank line, and a blank line cannot
		// occur inside one (serde escapes newlines in strings).
		i = bytes.Index(er.buf, []byte("\n\n"))
		if i < 0 || er.Skip == nil || !er.Skip(er.buf[:i]) {
			break
		}
		er.consume(i + 2)
	}
	start := er.off
	var raw rawEvent
	// Fast path: a whole event up to its blank line.
	if i >= 0 && json.Unmarshal(er.buf[:i], &raw) == nil {
		er.consume(i + 2)
		return raw.event(start)
	}
	raw = rawEvent{}
	dec := json.NewDecoder(bytes.NewReader(er.buf))
	err := dec.Decode(&raw)
	if errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, io.EOF) {
		return Event{}, false, nil
	}
	if err != nil {
		var te *json.UnmarshalTypeError
		skip := int(dec.InputOffset())
		if errors.As(err, &te) && skip == len(er.buf) && isDigit(er.buf[skip-1]) {
			// A number that ends the data so far may go on ("0" then
			// ".5"): wait for more, as for any unfinished record.
			return Event{}, false, nil
		}
		if !errors.As(err, &te) {
			// A syntax error: resynchronise on the blank line that ends every event.
			i := bytes.Index(er.buf, []byte("\n\n"))
			if i < 0 {
				return Event{}, false, nil
			}
			skip = i + 2
		}
		er.consume(skip)
		return Event{}, false, &MalformedEventError{Offset: start, Err: err}
	}
	er.consume(int(dec.InputOffset()))
	return raw.event(start)
}

func isDigit(b byte) bool { return '0' <= b && b <= '9' }

func (raw *rawEvent) event(offset int64) (Event, bool, error) {
	if raw.Timestamp == nil || raw.Source == nil || raw.Event == nil {
		return Event{}, false, &MalformedEventError{Offset: offset, Err: errors.New("missing timestamp, source or event")}
	}
	return Event{
		Timestamp:  time.Duration(raw.Timestamp.Secs)*time.Second + time.Duration(raw.Timestamp.Nanos),
		Source:     *raw.Source,
		Event:      *raw.Event,
		Properties: raw.Properties,
	}, true, nil
}

func (er *EventReader) consume(n int) {
	er.buf = er.buf[n:]
	er.off += int64(n)
	if len(er.buf) == 0 {
		er.buf = er.buf[:0:0] // let a large consumed buffer go
	}
}

// followPoll is how often FollowEvents looks for more data at the end of the stream.
const followPoll = 20 * time.Millisecond

// FollowEvents reads the event monitor at path (a regular file or a FIFO) from byte offset
// and calls fn for every event, following the stream as CH appends to it, until ctx ends
// (it then returns ctx.Err()) or fn returns an error (returned as is). Malformed records are
// passed to bad, if not nil, and skipped. The returned offset is where a later call should
// resume.
func FollowEvents(ctx context.Context, path string, offset int64, fn func(Event) error, bad func(error)) (int64, error) {
	// O_NONBLOCK keeps opening a FIFO without a writer from blocking; the
	// file is in a directory a confined VM owns, so a link is not followed.
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NONBLOCK|syscall.O_NOFOLLOW, 0)
	if err != nil {
		return offset, fmt.Errorf("opening event monitor %s: %w", path, err)
	}
	defer f.Close()
	if offset > 0 {
		if _, err := f.Seek(offset, io.SeekStart); err != nil {
			return offset, fmt.Errorf("seeking event monitor %s to %d: %w", path, offset, err)
		}
	}
	// A FIFO read blocks in the poller; a past deadline wakes it when ctx ends. Regular
	// files never block, so the error SetReadDeadline gives them does not matter.
	stop := context.AfterFunc(ctx, func() { f.SetReadDeadline(time.Now()) })
	defer stop()
	er := NewEventReader(f)
	er.off = offset
	tick := time.NewTicker(followPoll)
	defer tick.Stop()
	for {
		ev, err := er.Next()
		switch {
		case err == nil:
			if err := fn(ev); err != nil {
				return er.Offset(), err
			}
			continue
		case errors.As(err, new(*MalformedEventError)):
			if bad != nil {
				bad(err)
			}
			continue
		case errors.Is(err, io.EOF), errors.Is(err, os.ErrDeadlineExceeded):
			// End of what CH has written so far (or a FIFO with no writer yet).
		default:
			return er.Offset(), fmt.Errorf("reading event monitor %s: %w", path, err)
		}
		select {
		case <-ctx.Done():
			return er.Offset(), ctx.Err()
		case <-tick.C:
		}
	}
}
