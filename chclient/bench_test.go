package chclient_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"os/exec"
	"testing"

	"vmhost/chclient"
)

// BenchmarkPing is one vmm.ping round trip on a kept-alive connection to the simulator;
// BenchmarkPingCurl is what an operator would run instead (curl --unix-socket), for scale.
func BenchmarkPing(b *testing.B) {
	_, p := launchSim(b)
	c := p.Client()
	ctx := ctxT(b)
	b.ResetTimer()
	for b.Loop() {
		if _, err := c.Ping(ctx); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkPingCurl(b *testing.B) {
	curl, err := exec.LookPath("curl")
	if err != nil {
		b.Skip("curl not installed")
	}
	f, _ := launchSim(b)
	b.ResetTimer()
	for b.Loop() {
		out, err := exec.Command(curl, "-sf", "--unix-socket", f.sock, "http://localhost/api/v1/vmm.ping").Output()
		if err != nil || !bytes.Contains(out, []byte("version")) {
			b.Fatalf("curl: %v %s", err, out)
		}
	}
}

// BenchmarkEventReader parses the recorded stream (11 events) with EventReader;
// BenchmarkEventSplitUnmarshal does what CH's own tests do (split on blank lines, then
// json.Unmarshal each); BenchmarkEventJq runs jq over the same bytes.
func BenchmarkEventReader(b *testing.B) {
	data := recordedStream(b)
	b.SetBytes(int64(len(data)))
	for b.Loop() {
		r := chclient.NewEventReader(bytes.NewReader(data))
		n := 0
		for {
			_, err := r.Next()
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				b.Fatal(err)
			}
			n++
		}
		if n != len(recordedEvents) {
			b.Fatalf("%d events", n)
		}
	}
}

func BenchmarkEventSplitUnmarshal(b *testing.B) {
	data := recordedStream(b)
	b.SetBytes(int64(len(data)))
	for b.Loop() {
		n := 0
		for _, rec := range bytes.Split(bytes.TrimSpace(data), []byte("\n\n")) {
			var ev struct {
				Timestamp  struct{ Secs, Nanos uint64 }
				Source     string
				Event      string
				Properties map[string]string
			}
			if err := json.Unmarshal(rec, &ev); err != nil {
				b.Fatal(err)
			}
			n++
		}
		if n != len(recordedEvents) {
			b.Fatalf("%d events", n)
		}
	}
}

func BenchmarkEventJq(b *testing.B) {
	jq, err := exec.LookPath("jq")
	if err != nil {
		b.Skip("jq not installed")
	}
	data := recordedStream(b)
	b.SetBytes(int64(len(data)))
	for b.Loop() {
		cmd := exec.Command(jq, "-c", ".event")
		cmd.Stdin = bytes.NewReader(data)
		if out, err := cmd.Output(); err != nil || bytes.Count(out, []byte("\n")) != len(recordedEvents) {
			b.Fatalf("jq: %v %s", err, out)
		}
	}
}

// FuzzEventReader checks that any stream, cut anywhere, yields the same events and errors
// as the whole stream read at once, and never panics.
func FuzzEventReader(f *testing.F) {
	f.Add(recordedStream(f), 100)
	f.Add([]byte(`{"timestamp":{"secs":1,"nanos":2},"source":"a","event":"b","properties":{"x":"y"}}`+"\n\n{oops\n\n"), 5)
	f.Fuzz(func(t *testing.T, data []byte, cut int) {
		if cut < 0 || cut > len(data) {
			cut = len(data) / 2
		}
		whole := readAll(chclient.NewEventReader(bytes.NewReader(data)))
		g := &growingReader{}
		r := chclient.NewEventReader(g)
		g.buf.Write(data[:cut])
		split := readAll(r)
		g.buf.Write(data[cut:])
		split = append(split, readAll(r)...)
		if len(whole) != len(split) {
			t.Fatalf("whole %d results, split at %d %d:\n%v\n%v", len(whole), cut, len(split), whole, split)
		}
		for i := range whole {
			if whole[i] != split[i] {
				t.Fatalf("result %d: whole %q, split %q", i, whole[i], split[i])
			}
		}
	})
}

// readAll renders every event or malformed record until io.EOF.
func readAll(r *chclient.EventReader) []string {
	var out []string
	for i := 0; i < 10000; i++ {
		ev, err := r.Next()
		if errors.Is(err, io.EOF) {
			return out
		}
		var me *chclient.MalformedEventError
		if errors.As(err, &me) {
			out = append(out, "malformed")
			continue
		}
		if err != nil {
			return append(out, "error: "+err.Error())
		}
		out = append(out, ev.String()+" "+ev.Timestamp.String())
	}
	return out
}
