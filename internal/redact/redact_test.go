package redact

import (
	"bytes"
	"math/rand/v2"
	"strings"
	"testing"
)

func TestBytes(t *testing.T) {
	s := New("hunter22", "ab", "s3cr3t-value", "s3cr3t", "over", "overlapping")
	for _, tc := range []struct{ in, want string }{
		{"nothing here", "nothing here"},
		{"pw=hunter22!", "pw=[redacted]!"},
		{"ab is short", "ab is short"}, // below MinLen: left alone
		{"s3cr3t-value and s3cr3t", "[redacted] and [redacted]"},
		{"hunter22hunter22", "[redacted][redacted]"},
		{"xoverlappingx", "x[redacted]x"},
		{"hunter2", "hunter2"},
	} {
		if got := string(s.Bytes([]byte(tc.in))); got != tc.want {
			t.Errorf("Bytes(%q) = %q, want %q", tc.in, got, tc.want)
		}
	}
	if got := New().String("hunter22"); got != "hunter22" {
		t.Errorf("empty set: %q", got)
	}
	var nilSet *Set
	if got := nilSet.String("x"); got != "x" || !nilSet.Empty() {
		t.Errorf("nil set: %q", got)
	}
}

func TestOverlappingValuesLeaveNoByte(t *testing.T) {
	// "abcdef" and "defghi" overlap in "abcdefghi": one replacement covers
	// both, so no byte of either is left.
	s := New("abcdef", "defghi")
	if got := s.String("<abcdefghi>"); got != "<[redacted]>" {
		t.Errorf("got %q", got)
	}
}

func TestFileValues(t *testing.T) {
	content := "-----BEGIN KEY-----\r\nMIIBVQIBADANBg\nxyz\n-----END KEY-----\n"
	s := New(FileValues(content)...)
	got := s.String("the key line MIIBVQIBADANBg was printed, and xyz too; " + content)
	if strings.Contains(got, "MIIBVQIBADANBg") || strings.Contains(got, "BEGIN KEY") || strings.Contains(got, "END KEY") {
		t.Errorf("a line of the file survived: %q", got)
	}
	if !strings.Contains(got, "xyz too") {
		t.Errorf("a line shorter than MinLen was replaced: %q", got)
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

// TestStreamMatchesWhole: however the output is cut into pieces, the
// stream's output is what the whole output redacted at once gives.
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
		st := s.NewStream()
		var got []byte
		for rest := whole; len(rest) > 0; {
			n := 1 + r.IntN(min(len(rest), 12))
			got = append(got, st.Write(rest[:n])...)
			if st.Held() >= 2*len("ABCDEFGHIJKLMNOPQRSTUVWXYZ") {
				t.Fatalf("round %d: %d bytes held", round, st.Held())
			}
			rest = rest[n:]
		}
		got = append(got, st.Flush()...)
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

func TestStreamWithoutSecretsPassesThrough(t *testing.T) {
	st := New("ab").NewStream() // below MinLen: an empty set
	if got := string(st.Write([]byte("abc"))); got != "abc" || st.Held() != 0 {
		t.Errorf("Write = %q, held %d", got, st.Held())
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
