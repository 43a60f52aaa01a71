package seed

import (
	"fmt"
	"strings"
	"unicode/utf8"
)

// quote returns s as a YAML double-quoted scalar. Besides the quote and the
// backslash it escapes everything PyYAML treats as a line break or refuses
// as non-printable: C0 controls, DEL, C1 controls (NEL included), U+2028,
// U+2029, the BOM and U+FFFE/U+FFFF. Invalid UTF-8 becomes U+FFFD; Validate
// rejects such input before rendering.
func quote(s string) string {
	var b strings.Builder
	b.Grow(len(s) + 2)
	b.WriteByte('"')
	for _, r := range s {
		switch {
		case r == '"':
			b.WriteString(`\"`)
		case r == '\\':
			b.WriteString(`\\`)
		case r == '\n':
			b.WriteString(`\n`)
		case r == '\t':
			b.WriteString(`\t`)
		case r == '\r':
			b.WriteString(`\r`)
		case r < 0x20 || r >= 0x7F && r <= 0x9F:
			fmt.Fprintf(&b, `\x%02X`, r)
		case r == 0x2028 || r == 0x2029 || r == 0xFEFF || r == 0xFFFE || r == 0xFFFF:
			fmt.Fprintf(&b, `\u%04X`, r)
		case r == utf8.RuneError:
			b.WriteString(`\uFFFD`)
		default:
			b.WriteRune(r)
		}
	}
	b.WriteByte('"')
	return b.String()
}
