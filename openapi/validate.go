package openapi

import (
	"bytes"
	"encoding/json"
	"fmt"
	"mime"
	"regexp"
	"sort"
	"strconv"
	"strings"
)

// Doc is a parsed document that validates responses.
type Doc struct {
	root   map[string]any
	routes []route
}

type route struct {
	pattern string
	method  string
	re      *regexp.Regexp
}

// Parse reads a document (as Build writes it).
func Parse(data []byte) (*Doc, error) {
	d := &Doc{}
	if err := json.Unmarshal(data, &d.root); err != nil {
		return nil, fmt.Errorf("openapi: %w", err)
	}
	paths, _ := d.root["paths"].(map[string]any)
	for path, item := range paths {
		re := "^" + regexp.MustCompile(`\\\{[^/]+\\\}`).ReplaceAllString(regexp.QuoteMeta(path), `[^/]+`) + "$"
		for method := range item.(map[string]any) {
			d.routes = append(d.routes, route{pattern: strings.ToUpper(method) + " " + path, method: strings.ToUpper(method), re: regexp.MustCompile(re)})
		}
	}
	// Literal segments win over parameters, as in the mux: longer
	// patterns with fewer parameters first.
	sort.Slice(d.routes, func(i, j int) bool {
		a, b := d.routes[i].pattern, d.routes[j].pattern
		if ca, cb := strings.Count(a, "{"), strings.Count(b, "{"); ca != cb {
			return ca < cb
		}
		return a < b
	})
	return d, nil
}

// Patterns lists the document's routes as "METHOD /path", sorted.
func (d *Doc) Patterns() []string {
	var out []string
	for _, r := range d.routes {
		out = append(out, r.pattern)
	}
	sort.Strings(out)
	return out
}

// Match returns the documented route of a request, if any.
func (d *Doc) Match(method, path string) (string, bool) {
	if method == "HEAD" {
		method = "GET"
	}
	for _, r := range d.routes {
		if r.method == method && r.re.MatchString(path) {
			return r.pattern, true
		}
	}
	return "", false
}

// ValidateResponse checks a response of the route pattern against the
// document: the status must be documented for the route, the content type
// must be the documented one, and a JSON body must match its schema. The
// error names the route, the status and the JSON path of the problem.
func (d *Doc) ValidateResponse(pattern string, status int, contentType string, body []byte) error {
	method, path, _ := strings.Cut(pattern, " ")
	fail := func(format string, a ...any) error {
		return fmt.Errorf("%s %d: %s", pattern, status, fmt.Sprintf(format, a...))
	}
	op, ok := dig(d.root, "paths", path, strings.ToLower(method)).(map[string]any)
	if !ok {
		return fail("route not in the document")
	}
	resp, ok := dig(op, "responses", strconv.Itoa(status)).(map[string]any)
	if !ok {
		return fail("status not documented for the route")
	}
	content, _ := resp["content"].(map[string]any)
	if len(content) == 0 {
		if len(bytes.TrimSpace(body)) > 0 {
			return fail("documented without a body, got %d bytes", len(body))
		}
		return nil
	}
	mt, _, _ := mime.ParseMediaType(contentType)
	media, ok := content[mt].(map[string]any)
	if !ok {
		return fail("content type %q not documented (want one of %v)", contentType, keys(content))
	}
	if mt != "application/json" {
		return nil
	}
	var v any
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.UseNumber()
	if err := dec.Decode(&v); err != nil {
		return fail("body is not JSON: %v", err)
	}
	if err := d.check(media["schema"].(map[string]any), v, "$"); err != nil {
		return fail("%v", err)
	}
	return nil
}

func keys(m map[string]any) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

func dig(v any, path ...string) any {
	for _, p := range path {
		m, ok := v.(map[string]any)
		if !ok {
			return nil
		}
		v = m[p]
	}
	return v
}

// check validates v against the schema s (the subset Build writes:
// $ref, anyOf, type, enum, minimum, properties, required,
// additionalProperties, items).
func (d *Doc) check(s map[string]any, v any, at string) error {
	if ref, ok := s["$ref"].(string); ok {
		name := strings.TrimPrefix(ref, "#/components/schemas/")
		target, ok := dig(d.root, "components", "schemas", name).(map[string]any)
		if !ok {
			return fmt.Errorf("%s: unresolved $ref %s", at, ref)
		}
		return d.check(target, v, at)
	}
	if alts, ok := s["anyOf"].([]any); ok {
		var errs []string
		for _, alt := range alts {
			err := d.check(alt.(map[string]any), v, at)
			if err == nil {
				return nil
			}
			errs = append(errs, err.Error())
		}
		return fmt.Errorf("%s: matches none of anyOf (%s)", at, strings.Join(errs, "; "))
	}
	if typ, ok := s["type"].(string); ok {
		if got := jsonType(v); got != typ && !(typ == "number" && got == "integer") {
			return fmt.Errorf("%s: %s, want %s", at, got, typ)
		}
	}
	if enum, ok := s["enum"].([]any); ok {
		found := false
		for _, e := range enum {
			if e == v {
				found = true
			}
		}
		if !found {
			return fmt.Errorf("%s: %v is not one of %v", at, v, enum)
		}
	}
	if min, ok := s["minimum"].(float64); ok {
		if n, ok := v.(json.Number); ok {
			if f, err := n.Float64(); err == nil && f < min {
				return fmt.Errorf("%s: %v is below the minimum %v", at, n, min)
			}
		}
	}
	switch v := v.(type) {
	case map[string]any:
		props, _ := s["properties"].(map[string]any)
		for _, r := range asStrings(s["required"]) {
			if _, ok := v[r]; !ok {
				return fmt.Errorf("%s.%s: missing required field", at, r)
			}
		}
		for _, k := range keys(v) {
			if ps, ok := props[k].(map[string]any); ok {
				if err := d.check(ps, v[k], at+"."+k); err != nil {
					return err
				}
				continue
			}
			switch ap := s["additionalProperties"].(type) {
			case bool:
				if !ap {
					return fmt.Errorf("%s.%s: field not in the document", at, k)
				}
			case map[string]any:
				if err := d.check(ap, v[k], at+"."+k); err != nil {
					return err
				}
			}
		}
	case []any:
		if items, ok := s["items"].(map[string]any); ok {
			for i, e := range v {
				if err := d.check(items, e, fmt.Sprintf("%s[%d]", at, i)); err != nil {
					return err
				}
			}
		}
	}
	return nil
}

func asStrings(v any) []string {
	var out []string
	if l, ok := v.([]any); ok {
		for _, e := range l {
			if s, ok := e.(string); ok {
				out = append(out, s)
			}
		}
	}
	return out
}

func jsonType(v any) string {
	switch v := v.(type) {
	case nil:
		return "null"
	case bool:
		return "boolean"
	case string:
		return "string"
	case json.Number:
		if _, err := v.Int64(); err == nil || !strings.ContainsAny(v.String(), ".eE") {
			return "integer"
		}
		return "number"
	case []any:
		return "array"
	case map[string]any:
		return "object"
	}
	return fmt.Sprintf("%T", v)
}
