package labels

import (
	"fmt"
	"maps"
	"strings"
	"testing"
)

// TestCheck: every rule, each broken value beside the accepted boundary,
// and the message naming the rule and the key.
func TestCheck(t *testing.T) {
	many := func(n int) map[string]string {
		m := map[string]string{}
		for i := range n {
			m[fmt.Sprintf("k%d", i)] = "v"
		}
		return m
	}
	for _, tt := range []struct {
		name   string
		labels map[string]string
		want   string // "" accepted, else a substring of the error
	}{
		{"none", nil, ""},
		{"64 labels", many(64), ""},
		{"65 labels", many(65), "at most 64 labels, got 65"},
		{"one-byte key", map[string]string{"a": ""}, ""},
		{"63-byte key", map[string]string{strings.Repeat("a", 63): "v"}, ""},
		{"64-byte key", map[string]string{strings.Repeat("a", 64): "v"}, `key "` + strings.Repeat("a", 63) + `…": must be 1..63 bytes, got 64`},
		{"empty key", map[string]string{"": "v"}, `key "": must be 1..63 bytes, got 0`},
		{"every allowed byte", map[string]string{"a.b_c/d-e0": "v"}, ""},
		{"upper case", map[string]string{"Team": "v"}, `key "Team": may hold only a-z, 0-9, '.', '_', '/' and '-' (byte 0 is not one)`},
		{"space", map[string]string{"a b": "v"}, `key "a b": may hold only`},
		{"equals", map[string]string{"a=b": "v"}, `key "a=b": may hold only`},
		{"non-ASCII", map[string]string{"café": "v"}, `key "café": may hold only`},
		{"starts with a dash", map[string]string{"-a": "v"}, `key "-a": must start and end with a lower-case letter or a digit`},
		{"ends with a slash", map[string]string{"a/": "v"}, `key "a/": must start and end`},
		{"ends with a dot", map[string]string{"example.com/": "v"}, `must start and end`},
		{"digits", map[string]string{"0": "1"}, ""},
		{"256-byte value", map[string]string{"k": strings.Repeat("é", 128)}, ""},
		{"257-byte value", map[string]string{"k": strings.Repeat("v", 257)}, `value of key "k": at most 256 bytes, got 257`},
		{"newline", map[string]string{"k": "a\nb"}, `value of key "k": must not hold control characters (byte 1 is U+000A)`},
		{"NUL", map[string]string{"k": "\x00"}, `(byte 0 is U+0000)`},
		{"DEL", map[string]string{"k": "a\x7f"}, `(byte 1 is U+007F)`},
		{"C1", map[string]string{"k": "\u0085"}, `(byte 0 is U+0085)`},
		{"not UTF-8", map[string]string{"k": "\xff"}, `value of key "k": must be UTF-8`},
		{"printable", map[string]string{"k": "a b=c, d/e: ✓"}, ""},
	} {
		t.Run(tt.name, func(t *testing.T) {
			err := Check(tt.labels)
			switch {
			case tt.want == "" && err != nil:
				t.Errorf("Check = %v, want accepted", err)
			case tt.want != "" && (err == nil || !strings.Contains(err.Error(), tt.want)):
				t.Errorf("Check = %v, want an error containing %q", err, tt.want)
			}
		})
	}
}

// TestCheckReportsTheFirstKey: of several broken keys, the first by
// sort order is named, every time.
func TestCheckReportsTheFirstKey(t *testing.T) {
	l := map[string]string{"Zz": "", "Bb": "", "Aa": "", "ok": ""}
	for range 20 {
		if err := Check(l); err == nil || !strings.HasPrefix(err.Error(), `key "Aa"`) {
			t.Fatalf("Check = %v, want the error of key \"Aa\"", err)
		}
	}
}

func ptr(s string) *string { return &s }

// TestMerge: a value sets, null deletes, absent keeps; an edit that breaks
// a rule (its keys, deleted ones included, its values, the count after
// it) changes nothing.
func TestMerge(t *testing.T) {
	cur := map[string]string{"team": "infra", "job": "ci", "keep": "me"}
	orig := maps.Clone(cur)
	got, err := Merge(cur, map[string]*string{"team": ptr("web"), "job": nil, "new": ptr(""), "absent": nil})
	want := map[string]string{"team": "web", "keep": "me", "new": ""}
	if err != nil || !maps.Equal(got, want) {
		t.Errorf("Merge = %v, %v, want %v", got, err, want)
	}
	if !maps.Equal(cur, orig) {
		t.Errorf("Merge changed its input: %v", cur)
	}
	if got, err := Merge(cur, nil); err != nil || !maps.Equal(got, cur) {
		t.Errorf("Merge of an empty edit = %v, %v, want %v", got, err, cur)
	}
	if got, err := Merge(cur, map[string]*string{"team": nil, "job": nil, "keep": nil}); err != nil || got != nil {
		t.Errorf("Merge deleting every label = %#v, %v, want nil", got, err)
	}
	if got, err := Merge(nil, map[string]*string{"a": ptr("1")}); err != nil || !maps.Equal(got, map[string]string{"a": "1"}) {
		t.Errorf("Merge onto none = %v, %v", got, err)
	}
	full := map[string]string{}
	for i := range 64 {
		full[fmt.Sprintf("k%d", i)] = "v"
	}
	if _, err := Merge(full, map[string]*string{"one-more": ptr("v")}); err == nil || err.Error() != "at most 64 labels, got 65 after the edit" {
		t.Errorf("Merge past 64 = %v", err)
	}
	if got, err := Merge(full, map[string]*string{"one-more": ptr("v"), "k0": nil}); err != nil || len(got) != 64 {
		t.Errorf("Merge replacing one of 64 = %d labels, %v", len(got), err)
	}
	for _, bad := range []map[string]*string{
		{"Bad": ptr("v")},
		{"Bad": nil}, // a delete names a valid key too
		{"k": ptr("a\tb")},
		{"k": ptr(strings.Repeat("v", 257))},
	} {
		if got, err := Merge(cur, bad); err == nil || got != nil {
			t.Errorf("Merge(%v) = %v, %v, want an error", bad, got, err)
		}
	}
}

// TestSelector: key=value must equal, key must be present, every term
// must hold; a malformed filter is an error naming it.
func TestSelector(t *testing.T) {
	l := map[string]string{"team": "infra", "job": "a=b", "empty": ""}
	for _, tt := range []struct {
		filters []string
		want    bool
	}{
		{nil, true},
		{[]string{"team=infra"}, true},
		{[]string{"team=web"}, false},
		{[]string{"team"}, true},
		{[]string{"owner"}, false},
		{[]string{"job=a=b"}, true}, // the value holds '='
		{[]string{"job=a"}, false},
		{[]string{"empty="}, true},
		{[]string{"empty"}, true},
		{[]string{"team="}, false},
		{[]string{"team=infra", "job=a=b", "empty"}, true},
		{[]string{"team=infra", "owner"}, false},
		{[]string{"team=infra", "team=web"}, false},
	} {
		sel, err := ParseSelector(tt.filters)
		if err != nil {
			t.Fatalf("ParseSelector(%q): %v", tt.filters, err)
		}
		if got := sel.Matches(l); got != tt.want {
			t.Errorf("%q matches %v = %v, want %v", tt.filters, l, got, tt.want)
		}
	}
	if !(Selector(nil)).Matches(nil) {
		t.Error("the empty selector does not match a VM without labels")
	}
	if sel, _ := ParseSelector([]string{"team"}); sel.Matches(nil) {
		t.Error("a presence filter matches a VM without labels")
	}
	for _, tt := range []struct{ filter, want string }{
		{"", `filter "": key "": must be 1..63 bytes, got 0`},
		{"=v", `filter "=v": key "": must be 1..63 bytes`},
		{"Team=x", `filter "Team=x": key "Team": may hold only`},
		{"team!=x", `filter "team!=x": key "team!": may hold only`},
		{"k=\x01", `filter "k=\x01": value of key "k": must not hold control characters`},
		{"k=" + strings.Repeat("v", 257), `value of key "k": at most 256 bytes, got 257`},
	} {
		if _, err := ParseSelector([]string{"ok", tt.filter}); err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("ParseSelector(%q) = %v, want an error containing %q", tt.filter, err, tt.want)
		}
	}
}
