// Package metrics writes the Prometheus text exposition format 0.0.4:
// families with HELP and TYPE, samples with escaped labels, and the
// agent's own process and Go runtime metrics read from /proc/self and the
// runtime.
package metrics

import (
	"bytes"
	"math"
	"strconv"
	"strings"
)

// ContentType is the exposition format's media type.
const ContentType = "text/plain; version=0.0.4; charset=utf-8"

// Family types.
const (
	Counter = "counter"
	Gauge   = "gauge"
)

// Writer builds an exposition. Each family is declared once with Family
// and its samples follow before the next Family; the zero value is ready.
type Writer struct {
	b bytes.Buffer
}

// Family starts a family: its HELP and TYPE lines.
func (w *Writer) Family(name, typ, help string) {
	w.b.WriteString("# HELP ")
	w.b.WriteString(name)
	w.b.WriteByte(' ')
	w.b.WriteString(helpEscaper.Replace(help))
	w.b.WriteString("\n# TYPE ")
	w.b.WriteString(name)
	w.b.WriteByte(' ')
	w.b.WriteString(typ)
	w.b.WriteByte('\n')
}

// Sample writes one sample of name; labels are name, value pairs.
func (w *Writer) Sample(name string, value float64, labels ...string) {
	w.b.WriteString(name)
	if len(labels) > 0 {
		w.b.WriteByte('{')
		for i := 0; i+1 < len(labels); i += 2 {
			if i > 0 {
				w.b.WriteByte(',')
			}
			w.b.WriteString(labels[i])
			w.b.WriteString(`="`)
			w.b.WriteString(labelEscaper.Replace(labels[i+1]))
			w.b.WriteByte('"')
		}
		w.b.WriteByte('}')
	}
	w.b.WriteByte(' ')
	w.b.WriteString(formatValue(value))
	w.b.WriteByte('\n')
}

// Bytes is the exposition so far.
func (w *Writer) Bytes() []byte { return w.b.Bytes() }

var (
	helpEscaper  = strings.NewReplacer(`\`, `\\`, "\n", `\n`)
	labelEscaper = strings.NewReplacer(`\`, `\\`, "\n", `\n`, `"`, `\"`)
)

func formatValue(v float64) string {
	switch {
	case math.IsInf(v, 1):
		return "+Inf"
	case math.IsInf(v, -1):
		return "-Inf"
	case math.IsNaN(v):
		return "NaN"
	}
	return strconv.FormatFloat(v, 'g', -1, 64)
}
