// Package redact replaces the secret values of a VM with "[redacted]" in
// what the agent keeps or answers of a guest's output: an AppVM's workload
// logs, a VM's serial console log, exec output (docs/api.md, Secrets).
//
// A Set is built once per VM from every secret value the agent knows for
// it (vm/record's Secrets.Redactor): secret env values, the cloud-init
// password, the content of each secret file and each of its lines. Values
// shorter than MinLen bytes are left out: replacing every "ab" of the
// output would mangle it and protect nothing.
//
// Output arrives in pieces, so a secret may be split between two of them.
// Scan therefore says how much of a buffer is final: the rest may be the
// start of a secret and must wait for the next piece (a Stream does that
// for a plain byte stream). What is held back is at most the longest
// secret less one byte, or a secret already begun.
//
// Overlapping matches are merged: "[redacted]" replaces the whole run of
// bytes any secret covers, so no byte of a secret is left beside it.
package redact

import (
	"bytes"
	"slices"
	"strings"
)

// Replacement is what a secret value becomes.
const Replacement = "[redacted]"

// MinLen is the shortest value a Set replaces.
const MinLen = 4

// Set is a fixed set of secret values. A nil or empty Set replaces
// nothing. It is safe for concurrent use.
type Set struct {
	values [][]byte // longest first, no duplicates
}

// New returns the Set of values, leaving out those shorter than MinLen.
func New(values ...string) *Set {
	s := &Set{}
	for _, v := range values {
		if len(v) < MinLen || slices.ContainsFunc(s.values, func(b []byte) bool { return string(b) == v }) {
			continue
		}
		s.values = append(s.values, []byte(v))
	}
	slices.SortFunc(s.values, func(a, b []byte) int { return len(b) - len(a) })
	return s
}

// FileValues returns what a secret file's content makes secret: the
// content itself and each of its lines (without the line end, "\n" or
// "\r\n"), so that a workload printing one line of a key file is caught
// too. New leaves out the short ones.
func FileValues(content string) []string {
	out := []string{content}
	for _, line := range strings.Split(content, "\n") {
		line = strings.TrimSuffix(line, "\r")
		if line != content {
			out = append(out, line)
		}
	}
	return out
}

// MaxLen is the length of the longest value (0 for an empty set): a
// reader that starts inside output backs up this much less one byte to
// see a secret it starts in.
func (s *Set) MaxLen() int {
	if s.Empty() {
		return 0
	}
	return len(s.values[0])
}

// Empty reports whether s replaces nothing.
func (s *Set) Empty() bool { return s == nil || len(s.values) == 0 }

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
	// A span crossing the cut waits with it: a longer secret that may
	// continue could cover more.
	for i, sp := range spans {
		if sp.End > cut {
			if sp.Start < cut {
				cut = sp.Start
			}
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
		for off := 0; off < len(p); {
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
		if sp.Start < last.End { // adjacent values stay two replacements
			last.End = max(last.End, sp.End)
			continue
		}
		merged = append(merged, sp)
	}
	return merged
}

// partialAtEnd returns the length of the longest end of p that is a
// proper prefix of a secret value.
func (s *Set) partialAtEnd(p []byte) int {
	longest := 0
	for _, v := range s.values {
		for i := max(len(p)-len(v)+1, 0); i < len(p)-longest; i++ {
			if p[i] == v[0] && bytes.HasPrefix(v, p[i:]) {
				longest = len(p) - i
				break
			}
		}
	}
	return longest
}

// AppendReplaced appends p to dst with each span replaced by Replacement.
func AppendReplaced(dst, p []byte, spans []Span) []byte {
	last := 0
	for _, sp := range spans {
		dst = append(dst, p[last:sp.Start]...)
		dst = append(dst, Replacement...)
		last = sp.End
	}
	return append(dst, p[last:]...)
}

// Bytes returns p with every secret replaced (p itself when it holds
// none), for output that is complete: nothing follows it.
func (s *Set) Bytes(p []byte) []byte {
	if s.Empty() {
		return p
	}
	spans := s.find(p)
	if len(spans) == 0 {
		return p
	}
	return AppendReplaced(make([]byte, 0, len(p)), p, spans)
}

// String is Bytes for a string.
func (s *Set) String(v string) string {
	if s.Empty() {
		return v
	}
	return string(s.Bytes([]byte(v)))
}

// Stream redacts one byte stream that arrives in pieces. It is not safe
// for concurrent use.
type Stream struct {
	set  *Set
	held []byte
}

// NewStream returns a Stream over s; a nil or empty s passes everything.
func (s *Set) NewStream() *Stream { return &Stream{set: s} }

// Write takes the next piece p of the stream and returns what is final
// of the stream so far, redacted: all of it but an end that may begin a
// secret, which is held until the next Write or Flush. The result is
// valid until the next call.
func (st *Stream) Write(p []byte) []byte {
	if st.set.Empty() {
		return p
	}
	buf := append(st.held, p...)
	spans, cut := st.set.Scan(buf)
	out := AppendReplaced(make([]byte, 0, cut), buf[:cut], spans)
	st.held = append(st.held[:0:0], buf[cut:]...)
	return out
}

// Flush returns what is held back, redacted: the stream has ended, so a
// secret it began never completed.
func (st *Stream) Flush() []byte {
	held := st.held
	st.held = nil
	return st.set.Bytes(held)
}

// Held is how many bytes Write holds back now.
func (st *Stream) Held() int { return len(st.held) }
