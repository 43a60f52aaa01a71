// Package openapi builds vmhost's OpenAPI 3.1 document from the API's
// route table and the Go types its handlers encode and decode, and
// validates response bodies against it.
//
// The schemas follow encoding/json exactly, so the document says what the
// code sends: a field without omitempty is required, one with omitempty is
// optional, a pointer, map or interface field without omitempty may be
// null; a slice without omitempty is a required array that is never null
// (the handlers send [] for none, and the validation of every response the
// tests receive holds them to it). Response objects allow no other
// properties, so a field the code adds without the document is caught.
// What reflection cannot know is given by the caller: each route's
// statuses and content types, and the values of enum types.
package openapi

import (
	"encoding/json"
	"fmt"
	"reflect"
	"sort"
	"strings"
	"time"
	"unicode"
)

// Operation is one route of the document.
type Operation struct {
	// Pattern is the route as the mux spells it: "GET /api/vms/{id}".
	Pattern string
	Summary string
	Tag     string
	NoAuth  bool
	Mutates bool
	Request reflect.Type // the JSON body's type; nil: no body
	// RequestContentType is the media type of a body that is not JSON
	// (its schema is then binary), with Request nil.
	RequestContentType string
	Responses          []Response
	QueryParams        []Param
}

// Response is one status a route answers.
type Response struct {
	Status      int
	Description string
	// Type is the JSON body's type; nil with ContentType empty: no body.
	Type reflect.Type
	// ContentType is the body's media type when it is not JSON (its
	// schema is then a string).
	ContentType string
}

// Param is a query parameter, or with Header a request header.
type Param struct {
	Name, Description string
	Integer           bool
	// Repeated: the parameter may be given several times (?a=1&a=2).
	Repeated bool
	// Header: a request header, not a query parameter.
	Header bool
}

// Options are what reflection cannot see.
type Options struct {
	Title, Version, Description string
	// Enums lists the values of string types.
	Enums map[reflect.Type][]string
}

// Build returns the document of ops, indented.
func Build(o Options, ops []Operation) ([]byte, error) {
	g := &gen{o: o, comps: map[string]any{}, names: map[reflect.Type]string{}}
	paths := map[string]map[string]any{}
	for _, op := range ops {
		method, path, ok := strings.Cut(op.Pattern, " ")
		if !ok {
			return nil, fmt.Errorf("route %q: want METHOD /path", op.Pattern)
		}
		item := paths[path]
		if item == nil {
			item = map[string]any{}
			paths[path] = item
		}
		item[strings.ToLower(method)] = g.operation(method, path, op)
	}
	doc := map[string]any{
		"openapi": "3.1.0",
		"info": map[string]any{"title": o.Title, "version": o.Version, "description": o.Description,
			"license": map[string]any{"name": "Proprietary", "identifier": "LicenseRef-vmhost"}},
		"servers":  []any{map[string]any{"url": "/", "description": "the agent's --listen address"}},
		"security": []any{map[string]any{"bearer": []any{}}},
		"paths":    paths,
		"components": map[string]any{
			"schemas": g.comps,
			"securitySchemes": map[string]any{"bearer": map[string]any{
				"type": "http", "scheme": "bearer", "description": "an API key made with vmhost key add"}},
		},
	}
	return json.MarshalIndent(doc, "", "  ")
}

type gen struct {
	o     Options
	comps map[string]any
	names map[reflect.Type]string
}

func (g *gen) operation(method, path string, op Operation) map[string]any {
	out := map[string]any{
		"operationId": operationID(method, path),
		"summary":     op.Summary,
		"tags":        []any{op.Tag},
	}
	if op.NoAuth {
		out["security"] = []any{}
	}
	var params []any
	for _, seg := range strings.Split(path, "/") {
		if strings.HasPrefix(seg, "{") && strings.HasSuffix(seg, "}") {
			params = append(params, map[string]any{"name": seg[1 : len(seg)-1], "in": "path", "required": true,
				"schema": map[string]any{"type": "string"}})
		}
	}
	for _, p := range op.QueryParams {
		typ := "string"
		if p.Integer {
			typ = "integer"
		}
		schema := map[string]any{"type": typ}
		if p.Repeated {
			schema = map[string]any{"type": "array", "items": schema}
		}
		in := "query"
		if p.Header {
			in = "header"
		}
		params = append(params, map[string]any{"name": p.Name, "in": in, "required": false,
			"description": p.Description, "schema": schema})
	}
	if params != nil {
		out["parameters"] = params
	}
	switch {
	case op.Request != nil:
		out["requestBody"] = map[string]any{"required": true, "content": map[string]any{
			"application/json": map[string]any{"schema": g.schema(op.Request)}}}
	case op.RequestContentType != "":
		out["requestBody"] = map[string]any{"required": true, "content": map[string]any{
			op.RequestContentType: map[string]any{"schema": map[string]any{"type": "string", "format": "binary"}}}}
	}
	resps := map[string]any{}
	for _, r := range op.Responses {
		desc := r.Description
		if desc == "" {
			desc = statusText(r.Status)
		}
		resp := map[string]any{"description": desc}
		switch {
		case r.ContentType != "":
			resp["content"] = map[string]any{r.ContentType: map[string]any{"schema": map[string]any{"type": "string"}}}
		case r.Type != nil:
			resp["content"] = map[string]any{"application/json": map[string]any{"schema": g.schema(r.Type)}}
		}
		resps[fmt.Sprint(r.Status)] = resp
	}
	out["responses"] = resps
	return out
}

// operationID is a stable camel-case name: "GET /api/vms/{id}/start" →
// "getVmsIdStart".
func operationID(method, path string) string {
	var b strings.Builder
	b.WriteString(strings.ToLower(method))
	for _, seg := range strings.Split(strings.TrimPrefix(path, "/api"), "/") {
		seg = strings.Trim(seg, "{}")
		for _, part := range strings.FieldsFunc(seg, func(r rune) bool { return r == '.' || r == '_' || r == '-' }) {
			r := []rune(part)
			r[0] = unicode.ToUpper(r[0])
			b.WriteString(string(r))
		}
	}
	return b.String()
}

var (
	timeType       = reflect.TypeFor[time.Time]()
	rawMessageType = reflect.TypeFor[json.RawMessage]()
)

// schema is the schema of t: a $ref for named struct types (defined once
// in components), inline otherwise.
func (g *gen) schema(t reflect.Type) map[string]any {
	if t.Kind() == reflect.Pointer {
		return g.schema(t.Elem())
	}
	if vals, ok := g.o.Enums[t]; ok {
		return map[string]any{"type": "string", "enum": vals}
	}
	switch {
	case t == timeType:
		return map[string]any{"type": "string", "format": "date-time"}
	case t == rawMessageType:
		return map[string]any{} // any JSON value
	case t.Kind() == reflect.Struct && t.Name() != "":
		name, ok := g.names[t]
		if !ok {
			name = componentName(t)
			g.names[t] = name
			g.comps[name] = map[string]any{} // placeholder against recursion
			g.comps[name] = g.object(t)
		}
		return map[string]any{"$ref": "#/components/schemas/" + name}
	case t.Kind() == reflect.Struct:
		return g.object(t)
	}
	switch t.Kind() {
	case reflect.Bool:
		return map[string]any{"type": "boolean"}
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		return map[string]any{"type": "integer"}
	case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		return map[string]any{"type": "integer", "minimum": 0}
	case reflect.Float32, reflect.Float64:
		return map[string]any{"type": "number"}
	case reflect.String:
		return map[string]any{"type": "string"}
	case reflect.Slice, reflect.Array:
		return map[string]any{"type": "array", "items": g.schema(t.Elem())}
	case reflect.Map:
		elem := g.schema(t.Elem())
		if t.Elem().Kind() == reflect.Pointer { // a null value means something (a merge patch's delete)
			elem = map[string]any{"anyOf": []any{elem, map[string]any{"type": "null"}}}
		}
		return map[string]any{"type": "object", "additionalProperties": elem}
	}
	return map[string]any{} // an interface: anything
}

// object is the schema of struct t, with embedded structs' fields flattened
// as encoding/json does.
func (g *gen) object(t reflect.Type) map[string]any {
	props := map[string]any{}
	var required []string
	g.fields(t, props, &required)
	sort.Strings(required)
	out := map[string]any{"type": "object", "properties": props, "additionalProperties": false}
	if len(required) > 0 {
		out["required"] = required
	}
	return out
}

func (g *gen) fields(t reflect.Type, props map[string]any, required *[]string) {
	for i := range t.NumField() {
		f := t.Field(i)
		tag := f.Tag.Get("json")
		if tag == "-" || f.Tag.Get("decode") == "stored" {
			continue // stored: the agent's, refused in a request
		}
		name, opts, _ := strings.Cut(tag, ",")
		ft := f.Type
		if f.Anonymous && name == "" {
			et := ft
			if et.Kind() == reflect.Pointer {
				et = et.Elem()
			}
			if et.Kind() == reflect.Struct {
				g.fields(et, props, required)
				continue
			}
		}
		if !f.IsExported() {
			continue
		}
		if name == "" {
			name = f.Name
		}
		omitempty := strings.Contains(opts, "omitempty") || strings.Contains(opts, "omitzero")
		s := g.schema(ft)
		if !omitempty {
			*required = append(*required, name)
			switch ft.Kind() {
			case reflect.Pointer, reflect.Map, reflect.Interface:
				s = map[string]any{"anyOf": []any{s, map[string]any{"type": "null"}}}
			}
		}
		props[name] = s
	}
}

// componentName is "VmView" for vm.View: the package's last element and
// the type's name.
func componentName(t reflect.Type) string {
	pkg := t.PkgPath()
	if i := strings.LastIndexByte(pkg, '/'); i >= 0 {
		pkg = pkg[i+1:]
	}
	if pkg == "" {
		return t.Name()
	}
	return strings.ToUpper(pkg[:1]) + pkg[1:] + t.Name()
}

func statusText(code int) string {
	switch code {
	case 200:
		return "OK"
	case 201:
		return "Created"
	case 202:
		return "Accepted: the work goes on in the background"
	case 101:
		return "Switching Protocols: the connection carries the exchange the route describes"
	case 204:
		return "Done; no body"
	case 400:
		return "BAD_REQUEST: a field breaks a rule"
	case 401:
		return "UNAUTHORIZED: no valid API key"
	case 403:
		return "FORBIDDEN: the key's scope or allowlist does not cover the route"
	case 404:
		return "NOT_FOUND"
	case 409:
		return "A conflict: ALREADY_EXISTS, CONFLICT, INVALID_STATE or CAPACITY_CONFLICT"
	case 422:
		return "The body is not valid JSON for the route (plain text)"
	case 500:
		return "CH_ERROR, NETWORK_ERROR, STORAGE_ERROR or INTERNAL"
	case 503:
		return "Starting: records loading, VMs being reconciled"
	}
	return fmt.Sprint(code)
}
