// Package openapitest validates JSON values against the subset of OpenAPI 3
// schemas that Cloud Hypervisor's API document uses, for tests of what
// vmhost sends CH (chclient's requests, vm's generated vm.create bodies)
// and of what the simulator answers.
//
// The subset: $ref (to #/components/schemas only), type, properties,
// required, items, enum, additionalProperties and minimum. Unlike CH,
// which ignores unknown keys, a Validator rejects a property the schema
// does not name, so a misspelt field cannot be dropped silently; Lenient
// records such properties in Extras instead (for responses, where CH's
// document lags its code).
//
// The document is read from a file (shared/ref/cloud-hypervisor.openapi.json
// beside the checkout); Load skips the test when it is absent.
package openapitest

import (
	"encoding/json"
	"fmt"
	"os"
	"slices"
	"strings"
	"testing"
)

// DefaultPath is the document's path from a package directory one level
// below the module root (chclient, vm).
const DefaultPath = "../../shared/ref/cloud-hypervisor.openapi.json"

// Doc is the part of an OpenAPI document the validator reads.
type Doc struct {
	Paths      map[string]map[string]map[string]any `json:"paths"`
	Components struct {
		Schemas map[string]map[string]any `json:"schemas"`
	} `json:"components"`
}

// Validator checks values against the schemas of one Doc. It is not safe
// for concurrent use when Lenient (Extras grows).
type Validator struct {
	schemas map[string]map[string]any
	// Lenient records unnamed properties in Extras instead of failing.
	Lenient bool
	Extras  []string
}

// Load reads the document at path and returns it with a Validator over its
// schemas. It skips tb when the file does not exist and fails it on any
// other error.
func Load(tb testing.TB, path string) (*Doc, *Validator) {
	tb.Helper()
	data, err := os.ReadFile(path)
	if os.IsNotExist(err) {
		tb.Skipf("CH OpenAPI document not found at %s (shared/ref must sit beside the checkout)", path)
	}
	if err != nil {
		tb.Fatal(err)
	}
	var doc Doc
	if err := json.Unmarshal(data, &doc); err != nil {
		tb.Fatalf("parsing %s: %v", path, err)
	}
	return &doc, &Validator{schemas: doc.Components.Schemas}
}

// RequestSchema returns the body schema of method on path (without the
// /api/v1 prefix, e.g. "vm.create"), and false when the route takes no
// body. It fails tb when the document has no such route.
func (d *Doc) RequestSchema(tb testing.TB, method, path string) (map[string]any, bool) {
	tb.Helper()
	op, ok := d.Paths["/"+path][strings.ToLower(method)]
	if !ok {
		tb.Fatalf("OpenAPI document has no %s /%s", method, path)
	}
	rb, ok := op["requestBody"].(map[string]any)
	if !ok {
		return nil, false
	}
	return jsonSchema(rb), true
}

// ResponseSchema returns the schema of method path's answer with status
// (e.g. "200"). It fails tb when there is none.
func (d *Doc) ResponseSchema(tb testing.TB, method, path, status string) map[string]any {
	tb.Helper()
	op, ok := d.Paths["/"+path][strings.ToLower(method)]
	if !ok {
		tb.Fatalf("OpenAPI document has no %s /%s", method, path)
	}
	responses, _ := op["responses"].(map[string]any)
	r, _ := responses[status].(map[string]any)
	schema := jsonSchema(r)
	if schema == nil {
		tb.Fatalf("OpenAPI document has no %s schema for %s /%s", status, method, path)
	}
	return schema
}

func jsonSchema(body map[string]any) map[string]any {
	content, _ := body["content"].(map[string]any)
	mt, _ := content["application/json"].(map[string]any)
	schema, _ := mt["schema"].(map[string]any)
	return schema
}

// Decode parses JSON with numbers kept as json.Number, the form Validate
// expects.
func Decode(data []byte) (any, error) {
	dec := json.NewDecoder(strings.NewReader(string(data)))
	dec.UseNumber()
	var val any
	if err := dec.Decode(&val); err != nil {
		return nil, err
	}
	return val, nil
}

// ValidateJSON decodes data and validates it against schema; a decoding
// error is reported as a problem.
func (v *Validator) ValidateJSON(path string, schema map[string]any, data []byte) []string {
	val, err := Decode(data)
	if err != nil {
		return []string{path + ": " + err.Error()}
	}
	return v.Validate(path, schema, val)
}

// Validate checks val (decoded with Decode) against schema and returns one
// line per problem, each starting with the JSON path under path; none
// means valid.
func (v *Validator) Validate(path string, schema map[string]any, val any) []string {
	s, err := v.resolve(schema)
	if err != nil {
		return []string{path + ": " + err.Error()}
	}
	var errs []string
	if enum, ok := s["enum"].([]any); ok && !slices.Contains(enum, val) {
		errs = append(errs, fmt.Sprintf("%s: %v is not one of %v", path, val, enum))
	}
	switch typ, _ := s["type"].(string); typ {
	case "object", "":
		obj, ok := val.(map[string]any)
		if !ok {
			if typ == "" {
				return errs
			}
			return append(errs, fmt.Sprintf("%s: %T, want object", path, val))
		}
		props, _ := s["properties"].(map[string]any)
		for _, r := range asSlice(s["required"]) {
			if _, ok := obj[r.(string)]; !ok {
				errs = append(errs, fmt.Sprintf("%s: required property %q missing", path, r))
			}
		}
		extra, _ := s["additionalProperties"].(map[string]any)
		keys := make([]string, 0, len(obj))
		for k := range obj {
			keys = append(keys, k)
		}
		slices.Sort(keys) // stable problem order
		for _, k := range keys {
			fv := obj[k]
			ps, ok := props[k].(map[string]any)
			switch {
			case ok:
				errs = append(errs, v.Validate(path+"."+k, ps, fv)...)
			case extra != nil:
				errs = append(errs, v.Validate(path+"."+k, extra, fv)...)
			case v.Lenient:
				v.Extras = append(v.Extras, path+"."+k)
			default:
				errs = append(errs, fmt.Sprintf("%s: property %q is not in the schema", path, k))
			}
		}
	case "array":
		arr, ok := val.([]any)
		if !ok {
			return append(errs, fmt.Sprintf("%s: %T, want array", path, val))
		}
		items, _ := s["items"].(map[string]any)
		for i, e := range arr {
			errs = append(errs, v.Validate(fmt.Sprintf("%s[%d]", path, i), items, e)...)
		}
	case "string":
		if _, ok := val.(string); !ok {
			errs = append(errs, fmt.Sprintf("%s: %T, want string", path, val))
		}
	case "boolean":
		if _, ok := val.(bool); !ok {
			errs = append(errs, fmt.Sprintf("%s: %T, want boolean", path, val))
		}
	case "integer", "number":
		n, ok := val.(json.Number)
		if !ok {
			return append(errs, fmt.Sprintf("%s: %T, want %s", path, val, typ))
		}
		if typ == "integer" && strings.ContainsAny(n.String(), ".eE") {
			errs = append(errs, fmt.Sprintf("%s: %s is not an integer", path, n))
		}
		if min, ok := s["minimum"].(float64); ok {
			if f, _ := n.Float64(); f < min {
				errs = append(errs, fmt.Sprintf("%s: %s below minimum %v", path, n, min))
			}
		}
	default:
		errs = append(errs, fmt.Sprintf("%s: unsupported schema type %q", path, typ))
	}
	return errs
}

func (v *Validator) resolve(s map[string]any) (map[string]any, error) {
	for range 10 {
		ref, ok := s["$ref"].(string)
		if !ok {
			return s, nil
		}
		name, ok := strings.CutPrefix(ref, "#/components/schemas/")
		if !ok {
			return nil, fmt.Errorf("unsupported $ref %q", ref)
		}
		if s, ok = v.schemas[name]; !ok {
			return nil, fmt.Errorf("$ref %q names no schema", ref)
		}
	}
	return nil, fmt.Errorf("$ref chain too deep")
}

func asSlice(v any) []any {
	s, _ := v.([]any)
	return s
}
