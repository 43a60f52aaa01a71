// Package labels holds the rules of a VM's labels (docs/api.md, Labels):
// the key and value rules a create and a labels edit are checked against,
// the merge of an edit (a null value deletes its key), and the selectors
// of ?label= that lists and the event stream filter with.
//
// A VM's labels are a map of string to string: at most MaxLabels; each
// key 1..MaxKeyBytes bytes of [a-z0-9._/-], starting and ending with a
// letter or digit; each value at most MaxValueBytes bytes of UTF-8 without
// control characters. Keys hold no '=', so "key=value" splits at its first
// '=' without ambiguity.
//
// Labels are the caller's (a scheduler's job, tenant or allocation), never
// a secret: they are shown by views and events and may appear in
// messages.
package labels

import (
	"fmt"
	"maps"
	"slices"
	"strings"
	"unicode"
	"unicode/utf8"
)

// Limits of docs/api.md (Labels).
const (
	MaxLabels     = 64
	MaxKeyBytes   = 63
	MaxValueBytes = 256
)

// CheckKey applies the key rule.
func CheckKey(k string) error {
	if n := len(k); n < 1 || n > MaxKeyBytes {
		if len(k) > MaxKeyBytes {
			k = k[:MaxKeyBytes] + "…" // the message stays short
		}
		return fmt.Errorf("key %q: must be 1..%d bytes, got %d", k, MaxKeyBytes, n)
	}
	for i := 0; i < len(k); i++ {
		if !keyByte(k[i]) {
			return fmt.Errorf("key %q: may hold only a-z, 0-9, '.', '_', '/' and '-' (byte %d is not one)", k, i)
		}
	}
	if !alnum(k[0]) || !alnum(k[len(k)-1]) {
		return fmt.Errorf("key %q: must start and end with a lower-case letter or a digit", k)
	}
	return nil
}

// CheckValue applies the value rule to the value v of key k.
func CheckValue(k, v string) error {
	if len(v) > MaxValueBytes {
		return fmt.Errorf("value of key %q: at most %d bytes, got %d", k, MaxValueBytes, len(v))
	}
	if !utf8.ValidString(v) {
		return fmt.Errorf("value of key %q: must be UTF-8", k)
	}
	for i, r := range v {
		if unicode.IsControl(r) {
			return fmt.Errorf("value of key %q: must not hold control characters (byte %d is %U)", k, i, r)
		}
	}
	return nil
}

// Check applies every rule to a VM's labels, keys in sorted order so that
// the first broken rule reported is always the same.
func Check(l map[string]string) error {
	if len(l) > MaxLabels {
		return fmt.Errorf("at most %d labels, got %d", MaxLabels, len(l))
	}
	for _, k := range slices.Sorted(maps.Keys(l)) {
		if err := CheckKey(k); err != nil {
			return err
		}
		if err := CheckValue(k, l[k]); err != nil {
			return err
		}
	}
	return nil
}

// Merge applies the edit patch to cur and checks the result: a key with a
// value sets it, a key with nil deletes it, a key not in patch stays (a
// JSON merge patch, RFC 7396, of the labels object). Every key of patch
// must be a valid key, deleted ones included. cur is not modified; the
// result is a new map, nil when empty.
func Merge(cur map[string]string, patch map[string]*string) (map[string]string, error) {
	for _, k := range slices.Sorted(maps.Keys(patch)) {
		if err := CheckKey(k); err != nil {
			return nil, err
		}
		if v := patch[k]; v != nil {
			if err := CheckValue(k, *v); err != nil {
				return nil, err
			}
		}
	}
	out := maps.Clone(cur)
	if out == nil {
		out = map[string]string{}
	}
	for k, v := range patch {
		if v == nil {
			delete(out, k)
		} else {
			out[k] = *v
		}
	}
	if len(out) > MaxLabels {
		return nil, fmt.Errorf("at most %d labels, got %d after the edit", MaxLabels, len(out))
	}
	if len(out) == 0 {
		return nil, nil
	}
	return out, nil
}

func alnum(c byte) bool { return 'a' <= c && c <= 'z' || '0' <= c && c <= '9' }

func keyByte(c byte) bool { return alnum(c) || c == '.' || c == '_' || c == '/' || c == '-' }

// Selector is the conjunction of ?label= filters: a VM matches when every
// term does. The zero Selector matches everything.
type Selector []Term

// Term is one filter: Key present, or (with HasValue) Key equal to Value.
type Term struct {
	Key      string
	Value    string
	HasValue bool
}

// ParseSelector parses the values of the ?label= query parameter, each
// "key=value" (the label key has exactly that value) or "key" (the VM has
// the label). A filter whose key or value breaks the label rules is an
// error naming it.
func ParseSelector(filters []string) (Selector, error) {
	var sel Selector
	for _, f := range filters {
		k, v, eq := strings.Cut(f, "=")
		if err := CheckKey(k); err != nil {
			return nil, fmt.Errorf("filter %q: %w", f, err)
		}
		if eq {
			if err := CheckValue(k, v); err != nil {
				return nil, fmt.Errorf("filter %q: %w", f, err)
			}
		}
		sel = append(sel, Term{Key: k, Value: v, HasValue: eq})
	}
	return sel, nil
}

// Matches reports whether labels satisfy every term of s.
func (s Selector) Matches(labels map[string]string) bool {
	for _, t := range s {
		v, ok := labels[t.Key]
		if !ok || t.HasValue && v != t.Value {
			return false
		}
	}
	return true
}
