package vm

import "vmhost/vm/record"

// The record types live in package vm/record, which package vm/engine
// shares; these aliases keep them in vm's API, where callers (api, appvm)
// meet them with the rules that govern them.

type (
	Record        = record.Record
	Mode          = record.Mode
	State         = record.State
	NIC           = record.NIC
	BaseImage     = record.BaseImage
	Secrets       = record.Secrets
	Secret        = record.Secret
	SecretEnv     = record.SecretEnv
	FailureReason = record.FailureReason
	FailureDetail = record.FailureDetail
	AppVMSpec     = record.AppVMSpec
	AppVMGuest    = record.AppVMGuest
	GuestLease    = record.GuestLease
	Workload      = record.Workload
	Healthcheck   = record.Healthcheck
	ExtraHost     = record.ExtraHost
	ConfigFile    = record.ConfigFile
	TmpfsMount    = record.TmpfsMount
	SecretFile    = record.SecretFile
	Redeploy      = record.Redeploy
	Restart       = record.Restart
	Mount         = record.Mount
	Layout        = record.Layout
	Runtime       = record.Runtime
	CHRuntime     = record.CHRuntime
	QSDRuntime    = record.QSDRuntime
	Confinement   = record.Confinement
	Usage         = record.Usage

	Spec          = record.Spec
	DiskSpec      = record.DiskSpec
	ImageSpec     = record.ImageSpec
	VolumeSpec    = record.VolumeSpec
	NetSpec       = record.NetSpec
	NetIPSpec     = record.NetIPSpec
	Platform      = record.Platform
	CPUTopology   = record.CPUTopology
	CloudInitSpec = record.CloudInitSpec
	CloudInitNet  = record.CloudInitNet
	CloudInitIP   = record.CloudInitIP
	NetView       = record.NetView

	ExistsError   = record.ExistsError
	HostError     = record.HostError
	HostErrorKind = record.HostErrorKind
	StateError    = record.StateError
	FieldError    = record.FieldError
)

// The two families, the stored states and the display states.
const (
	ModeVM    = record.ModeVM
	ModeAppVM = record.ModeAppVM

	StateCreated = record.StateCreated
	StateRunning = record.StateRunning
	StatePaused  = record.StatePaused
	StateStopped = record.StateStopped
	StateFailed  = record.StateFailed

	DisplayBooting         = record.DisplayBooting
	DisplayDownloading     = record.DisplayDownloading
	DisplayCreating        = record.DisplayCreating
	DisplayProvisionFailed = record.DisplayProvisionFailed

	PendingAttach = record.PendingAttach
	PendingDetach = record.PendingDetach
)

// Kinds of HostError.
const (
	HostInternal   = record.HostInternal
	HostStorage    = record.HostStorage
	HostNetwork    = record.HostNetwork
	HostHypervisor = record.HostHypervisor
)

// Limits shared with the record package.
const (
	MaxHostnameBytes = record.MaxHostnameBytes
	MaxNets          = record.MaxNets
)

// StepData is the provisioning step of creating data volume n.
func StepData(n int) string { return record.StepData(n) }

// DeviceName is the guest block device of disk index i (record.DeviceName).
func DeviceName(i int) string { return record.DeviceName(i) }

// ParseCPUSet parses cpuset notation (record.ParseCPUSet).
func ParseCPUSet(s string) ([]int, error) { return record.ParseCPUSet(s) }
