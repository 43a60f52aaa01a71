package vm

import (
	"context"
	"errors"
	"fmt"
)

// Host is what a create needs done on the host: disk copies, data volumes,
// taps, the seed, qemu-storage-daemon and Cloud Hypervisor. The Service
// calls it only after validation and admission passed. Implementations
// report failures as *HostError so the API can pick the error code.
//
// The engine issue provides the real implementation; tests use an
// in-memory fake that records calls.
type Host interface {
	// Preflight reports whether the host can carry out creating rec at
	// all, before anything is stored. It changes nothing.
	Preflight(ctx context.Context, rec *Record) error
	// Provision creates the VM's disks, taps and seed (downloading the
	// image first when rec.Spec.Image is set). On error it leaves nothing
	// behind that Rollback cannot remove.
	Provision(ctx context.Context, rec *Record) error
	// Boot starts the VM's processes and boots it.
	Boot(ctx context.Context, rec *Record) error
	// Rollback removes everything Provision created for rec. It is
	// idempotent.
	Rollback(ctx context.Context, rec *Record) error
}

// HostErrorKind says which part of the host failed.
type HostErrorKind int

// Kinds of HostError; the API maps them to STORAGE_ERROR, NETWORK_ERROR,
// CH_ERROR and INTERNAL.
const (
	HostInternal HostErrorKind = iota
	HostStorage
	HostNetwork
	HostHypervisor
)

// HostError is a failure of host work.
type HostError struct {
	Kind HostErrorKind
	Op   string // what was being done, such as "copying base image"
	Err  error
}

// Error gives the operation and the cause.
func (e *HostError) Error() string { return e.Op + ": " + e.Err.Error() }

// Unwrap returns the cause.
func (e *HostError) Unwrap() error { return e.Err }

// ErrNotBuilt is wrapped by the errors of NotBuiltHost.
var ErrNotBuilt = errors.New("not built yet")

// NotBuiltHost is the production Host until the engine issue lands: every
// create that needs host work fails in Preflight with a HostInternal error
// that names the missing part.
type NotBuiltHost struct{}

// Preflight fails, naming the part of the host work that does not exist.
func (NotBuiltHost) Preflight(_ context.Context, rec *Record) error {
	part := "classic VM provisioning (disk copy, taps, seed, qemu-storage-daemon, Cloud Hypervisor)"
	if rec.Mode == ModeAppVM {
		part = "AppVM provisioning (root disk copy, data volumes, tap, qemu-storage-daemon, Cloud Hypervisor, guest agent)"
	}
	return &HostError{Kind: HostInternal, Op: "creating VM " + rec.ID, Err: fmt.Errorf("%s is %w", part, ErrNotBuilt)}
}

// Provision fails like Preflight.
func (h NotBuiltHost) Provision(ctx context.Context, rec *Record) error { return h.Preflight(ctx, rec) }

// Boot fails: booting is not built yet.
func (NotBuiltHost) Boot(_ context.Context, rec *Record) error {
	return &HostError{Kind: HostInternal, Op: "booting VM " + rec.ID, Err: fmt.Errorf("booting (qemu-storage-daemon, Cloud Hypervisor) is %w", ErrNotBuilt)}
}

// Rollback has nothing to undo.
func (NotBuiltHost) Rollback(context.Context, *Record) error { return nil }
