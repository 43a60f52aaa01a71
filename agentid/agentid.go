// Package agentid gives an agent its identity on the host: a random id made
// once per state directory and kept in <state>/agent_id, so that every host
// object the agent makes (tap ifaliases, nftables tables, cgroup
// directories, dev bridges) can say whose it is, and an agent reaps only
// its own.
//
// An id is 16 lowercase hex digits (64 random bits): short enough for the
// places it must fit (an ifalias "vmhost:<agent_id>:<vm_id>:<index>", an
// nftables table name, a cgroup directory name) and long enough that two
// agents never draw the same one. It is not a secret: the file is 0644 and
// GET /api/host shows it.
//
// The file is written once, atomically (internal/atomicfile), and never
// rewritten: a file that exists but does not hold a valid id is an error,
// not a reason to make a new id, since a new id would disown every object
// the agent made under the old one.
package agentid

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"vmhost/internal/atomicfile"
)

// FileName is the file in the state directory that holds the id.
const FileName = "agent_id"

// Len is the length of an id: hex digits of 8 random bytes.
const Len = 16

// Valid reports whether s has the form of an id: Len lowercase hex digits.
func Valid(s string) bool {
	if len(s) != Len {
		return false
	}
	for i := 0; i < len(s); i++ {
		if c := s[i]; !('0' <= c && c <= '9' || 'a' <= c && c <= 'f') {
			return false
		}
	}
	return true
}

// New returns a fresh random id.
func New() string {
	var b [Len / 2]byte
	rand.Read(b[:]) // never fails (crypto/rand)
	return hex.EncodeToString(b[:])
}

// Load returns the id kept in stateDir, making and storing one (mode 0644)
// when the directory has none yet. The caller holds the state directory's
// lock, so no other agent makes one at the same time.
func Load(stateDir string) (string, error) {
	path := filepath.Join(stateDir, FileName)
	id, err := read(path)
	if err == nil || !errors.Is(err, fs.ErrNotExist) {
		return id, err
	}
	// A write interrupted by a crash left a temp file beside it; the
	// caller's lock means no write is in flight now.
	if tmps, _ := filepath.Glob(filepath.Join(stateDir, "."+FileName+".tmp-*")); len(tmps) > 0 {
		for _, t := range tmps {
			os.Remove(t)
		}
	}
	id = New()
	err = atomicfile.Create(path, 0o644, func(f *os.File) error {
		_, err := f.WriteString(id + "\n")
		return err
	})
	if errors.Is(err, fs.ErrExist) {
		return read(path) // made meanwhile: that one counts
	}
	if err != nil {
		return "", fmt.Errorf("storing the agent id: %w", err)
	}
	return id, nil
}

func read(path string) (string, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return "", err
		}
		return "", fmt.Errorf("reading the agent id: %w", err)
	}
	id := strings.TrimSuffix(string(data), "\n")
	if !Valid(id) {
		return "", fmt.Errorf("agent id file %s holds %q, not %d lowercase hex digits: restore it from a backup (a new id would disown the taps, rules and cgroups this agent made)", path, truncate(id, 40), Len)
	}
	return id, nil
}

func truncate(s string, n int) string {
	if len(s) > n {
		return s[:n] + "…"
	}
	return s
}
