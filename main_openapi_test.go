package main

import (
	"bytes"
	"encoding/json"
	"testing"
)

// TestOpenAPICommand: vmhost openapi prints the document as JSON, an
// OpenAPI 3.1 one with the API's routes; an argument is a usage error.
func TestOpenAPICommand(t *testing.T) {
	var out, errb bytes.Buffer
	if code := run([]string{"openapi"}, &out, &errb); code != 0 {
		t.Fatalf("exit %d: %s", code, errb.String())
	}
	var doc struct {
		OpenAPI string                    `json:"openapi"`
		Paths   map[string]map[string]any `json:"paths"`
	}
	if err := json.Unmarshal(out.Bytes(), &doc); err != nil {
		t.Fatal(err)
	}
	if doc.OpenAPI != "3.1.0" || doc.Paths["/api/vms/{id}"]["get"] == nil || doc.Paths["/healthz"]["get"] == nil {
		t.Errorf("document: openapi %q, %d paths", doc.OpenAPI, len(doc.Paths))
	}
	if code := run([]string{"openapi", "x"}, &out, &errb); code != 2 {
		t.Errorf("vmhost openapi x = %d, want 2", code)
	}
}
