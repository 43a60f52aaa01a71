package config

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"sort"
	"strconv"
	"strings"
)

// Problem is one thing wrong with a configuration: the key it is about,
// what is wrong, and where the file holds that key (Line and Column count
// from 1, Column in bytes, as compilers and editors do; 0 when the file
// does not hold the key, for example a default that another key
// contradicts).
type Problem struct {
	Key          string // "networks[1].mtu"; "" for the document as a whole
	Msg          string
	Line, Column int
}

func (p Problem) String() string {
	var b strings.Builder
	if p.Line > 0 {
		fmt.Fprintf(&b, "%d:%d: ", p.Line, p.Column)
	}
	if p.Key != "" {
		b.WriteString(p.Key + ": ")
	}
	b.WriteString(p.Msg)
	return b.String()
}

// Error is an invalid configuration: every problem found, in document
// order where the file holds the keys. File is the path it was read from
// ("" for Parse and Validate); each line of Error() then starts with
// FILE:LINE:COLUMN, so an editor can jump to it.
type Error struct {
	File     string
	Problems []Problem
}

func (e *Error) Error() string {
	var b strings.Builder
	if e.File != "" {
		fmt.Fprintf(&b, "config %s is invalid:", e.File)
	} else {
		b.WriteString("invalid config:")
	}
	for _, p := range e.Problems {
		b.WriteString("\n")
		if e.File != "" {
			b.WriteString(e.File + ":")
			if p.Line == 0 {
				b.WriteString(" ")
			}
		}
		b.WriteString(p.String())
	}
	return b.String()
}

// locator knows where each key of a JSON document starts.
type locator struct {
	data []byte
	// starts are the offsets where each key's value starts ("" the
	// document), and keys the key whose name starts at an offset.
	starts map[string]int
	order  []keyAt // every value, in document order
}

type keyAt struct {
	key    string
	offset int
}

// position turns a byte offset into a 1-based line and byte column.
func (l *locator) position(off int) (line, col int) {
	off = min(max(off, 0), len(l.data))
	line = 1 + bytes.Count(l.data[:off], []byte("\n"))
	col = off - bytes.LastIndexByte(l.data[:off], '\n')
	return line, col
}

// at returns p with the position of its key, when the document holds it.
func (l *locator) at(p Problem) Problem {
	if off, ok := l.starts[p.Key]; ok {
		p.Line, p.Column = l.position(off)
	}
	return p
}

// enclosing returns the key of the innermost value that starts before off.
func (l *locator) enclosing(off int) (string, int) {
	i := sort.Search(len(l.order), func(i int) bool { return l.order[i].offset >= off })
	if i == 0 {
		return "", 0
	}
	return l.order[i-1].key, l.order[i-1].offset
}

// skipSpace returns the offset of the next token at or after off:
// whitespace, and the commas and colons between tokens, are skipped.
func skipSpace(data []byte, off int) int {
	for off < len(data) && strings.IndexByte(" \t\r\n,:", data[off]) >= 0 {
		off++
	}
	return off
}

// locate walks a syntactically valid JSON document along the type t (the
// Config struct), recording where each value starts, and reports keys t
// does not have, with their position.
func locate(data []byte, t reflect.Type) (*locator, []Problem, error) {
	l := &locator{data: data, starts: map[string]int{}}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	var unknown []Problem
	var walk func(t reflect.Type, key string) error
	walk = func(t reflect.Type, key string) error {
		for t != nil && t.Kind() == reflect.Pointer {
			t = t.Elem()
		}
		start := skipSpace(data, int(dec.InputOffset()))
		l.starts[key] = start
		l.order = append(l.order, keyAt{key, start})
		tok, err := dec.Token()
		if err != nil {
			return err
		}
		switch tok {
		case json.Delim('{'):
			fields := map[string]reflect.Type{}
			if t != nil && t.Kind() == reflect.Struct {
				for i := range t.NumField() {
					f := t.Field(i)
					name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
					if name != "" && name != "-" && f.IsExported() {
						fields[name] = f.Type
					}
				}
			}
			for dec.More() {
				at := skipSpace(data, int(dec.InputOffset()))
				ktok, err := dec.Token()
				if err != nil {
					return err
				}
				name, _ := ktok.(string)
				child := name
				if key != "" {
					child = key + "." + name
				}
				var ft reflect.Type
				switch {
				case t != nil && t.Kind() == reflect.Map:
					ft = t.Elem()
				case t != nil && t.Kind() == reflect.Struct:
					var ok bool
					if ft, ok = fields[name]; !ok {
						p := Problem{Key: key, Msg: fmt.Sprintf("unknown field %q", name)}
						p.Line, p.Column = l.position(at)
						unknown = append(unknown, p)
					}
				}
				if err := walk(ft, child); err != nil {
					return err
				}
			}
			_, err = dec.Token() // '}'
			return err
		case json.Delim('['):
			var et reflect.Type
			if t != nil && (t.Kind() == reflect.Slice || t.Kind() == reflect.Array) {
				et = t.Elem()
			}
			for i := 0; dec.More(); i++ {
				if err := walk(et, key+"["+strconv.Itoa(i)+"]"); err != nil {
					return err
				}
			}
			_, err = dec.Token() // ']'
			return err
		}
		return nil
	}
	if err := walk(t, ""); err != nil {
		return nil, nil, err
	}
	return l, unknown, nil
}

// decodeProblem turns an encoding/json error into a Problem with the
// position it happened at.
func decodeProblem(data []byte, err error, l *locator) Problem {
	var se *json.SyntaxError
	var te *json.UnmarshalTypeError
	switch {
	case errors.As(err, &se):
		p := Problem{Msg: "decoding: " + se.Error()}
		tmp := &locator{data: data}
		p.Line, p.Column = tmp.position(int(se.Offset) - 1)
		return p
	case errors.As(err, &te) && l != nil:
		// The offset is just past the bad value: the value is the last
		// one that starts before it.
		key, start := l.enclosing(int(te.Offset))
		p := Problem{Key: key, Msg: fmt.Sprintf("decoding: a JSON %s where %s belongs", te.Value, typeName(te.Type))}
		p.Line, p.Column = l.position(start)
		return p
	}
	return Problem{Msg: "decoding: " + err.Error()}
}

// typeName says what a Go type is in JSON's words.
func typeName(t reflect.Type) string {
	switch t.Kind() {
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64,
		reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		return "an integer"
	case reflect.Float32, reflect.Float64:
		return "a number"
	case reflect.Bool:
		return "true or false"
	case reflect.String:
		return "a string"
	case reflect.Slice, reflect.Array:
		return "an array"
	case reflect.Struct, reflect.Map:
		return "an object"
	case reflect.Pointer:
		return typeName(t.Elem())
	}
	return t.String()
}
