// Package record defines the VM record (Record, Spec, Runtime, NIC, ...)
// that package vm/records owns and packages vm (the records' rules),
// vm/engine (the host work) and appvm share: the record file's encoding
// (secrets included, records of earlier versions migrated on read), the
// path Layout of a VM, the host-side errors (HostError, StateError,
// FieldError, ExistsError), the failure kinds and causes, and pure
// derivations (the effective interface, device, volume, tap and host
// names, the guest's mounts, the cloud-init identity, CPU sets). It
// imports none of those packages.
package record
