package config

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestProblemPositions: every problem a file holds is reported at the line
// and column (1-based, in bytes) where its key's value, or the unknown key,
// starts; a problem about a key the file does not hold has no position.
func TestProblemPositions(t *testing.T) {
	for _, tt := range []struct {
		name, body string
		want       []string // Problem.String() of each problem, in order
	}{
		{"syntax", "{\n  \"a\": 1,,\n}", []string{`2:10: decoding: invalid character ',' looking for beginning of object key string`}},
		{"trailing", "{}\n  {}", []string{"2:3: decoding: unexpected data after the JSON object"}},
		{"unknown top-level key", "{\n\t\"boot_timeout\": 5}", []string{`2:2: unknown field "boot_timeout"`}},
		{"unknown nested key", "{\"networks\": [\n  {\"id\": \"a\", \"bridge\": \"b\"},\n  {\"id\": \"c\", \"bridge\": \"d\", \"vlan\": 3}]}",
			[]string{`3:30: networks[1]: unknown field "vlan"`}},
		{"every unknown key at once", `{"x": 1, "tls": {"crt": "/a"}}`,
			[]string{`1:2: unknown field "x"`, `1:18: tls: unknown field "crt"`}},
		{"wrong type", "{\"overcommit\": {\n    \"cpu\": \"2\"}}", []string{`2:12: overcommit.cpu: decoding: a JSON string where a number belongs`}},
		{"wrong type in an array", `{"host_path_roots": ["/a", 3]}`, []string{`1:28: host_path_roots[1]: decoding: a JSON number where a string belongs`}},
		{"rule", "{\n  \"networks\": [{\"id\": \"a\", \"bridge\": \"b\", \"mtu\": 99}],\n  \"default_network\": \"a\",\n  \"boot_timeout_secs\": 0\n}",
			[]string{"2:50: networks[0].mtu: 99 is outside 1280..65521, the range a tap takes with Cloud Hypervisor (0 = default_mtu)",
				"4:24: boot_timeout_secs: 0 must be at least 1"}},
		{"a default the file contradicts has no position", `{"networks": [{"id": "lan", "bridge": "br0"}]}`,
			[]string{`default_network: "default" is not the id of any entry in networks`}},
		{"an object's own rule", `{"tls": {"cert": "/c"}}`, []string{"1:9: tls: cert and key go together (one of them is empty)"}},
		{"multi-byte characters count in bytes", "{\"default_cmdline\": \"é\", \"ping_timeout_secs\": -1}", []string{"1:48: ping_timeout_secs: -1 must be at least 1"}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			_, err := Parse([]byte(tt.body))
			var e *Error
			if !errors.As(err, &e) {
				t.Fatalf("Parse = %v, want an *Error", err)
			}
			var got []string
			for _, p := range e.Problems {
				got = append(got, p.String())
			}
			if strings.Join(got, "\n") != strings.Join(tt.want, "\n") {
				t.Errorf("problems:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(tt.want, "\n"))
			}
		})
	}
}

// TestLoadNamesFileLineColumn: Load's error starts each problem with
// FILE:LINE:COLUMN (FILE: alone without a position), the form editors and
// terminals jump to; a missing file is fs.ErrNotExist.
func TestLoadNamesFileLineColumn(t *testing.T) {
	path := filepath.Join(t.TempDir(), "config.json")
	os.WriteFile(path, []byte("{\n  \"networks\": [{\"id\": \"lan\", \"bridge\": \"br 0\"}]\n}\n"), 0o644)
	_, err := Load(path)
	want := "config " + path + " is invalid:\n" +
		path + ":2:40: networks[0].bridge: \"br 0\" is not an interface name (1-15 of letters, digits, _ . @ -)\n" +
		path + `: default_network: "default" is not the id of any entry in networks`
	if err == nil || err.Error() != want {
		t.Errorf("Load error:\n%v\nwant:\n%s", err, want)
	}
	if _, err := Load(filepath.Join(t.TempDir(), "absent.json")); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("Load of a missing file = %v, want fs.ErrNotExist", err)
	}
}

// TestEveryProblemNamesItsKey: Validate's messages all start with a key,
// which Problem.Key holds apart; a problem with no key would have no
// position to be reported at.
func TestEveryProblemNamesItsKey(t *testing.T) {
	c := &Config{Overcommit: Overcommit{CPU: -1}, TLS: TLS{ClientCA: "x"}, FetchDeny: []string{"nope"},
		HostPathRoots: []string{"rel"}, Registry: Registry{Indexes: []string{"ftp://x"}}}
	probs := c.problems()
	if len(probs) < 15 {
		t.Fatalf("only %d problems for a zero config: %v", len(probs), probs)
	}
	for _, p := range probs {
		if p.Key == "" || strings.ContainsAny(p.Key, " :") || p.Msg == "" {
			t.Errorf("problem %q has no proper key", p.String())
		}
	}
}
