package store

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"testing"
)

// FuzzLoad writes arbitrary bytes as a record and checks that Load either
// returns them unchanged as a record holding a JSON object, or moves them
// aside byte for byte as damaged; never both, never neither, never an error.
func FuzzLoad(f *testing.F) {
	for _, seed := range []string{
		`{"id":"vm1"}`, ``, ` `, `{`, `[]`, `null`, `"x"`, `{"a":1}{"b":2}`,
		`{"a":"\u0000"}`, "\xef\xbb\xbf{}", `{"a":1e999}`, "{\"a\":\"\xff\"}",
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		dir := t.TempDir()
		s, err := Open(dir)
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		if err := os.WriteFile(filepath.Join(dir, "vm.json"), data, 0o600); err != nil {
			t.Fatal(err)
		}
		got, err := s.Load()
		if err != nil {
			t.Fatalf("Load: %v", err)
		}
		if len(got.Invalid) != 0 || len(got.RemovedTemps) != 0 {
			t.Fatalf("Load = %+v, want no invalid ids or temps", got)
		}
		switch {
		case len(got.Records) == 1 && len(got.Damaged) == 0:
			if !bytes.Equal(got.Records[0].Data, data) {
				t.Fatalf("record data = %q, want %q", got.Records[0].Data, data)
			}
			var m map[string]json.RawMessage
			if err := json.Unmarshal(data, &m); err != nil || m == nil {
				t.Fatalf("loaded a record that is not a JSON object: %q (%v)", data, err)
			}
		case len(got.Records) == 0 && len(got.Damaged) == 1:
			var m map[string]json.RawMessage
			if err := json.Unmarshal(data, &m); err == nil && m != nil {
				t.Fatalf("a JSON object was reported damaged: %q (%v)", data, got.Damaged[0].Err)
			}
			aside, err := os.ReadFile(filepath.Join(dir, got.Damaged[0].MovedTo))
			if err != nil || !bytes.Equal(aside, data) {
				t.Fatalf("damaged copy = %q, %v; want %q", aside, err, data)
			}
		default:
			t.Fatalf("Load = %+v, want exactly one record or one damaged", got)
		}
	})
}
