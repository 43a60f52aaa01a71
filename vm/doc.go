// Package vm holds the VM records of both families (classic VMs and
// AppVMs) and the machinery around them: the classic create request (Spec)
// and its rules, host facts read from sysfs, the registry with its single
// id namespace, admission, the create path and the classic view.
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
// Host.Preflight → the record is stored → Host.Provision (in the
// background when an image must be downloaded, answered 202) → Host.Boot
// when auto_boot is set. A synchronous failure before boot rolls back the
// host work and the record; a boot failure keeps the VM.
//
// # Host
//
// Host is the seam to disk copies, taps, the seed, qemu-storage-daemon and
// Cloud Hypervisor. Engine (engine*.go) is the production implementation:
// provisioning steps recorded one by one in Record.Runtime and rolled back
// exactly, the Cloud Hypervisor config (chconfig.go), boot with a state
// check after each step, and the lifecycle actions (lifecycle.go). AppVM
// specifics reach it through AppVMHooks, which package appvm registers.
// vmtest.Host is the recording fake of the contract tests.
//
// # Supervision and recovery
//
// Every running or paused VM has one monitor (monitor.go): the CH child's
// exit (or, for a process adopted after an agent restart, its pidfd), the
// event stream (root disk activated, guest panic, shutdown), the API
// socket's presence and answers, pings, the root disk file, and QSD's
// death; each ends the VM with the failure_reason DESIGN §5 maps it to.
// facts.go learns guest addresses (DHCP snooping, neighbour table). At New,
// recover.go reconciles every record with the host: live processes whose
// pid and start time match are adopted, dead ones end their VM, cut-short
// provisions are resumed or rolled back, and taps, run dirs and processes
// that no record owns are reaped.
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
