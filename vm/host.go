package vm

import (
	"context"
	"errors"
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

// ErrNoHost is wrapped by the errors of NoHost.
var ErrNoHost = errors.New("this service does no host work")

// NoHost is a Host that refuses all host work: every create fails in
// Preflight (before anything is stored) with a HostInternal error, and Boot
// fails likewise. Tests use it where no disk, tap or process may be made.
type NoHost struct{}

// Preflight refuses the create.
func (NoHost) Preflight(_ context.Context, rec *Record) error {
	return &HostError{Kind: HostInternal, Op: "creating VM " + rec.ID, Err: ErrNoHost}
}

// Provision refuses like Preflight.
func (h NoHost) Provision(ctx context.Context, rec *Record) error { return h.Preflight(ctx, rec) }

// Boot refuses.
func (NoHost) Boot(_ context.Context, rec *Record) error {
	return &HostError{Kind: HostInternal, Op: "booting VM " + rec.ID, Err: ErrNoHost}
}

// Rollback has nothing to undo.
func (NoHost) Rollback(context.Context, *Record) error { return nil }
