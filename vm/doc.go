// Package vm holds the VM records of both families (classic VMs and
// AppVMs) and their rules: the classic create request (Spec) and its
// validation, host facts read from sysfs, the registry with its single id
// namespace, admission, the create path, the lifecycle actions' state
// rules and per-VM locks, and the classic view. The host work (disks,
// taps, processes, supervision, recovery) is behind Host; package
// vm/engine implements it. The record types themselves live in package
// vm/record, shared with the engine; vm re-exports them.
//
// # Records
//
// One JSON file per VM in a store.Store (<state>/vms/<id>.json, 0600),
// holding the validated request, generated values (id, MACs, tap names,
// created_at), the base image as validated, the state, and the secrets
// (cloud-init password, secret env values) that only the record file and
// the guest ever see. Records are copy-on-write: a *Record handed out is
// never modified, so readers need no lock. Values derivable from a record
// (paths, device letters, hostnames, the default interface, the effective
// kernel command line, CPU numbers) are computed by the views.
//
// # Create path
//
// Validation (*FieldError, 400) → admission under the registry lock, on
// host totals and free space read just before it (*ExistsError or
// *CapacityError, 409; a pending create holds its id and
// counts in later admissions, so of concurrent creates of one id exactly
// one wins and nothing on the host changes before admission passes) →
// Host.Preflight → the record is stored (the create's intent) →
// Host.Provision (in the background when an image must be downloaded,
// answered 202), which records its result, display created included →
// Host.Boot when auto_boot is set, which records its own. A create with
// auto_boot on the Engine thus writes its record three times before it
// answers. A synchronous failure before boot rolls back the host work and
// the record; a boot failure keeps the VM.
//
// # Actions
//
// Act and Delete check the state (*StateError, 409), take the VM's action
// lock (freed once released) and call the Host. Delete stores its intent
// (Record.Deleting) before the Host tears anything down, so that an agent
// killed meanwhile finishes the delete at restart; a forced delete of a VM
// still provisioning has the Host cancel the provision. HostRecords is the
// records as the host sees them (engine.Records): get, list, update,
// stage (a change in memory that the record's next write stores), save,
// remove, and the same per-VM lock.
//
// # Views
//
// View builds the VmView of contract §2.1; ViewJSON encodes it with
// encoding/json, once per record version for a list item and once per
// record version and disk_bytes sample for the single read.
//
// # Knobs
//
// Options.Now, Options.Rand and Options.DiskFree make time, generated
// values and free space deterministic in tests; config.Config.SysfsRoot
// points host facts at a fake sysfs tree; config.Config.Nested overrides
// nested-virtualization detection; HostCPUs, HostMemoryMB and Overcommit
// set admission's totals.
//
// # Limits
//
// vCPUs 1..254 (Cloud Hypervisor's x86_64 limit), memory at least 64 MiB,
// sizes 1..65535 GiB, at most 64 interfaces (tap names stay within
// IFNAMSIZ), volumes[].disk_bytes at most one second stale.
package vm
