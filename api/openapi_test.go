package api

import (
	"encoding/json"
	"slices"
	"strings"
	"testing"
)

// TestOpenAPIDocument: the document has exactly the route table's routes
// (and /healthz, which serve answers beside the API), every route is
// described, the route serves it, and a real view that lost a field or
// gained one no longer validates: the document is as strict as the tests
// that validate every response against it rely on.
func TestOpenAPIDocument(t *testing.T) {
	doc := parsedOpenAPI(t)
	var want []string
	for _, rt := range Routes() {
		want = append(want, rt.Pattern)
		d, ok := routeDocs[rt.Pattern]
		if !ok || d.summary == "" || d.tag == "" || len(d.ok) == 0 {
			t.Errorf("route %s has no description in routeDocs", rt.Pattern)
		}
	}
	want = append(want, "GET /healthz")
	slices.Sort(want)
	if got := doc.Patterns(); !slices.Equal(got, want) {
		t.Errorf("documented routes\n%s\nroute table\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
	for p := range routeDocs {
		if !slices.Contains(want, p) {
			t.Errorf("routeDocs describes %s, which no route serves", p)
		}
	}

	h := newHarness(t)
	st, hdr, body := h.do(t, "GET", "/api/openapi.json", h.ro, "")
	served, _ := OpenAPI()
	if st != 200 || hdr.Get("Content-Type") != "application/json" || body != string(served) {
		t.Fatalf("GET /api/openapi.json = %d %q (%d bytes)", st, hdr.Get("Content-Type"), len(body))
	}
	if st, _, b := h.do(t, "POST", "/api/vms", h.rw, minimalVMBody(h, "doc")); st != 201 {
		t.Fatalf("create: %d %s", st, b)
	}
	_, _, view := h.do(t, "GET", "/api/vms/doc", h.ro, "")
	var v map[string]any
	if err := json.Unmarshal([]byte(view), &v); err != nil {
		t.Fatal(err)
	}
	check := func(what string, v map[string]any, wantErr string) {
		t.Helper()
		b, _ := json.Marshal(v)
		err := doc.ValidateResponse("GET /api/vms/{id}", 200, "application/json", b)
		if err == nil || !strings.Contains(err.Error(), wantErr) {
			t.Errorf("a view with %s validated: %v (want %q)", what, err, wantErr)
		}
	}
	delete(v, "state")
	check("no state", v, "$.state: missing required field")
	v["state"] = "exploded"
	check("an unknown state", v, "$.state: exploded is not one of")
	v["state"] = "created"
	v["surprise"] = true
	check("a field the document lacks", v, "$.surprise: field not in the document")
}
