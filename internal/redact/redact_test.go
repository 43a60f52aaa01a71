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
	s := New("hunter22", "abc", "hunter22", "PLANTED-secret", "secret-tail", "")
	for _, tc := range []struct{ in, want string }{
		{"nothing here", "nothing here"},
		{"pw=hunter22.", "pw=[redacted]."},
		{"hunter22hunter22", "[redacted][redacted]"},
		// abc is shorter than MinLen: left alone.
		{"abc abc", "abc abc"},
		// Overlapping values are one mark.
		{"PLANTED-secret-tail!", "[redacted]!"},
		{"x PLANTED-secret y secret-tail", "x [redacted] y [redacted]"},
		{"hunter2", "hunter2"},
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
	if got := none.String("hunter22"); got != "hunter22" || !none.Empty() || !New().Empty() || none.Longest() != 0 {
		t.Error("a nil or empty set redacts")
	}
	if !New("ab", "").Empty() {
		t.Error("values below MinLen make a set that is not empty")
	}
	args := []string{"echo", "hunter22"}
	if got := s.Strings(args); !slices.Equal(got, []string{"echo", Mark}) || args[1] != "hunter22" {
		t.Errorf("Strings = %q (input %q)", got, args)
	}
	if clean := []string{"echo", "hi"}; &s.Strings(clean)[0] != &clean[0] {
		t.Error("Strings copied an argv without a secret")
	}
}

// TestBytesNestedValues: a value inside another, and values sharing bytes.
func TestBytesNestedValues(t *testing.T) {
	s := New("hunter22", "ab", "s3cr3t-value", "s3cr3t", "over", "overlapping")
	for _, tc := range []struct{ in, want string }{
		{"ab is short", "ab is short"},
		{"s3cr3t-value and s3cr3t", "[redacted] and [redacted]"},
		{"xoverlappingx", "x[redacted]x"},
		{"over and overlapping", "[redacted] and [redacted]"},
	} {
		if got := s.String(tc.in); got != tc.want {
			t.Errorf("String(%q) = %q, want %q", tc.in, got, tc.want)
		}
	}
	if s.Longest() != len("s3cr3t-value") {
		t.Errorf("Longest = %d", s.Longest())
	}
}

func TestOverlappingValuesLeaveNoByte(t *testing.T) {
	// "abcdef" and "defghi" overlap in "abcdefghi": one mark covers both,
	// so no byte of either is left.
	s := New("abcdef", "defghi")
	if got := s.String("<abcdefghi>"); got != "<[redacted]>" {
		t.Errorf("got %q", got)
	}
}

func TestFileValues(t *testing.T) {
	got := FileValues("user: admin\r\npassword: s3cr3t\nab\n\nlast line")
	want := []string{"user: admin\r\npassword: s3cr3t\nab\n\nlast line", "user: admin", "password: s3cr3t", "last line"}
	if !slices.Equal(got, want) {
		t.Errorf("FileValues = %q, want %q", got, want)
	}
	if got := FileValues("token\n"); !slices.Equal(got, []string{"token\n", "token"}) {
		t.Errorf("FileValues(token\\n) = %q", got)
	}
	if got := FileValues("token"); !slices.Equal(got, []string{"token"}) {
		t.Errorf("FileValues(token) = %q, want the content alone", got)
	}

	content := "-----BEGIN KEY-----\r\nMIIBVQIBADANBg\nxyz\n-----END KEY-----\n"
	s := New(FileValues(content)...)
	out := s.String("the key line MIIBVQIBADANBg was printed, and xyz too; " + content)
	if strings.Contains(out, "MIIBVQIBADANBg") || strings.Contains(out, "BEGIN KEY") || strings.Contains(out, "END KEY") {
		t.Errorf("a line of the file survived: %q", out)
	}
	if !strings.Contains(out, "xyz too") {
		t.Errorf("a line shorter than MinLen was replaced: %q", out)
	}
	// The file printed without its last newline (a shell's $(cat …)) is
	// one mark, its short line included.
	if out := s.String("<" + strings.TrimRight(content, "\n") + ">"); out != "<[redacted]>" {
		t.Errorf("the file without its final newline: %q", out)
	}
}

// TestLongValue: a value of any length is matched whole (a secret file
// of one long line has no shorter line to be caught by), in a stream too.
func TestLongValue(t *testing.T) {
	big := strings.Repeat("k", 1<<20-1) + "!"
	s := New(big)
	if s.Longest() != len(big) {
		t.Fatalf("Longest = %d", s.Longest())
	}
	if got := s.String("<" + big + ">"); got != "<[redacted]>" {
		t.Errorf("a 1 MiB value is not redacted: %d bytes", len(got))
	}
	var out bytes.Buffer
	st := s.NewStream(&out)
	for rest := "<" + big + ">"; rest != ""; {
		n := min(len(rest), 32<<10)
		st.Write([]byte(rest[:n]))
		rest = rest[n:]
	}
	st.Flush()
	if out.String() != "<[redacted]>" {
		t.Errorf("a 1 MiB value in 32 KiB pieces: %d bytes out", out.Len())
	}
}

func TestScanHoldsAPossibleStart(t *testing.T) {
	s := New("password123", "pass")
	for _, tc := range []struct {
		in       string
		cut      int
		replaced string
	}{
		{"hello pa", 6, "hello "},
		{"hello pass", 6, "hello "}, // "pass" is complete, but password123 may follow
		{"hello password123", 17, "hello [redacted]"},
		{"hello passport", 14, "hello [redacted]port"},
		{"plain", 5, "plain"},
		{"x p", 2, "x "},
	} {
		spans, cut := s.Scan([]byte(tc.in))
		if cut != tc.cut {
			t.Errorf("Scan(%q) cut = %d, want %d", tc.in, cut, tc.cut)
		}
		if got := string(AppendReplaced(nil, []byte(tc.in)[:cut], spans)); got != tc.replaced {
			t.Errorf("Scan(%q) final part = %q, want %q", tc.in, got, tc.replaced)
		}
	}
}

// TestPrefixAtEnd: the automaton finds what trying every end of the
// buffer finds, for values that repeat themselves.
func TestPrefixAtEnd(t *testing.T) {
	naive := func(p, v []byte) int {
		for n := min(len(p), len(v)-1); n > 0; n-- {
			if bytes.HasPrefix(v, p[len(p)-n:]) {
				return n
			}
		}
		return 0
	}
	r := rand.New(rand.NewPCG(3, 4))
	for _, v := range []string{"aaaa", "abab", "aabaab", "abaababa", "abcabd", "xyzw"} {
		b := borders([]byte(v))
		for range 2000 {
			p := make([]byte, r.IntN(20))
			for i := range p {
				p[i] = "abxyz"[r.IntN(5)]
			}
			if got, want := prefixAtEnd(p, []byte(v), b), naive(p, []byte(v)); got != want {
				t.Fatalf("prefixAtEnd(%q, %q) = %d, want %d", p, v, got, want)
			}
		}
	}
}

// pieces writes text to a new stream of s in pieces of 1..maxPiece bytes
// drawn from r, checks what it holds meanwhile, and returns what came out.
func pieces(t *testing.T, s *Set, text []byte, r *rand.Rand, maxPiece int) []byte {
	t.Helper()
	var out bytes.Buffer
	st := s.NewStream(&out)
	for rest := text; len(rest) > 0; {
		n := 1 + r.IntN(min(len(rest), maxPiece))
		if w, err := st.Write(rest[:n]); err != nil || w != n {
			t.Fatalf("Write = %d, %v; want %d", w, err, n)
		}
		if st.Held() >= 2*s.Longest() {
			t.Fatalf("%d bytes held, the longest value is %d", st.Held(), s.Longest())
		}
		rest = rest[n:]
	}
	if err := st.Flush(); err != nil || st.Held() != 0 {
		t.Fatalf("Flush: %v, %d held", err, st.Held())
	}
	return out.Bytes()
}

// TestStreamSplit writes output holding secrets in every possible cut
// into two, and in random pieces: the result is always that of redacting
// the whole at once.
func TestStreamSplit(t *testing.T) {
	s := New("PLANTED-secret-0815", "line of a file", "aaaab")
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
		if got := string(pieces(t, s, []byte(text), r, 7)); got != want {
			t.Fatalf("random pieces: %q, want %q", got, want)
		}
	}
}

// TestStreamMatchesWhole: however output made of secrets, their parts and
// other bytes is cut into pieces, the stream's output is what the whole
// output redacted at once gives, and no secret survives.
func TestStreamMatchesWhole(t *testing.T) {
	secrets := []string{"hunter22", "s3cr3t-value", "s3cr3t", "aaaab", "abab", "ABCDEFGHIJKLMNOPQRSTUVWXYZ"}
	s := New(secrets...)
	r := rand.New(rand.NewPCG(1, 2))
	alphabet := []string{"a", "b", "x", "\n", "hunter22", "hunter2", "s3cr3t", "s3cr3t-value", "-value", "aaaa", "ab", "ABCDEFGHIJKLM", "NOPQRSTUVWXYZ"}
	for round := range 2000 {
		var whole []byte
		for range r.IntN(40) {
			whole = append(whole, alphabet[r.IntN(len(alphabet))]...)
		}
		got := pieces(t, s, whole, r, 12)
		if want := s.Bytes(whole); !bytes.Equal(got, want) {
			t.Fatalf("round %d: stream gave %q, whole gives %q (input %q)", round, got, want, whole)
		}
		for _, v := range secrets {
			if bytes.Contains(got, []byte(v)) {
				t.Fatalf("round %d: %q survived in %q", round, v, got)
			}
		}
	}
}

// TestStreamHolds: only an end that may begin a value is held, and Flush
// lets it go.
func TestStreamHolds(t *testing.T) {
	s := New("PLANTED-secret-0815")
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
	// A complete value that a longer one may continue is held, and
	// Flush redacts it.
	out.Reset()
	st = New("password123", "pass").NewStream(&out)
	st.Write([]byte("pw: pass"))
	if out.String() != "pw: " || st.Held() != 4 {
		t.Fatalf("wrote %q, holds %d", out.String(), st.Held())
	}
	st.Flush()
	if out.String() != "pw: [redacted]" {
		t.Fatalf("after Flush: %q", out.String())
	}
}

func TestStreamWithoutSecretsPassesThrough(t *testing.T) {
	var out bytes.Buffer
	st := New("ab").NewStream(&out) // below MinLen: an empty set
	if n, err := st.Write([]byte("abc")); n != 3 || err != nil || out.String() != "abc" || st.Held() != 0 {
		t.Errorf("Write = %d, %v: %q, held %d", n, err, out.String(), st.Held())
	}
	out.Reset()
	var none *Set
	none.NewStream(&out).Write([]byte("PLANT"))
	if out.String() != "PLANT" {
		t.Errorf("nil set: %q", out.String())
	}
}

// TestStreamWriteError: the underlying writer's error comes back.
func TestStreamWriteError(t *testing.T) {
	st := New("hunter22").NewStream(failWriter{})
	if n, err := st.Write([]byte("output")); n != 0 || err != io.ErrClosedPipe {
		t.Errorf("Write = %d, %v", n, err)
	}
}

type failWriter struct{}

func (failWriter) Write([]byte) (int, error) { return 0, io.ErrClosedPipe }

func BenchmarkStream(b *testing.B) {
	s := New("PLANTED-secret-0815", "another secret value", "a third one")
	chunk := bytes.Repeat([]byte("ordinary output of a workload, line after line\n"), 700) // ~32 KiB
	b.SetBytes(int64(len(chunk)))
	st := s.NewStream(io.Discard)
	for b.Loop() {
		st.Write(chunk)
	}
}

func BenchmarkScan64KiB(b *testing.B) {
	s := New("hunter22", "s3cr3t-value", "-----BEGIN KEY-----", "MIIBVQIBADANBgkqhkiG9w0BAQEFAASCAT8wggE7AgEAAkEA")
	p := bytes.Repeat([]byte("an ordinary line of workload output, nothing secret in it\n"), 64<<10/58)
	b.SetBytes(int64(len(p)))
	for b.Loop() {
		s.Scan(p)
	}
}
