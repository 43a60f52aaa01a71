// Package auth holds vmhost's API keys and decides whether a request may
// call a route.
//
// Keys live in one JSON file, <state>/keys.json (mode 0600), written
// atomically (temp file, fsync, rename, fsync of the directory) under an
// exclusive flock of the directory, so concurrent `vmhost key` commands do
// not lose each other's changes. The file holds, per key, its name, scope,
// optional allowlist, creation time and the SHA-256 of its token, never the
// token itself: a token is shown once, by Add, and cannot be recovered.
//
// A token is "vmh_" followed by 32 random bytes in unpadded base64url. A
// request presents it as "Authorization: Bearer <token>". The Keyring looks
// the token's SHA-256 up in a map and confirms the match with a
// constant-time comparison.
//
// Scopes: ScopeRead allows routes that do not mutate; ScopeReadWrite allows
// every route. A key with a non-empty allowlist may call only the route
// patterns listed, spelled exactly as the API's mux spells them, for example
// "GET /api/vms/{id}"; a concrete path such as "GET /api/vms/vm1" matches
// nothing.
//
// The package imports none of vmhost's packages.
package auth

import (
	"bytes"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"vmhost/internal/atomicfile"
)

// Scope is what a key may do.
type Scope string

// The scopes of the API (docs/api.md, Conventions: Keys).
const (
	ScopeRead      Scope = "read"
	ScopeReadWrite Scope = "readwrite"
)

// TokenPrefix starts every token, so a leaked one is easy to recognise.
const TokenPrefix = "vmh_"

// Errors of Authorize. The api layer maps them to 401 UNAUTHORIZED and
// 403 FORBIDDEN; the wrapping error says why, never the token.
var (
	ErrUnauthorized = errors.New("unauthorized")
	ErrForbidden    = errors.New("forbidden")
)

// ErrKeyExists is returned by Add for a name already in use.
var ErrKeyExists = errors.New("key name already exists")

// Key is one stored API key.
type Key struct {
	// Name identifies the key to operators (key list, key remove, logs).
	Name string `json:"name"`
	// SHA256 is the lower-case hex SHA-256 of the token.
	SHA256 string `json:"sha256"`
	// Scope is read or readwrite.
	Scope Scope `json:"scope"`
	// Allow, when non-empty, lists the only route patterns the key may call.
	Allow []string `json:"allow,omitempty"`
	// CreatedAt is when Add created the key.
	CreatedAt time.Time `json:"created_at"`
}

// file is the format of keys.json.
type file struct {
	Keys []Key `json:"keys"`
}

var (
	namePattern = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$`)
	hashPattern = regexp.MustCompile(`^[0-9a-f]{64}$`)
	// A route pattern as net/http.ServeMux spells it with a method: an
	// upper-case method, one space, an absolute path.
	routePattern = regexp.MustCompile(`^[A-Z]+ /[^\s]*$`)
)

// ValidateAllow reports whether each entry looks like a method route pattern
// ("GET /api/vms/{id}").
func ValidateAllow(allow []string) error {
	for _, a := range allow {
		if !routePattern.MatchString(a) {
			return fmt.Errorf("allowlist entry %q is not a route pattern such as %q", a, "GET /api/vms/{id}")
		}
	}
	return nil
}

func (k *Key) validate() error {
	if !namePattern.MatchString(k.Name) {
		return fmt.Errorf("key name %q must match %s", k.Name, namePattern)
	}
	if !hashPattern.MatchString(k.SHA256) {
		return fmt.Errorf("key %q: sha256 must be 64 lower-case hex digits", k.Name)
	}
	if k.Scope != ScopeRead && k.Scope != ScopeReadWrite {
		return fmt.Errorf("key %q: scope %q is neither %q nor %q", k.Name, k.Scope, ScopeRead, ScopeReadWrite)
	}
	if err := ValidateAllow(k.Allow); err != nil {
		return fmt.Errorf("key %q: %w", k.Name, err)
	}
	return nil
}

// Keyring is the set of keys the server accepts. It is safe for concurrent
// use; Reload swaps the set atomically.
type Keyring struct {
	path   string
	mu     sync.RWMutex
	byHash map[[sha256.Size]byte]*Key
}

// Open reads the keys at path. A missing file means no keys: every request
// is then unauthorized until a key is added and Reload is called.
func Open(path string) (*Keyring, error) {
	k := &Keyring{path: path}
	if err := k.Reload(); err != nil {
		return nil, err
	}
	return k, nil
}

// Reload rereads the key file. On error the keys in use stay as they were.
func (k *Keyring) Reload() error {
	keys, err := read(k.path)
	if err != nil {
		return err
	}
	byHash := make(map[[sha256.Size]byte]*Key, len(keys))
	for i := range keys {
		var h [sha256.Size]byte
		hex.Decode(h[:], []byte(keys[i].SHA256)) // validated by read
		byHash[h] = &keys[i]
	}
	k.mu.Lock()
	k.byHash = byHash
	k.mu.Unlock()
	return nil
}

// Len returns the number of keys in use.
func (k *Keyring) Len() int {
	k.mu.RLock()
	defer k.mu.RUnlock()
	return len(k.byHash)
}

// Authorize checks the value of an Authorization header against the keyring
// for the route pattern (as the mux spells it, e.g. "GET /api/vms/{id}"),
// which mutates or not. It returns a copy of the matching key, or an error
// wrapping ErrUnauthorized (missing or malformed header, unknown token; no
// key) or ErrForbidden (read key on a mutation, pattern outside a non-empty
// allowlist; with the refused key, so the audit log can name it).
func (k *Keyring) Authorize(header, pattern string, mutates bool) (*Key, error) {
	token, err := bearerToken(header)
	if err != nil {
		return nil, err
	}
	sum := sha256.Sum256([]byte(token))
	k.mu.RLock()
	key := k.byHash[sum]
	k.mu.RUnlock()
	if key == nil {
		return nil, fmt.Errorf("%w: unknown API key", ErrUnauthorized)
	}
	// The map lookup already matched the hash; the constant-time compare
	// keeps the final decision free of data-dependent timing.
	stored, _ := hex.DecodeString(key.SHA256)
	if subtle.ConstantTimeCompare(stored, sum[:]) != 1 {
		return nil, fmt.Errorf("%w: unknown API key", ErrUnauthorized)
	}
	c := *key
	c.Allow = slices.Clone(key.Allow)
	if mutates && key.Scope != ScopeReadWrite {
		return &c, fmt.Errorf("%w: key %q has scope %s; %s needs %s", ErrForbidden, key.Name, key.Scope, pattern, ScopeReadWrite)
	}
	if len(key.Allow) > 0 && !slices.Contains(key.Allow, pattern) {
		return &c, fmt.Errorf("%w: %s is not in the allowlist of key %q", ErrForbidden, pattern, key.Name)
	}
	return &c, nil
}

// bearerToken extracts the token of "Bearer <token>". The scheme is
// case-insensitive (RFC 9110 §11.1); the token may not contain whitespace.
func bearerToken(header string) (string, error) {
	if header == "" {
		return "", fmt.Errorf("%w: missing Authorization header", ErrUnauthorized)
	}
	scheme, token, ok := strings.Cut(header, " ")
	token = strings.TrimLeft(token, " ")
	if !ok || !strings.EqualFold(scheme, "Bearer") || token == "" || strings.ContainsAny(token, " \t\r\n") {
		return "", fmt.Errorf("%w: Authorization header is not \"Bearer <API key>\"", ErrUnauthorized)
	}
	return token, nil
}

// NewToken returns a fresh random token.
func NewToken() string {
	var b [32]byte
	rand.Read(b[:])
	return TokenPrefix + base64.RawURLEncoding.EncodeToString(b[:])
}

// Add creates a key named name in the key file at path (creating the file
// with mode 0600 if missing) and returns its token, which is stored nowhere:
// only its SHA-256 is written. A name in use gives an error wrapping
// ErrKeyExists.
func Add(path, name string, scope Scope, allow []string) (token string, err error) {
	token = NewToken()
	sum := sha256.Sum256([]byte(token))
	key := Key{
		Name:      name,
		SHA256:    hex.EncodeToString(sum[:]),
		Scope:     scope,
		Allow:     slices.Clone(allow),
		CreatedAt: time.Now().UTC().Truncate(time.Second),
	}
	if err := key.validate(); err != nil {
		return "", fmt.Errorf("adding key: %w", err)
	}
	err = update(path, func(keys []Key) ([]Key, error) {
		if slices.ContainsFunc(keys, func(k Key) bool { return k.Name == name }) {
			return nil, fmt.Errorf("%w: %q", ErrKeyExists, name)
		}
		return append(keys, key), nil
	})
	if err != nil {
		return "", fmt.Errorf("adding key %q: %w", name, err)
	}
	return token, nil
}

// noKeyError is Remove's error for a name not in the file. It satisfies
// errors.Is(err, fs.ErrNotExist) without printing "file does not exist",
// which would suggest the key file itself is missing.
type noKeyError struct{ name string }

func (e *noKeyError) Error() string        { return fmt.Sprintf("no key named %q", e.name) }
func (e *noKeyError) Is(target error) bool { return target == fs.ErrNotExist }

// Remove deletes the key named name. A name not in the file (or no file)
// gives an error reading `no key named "name"` that satisfies
// errors.Is(err, fs.ErrNotExist).
func Remove(path, name string) error {
	err := update(path, func(keys []Key) ([]Key, error) {
		i := slices.IndexFunc(keys, func(k Key) bool { return k.Name == name })
		if i < 0 {
			return nil, &noKeyError{name: name}
		}
		return slices.Delete(keys, i, i+1), nil
	})
	if err != nil {
		return fmt.Errorf("removing key: %w", err)
	}
	return nil
}

// List returns the keys in the file at path, in creation order. A missing
// file has no keys.
func List(path string) ([]Key, error) {
	return read(path)
}

// read parses and validates the key file. A missing file has no keys.
func read(path string) ([]Key, error) {
	data, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("reading keys: %w", err)
	}
	keys, err := parse(data)
	if err != nil {
		return nil, fmt.Errorf("keys file %s: %w", path, err)
	}
	return keys, nil
}

func parse(data []byte) ([]Key, error) {
	var f file
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&f); err != nil {
		return nil, fmt.Errorf("decoding: %w", err)
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return nil, errors.New("decoding: unexpected data after the JSON object")
	}
	names := map[string]bool{}
	hashes := map[string]bool{}
	for i := range f.Keys {
		k := &f.Keys[i]
		if err := k.validate(); err != nil {
			return nil, err
		}
		if names[k.Name] {
			return nil, fmt.Errorf("key name %q appears twice", k.Name)
		}
		if hashes[k.SHA256] {
			return nil, fmt.Errorf("key %q has the same token hash as another key", k.Name)
		}
		names[k.Name], hashes[k.SHA256] = true, true
	}
	return f.Keys, nil
}

// update applies change to the keys in path under an exclusive lock of the
// directory and writes the result atomically.
func update(path string, change func([]Key) ([]Key, error)) error {
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	// Held until d is closed. flock on the directory needs no lock file.
	if err := syscall.Flock(int(d.Fd()), syscall.LOCK_EX); err != nil {
		return fmt.Errorf("locking %s: %w", dir, err)
	}
	keys, err := read(path)
	if err != nil {
		return err
	}
	keys, err = change(keys)
	if err != nil {
		return err
	}
	data, err := json.MarshalIndent(file{Keys: keys}, "", "  ")
	if err != nil {
		return err
	}
	return atomicfile.WriteFile(path, append(data, '\n'), 0o600)
}
