//go:build !linux

package netnstest

import (
	"errors"
	"testing"
)

const skipReason = "network namespaces exist only on Linux"

// RequireRoot skips: the tests that call it need Linux network namespaces.
func RequireRoot(t testing.TB) { t.Helper(); t.Skip(skipReason) }

// RequireTun skips, as RequireRoot.
func RequireTun(t testing.TB) { t.Helper(); t.Skip(skipReason) }

// NS is a network namespace; off Linux none is ever made.
type NS struct{ FD int }

// New skips the test.
func New(t testing.TB) *NS { t.Helper(); t.Skip(skipReason); return nil }

// Run fails: there is no namespace to run in.
func (ns *NS) Run(f func() error) error { return errors.ErrUnsupported }

// Enter skips the test.
func Enter(t testing.TB) { t.Helper(); t.Skip(skipReason) }

// RunIn fails: there is no namespace to run in.
func RunIn(fd int, f func() error) error { return errors.ErrUnsupported }
