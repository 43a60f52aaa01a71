package auth

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"sync"
	"testing"
)

func keysPath(t *testing.T) string {
	t.Helper()
	return filepath.Join(t.TempDir(), "state", "keys.json")
}

func mustAdd(t *testing.T, path, name string, scope Scope, allow ...string) string {
	t.Helper()
	tok, err := Add(path, name, scope, allow)
	if err != nil {
		t.Fatal(err)
	}
	return tok
}

func TestAddStoresOnlyTheHash(t *testing.T) {
	path := keysPath(t)
	tok := mustAdd(t, path, "ops", ScopeReadWrite, "GET /api/vms/{id}")
	if !strings.HasPrefix(tok, TokenPrefix) || len(tok) != len(TokenPrefix)+43 {
		t.Errorf("token %q: want %q + 43 base64url characters", tok, TokenPrefix)
	}
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	secret := strings.TrimPrefix(tok, TokenPrefix)
	if strings.Contains(string(data), secret) {
		t.Fatalf("keys file contains the token:\n%s", data)
	}
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o600 {
		t.Errorf("keys file mode = %o, want 600", fi.Mode().Perm())
	}
	entries, _ := os.ReadDir(filepath.Dir(path))
	if len(entries) != 1 {
		t.Errorf("state dir holds %d entries, want only keys.json (no temp files)", len(entries))
	}

	keys, err := List(path)
	if err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256([]byte(tok))
	if len(keys) != 1 || keys[0].Name != "ops" || keys[0].Scope != ScopeReadWrite ||
		keys[0].SHA256 != hex.EncodeToString(sum[:]) || keys[0].CreatedAt.IsZero() ||
		!reflect.DeepEqual(keys[0].Allow, []string{"GET /api/vms/{id}"}) {
		t.Errorf("List = %+v", keys)
	}
}

func TestTokensAreDistinct(t *testing.T) {
	seen := map[string]bool{}
	for range 100 {
		tok := NewToken()
		if seen[tok] {
			t.Fatalf("NewToken repeated %q", tok)
		}
		seen[tok] = true
	}
}

func TestAuthorize(t *testing.T) {
	path := keysPath(t)
	rw := mustAdd(t, path, "rw", ScopeReadWrite)
	ro := mustAdd(t, path, "ro", ScopeRead)
	narrow := mustAdd(t, path, "narrow", ScopeReadWrite, "GET /api/vms/{id}", "POST /api/vms")
	narrowRO := mustAdd(t, path, "narrow-ro", ScopeRead, "POST /api/vms")
	k, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	if k.Len() != 4 {
		t.Fatalf("Len = %d, want 4", k.Len())
	}
	const (
		get    = "GET /api/vms/{id}"
		create = "POST /api/vms"
		appget = "GET /api/appvm/vms/{id}"
	)
	tests := []struct {
		name     string
		header   string
		pattern  string
		mutates  bool
		wantErr  error
		wantName string
	}{
		{"readwrite reads", "Bearer " + rw, get, false, nil, "rw"},
		{"readwrite creates", "Bearer " + rw, create, true, nil, "rw"},
		{"scheme case-insensitive", "bearer " + rw, get, false, nil, "rw"},
		{"extra spaces", "Bearer   " + rw, get, false, nil, "rw"},
		{"read reads", "Bearer " + ro, get, false, nil, "ro"},
		{"read on mutation", "Bearer " + ro, create, true, ErrForbidden, "ro"},
		{"allowlist hit", "Bearer " + narrow, create, true, nil, "narrow"},
		{"allowlist miss", "Bearer " + narrow, appget, false, ErrForbidden, "narrow"},
		{"allowlist concrete path is not a pattern", "Bearer " + narrow, "GET /api/vms/vm1", false, ErrForbidden, "narrow"},
		{"allowlist does not lift scope", "Bearer " + narrowRO, create, true, ErrForbidden, "narrow-ro"},
		{"missing header", "", get, false, ErrUnauthorized, ""},
		{"bare token", rw, get, false, ErrUnauthorized, ""},
		{"basic scheme", "Basic " + rw, get, false, ErrUnauthorized, ""},
		{"no token", "Bearer", get, false, ErrUnauthorized, ""},
		{"empty token", "Bearer ", get, false, ErrUnauthorized, ""},
		{"token with junk", "Bearer " + rw + " x", get, false, ErrUnauthorized, ""},
		{"unknown token", "Bearer " + NewToken(), get, false, ErrUnauthorized, ""},
		{"token prefix only", "Bearer " + rw[:len(rw)-1], get, false, ErrUnauthorized, ""},
		{"hash instead of token", "Bearer " + hashOf(rw), get, false, ErrUnauthorized, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			key, err := k.Authorize(tt.header, tt.pattern, tt.mutates)
			if tt.wantErr != nil {
				// A refused key is named (for the audit log); an unknown
				// caller is not.
				if !errors.Is(err, tt.wantErr) || (tt.wantName == "") != (key == nil) || (key != nil && key.Name != tt.wantName) {
					t.Fatalf("Authorize = %v, %v; want %v with key %q", key, err, tt.wantErr, tt.wantName)
				}
				for _, tok := range []string{rw, ro, narrow, narrowRO} {
					if strings.Contains(err.Error(), strings.TrimPrefix(tok, TokenPrefix)) {
						t.Errorf("error %q contains a token", err)
					}
				}
				return
			}
			if err != nil || key == nil || key.Name != tt.wantName {
				t.Fatalf("Authorize = %+v, %v; want key %q", key, err, tt.wantName)
			}
		})
	}
}

func hashOf(tok string) string {
	sum := sha256.Sum256([]byte(tok))
	return hex.EncodeToString(sum[:])
}

func TestAuthorizeReturnsACopy(t *testing.T) {
	path := keysPath(t)
	tok := mustAdd(t, path, "k", ScopeRead, "GET /a")
	k, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	got, err := k.Authorize("Bearer "+tok, "GET /a", false)
	if err != nil {
		t.Fatal(err)
	}
	got.Scope = ScopeReadWrite
	got.Allow[0] = "POST /b"
	if _, err := k.Authorize("Bearer "+tok, "POST /b", true); !errors.Is(err, ErrForbidden) {
		t.Errorf("changing the returned key changed the keyring: %v", err)
	}
}

func TestOpenMissingFileHasNoKeys(t *testing.T) {
	k, err := Open(keysPath(t))
	if err != nil {
		t.Fatal(err)
	}
	if k.Len() != 0 {
		t.Errorf("Len = %d, want 0", k.Len())
	}
	if _, err := k.Authorize("Bearer "+NewToken(), "GET /x", false); !errors.Is(err, ErrUnauthorized) {
		t.Errorf("Authorize on an empty keyring = %v, want ErrUnauthorized", err)
	}
}

func TestReload(t *testing.T) {
	path := keysPath(t)
	first := mustAdd(t, path, "first", ScopeRead)
	k, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	second := mustAdd(t, path, "second", ScopeRead)
	if _, err := k.Authorize("Bearer "+second, "GET /x", false); !errors.Is(err, ErrUnauthorized) {
		t.Errorf("key added after Open works before Reload: %v", err)
	}
	if err := Remove(path, "first"); err != nil {
		t.Fatal(err)
	}
	if err := k.Reload(); err != nil {
		t.Fatal(err)
	}
	if _, err := k.Authorize("Bearer "+second, "GET /x", false); err != nil {
		t.Errorf("new key after Reload: %v", err)
	}
	if _, err := k.Authorize("Bearer "+first, "GET /x", false); !errors.Is(err, ErrUnauthorized) {
		t.Errorf("removed key after Reload = %v, want ErrUnauthorized", err)
	}

	// A broken file is reported and the keys in use stay.
	if err := os.WriteFile(path, []byte(`{"keys": [`), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := k.Reload(); err == nil {
		t.Error("Reload of a broken file = nil, want an error")
	}
	if _, err := k.Authorize("Bearer "+second, "GET /x", false); err != nil {
		t.Errorf("keys lost after a failed Reload: %v", err)
	}
}

func TestAddErrors(t *testing.T) {
	path := keysPath(t)
	mustAdd(t, path, "taken", ScopeRead)
	tests := []struct {
		name  string
		key   string
		scope Scope
		allow []string
	}{
		{"duplicate", "taken", ScopeRead, nil},
		{"empty name", "", ScopeRead, nil},
		{"bad name", "a b", ScopeRead, nil},
		{"bad scope", "x", "admin", nil},
		{"empty scope", "x", "", nil},
		{"concrete path without method", "x", ScopeRead, []string{"/api/vms"}},
		{"lower-case method", "x", ScopeRead, []string{"get /api/vms/{id}"}},
		{"two spaces", "x", ScopeRead, []string{"GET  /api/vms"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if tok, err := Add(path, tt.key, tt.scope, tt.allow); err == nil {
				t.Errorf("Add = %q, nil; want an error", tok)
			}
		})
	}
	if _, err := Add(path, "taken", ScopeRead, nil); !errors.Is(err, ErrKeyExists) {
		t.Errorf("Add(taken) = %v, want ErrKeyExists", err)
	}
	keys, err := List(path)
	if err != nil || len(keys) != 1 {
		t.Errorf("List after failed Adds = %+v, %v; want only taken", keys, err)
	}
}

func TestRemove(t *testing.T) {
	path := keysPath(t)
	mustAdd(t, path, "a", ScopeRead)
	mustAdd(t, path, "b", ScopeRead)
	mustAdd(t, path, "c", ScopeRead)
	if err := Remove(path, "b"); err != nil {
		t.Fatal(err)
	}
	err := Remove(path, "b")
	if !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("Remove(b) twice = %v, want fs.ErrNotExist", err)
	}
	// The CLI prints this message: it names the key, not a missing file.
	if err == nil || err.Error() != `removing key: no key named "b"` {
		t.Errorf("Remove(b) twice says %q, want %q", err, `removing key: no key named "b"`)
	}
	noFile := filepath.Join(t.TempDir(), "keys.json")
	if err := Remove(noFile, "x"); err == nil || err.Error() != `removing key: no key named "x"` {
		t.Errorf("Remove from a missing file says %q, want %q", err, `removing key: no key named "x"`)
	}
	keys, err := List(path)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, k := range keys {
		names = append(names, k.Name)
	}
	if !reflect.DeepEqual(names, []string{"a", "c"}) {
		t.Errorf("names after Remove = %q, want [a c]", names)
	}
}

func TestConcurrentAdds(t *testing.T) {
	path := keysPath(t)
	var wg sync.WaitGroup
	for i := range 10 {
		wg.Go(func() {
			if _, err := Add(path, fmt.Sprintf("k%d", i), ScopeRead, nil); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	keys, err := List(path)
	if err != nil {
		t.Fatal(err)
	}
	if len(keys) != 10 {
		t.Errorf("List after 10 concurrent Adds has %d keys, want 10", len(keys))
	}
}

func TestReadRejectsBadFiles(t *testing.T) {
	good := hashOf("x")
	tests := []struct{ name, body string }{
		{"not json", `keys`},
		{"unknown field", `{"keys": [], "version": 2}`},
		{"unknown key field", `{"keys": [{"name":"a","sha256":"` + good + `","scope":"read","token":"x"}]}`},
		{"bad hash", `{"keys": [{"name":"a","sha256":"abc","scope":"read"}]}`},
		{"upper-case hash", `{"keys": [{"name":"a","sha256":"` + strings.ToUpper(good) + `","scope":"read"}]}`},
		{"bad scope", `{"keys": [{"name":"a","sha256":"` + good + `","scope":"root"}]}`},
		{"duplicate name", `{"keys": [{"name":"a","sha256":"` + good + `","scope":"read"},{"name":"a","sha256":"` + hashOf("y") + `","scope":"read"}]}`},
		{"duplicate hash", `{"keys": [{"name":"a","sha256":"` + good + `","scope":"read"},{"name":"b","sha256":"` + good + `","scope":"read"}]}`},
		{"trailing", `{"keys": []} x`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			path := keysPath(t)
			os.MkdirAll(filepath.Dir(path), 0o700)
			if err := os.WriteFile(path, []byte(tt.body), 0o600); err != nil {
				t.Fatal(err)
			}
			if _, err := Open(path); err == nil {
				t.Errorf("Open(%s) = nil error", tt.body)
			}
			if _, err := Add(path, "new", ScopeRead, nil); err == nil {
				t.Errorf("Add over a bad file = nil error; it would drop the keys it cannot read")
			}
		})
	}
}
