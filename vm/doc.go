// Package vm holds the rules of the VM records of both families (classic
// VMs and AppVMs): the classic create request (Spec) and its validation,
// host facts read from sysfs, the single id namespace, admission, the
// create path, the lifecycle actions' state rules, volumes, and the
// classic view. The records themselves are owned by package vm/records
// (registry, per-VM locks, staged writes, change events), which the
// Service is handed; the host work (disks, taps, processes, supervision,
// recovery) is behind Host, which package vm/engine implements and which
// records its results through the same owner. The record types live in
// package vm/record; vm re-exports them.
//
// # Records
//
// One JSON file per VM (<state>/vms/<id>.json, 0600), holding the
// validated request, generated values (id, MACs, tap names, created_at),
// the base image as validated, the state, and the secrets (cloud-init
// password, secret env values) that only the record file and the guest
// ever see. Records are copy-on-write: a *Record handed out is never
// modified, so readers need no lock. Values derivable from a record
// (paths, device letters, hostnames, the default interface, the effective
// kernel command line, CPU numbers) are computed by the views.
//
// # Create path
//
// Validation (*FieldError, 400) → Host.Preflight, the host preconditions
// (the AppVM kernel, the programs, taps and bridges; *FieldError, 400,
// naming what the host lacks) → admission under the registry lock, on
// host totals and free space read just before it (*ExistsError or
// *CapacityError, 409; a pending create holds its id and
// counts in later admissions, so of concurrent creates of one id exactly
// one wins and nothing on the host changes before admission passes) →
// the record is stored (the create's intent) →
// Host.Provision (in the background when an image must be downloaded,
// answered 202), which records its result, display created included →
// Host.Boot when auto_boot is set, which records its own. With auto_boot
// the provision stages its result (records.Registry.Stage) and the boot's
// write stores both, so a create writes its record twice before it
// answers. A synchronous failure before boot rolls back the host work and
// the record; a boot failure keeps the VM.
//
// # Actions
//
// Act and Delete take the VM's action lock (records.Registry.Lock), check
// the state (*StateError, 409) and call the Host. Delete stores its intent
// (Record.Deleting) before the Host tears anything down, so that an agent
// killed meanwhile finishes the delete at restart; a forced delete of a VM
// still provisioning has the Host cancel the provision.
//
// # Views
//
// View builds the VmView of docs/api.md (The VM view); ViewJSON encodes it with
// encoding/json, once per record version for a list item and once per
// record version and disk_bytes sample for the single read; the memo of a
// removed VM goes with it (the Service follows the records' changes).
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
