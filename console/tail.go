package console

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"regexp"
	"strings"
	"unicode"

	"vmhost/internal/nofollow"
)

// MaxLineRunes bounds each line Tail returns, so a summary stays short
// even when the guest printed a huge line.
const MaxLineRunes = 200

// tailWindow bounds how much of each file Tail reads: far more than a
// summary's few lines need, and far less than the files can hold.
const tailWindow = 64 << 10

// Tail returns the last n non-blank lines the guest printed since the last
// Marker, read across the rotation (path.1, then path), as one readable
// string: ANSI escape sequences and other control characters removed, a
// carriage-return overwrite reduced to what a terminal would show last,
// lines longer than MaxLineRunes cut with "…", joined by " | ". A missing
// log gives "" and no error.
func Tail(path string, n int) (string, error) {
	var data []byte
	for _, p := range []string{path + ".1", path} {
		b, err := readEnd(p, tailWindow)
		if err != nil {
			return "", err
		}
		data = append(data, b...)
	}
	if i := bytes.LastIndex(data, []byte(Marker)); i >= 0 {
		data = data[i:]
		if j := bytes.IndexByte(data, '\n'); j >= 0 {
			data = data[j+1:]
		} else {
			data = nil
		}
	}
	var lines []string
	for _, raw := range strings.Split(string(data), "\n") {
		if l := cleanLine(raw); l != "" {
			lines = append(lines, l)
		}
	}
	if n >= 0 && len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, " | "), nil
}

// readEnd reads at most limit bytes from the end of path; a missing file is
// empty.
func readEnd(path string, limit int64) ([]byte, error) {
	f, err := nofollow.Open(path) // in a directory a confined VM owns
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("reading console log: %w", err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("reading console log: %w", err)
	}
	off := max(st.Size()-limit, 0)
	b, err := io.ReadAll(io.NewSectionReader(f, off, st.Size()-off))
	if err != nil {
		return nil, fmt.Errorf("reading console log: %w", err)
	}
	return b, nil
}

// ansiRE matches the escape sequences terminals interpret: CSI (colours,
// cursor moves), OSC (titles, ended by BEL or ST) and two-byte escapes.
var ansiRE = regexp.MustCompile("\x1b\\[[0-?]*[ -/]*[@-~]|\x1b\\][^\x07\x1b]*(\x07|\x1b\\\\)?|\x1b[@-Z\\\\-_]|\x1b")

// cleanLine turns one raw console line into plain text.
func cleanLine(s string) string {
	s = strings.ToValidUTF8(s, "\uFFFD")
	s = ansiRE.ReplaceAllString(s, "")
	// "progress 10%\rprogress 20%": keep what the terminal shows last.
	s = strings.TrimRight(s, "\r")
	if i := strings.LastIndexByte(s, '\r'); i >= 0 {
		s = s[i+1:]
	}
	s = strings.Map(func(r rune) rune {
		switch {
		case r == '\t':
			return ' '
		case unicode.IsControl(r), r == 0x2028, r == 0x2029, r == 0xFEFF:
			return -1
		}
		return r
	}, s)
	s = strings.Join(strings.Fields(s), " ")
	if r := []rune(s); len(r) > MaxLineRunes {
		s = string(r[:MaxLineRunes-1]) + "…"
	}
	return s
}
