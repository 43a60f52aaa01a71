package proto

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"reflect"
	"strings"
	"testing"
	"time"
)

func intp(i int) *int { return &i }

func u64p(n uint64) *uint64 { return &n }

// samples holds one valid value of every message type.
func samples() []Message {
	return []Message{
		&Hello{V: Version, AgentVersion: "test", BootID: "b1"},
		&Spec{
			V:          Version,
			Entrypoint: []string{"/bin/sh", "-c"},
			Command:    []string{"echo hi"},
			Env:        []string{"A=1"},
			SecretEnv:  []SecretEnv{{Key: "TOKEN", Value: NewSecret("s3cr3t")}},
			User:       "app:app",
			Workdir:    "/srv",
			Hostname:   "web-1",
			Network:    Network{Mode: NetworkStatic, IP: "10.0.0.5", Prefix: 24, Gateway: "10.0.0.1", DNS: []string{"10.0.0.1"}},
			ExtraHosts: []HostEntry{{Host: "db", IP: "10.0.0.9"}},
			ConfigFiles: []ConfigFile{
				{Path: "/etc/app.conf", Mode: 0o644, Content: "a=b\n"},
			},
			SecretFiles: []SecretFile{{Path: "/run/secrets/key", Mode: 0o400, Content: NewSecret("PRIVATE")}},
			TmpfsMounts: []TmpfsMount{{Path: "/scratch", SizeBytes: 1 << 20, Mode: 0o1777}},
			DataMounts:  []DataMount{{Device: "/dev/vdb", Mountpoint: "/data", ReadOnly: true}},
			Healthcheck: &Healthcheck{Type: CheckHTTP, URL: "http://127.0.0.1:8080/", IntervalSecs: 5, TimeoutSecs: 2, Retries: 3, StartPeriodSecs: 10},
			Keepalive:   true, StopGraceSecs: 3, HeartbeatSecs: 2,
		},
		&Hello{V: Version, AgentVersion: "test", BootID: "b1", Resume: true},
		&Hello{V: Version, AgentVersion: "test", BootID: "b1", Resume: true, LogSeq: u64p(0)},
		&Hello{V: Version, AgentVersion: "test", BootID: "b1", Resume: true, LogSeq: u64p(41)},
		&Stop{GraceSecs: 4},
		&Heartbeat{Seq: 7, At: time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)},
		&Lease{IP: "192.168.1.10", Prefix: 24, Gateway: "192.168.1.1", DNS: []string{"1.1.1.1"}, Search: []string{"lan"}, LeaseSecs: 3600, Hostname: "h"},
		&Started{PID: 42},
		&Exit{Code: intp(3)},
		&Exit{Signal: 9},
		&Fatal{Message: "exec: \"nope\": not found"},
		&Health{Status: HealthUnhealthy, Streak: 3, Output: "down"},
		&Log{Stream: Stderr, Data: []byte{0xff, 0, '\n'}, Seq: 1},
		&Log{Stream: Stdout, Data: []byte("v3"), Seq: 2, At: time.Date(2026, 1, 2, 3, 4, 5, 6, time.UTC)},
		&LogAck{Seq: 2},
		&Hello{V: MinVersion, AgentVersion: "old", BootID: "b0"},
		&Mount{Seq: 1, BDF: "0000:01:00.0", Mountpoint: "/data", ReadOnly: true},
		&Unmount{Seq: 2, Mountpoint: "/data"},
		&MountResult{Seq: 2, Error: "unmounting /data: device or resource busy", Busy: true},
		&MountResult{Seq: 1},
		&ExitAck{},
	}
}

func TestRoundTrip(t *testing.T) {
	var buf bytes.Buffer
	c := NewConn(&buf)
	for _, m := range samples() {
		if err := c.Send(m); err != nil {
			t.Fatalf("Send(%s) = %v", m.Type(), err)
		}
	}
	for _, want := range samples() {
		got, err := c.Recv()
		if err != nil {
			t.Fatalf("Recv() = %v, want %s", err, want.Type())
		}
		if !reflect.DeepEqual(got, want) {
			t.Errorf("Recv() = %#v\nwant %#v", got, want)
		}
	}
	if _, err := c.Recv(); err != io.EOF {
		t.Errorf("Recv() at end = %v, want io.EOF", err)
	}
}

func TestBodyBeforeType(t *testing.T) {
	m, err := NewConn(bytes.NewBuffer(frame(` { "body" : {"pid":9} , "type":"started" } `))).Recv()
	if want := (&Started{PID: 9}); err != nil || !reflect.DeepEqual(m, want) {
		t.Errorf("Recv() = %#v, %v; want %#v", m, err, want)
	}
}

func TestSecretOnWire(t *testing.T) {
	b, err := Marshal(&Spec{V: Version, Command: []string{"x"}, Network: Network{Mode: NetworkDHCP},
		SecretEnv: []SecretEnv{{Key: "K", Value: NewSecret("wire-value")}}})
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Contains(b, []byte(`"value":"wire-value"`)) {
		t.Errorf("frame %s lacks the secret value", b)
	}
}

func TestSecretRedacted(t *testing.T) {
	const v = "hunter2-value"
	s := NewSecret(v)
	e := SecretEnv{Key: "K", Value: s}
	var logs bytes.Buffer
	slog.New(slog.NewTextHandler(&logs, nil)).Info("spec", "secret", s, "env", e)
	slog.New(slog.NewJSONHandler(&logs, nil)).Info("spec", "secret", s)
	outputs := []string{
		s.String(),
		fmt.Sprint(s), fmt.Sprintf("%v %+v %#v %s %q %x %X %d", s, s, s, s, s, s, s, s),
		fmt.Sprintf("%v %+v %#v", e, e, e),
		fmt.Sprintf("%v", &SecretFile{Path: "/p", Content: s}),
		fmt.Errorf("wrapping %v: %w", s, errors.New("x")).Error(),
		logs.String(),
	}
	for _, o := range outputs {
		if strings.Contains(o, v) {
			t.Errorf("output %q leaks the secret", o)
		}
		if !strings.Contains(o, Redacted) {
			t.Errorf("output %q lacks %q", o, Redacted)
		}
	}
	if s.Reveal() != v {
		t.Errorf("Reveal() = %q, want %q", s.Reveal(), v)
	}
}

func frame(s string) []byte {
	b := binary.BigEndian.AppendUint32(nil, uint32(len(s)))
	return append(b, s...)
}

func TestRecvErrors(t *testing.T) {
	huge := binary.BigEndian.AppendUint32(nil, MaxFrame+1)
	tests := []struct {
		name  string
		input []byte
		want  string
	}{
		{"unknown type", frame(`{"type":"reboot","body":{}}`), "unknown message type"},
		{"unknown field", frame(`{"type":"started","body":{"pid":1,"x":2}}`), "unknown field"},
		{"unknown envelope field", frame(`{"type":"started","body":{"pid":1},"v":1}`), "unknown field"},
		{"missing body", frame(`{"type":"started"}`), "missing body"},
		{"null body", frame(`{"type":"started","body":null}`), "missing body"},
		{"trailing data", frame(`{"type":"started","body":{"pid":1}} {}`), "trailing"},
		{"wrong type", frame(`{"type":"started","body":{"pid":"1"}}`), "cannot unmarshal"},
		{"newer version", frame(`{"type":"hello","body":{"v":5,"agent_version":"","boot_id":""}}`), "version 5"},
		{"log_seq without resume", frame(`{"type":"hello","body":{"v":4,"agent_version":"","boot_id":"b","log_seq":3}}`), "log_seq"},
		{"no version", frame(`{"type":"hello","body":{"v":0,"agent_version":"","boot_id":""}}`), "version 0"},
		{"mount bad bdf", frame(`{"type":"mount","body":{"seq":1,"bdf":"../../x","mountpoint":"/data"}}`), "not a PCI address"},
		{"mount uppercase bdf", frame(`{"type":"mount","body":{"seq":1,"bdf":"0000:00:0A.0","mountpoint":"/data"}}`), "not a PCI address"},
		{"mount relative", frame(`{"type":"mount","body":{"seq":1,"bdf":"0000:00:0a.0","mountpoint":"data"}}`), "not an absolute"},
		{"unmount dotdot", frame(`{"type":"unmount","body":{"seq":1,"mountpoint":"/a/../etc"}}`), ".. segment"},
		{"busy without error", frame(`{"type":"mount_result","body":{"seq":1,"busy":true}}`), "busy without"},
		{"exit both", frame(`{"type":"exit","body":{"code":1,"signal":9}}`), "exactly one"},
		{"exit none", frame(`{"type":"exit","body":{}}`), "exactly one"},
		{"bad stream", frame(`{"type":"log","body":{"stream":"stdin","data":"","seq":1}}`), "unknown stream"},
		{"bad health", frame(`{"type":"health","body":{"status":"ok"}}`), "unknown status"},
		{"spec relative path", frame(`{"type":"spec","body":{"v":1,"command":["x"],"network":{"mode":"dhcp"},"config_files":[{"path":"etc/x","mode":420,"content":""}]}}`), "absolute"},
		{"spec dotdot", frame(`{"type":"spec","body":{"v":1,"command":["x"],"network":{"mode":"dhcp"},"tmpfs_mounts":[{"path":"/a/../b"}]}}`), ". or .."},
		{"spec bad mode", frame(`{"type":"spec","body":{"v":1,"command":["x"],"network":{"mode":"bridge"}}}`), "network.mode"},
		{"spec no command", frame(`{"type":"spec","body":{"v":1,"network":{"mode":"dhcp"}}}`), "empty command"},
		{"secret not string", frame(`{"type":"spec","body":{"v":1,"command":["x"],"network":{"mode":"dhcp"},"secret_env":[{"key":"K","value":5}]}}`), "want a string"},
		{"env without =", frame(`{"type":"spec","body":{"v":1,"command":["x"],"network":{"mode":"dhcp"},"env":["NOVALUE"]}}`), "KEY=VALUE"},
		{"env bad key", frame(`{"type":"spec","body":{"v":1,"command":["x"],"network":{"mode":"dhcp"},"env":["1A=b"]}}`), "KEY=VALUE"},
		{"secret bad key", frame(`{"type":"spec","body":{"v":1,"command":["x"],"network":{"mode":"dhcp"},"secret_env":[{"key":"A-B","value":"hidden-v"}]}}`), "not a valid name"},
		{"oversize", huge, "maximum size"},
		{"truncated body", frame(`{"type":"started","body":{"pid":1}}`)[:10], "unexpected EOF"},
		{"truncated header", []byte{0, 0}, "unexpected EOF"},
		{"not json", frame(`hello`), "invalid character"},
		{"not an object", frame(`[1]`), "not a JSON object"},
		{"duplicate type", frame(`{"type":"started","type":"exit","body":{"pid":1}}`), "duplicate type"},
		{"duplicate body", frame(`{"type":"started","body":{"pid":1},"body":{"pid":2}}`), "duplicate body"},
		{"no type", frame(`{"body":{"pid":1}}`), "unknown message type"},
		{"body first, bad", frame(`{"body":{"pid":1,"x":1},"type":"started"}`), "unknown field"},
		{"body first, null", frame(`{"body": null,"type":"started"}`), "missing body"},
		{"key case", frame(`{"TYPE":"started","body":{"pid":1}}`), "unknown field"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			m, err := NewConn(bytes.NewBuffer(tt.input)).Recv()
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("Recv() = %v, %v; want error containing %q", m, err, tt.want)
			}
		})
	}
	_, err := NewConn(bytes.NewBuffer(frame(`{"type":"spec","body":{"v":1,"command":["x"],"network":{"mode":"dhcp"},"secret_env":[{"key":"A-B","value":"hidden-v"}]}}`))).Recv()
	if err == nil || strings.Contains(err.Error(), "hidden-v") {
		t.Errorf("error %v names the secret value", err)
	}
	_, err = NewConn(bytes.NewBuffer(huge)).Recv()
	if !errors.Is(err, ErrFrameTooLarge) {
		t.Errorf("oversize: %v is not ErrFrameTooLarge", err)
	}
}

func TestSendRefusesInvalid(t *testing.T) {
	var buf bytes.Buffer
	c := NewConn(&buf)
	bad := []Message{
		&Log{Stream: Stdout, Data: make([]byte, MaxLogChunk+1)},
		&Exit{},
		&Hello{V: 0},
		&Hello{V: Version, BootID: "b", LogSeq: u64p(3)},                // not a resume
		&Hello{V: Version3, BootID: "b", Resume: true, LogSeq: u64p(3)}, // a version 3 guest has none
	}
	for _, m := range bad {
		if err := c.Send(m); err == nil {
			t.Errorf("Send(%#v) = nil, want error", m)
		}
	}
	if buf.Len() != 0 {
		t.Errorf("invalid sends wrote %d bytes", buf.Len())
	}
}

// TestConcurrentSend checks that frames from concurrent senders never
// interleave, over a real socket pair.
func TestConcurrentSend(t *testing.T) {
	a, b := net.Pipe()
	defer a.Close()
	defer b.Close()
	ca, cb := NewConn(a), NewConn(b)
	const n = 50
	for g := 0; g < 4; g++ {
		go func() {
			for i := 0; i < n; i++ {
				ca.Send(&Log{Stream: Stdout, Data: bytes.Repeat([]byte{'x'}, 3000), Seq: uint64(i + 1)})
			}
		}()
	}
	for i := 0; i < 4*n; i++ {
		m, err := cb.Recv()
		if err != nil {
			t.Fatalf("Recv() #%d = %v", i, err)
		}
		if l, ok := m.(*Log); !ok || len(l.Data) != 3000 {
			t.Fatalf("Recv() #%d = %#v", i, m)
		}
	}
}

// FuzzRecv feeds arbitrary bytes to Recv: it must return messages or errors,
// never panic, and every message it returns must survive a round trip.
func FuzzRecv(f *testing.F) {
	for _, m := range samples() {
		b, err := Marshal(m)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Add(frame(`{"type":"exit","body":{"code":1,"signal":9}}`))
	f.Add([]byte{0xff, 0xff, 0xff, 0xff})
	f.Fuzz(func(t *testing.T, data []byte) {
		c := NewConn(bytes.NewBuffer(data))
		for i := 0; i < 8; i++ {
			m, err := c.Recv()
			if err != nil {
				return
			}
			b, err := Marshal(m)
			if err != nil {
				t.Fatalf("Marshal(decoded %#v) = %v", m, err)
			}
			m2, err := NewConn(bytes.NewBuffer(b)).Recv()
			if err != nil {
				t.Fatalf("re-decoding %s = %v", b, err)
			}
			j1, _ := json.Marshal(m)
			j2, _ := json.Marshal(m2)
			if !bytes.Equal(j1, j2) {
				t.Fatalf("round trip changed %s into %s", j1, j2)
			}
		}
	})
}

func logFrame() *Log {
	return &Log{Stream: Stdout, Data: bytes.Repeat([]byte("log line of a workload\n"), 1000), Seq: 1}
}

// BenchmarkLogRoundTrip encodes and decodes a 23 KB Log chunk through
// Conn.
func BenchmarkLogRoundTrip(b *testing.B) {
	m := logFrame()
	var buf bytes.Buffer
	c := NewConn(&buf)
	for b.Loop() {
		if err := c.Send(m); err != nil {
			b.Fatal(err)
		}
		if _, err := c.Recv(); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkLogRoundTripNDJSON is the plain alternative: newline-delimited
// JSON with json.Encoder/Decoder, without strictness or validation.
func BenchmarkLogRoundTripNDJSON(b *testing.B) {
	m := logFrame()
	var buf bytes.Buffer
	enc, dec := json.NewEncoder(&buf), json.NewDecoder(&buf)
	for b.Loop() {
		if err := enc.Encode(envelopeOf(m)); err != nil {
			b.Fatal(err)
		}
		var env struct {
			Type string
			Body Log
		}
		if err := dec.Decode(&env); err != nil {
			b.Fatal(err)
		}
	}
}

func envelopeOf(m Message) any {
	return struct {
		Type string  `json:"type"`
		Body Message `json:"body"`
	}{m.Type(), m}
}
