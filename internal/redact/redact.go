// Package redact replaces the secret values of a VM with "[redacted]" in
// what the agent keeps or answers of a guest and its workload: exec
// output, an AppVM's workload logs, a VM's serial console log, and the
// argv an audit entry names (docs/api.md, Guest operations: no answer
// carries a secret).
//
// A Set is built once per VM from every secret value the agent knows for
// it (vm/record's Secrets.Redactor): secret env values, the cloud-init
// password, the content of each secret file and each of its lines
// (FileValues). Values shorter than MinLen bytes are left out: replacing
// every "ab" of the output would mangle it and protect nothing.
//
// Overlapping matches are merged: one "[redacted]" replaces the whole run
// of bytes any value covers, so no byte of a secret is left beside it.
//
// Output arrives in pieces, so a secret may be split between two of them.
// Scan therefore says how much of a buffer is final: the rest may be the
// start of a secret and must wait for the next piece. A Stream does that
// for a plain byte stream; a caller that keeps pieces whole (the workload
// log stores a guest's chunk whole or not at all) uses Scan, Spans and
// AppendReplaced itself. What is held back is only an end that could
// begin a value (at most the longest value less one byte), or a value
// already begun that a longer one could continue.
package redact

import (
	"bytes"
	"io"
	"slices"
	"strings"
)

// Mark is what a secret value becomes.
const Mark = "[redacted]"

// MinLen is the length of the shortest value a Set replaces.
const MinLen = 4

// Set is a fixed set of secret values. A nil or empty Set replaces
// nothing. A Set is immutable and safe for concurrent use.
type Set struct {
	// values are distinct, at least MinLen long, longest first.
	values [][]byte
	// borders[i][j] is the length of the longest proper prefix of
	// values[i][:j+1] that is also its suffix (KMP's failure function):
	// with it, finding the end of a buffer that begins a value costs one
	// pass over that end, whatever the value repeats.
	borders [][]int32
}

// New returns the Set of values, leaving out duplicates and those shorter
// than MinLen.
func New(values ...string) *Set {
	s := &Set{}
	seen := make(map[string]bool, len(values))
	for _, v := range values {
		if len(v) < MinLen || seen[v] {
			continue
		}
		seen[v] = true
		s.values = append(s.values, []byte(v))
	}
	slices.SortStableFunc(s.values, func(a, b []byte) int { return len(b) - len(a) })
	s.borders = make([][]int32, len(s.values))
	for i, v := range s.values {
		s.borders[i] = borders(v)
	}
	return s
}

// borders returns v's failure function: for each j, the length of the
// longest proper prefix of v[:j+1] that is also its suffix.
func borders(v []byte) []int32 {
	b := make([]int32, len(v))
	k := int32(0)
	for j := 1; j < len(v); j++ {
		for k > 0 && v[j] != v[k] {
			k = b[k-1]
		}
		if v[j] == v[k] {
			k++
		}
		b[j] = k
	}
	return b
}

// FileValues returns what a secret file's content makes secret: the
// content itself, the content without its final line end, and each of its
// lines (without "\n" or "\r\n") of MinLen bytes or more, so that a
// workload printing one line of a key file, or the file through a command
// that drops its last newline, is caught too.
func FileValues(content string) []string {
	out := []string{content}
	trimmed := strings.TrimRight(content, "\r\n")
	if trimmed != content {
		out = append(out, trimmed)
	}
	for _, line := range strings.Split(content, "\n") {
		line = strings.TrimSuffix(line, "\r")
		if len(line) >= MinLen && line != content && line != trimmed {
			out = append(out, line)
		}
	}
	return out
}

// Empty reports whether s replaces nothing.
func (s *Set) Empty() bool { return s == nil || len(s.values) == 0 }

// Longest is the length of the longest value (0 for an empty set): a
// reader that starts inside output backs up this much less one byte to
// see a secret it starts in.
func (s *Set) Longest() int {
	if s.Empty() {
		return 0
	}
	return len(s.values[0])
}

// Span is the byte range [Start, End) of a buffer that secrets cover.
type Span struct{ Start, End int }

// Scan returns the spans of p that secret values cover, merged and in
// order, and cut: p[:cut] is final, and p[cut:] may be (or hold) the start
// of a secret that the next piece of the same stream completes. No span
// crosses cut; spans at or after cut are left out (a later Scan, of
// p[cut:] and what follows, finds them).
func (s *Set) Scan(p []byte) (spans []Span, cut int) {
	if s.Empty() {
		return nil, len(p)
	}
	spans = s.find(p)
	cut = len(p) - s.partialAtEnd(p)
	// A span reaching past the cut waits with it: a longer value that
	// may continue there could cover more.
	for i, sp := range spans {
		if sp.End > cut {
			cut = min(cut, sp.Start)
			spans = spans[:i]
			break
		}
	}
	return spans, cut
}

// Spans returns every span of p that a value covers, merged and in
// order, holding nothing back: for output that is complete.
func (s *Set) Spans(p []byte) []Span {
	if s.Empty() {
		return nil
	}
	return s.find(p)
}

// find returns every span of p that a value covers, merged, in order.
func (s *Set) find(p []byte) []Span {
	var spans []Span
	for _, v := range s.values {
		for off := 0; off+len(v) <= len(p); {
			i := bytes.Index(p[off:], v)
			if i < 0 {
				break
			}
			spans = append(spans, Span{off + i, off + i + len(v)})
			off += i + 1
		}
	}
	if len(spans) < 2 {
		return spans
	}
	slices.SortFunc(spans, func(a, b Span) int { return a.Start - b.Start })
	merged := spans[:1]
	for _, sp := range spans[1:] {
		last := &merged[len(merged)-1]
		if sp.Start < last.End { // adjacent values stay two marks
			last.End = max(last.End, sp.End)
			continue
		}
		merged = append(merged, sp)
	}
	return merged
}

// partialAtEnd returns the length of the longest end of p that is a
// proper prefix of a value.
func (s *Set) partialAtEnd(p []byte) int {
	longest := 0
	for i, v := range s.values {
		if len(v)-1 <= longest {
			break // the values that follow are no longer
		}
		longest = max(longest, prefixAtEnd(p, v, s.borders[i]))
	}
	return longest
}

// prefixAtEnd returns the length of the longest end of p that is a proper
// prefix of v, whose failure function is border: it runs KMP's automaton
// over the last len(v)-1 bytes of p (no longer end can be a proper
// prefix), skipping to v's first byte whenever nothing is matched.
func prefixAtEnd(p, v []byte, border []int32) int {
	w := p[max(len(p)-len(v)+1, 0):]
	q := 0 // how much of v the end of w[:i] matches
	for i := 0; i < len(w); i++ {
		if q == 0 {
			j := bytes.IndexByte(w[i:], v[0])
			if j < 0 {
				return 0
			}
			i += j
		}
		for q > 0 && v[q] != w[i] {
			q = int(border[q-1])
		}
		if v[q] == w[i] {
			q++ // never len(v): w is shorter than v
		}
	}
	return q
}

// AppendReplaced appends p to dst with each span (in order, not
// overlapping) replaced by Mark.
func AppendReplaced(dst, p []byte, spans []Span) []byte {
	last := 0
	for _, sp := range spans {
		dst = append(dst, p[last:sp.Start]...)
		dst = append(dst, Mark...)
		last = sp.End
	}
	return append(dst, p[last:]...)
}

// Bytes returns p with every value replaced by Mark, for output that is
// complete (nothing follows it): p itself when it holds none, else a new
// slice.
func (s *Set) Bytes(p []byte) []byte {
	spans := s.Spans(p)
	if len(spans) == 0 {
		return p
	}
	return AppendReplaced(make([]byte, 0, len(p)+len(spans)*len(Mark)), p, spans)
}

// String is Bytes for a string.
func (s *Set) String(v string) string {
	if s.Empty() {
		return v
	}
	return string(s.Bytes([]byte(v)))
}

// Strings returns vs with each element redacted on its own (an argv): vs
// itself when nothing was.
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

// Stream redacts one byte stream that is written in pieces to an
// underlying writer. It is not safe for concurrent use.
type Stream struct {
	set  *Set
	w    io.Writer
	held []byte // the end of the stream so far that may begin a value
	out  []byte // reused for what a Write passes on redacted
}

// NewStream returns a Stream of s writing to w; a nil or empty s passes
// everything through at once.
func (s *Set) NewStream(w io.Writer) *Stream { return &Stream{set: s, w: w} }

// Write redacts what of the stream is final with p and writes it to the
// underlying writer: all of it but an end that may begin a value, which
// is held until the next Write or Flush. It returns len(p) once the rest
// is written.
func (st *Stream) Write(p []byte) (int, error) {
	if st.set.Empty() {
		return st.w.Write(p)
	}
	buf := p
	if len(st.held) > 0 {
		buf = append(st.held, p...)
	}
	spans, cut := st.set.Scan(buf)
	out := buf[:cut]
	if len(spans) > 0 {
		st.out = AppendReplaced(st.out[:0], out, spans)
		out = st.out
	}
	if len(out) > 0 {
		if _, err := st.w.Write(out); err != nil {
			return 0, err
		}
	}
	// A new slice: buf may be p, or share the old held's array.
	st.held = append([]byte(nil), buf[cut:]...)
	return len(p), nil
}

// Flush writes what is held back, redacted: the stream has ended (so a
// value it began never completed), or the caller will not wait longer for
// the rest of one.
func (st *Stream) Flush() error {
	if len(st.held) == 0 {
		return nil
	}
	p := st.set.Bytes(st.held)
	st.held = nil
	_, err := st.w.Write(p)
	return err
}

// Held reports how many bytes the stream holds back.
func (st *Stream) Held() int { return len(st.held) }
