package record

import (
	"errors"
	"fmt"
)

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

// ExistsError is a create whose id is taken by a VM of either family, or
// by a create still in flight (409).
type ExistsError struct {
	ID   string
	What string // what has the id: "" for a VM, "volume"
}

// Error names the taken id.
func (e *ExistsError) Error() string {
	what := e.What
	if what == "" {
		what = "VM"
	}
	return fmt.Sprintf("a %s with id %q already exists", what, e.ID)
}

// StateError is an action the VM's state does not allow (409
// INVALID_STATE).
type StateError struct {
	ID     string
	Action string
	State  string // the display state
	// Hint, when set, says how to get the action done anyway.
	Hint string
	// Msg, when set, is the whole message (a conflict that is not about
	// the VM's state, such as a volume in use or a busy mount).
	Msg string
}

// Error names the action and the state, then the hint if any.
func (e *StateError) Error() string {
	if e.Msg != "" {
		return e.Msg
	}
	msg := fmt.Sprintf("cannot %s VM %q while it is %s", e.Action, e.ID, e.State)
	if e.Hint != "" {
		msg += "; " + e.Hint
	}
	return msg
}

// FieldError is a request that decoded but breaks a field rule, a
// combination rule or a host precondition (400 BAD_REQUEST). Field is the
// request path of the offending field, such as "nets[1].ipv4.gateway". The
// message never contains a secret value.
type FieldError struct {
	Field string
	Msg   string
}

// Error gives "field: reason".
func (e *FieldError) Error() string { return e.Field + ": " + e.Msg }

// ErrDeleted is wrapped by the error of a provision that a forced delete
// cancelled (or that began after the delete was recorded): the delete
// removes what the provision made and the record, so its caller neither
// rolls back nor records a failure.
var ErrDeleted = errors.New("the VM was deleted while it was being provisioned")

// Failure kinds and causes of docs/api.md (The VM view).
const (
	KindSocketGone      = "socket_gone"
	KindSocketDead      = "socket_dead"
	KindPingTimeout     = "ping_timeout"
	KindProcessExit     = "process_exit"
	KindProcessSignal   = "process_signal"
	KindMissingPID      = "missing_pid"
	KindDiskMissing     = "disk_missing"
	KindBootTimeout     = "boot_timeout"
	KindProvisionFailed = "provision_failed"

	CauseOperatorShutdown = "operator_shutdown"
	CauseGuestShutdown    = "guest_shutdown"
	CauseCHCrash          = "ch_crash"
	CauseVMMHang          = "vmm_hang"
	CauseDiskMissing      = "disk_missing"
	CauseBootTimeout      = "boot_timeout"
	CauseProvisionFailed  = "provision_failed"
	CauseUnknown          = "unknown"
)

// Check reports a detail that lacks a field docs/api.md (The VM view) makes
// conditional on its kind: code for process_exit, signum for
// process_signal, path for disk_missing, id for invalid_vm_id, seconds for
// boot_timeout. A process whose exit status cannot be read has no code, so
// its end is missing_pid, never process_exit.
func (d FailureDetail) Check() error {
	var missing string
	switch {
	case d.Kind == KindProcessExit && d.Code == nil:
		missing = "code"
	case d.Kind == KindProcessSignal && d.Signum == nil:
		missing = "signum"
	case d.Kind == KindDiskMissing && d.Path == "":
		missing = "path"
	case d.Kind == "invalid_vm_id" && d.ID == "":
		missing = "id"
	case d.Kind == KindBootTimeout && d.Seconds == nil:
		missing = "seconds"
	}
	if missing != "" {
		return fmt.Errorf("failure detail of kind %s lacks its %s", d.Kind, missing)
	}
	return nil
}
