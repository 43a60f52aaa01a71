package redact

import (
	"bytes"
	"io"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
)

func TestBytes(t *testing.T) {
	s := New([]string{"hunter22", "abc", "hunter22", "PLANTED-secret", "secret-tail", ""})
	for _, tc := range []struct{ in, want string }{
		{"nothing here", "nothing here"},
		{"pw=hunter22.", "pw=[redacted]."},
		{"hunter22hunter22", "[redacted][redacted]"},
		// abc is shorter than MinLen: left alone.
		{"abc abc", "abc abc"},
		// Overlapping values are one mark.
		{"PLANTED-secret-tail!", "[redacted]!"},
		{"x PLANTED-secret y secret-tail", "x [redacted] y [redacted]"},
		{"", ""},
	} {
		if got := string(s.Bytes([]byte(tc.in))); got != tc.want {
			t.Errorf("Bytes(%q) = %q, want %q", tc.in, got, tc.want)
		}
	}
	in := []byte("clean")
	if out := s.Bytes(in); &out[0] != &in[0] {
		t.Error("Bytes copied a slice without a secret")
	}
	var none *Set
	if got := none.String("hunter22"); got != "hunter22" || !none.Empty() || !New(nil).Empty() {
		t.Error("a nil or empty set redacts")
	}
	args := []string{"echo", "hunter22"}
	if got := s.Strings(args); !slices.Equal(got, []string{"echo", Mark}) || args[1] != "hunter22" {
		t.Errorf("Strings = %q (input %q)", got, args)
	}
}

func TestMaxLen(t *testing.T) {
	big := strings.Repeat("k", MaxLen+1)
	if !New([]string{big}).Empty() {
		t.Error("a value above MaxLen is matched whole")
	}
	if New([]string{big[:MaxLen]}).Empty() {
		t.Error("a value of MaxLen is dropped")
	}
}

func TestLines(t *testing.T) {
	got := Lines("user: admin\r\npassword: s3cr3t\nab\n\nlast line")
	want := []string{"user: admin", "password: s3cr3t", "last line"}
	if !slices.Equal(got, want) {
		t.Errorf("Lines = %q, want %q", got, want)
	}
	if got := Lines("token\n"); !slices.Equal(got, []string{"token"}) {
		t.Errorf("Lines(token\\n) = %q", got)
	}
	if got := Lines("token"); len(got) != 0 {
		t.Errorf("Lines(token) = %q, want nothing (the content itself is the value)", got)
	}
}

// TestStreamSplit writes output holding secrets in every possible cut
// into two, and in random pieces: the result is always that of redacting
// the whole at once.
func TestStreamSplit(t *testing.T) {
	s := New([]string{"PLANTED-secret-0815", "line of a file", "aaaab"})
	text := "start PLANTED-secret-0815 mid line of a file aaaaab PLANTED-secret-08 end PLANTED-secret-0815"
	want := string(s.Bytes([]byte(text)))
	if strings.Contains(want, "PLANTED-secret-0815") || !strings.Contains(want, "PLANTED-secret-08 ") {
		t.Fatalf("whole redaction wrong: %q", want)
	}
	for cut := 0; cut <= len(text); cut++ {
		var out bytes.Buffer
		st := s.NewStream(&out)
		st.Write([]byte(text[:cut]))
		st.Write([]byte(text[cut:]))
		st.Flush()
		if out.String() != want {
			t.Fatalf("cut at %d: %q, want %q", cut, out.String(), want)
		}
	}
	r := rand.New(rand.NewPCG(1, 2))
	for range 200 {
		var out bytes.Buffer
		st := s.NewStream(&out)
		for rest := text; rest != ""; {
			n := 1 + r.IntN(min(len(rest), 7))
			if n, err := st.Write([]byte(rest[:n])); err != nil || n == 0 {
				t.Fatal(n, err)
			}
			rest = rest[n:]
		}
		st.Flush()
		if out.String() != want {
			t.Fatalf("random pieces: %q, want %q", out.String(), want)
		}
	}
}

// TestStreamHolds: only an end that may begin a value is held, and Flush
// lets it go.
func TestStreamHolds(t *testing.T) {
	s := New([]string{"PLANTED-secret-0815"})
	var out bytes.Buffer
	st := s.NewStream(&out)
	st.Write([]byte("prompt $ PLANT"))
	if out.String() != "prompt $ " || st.Held() != 5 {
		t.Fatalf("wrote %q, holds %d", out.String(), st.Held())
	}
	st.Write([]byte("S grow"))
	if out.String() != "prompt $ PLANTS grow" || st.Held() != 0 {
		t.Fatalf("wrote %q, holds %d", out.String(), st.Held())
	}
	st.Write([]byte(" P"))
	st.Flush()
	if out.String() != "prompt $ PLANTS grow P" {
		t.Fatalf("after Flush: %q", out.String())
	}
	// An empty set passes everything through at once.
	out.Reset()
	New(nil).NewStream(&out).Write([]byte("PLANT"))
	if out.String() != "PLANT" {
		t.Fatalf("empty set: %q", out.String())
	}
}

func BenchmarkStream(b *testing.B) {
	s := New([]string{"PLANTED-secret-0815", "another secret value", "a third one"})
	chunk := bytes.Repeat([]byte("ordinary output of a workload, line after line\n"), 700) // ~32 KiB
	b.SetBytes(int64(len(chunk)))
	st := s.NewStream(io.Discard)
	for b.Loop() {
		st.Write(chunk)
	}
}
