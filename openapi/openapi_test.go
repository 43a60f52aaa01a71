package openapi

import (
	"reflect"
	"strings"
	"testing"
	"time"
)

type color string

type inner struct {
	N uint32 `json:"n"`
}

type base struct {
	ID string `json:"id"`
}

type sample struct {
	*base
	Name    string            `json:"name"`
	Color   color             `json:"color"`
	Note    string            `json:"note,omitempty"`
	At      time.Time         `json:"at"`
	Tags    []string          `json:"tags"`
	Inner   *inner            `json:"inner"`
	Opt     *inner            `json:"opt,omitempty"`
	Labels  map[string]string `json:"labels,omitempty"`
	Ratio   float64           `json:"ratio"`
	Secret  string            `json:"-"`
	private int
}

type errorBody struct {
	Code string `json:"code"`
}

func testDoc(t *testing.T) *Doc {
	t.Helper()
	data, err := Build(Options{Title: "t", Version: "1", Enums: map[reflect.Type][]string{reflect.TypeFor[color](): {"red", "blue"}}},
		[]Operation{
			{Pattern: "GET /api/things/{id}", Tag: "things", Responses: []Response{
				{Status: 200, Type: reflect.TypeFor[sample]()},
				{Status: 404, Type: reflect.TypeFor[errorBody]()},
				{Status: 204},
			}},
			{Pattern: "GET /api/things/special", Tag: "things", Responses: []Response{{Status: 200, ContentType: "text/plain"}}},
		})
	if err != nil {
		t.Fatal(err)
	}
	d, err := Parse(data)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

const good = `{"id":"a","name":"n","color":"red","at":"2026-01-01T00:00:00Z","tags":[],"inner":null,"ratio":0.5,"labels":{"k":"v"},"opt":{"n":1}}`

// TestValidateAcceptsWhatEncodingJSONSends: a body as encoding/json
// writes it passes; optional fields may be left out.
func TestValidateAcceptsWhatEncodingJSONSends(t *testing.T) {
	d := testDoc(t)
	for _, body := range []string{good, `{"id":"a","name":"n","color":"blue","at":"x","tags":["t"],"inner":{"n":0},"ratio":1}`} {
		if err := d.ValidateResponse("GET /api/things/{id}", 200, "application/json", []byte(body)); err != nil {
			t.Errorf("%s: %v", body, err)
		}
	}
	if err := d.ValidateResponse("GET /api/things/{id}", 204, "", nil); err != nil {
		t.Error(err)
	}
	if err := d.ValidateResponse("GET /api/things/special", 200, "text/plain; charset=utf-8", []byte("hi")); err != nil {
		t.Error(err)
	}
}

// TestValidateRefuses: each rule fails when it should, naming the route,
// the status and the field.
func TestValidateRefuses(t *testing.T) {
	d := testDoc(t)
	repl := func(old, new string) string { return strings.Replace(good, old, new, 1) }
	cases := map[string]struct {
		status int
		ctype  string
		body   string
		want   string
	}{
		"missing required":       {200, "application/json", repl(`"name":"n",`, ""), "$.name: missing required field"},
		"missing embedded field": {200, "application/json", repl(`"id":"a",`, ""), "$.id: missing required field"},
		"extra field":            {200, "application/json", repl(`"ratio":0.5`, `"ratio":0.5,"new":1`), "$.new: field not in the document"},
		"wrong type":             {200, "application/json", repl(`"name":"n"`, `"name":1`), "$.name: integer, want string"},
		"null array":             {200, "application/json", repl(`"tags":[]`, `"tags":null`), "$.tags: null, want array"},
		"item type":              {200, "application/json", repl(`"tags":[]`, `"tags":[1]`), "$.tags[0]: integer, want string"},
		"enum":                   {200, "application/json", repl(`"red"`, `"green"`), "$.color: green is not one of"},
		"minimum":                {200, "application/json", repl(`"opt":{"n":1}`, `"opt":{"n":-1}`), "$.opt.n: -1 is below the minimum"},
		"nested ref":             {200, "application/json", repl(`"inner":null`, `"inner":{"m":1}`), "$.inner"},
		"null optional":          {200, "application/json", repl(`"opt":{"n":1}`, `"opt":null`), "$.opt: null, want object"},
		"map values":             {200, "application/json", repl(`"k":"v"`, `"k":2`), "$.labels.k: integer, want string"},
		"undocumented status":    {409, "application/json", `{"code":"X"}`, "status not documented"},
		"content type":           {200, "text/html", good, `content type "text/html" not documented`},
		"body where none":        {204, "", `{}`, "documented without a body"},
		"not JSON":               {200, "application/json", `{`, "body is not JSON"},
	}
	for name, c := range cases {
		err := d.ValidateResponse("GET /api/things/{id}", c.status, c.ctype, []byte(c.body))
		if err == nil || !strings.Contains(err.Error(), c.want) || !strings.HasPrefix(err.Error(), "GET /api/things/{id} ") {
			t.Errorf("%s: %v, want an error containing %q", name, err, c.want)
		}
	}
	if err := d.ValidateResponse("POST /api/things", 200, "", nil); err == nil {
		t.Error("a route not in the document validated")
	}
}

// TestMatch: requests find their documented route; literal segments win
// over parameters.
func TestMatch(t *testing.T) {
	d := testDoc(t)
	for path, want := range map[string]string{
		"/api/things/x":       "GET /api/things/{id}",
		"/api/things/special": "GET /api/things/special",
	} {
		if got, ok := d.Match("GET", path); !ok || got != want {
			t.Errorf("Match(GET %s) = %q, %v; want %q", path, got, ok, want)
		}
	}
	if _, ok := d.Match("GET", "/api/things/x/y"); ok {
		t.Error("a longer path matched")
	}
	if _, ok := d.Match("DELETE", "/api/things/x"); ok {
		t.Error("another method matched")
	}
}
