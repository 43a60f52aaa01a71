package chclient_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"syscall"
	"testing"
	"time"

	"vmhost/chclient"
)

// growingReader returns what has been fed so far and io.EOF when it is drained, like a
// file CH is still writing.
type growingReader struct{ buf bytes.Buffer }

func (g *growingReader) Read(p []byte) (int, error) { return g.buf.Read(p) }

func recordedStream(t testing.TB) []byte {
	t.Helper()
	data, err := os.ReadFile("testdata/ch-events.stream")
	if err != nil {
		t.Fatal(err)
	}
	return data
}

var recordedEvents = []chclient.Event{
	{Timestamp: 81234, Source: "vmm", Event: "starting"},
	{Timestamp: 9123456, Source: "vm", Event: "booting"},
	{Timestamp: 152000789, Source: "vm", Event: "booted"},
	{Timestamp: time.Second + 500, Source: "virtio-device", Event: "activated", Properties: map[string]string{"id": "_disk0"}},
	{Timestamp: 2*time.Second + 999999999, Source: "virtio-device", Event: "activated", Properties: map[string]string{"id": "_net1"}},
	{Timestamp: 14*time.Second + 250*time.Millisecond, Source: "guest", Event: "panic", Properties: map[string]string{"event": "panic"}},
	{Timestamp: 20*time.Second + 1, Source: "vm", Event: "device-removed", Properties: map[string]string{"id": "_disk2", "bdf": "0000:00:07.0"}},
	{Timestamp: 31*time.Second + 42, Source: "virtio-device", Event: "reset", Properties: map[string]string{"id": "_disk0"}},
	{Timestamp: 31*time.Second + 43, Source: "vm", Event: "shutdown"},
	{Timestamp: 31*time.Second + 44, Source: "vm", Event: "deleted"},
	{Timestamp: 31*time.Second + 45, Source: "vmm", Event: "shutdown"},
}

// drain reads events until io.EOF.
func drain(t *testing.T, r *chclient.EventReader) []chclient.Event {
	t.Helper()
	var evs []chclient.Event
	for {
		ev, err := r.Next()
		if errors.Is(err, io.EOF) {
			return evs
		}
		if err != nil {
			t.Fatalf("Next: %v", err)
		}
		evs = append(evs, ev)
	}
}

// TestEventReaderSplitEverywhere feeds the recorded stream in two parts, cut at every byte
// offset: the events before the cut come out at once, the one cut in half waits and
// completes when the rest arrives.
func TestEventReaderSplitEverywhere(t *testing.T) {
	data := recordedStream(t)
	for cut := 0; cut <= len(data); cut++ {
		g := &growingReader{}
		r := chclient.NewEventReader(g)
		g.buf.Write(data[:cut])
		first := drain(t, r)
		g.buf.Write(data[cut:])
		all := append(first, drain(t, r)...)
		if !reflect.DeepEqual(all, recordedEvents) {
			t.Fatalf("cut at %d: events = %v\nwant %v", cut, all, recordedEvents)
		}
		if r.Offset() != int64(len(data)) {
			t.Fatalf("cut at %d: offset = %d, want %d", cut, r.Offset(), len(data))
		}
	}
}

// TestEventReaderSkip: events Skip reports true for are passed over
// (undecoded) and the others come out in order, with the offset still the
// whole stream's, whatever the cut; an event read whole, up to its blank
// line, is skipped for sure (one that had to be decoded before its blank
// line arrived may come out anyway).
func TestEventReaderSkip(t *testing.T) {
	data := recordedStream(t)
	var want []chclient.Event
	for _, ev := range recordedEvents {
		if ev.Source == "vm" {
			want = append(want, ev)
		}
	}
	if len(want) == 0 || len(want) == len(recordedEvents) {
		t.Fatalf("the recorded stream has %d vm events of %d: the test shows nothing", len(want), len(recordedEvents))
	}
	for cut := 0; cut <= len(data); cut++ {
		g := &growingReader{}
		r := chclient.NewEventReader(g)
		asked := 0
		r.Skip = func(raw []byte) bool {
			asked++
			return !bytes.Contains(raw, []byte(`"source": "vm"`)) && !bytes.Contains(raw, []byte(`"source":"vm"`))
		}
		g.buf.Write(data[:cut])
		first := drain(t, r)
		g.buf.Write(data[cut:])
		all := append(first, drain(t, r)...)
		if cut == len(data) && !reflect.DeepEqual(all, want) {
			t.Fatalf("whole stream: events = %v\nwant %v", all, want)
		}
		if vm := slices.DeleteFunc(all, func(ev chclient.Event) bool { return ev.Source != "vm" }); !reflect.DeepEqual(vm, want) {
			t.Fatalf("cut at %d: events = %v\nwant %v", cut, all, want)
		}
		if r.Offset() != int64(len(data)) || asked < len(want) {
			t.Fatalf("cut at %d: offset %d (want %d), Skip asked %d times", cut, r.Offset(), len(data), asked)
		}
	}
}

func TestEventReaderCompactAndMalformed(t *testing.T) {
	stream := `{"timestamp":{"secs":0,"nanos":1},"source":"vmm","event":"starting","properties":null}
{"timestamp":{"secs":0,"nanos":2},"source":"vm",` + "\n" + `"event": oops}

{"timestamp":{"secs":0,"nanos":3},"source":"vm","event":"booted","properties":{"id":7}}

{"timestamp":{"secs":0,"nanos":4},"source":"vm","event":"booted","properties":null}

`
	r := chclient.NewEventReader(bytes.NewBufferString(stream))
	var got []string
	var bad int
	for {
		ev, err := r.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		var me *chclient.MalformedEventError
		if errors.As(err, &me) {
			bad++
			continue
		}
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, ev.String())
	}
	if want := []string{"vmm/starting", "vm/booted"}; !reflect.DeepEqual(got, want) || bad != 2 {
		t.Errorf("events = %v with %d malformed, want %v with 2", got, bad, want)
	}
}

// TestFollowEventsFile follows a file written in pieces, including a partial event, and
// resumes from the returned offset.
func TestFollowEventsFile(t *testing.T) {
	data := recordedStream(t)
	path := filepath.Join(t.TempDir(), "events")
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	got := make(chan chclient.Event, 100)
	ctx, cancel := context.WithCancel(context.Background())
	res := make(chan int64, 1)
	go func() {
		off, _ := chclient.FollowEvents(ctx, path, 0, func(ev chclient.Event) error { got <- ev; return nil }, nil)
		res <- off
	}()
	half := len(data)/2 + 7
	f.Write(data[:half])
	time.Sleep(50 * time.Millisecond)
	f.Write(data[half:])
	for i, want := range recordedEvents {
		select {
		case ev := <-got:
			if !reflect.DeepEqual(ev, want) {
				t.Fatalf("event %d = %v, want %v", i, ev, want)
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("event %d did not arrive", i)
		}
	}
	cancel()
	off := <-res
	// Resuming at the offset yields only what is written later.
	f.Write([]byte(`{"timestamp":{"secs":40,"nanos":0},"source":"vmm","event":"starting","properties":null}` + "\n\n"))
	ctx2, cancel2 := context.WithCancel(context.Background())
	defer cancel2()
	var resumed []chclient.Event
	_, err = chclient.FollowEvents(ctx2, path, off, func(ev chclient.Event) error {
		resumed = append(resumed, ev)
		return errStop
	}, nil)
	if !errors.Is(err, errStop) || len(resumed) != 1 || resumed[0].Timestamp != 40*time.Second {
		t.Fatalf("resumed = %v, %v", resumed, err)
	}
}

var errStop = errors.New("stop")

// TestFollowEventsFIFO reads the simulator's events through a pipe.
func TestFollowEventsFIFO(t *testing.T) {
	dir := shortDir(t)
	fifo := filepath.Join(dir, "events")
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	got := make(chan chclient.Event, 100)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() {
		_, err := chclient.FollowEvents(ctx, fifo, 0, func(ev chclient.Event) error { got <- ev; return nil }, nil)
		done <- err
	}()
	time.Sleep(20 * time.Millisecond) // let the reader open the FIFO first, as the agent would
	f := newFixture(t)
	cfg := f.config()
	cfg.EventMonitor = fifo
	p, err := chclient.Launch(ctxT(t), cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	if err := p.Client().ShutdownVMM(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	<-p.Done()
	var seq []string
	for len(seq) < 2 {
		select {
		case ev := <-got:
			seq = append(seq, ev.String())
		case <-time.After(5 * time.Second):
			t.Fatalf("events through the FIFO = %v", seq)
		}
	}
	if !reflect.DeepEqual(seq, []string{"vmm/starting", "vmm/shutdown"}) {
		t.Errorf("events = %v", seq)
	}
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Errorf("FollowEvents = %v, want context.Canceled", err)
	}
}
