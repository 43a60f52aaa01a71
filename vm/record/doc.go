// Package record defines the VM record (Record, Spec, Runtime, NIC, ...)
// shared by package vm, which owns the records and their rules, and
// package vm/engine, which does the host work: the record file's encoding
// (secrets included), the path Layout of a VM, the host-side errors
// (HostError, StateError, FieldError), the failure kinds and causes, and
// pure derivations (the effective interface, device, volume, tap and host
// names, CPU sets).
package record
