// Package redact replaces a VM's secret values by "[redacted]" in what the
// agent answers with: exec output, workload logs, console output, and the
// argv an audit entry names (docs/api.md, Authentication: no answer carries
// a secret).
//
// A Set holds the values (see vm/record's Secrets.Values for which ones a
// VM has); values shorter than MinLen are left alone, as they would mangle
// ordinary output, and a value longer than MaxLen is matched through its
// lines only. Overlapping matches become one mark. A Stream redacts output
// that arrives in pieces: a piece that ends with the start of a value is
// held back until the next piece shows whether the value completes, so a
// value cut in two is still caught; Flush writes what is held once the
// stream has ended (or a caller decides it waited long enough).
package redact

import (
	"bytes"
	"io"
	"slices"
	"strings"
)

// Mark replaces each secret value.
const Mark = "[redacted]"

// MinLen is the length of the shortest value redacted.
const MinLen = 4

// MaxLen is the length of the longest value matched whole. A longer one
// (a large secret file) is matched by its lines, which Values lists too:
// holding back up to MaxLen bytes of a stream is the price of a value,
// and matching costs up to its length per piece.
const MaxLen = 64 << 10

// Set is the secret values of one VM. The zero value and nil redact
// nothing. A Set is immutable and safe for concurrent use.
type Set struct {
	// values are distinct, at least MinLen and at most MaxLen long,
	// longest first.
	values [][]byte
}

// New returns the set of values (duplicates and values out of
// MinLen..MaxLen dropped).
func New(values []string) *Set {
	s := &Set{}
	seen := map[string]bool{}
	for _, v := range values {
		if len(v) < MinLen || len(v) > MaxLen || seen[v] {
			continue
		}
		seen[v] = true
		s.values = append(s.values, []byte(v))
	}
	slices.SortFunc(s.values, func(a, b []byte) int { return len(b) - len(a) })
	return s
}

// Empty reports whether s redacts nothing.
func (s *Set) Empty() bool { return s == nil || len(s.values) == 0 }

// Bytes returns b with every value replaced by Mark: b itself when no
// value occurs in it, else a new slice.
func (s *Set) Bytes(b []byte) []byte {
	if s.Empty() {
		return b
	}
	var spans []span
	for _, v := range s.values {
		for off := 0; ; {
			i := bytes.Index(b[off:], v)
			if i < 0 {
				break
			}
			spans = append(spans, span{off + i, off + i + len(v)})
			off += i + 1
		}
	}
	if len(spans) == 0 {
		return b
	}
	slices.SortFunc(spans, func(a, b span) int { return a.start - b.start })
	out := make([]byte, 0, len(b)+len(spans)*len(Mark))
	at := 0
	for i := 0; i < len(spans); {
		start, end := spans[i].start, spans[i].end
		// Overlapping matches (one value inside or across another) are
		// one mark.
		for i++; i < len(spans) && spans[i].start < end; i++ {
			end = max(end, spans[i].end)
		}
		out = append(append(out, b[at:start]...), Mark...)
		at = end
	}
	return append(out, b[at:]...)
}

type span struct{ start, end int }

// String is Bytes for a string.
func (s *Set) String(v string) string {
	if s.Empty() {
		return v
	}
	return string(s.Bytes([]byte(v)))
}

// Strings returns vs with each element redacted (vs itself when nothing
// was).
func (s *Set) Strings(vs []string) []string {
	var out []string
	for i, v := range vs {
		r := s.String(v)
		if r != v && out == nil {
			out = slices.Clone(vs)
		}
		if out != nil {
			out[i] = r
		}
	}
	if out == nil {
		return vs
	}
	return out
}

// heldPrefix returns the length of the longest end of p that is a proper
// prefix of a value: what a stream must hold back.
func (s *Set) heldPrefix(p []byte) int {
	longest := 0
	for _, v := range s.values {
		// Only ends shorter than v can be proper prefixes of it.
		for i := max(len(p)-len(v)+1, 0); i < len(p)-longest; i++ {
			if p[i] == v[0] && bytes.HasPrefix(v, p[i:]) {
				longest = len(p) - i
				break
			}
		}
	}
	return longest
}

// Stream redacts a stream written in pieces to w. It is not safe for
// concurrent use.
type Stream struct {
	s    *Set
	w    io.Writer
	held []byte
}

// NewStream returns a Stream of s writing to w.
func (s *Set) NewStream(w io.Writer) *Stream { return &Stream{s: s, w: w} }

// Write redacts p and writes it to the underlying writer, except an end
// that may begin a value, which is held back. It returns len(p) once the
// rest is written.
func (st *Stream) Write(p []byte) (int, error) {
	if st.s.Empty() {
		return st.w.Write(p)
	}
	buf := p
	if len(st.held) > 0 {
		buf = append(st.held, p...)
	}
	buf = st.s.Bytes(buf)
	keep := st.s.heldPrefix(buf)
	out := buf[:len(buf)-keep]
	st.held = append(st.held[:0:0], buf[len(buf)-keep:]...)
	if len(out) > 0 {
		if _, err := st.w.Write(out); err != nil {
			return 0, err
		}
	}
	return len(p), nil
}

// Held reports how many bytes the stream holds back.
func (st *Stream) Held() int { return len(st.held) }

// Flush writes what is held back: the stream ended, or the caller will
// not wait longer for the rest of a value.
func (st *Stream) Flush() error {
	if len(st.held) == 0 {
		return nil
	}
	p := st.held
	st.held = nil
	_, err := st.w.Write(p)
	return err
}

// Lines returns the lines of a secret file's content worth matching on
// their own: each line (without its line ending) of MinLen bytes or more,
// and the content without a final line ending.
func Lines(content string) []string {
	var out []string
	trimmed := strings.TrimRight(content, "\r\n")
	if trimmed != content {
		out = append(out, trimmed)
	}
	for _, l := range strings.Split(content, "\n") {
		l = strings.TrimSuffix(l, "\r")
		if len(l) >= MinLen && l != content && l != trimmed {
			out = append(out, l)
		}
	}
	return out
}
