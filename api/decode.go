package api

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"sync"
)

// DecodeError is a body the framework rules reject before any field rule
// runs (422): malformed JSON, trailing data, a wrong type, an unknown field,
// a negative or fractional count, an enum value outside its set, or a
// required field that is missing or null. Error gives one line that names
// the field path, such as "nets[1].ipv4.address: required field missing";
// an unknown field is named quoted after its parent's path, such as
// `disk: unknown field "zz"`.
type DecodeError struct {
	Path string // field path, empty for the body as a whole
	Msg  string
}

// Error gives the one-line reason, starting with the field path.
func (e *DecodeError) Error() string {
	if e.Path == "" {
		return "body: " + e.Msg
	}
	return e.Path + ": " + e.Msg
}

// Enum is implemented by string types whose JSON value must be one of a
// fixed set; any other value is a decode error (422), not a field rule.
type Enum interface {
	EnumValues() []string
}

// decodeStrict decodes body into v, a pointer to a struct, by the rules of
// DecodeError. Struct fields are named by their json tag; a field tagged
// `decode:"required"` must be present and non-null; one tagged
// `decode:"stored"` is the agent's and unknown here. A null optional field is
// treated as absent, except for json.RawMessage fields, which keep the
// literal null so callers can tell null from absent. Unsigned integer kinds
// accept only plain non-negative integers within range.
//
// Unlike encoding/json, the whole body is first read as a tree, so the error
// always carries the full path with array indices, and values (which may be
// secrets) never appear in messages except numbers and enum values.
func decodeStrict(body []byte, v any) error {
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.UseNumber()
	var root any
	if err := dec.Decode(&root); err != nil {
		if errors.Is(err, io.EOF) {
			return &DecodeError{Msg: "empty body, expected a JSON object"}
		}
		return &DecodeError{Msg: "malformed JSON: " + oneLine(err.Error())}
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return &DecodeError{Msg: fmt.Sprintf("trailing data after the JSON value at offset %d", dec.InputOffset())}
	}
	rv := reflect.ValueOf(v)
	if rv.Kind() != reflect.Pointer || rv.Elem().Kind() != reflect.Struct && rv.Elem().Kind() != reflect.Map {
		panic("decodeStrict: v must be a pointer to a struct or a map")
	}
	return fill("", root, rv.Elem())
}

func oneLine(s string) string {
	return strings.Join(strings.Fields(s), " ")
}

var rawMessageType = reflect.TypeFor[json.RawMessage]()

func jsonKind(val any) string {
	switch val.(type) {
	case nil:
		return "null"
	case map[string]any:
		return "object"
	case []any:
		return "array"
	case string:
		return "string"
	case json.Number:
		return "number"
	case bool:
		return "boolean"
	}
	return fmt.Sprintf("%T", val)
}

func typeErr(path, want string, val any) error {
	return &DecodeError{Path: path, Msg: fmt.Sprintf("expected %s, got %s", want, jsonKind(val))}
}

// fill stores val (a tree from encoding/json with UseNumber) into rv.
func fill(path string, val any, rv reflect.Value) error {
	t := rv.Type()
	if t == rawMessageType {
		b, err := json.Marshal(val)
		if err != nil {
			return &DecodeError{Path: path, Msg: oneLine(err.Error())}
		}
		rv.SetBytes(b)
		return nil
	}
	switch t.Kind() {
	case reflect.Pointer:
		if val == nil {
			rv.SetZero()
			return nil
		}
		p := reflect.New(t.Elem())
		if err := fill(path, val, p.Elem()); err != nil {
			return err
		}
		rv.Set(p)
		return nil
	case reflect.Struct:
		m, ok := val.(map[string]any)
		if !ok {
			return typeErr(path, "object", val)
		}
		return fillStruct(path, m, rv)
	case reflect.Map:
		// An object of string keys (labels); a key is named quoted, as it
		// may hold dots: labels["a.b"].
		m, ok := val.(map[string]any)
		if !ok {
			return typeErr(path, "object", val)
		}
		if t.Key().Kind() != reflect.String {
			panic(fmt.Sprintf("decodeStrict: map key type %v at %s", t.Key(), path))
		}
		out := reflect.MakeMapWithSize(t, len(m))
		for _, k := range slices.Sorted(maps.Keys(m)) {
			e := reflect.New(t.Elem()).Elem()
			if err := fill(path+"["+strconv.Quote(k)+"]", m[k], e); err != nil {
				return err
			}
			out.SetMapIndex(reflect.ValueOf(k).Convert(t.Key()), e)
		}
		rv.Set(out)
		return nil
	case reflect.Slice:
		a, ok := val.([]any)
		if !ok {
			return typeErr(path, "array", val)
		}
		s := reflect.MakeSlice(t, len(a), len(a))
		for i, e := range a {
			if err := fill(path+"["+strconv.Itoa(i)+"]", e, s.Index(i)); err != nil {
				return err
			}
		}
		rv.Set(s)
		return nil
	case reflect.String:
		s, ok := val.(string)
		if !ok {
			return typeErr(path, "string", val)
		}
		if e, ok := rv.Interface().(Enum); ok {
			if vals := e.EnumValues(); !slices.Contains(vals, s) {
				return &DecodeError{Path: path, Msg: fmt.Sprintf("unknown value %q, expected one of %s", s, strings.Join(vals, ", "))}
			}
		}
		rv.SetString(s)
		return nil
	case reflect.Bool:
		b, ok := val.(bool)
		if !ok {
			return typeErr(path, "boolean", val)
		}
		rv.SetBool(b)
		return nil
	case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		n, ok := val.(json.Number)
		if !ok {
			return typeErr(path, "a non-negative integer", val)
		}
		s := string(n)
		if strings.ContainsAny(s, "-.eE") {
			return &DecodeError{Path: path, Msg: "expected a non-negative integer, got " + s}
		}
		u, err := strconv.ParseUint(s, 10, t.Bits())
		if err != nil {
			return &DecodeError{Path: path, Msg: fmt.Sprintf("integer %s out of range (at most %d)", s, uint64(1)<<t.Bits()-1)}
		}
		rv.SetUint(u)
		return nil
	}
	panic(fmt.Sprintf("decodeStrict: unsupported type %v at %s", t, path))
}

type fieldInfo struct {
	name     string
	index    int
	required bool
}

var structFields sync.Map // reflect.Type → []fieldInfo

func fieldsOf(t reflect.Type) []fieldInfo {
	if fs, ok := structFields.Load(t); ok {
		return fs.([]fieldInfo)
	}
	var fs []fieldInfo
	for i := range t.NumField() {
		f := t.Field(i)
		if !f.IsExported() {
			continue
		}
		name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		if name == "-" || f.Tag.Get("decode") == "stored" {
			continue // the agent's own field: unknown in a request
		}
		if name == "" {
			name = f.Name
		}
		fs = append(fs, fieldInfo{name: name, index: i, required: f.Tag.Get("decode") == "required"})
	}
	structFields.Store(t, fs)
	return fs
}

func fillStruct(path string, m map[string]any, rv reflect.Value) error {
	fs := fieldsOf(rv.Type())
	// Unknown fields first, in sorted order, so the message is stable.
	var unknown []string
	for k := range m {
		if !slices.ContainsFunc(fs, func(f fieldInfo) bool { return f.name == k }) {
			unknown = append(unknown, k)
		}
	}
	if len(unknown) > 0 {
		slices.Sort(unknown)
		// The name is the client's, and may hold newlines or anything
		// else: quoted, the 422 stays one printable line.
		return &DecodeError{Path: path, Msg: "unknown field " + strconv.Quote(unknown[0])}
	}
	for _, f := range fs {
		p := join(path, f.name)
		val, present := m[f.name]
		switch {
		case !present && f.required:
			return &DecodeError{Path: p, Msg: "required field missing"}
		case present && val == nil && f.required:
			return &DecodeError{Path: p, Msg: "required field is null"}
		case !present:
			continue
		case val == nil && rv.Field(f.index).Type() != rawMessageType:
			continue // null optional field: as if absent
		}
		if err := fill(p, val, rv.Field(f.index)); err != nil {
			return err
		}
	}
	return nil
}

func join(path, name string) string {
	if path == "" {
		return name
	}
	return path + "." + name
}
