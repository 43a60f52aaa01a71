package record

import (
	"fmt"
	"slices"
	"strconv"
)

// Runtime is what the engine records about a VM's host side: which
// provisioning steps are done (so each is done once and rollback removes
// exactly those), the vsock CID, and the identity of the two processes.
// A process is trusted only while pid and start time both match
// (docs/design.md §2).
type Runtime struct {
	// Steps are the completed provisioning steps, in the order done
	// (Step* constants; "data<N>" and "tap<N>" per volume and interface).
	Steps []string `json:"steps,omitempty"`
	// VsockCID is the guest CID of the VM's vsock device (≥ 3, unique among
	// records); 0 until allocated.
	VsockCID uint32 `json:"vsock_cid,omitempty"`
	// CH is the running Cloud Hypervisor, nil when none.
	CH *CHRuntime `json:"ch,omitempty"`
	// QSD is the running qemu-storage-daemon, nil when none.
	QSD *QSDRuntime `json:"qsd,omitempty"`
}

// CHRuntime identifies a Cloud Hypervisor process and its files.
type CHRuntime struct {
	Pid          int    `json:"pid"`
	StartTime    uint64 `json:"start_time"` // field 22 of /proc/PID/stat
	APISocket    string `json:"api_socket"`
	EventsPath   string `json:"events_path"`
	SerialSocket string `json:"serial_socket"`
	VsockSocket  string `json:"vsock_socket"`
	LogFile      string `json:"log_file"`
}

// QSDRuntime identifies a qemu-storage-daemon process and its files.
type QSDRuntime struct {
	Pid         int      `json:"pid"`
	StartTime   uint64   `json:"start_time"`
	QMPSocket   string   `json:"qmp_socket"`
	RootSocket  string   `json:"root_socket"`
	DataSockets []string `json:"data_sockets,omitempty"`
	PidFile     string   `json:"pid_file"`
	LogFile     string   `json:"log_file"`
}

// Provisioning steps recorded in Runtime.Steps.
const (
	StepImage    = "image"     // the image is in the cache (downloaded or already there)
	StepRootDisk = "root_disk" // root.qcow2 copied from the base image
	StepSeed     = "seed"      // seed.img written
	StepRunDir   = "run_dir"   // <run>/vms/<id> created
)

// StepData is the step of creating data volume n.
func StepData(n int) string { return "data" + strconv.Itoa(n) }

// StepTap is the step of creating, attaching and guarding tap n.
func StepTap(n int) string { return "tap" + strconv.Itoa(n) }

// Done reports whether step is recorded as completed. A nil Runtime has no
// steps.
func (rt *Runtime) Done(step string) bool {
	return rt != nil && slices.Contains(rt.Steps, step)
}

// MaxSocketPath is the longest unix socket path the kernel accepts
// (sun_path is 108 bytes with its terminating NUL).
const MaxSocketPath = 107

// longestRunFile is the longest name a VM's run directory holds: a hybrid
// vsock listener "vsock.sock_<port>" for a 5-digit port.
const longestRunFile = "vsock.sock_65535"

// APISocket is Cloud Hypervisor's API socket.
func (l Layout) APISocket(id string) string { return l.RunVMDir(id) + "/ch.sock" }

// Events is Cloud Hypervisor's event-monitor file.
func (l Layout) Events(id string) string { return l.RunVMDir(id) + "/events" }

// VsockSocket is the hybrid vsock socket; listeners add "_<port>".
func (l Layout) VsockSocket(id string) string { return l.RunVMDir(id) + "/vsock.sock" }

// QMPSocket is qemu-storage-daemon's monitor socket.
func (l Layout) QMPSocket(id string) string { return l.RunVMDir(id) + "/qsd.qmp" }

// RootSocket is the root disk's vhost-user-blk socket.
func (l Layout) RootSocket(id string) string { return l.RunVMDir(id) + "/root.vhost" }

// DataSocket is the vhost-user-blk socket of the data volume with per-VM
// id key.
func (l Layout) DataSocket(id, key string) string {
	return l.RunVMDir(id) + "/" + key + ".vhost"
}

// QSDPidFile is the pid file qemu-storage-daemon writes and locks.
func (l Layout) QSDPidFile(id string) string { return l.RunVMDir(id) + "/qsd.pid" }

// CHLog is Cloud Hypervisor's log file (its stdout and stderr go to
// ConsoleLog is the file keeping the VM's serial console output (rotated
// to ConsoleLog + ".1").
func (l Layout) ConsoleLog(id string) string { return l.RunVMDir(id) + "/console.log" }

// CHLog+".out").
func (l Layout) CHLog(id string) string { return l.RunVMDir(id) + "/ch.log" }

// QSDLog is qemu-storage-daemon's stdout and stderr.
func (l Layout) QSDLog(id string) string { return l.RunVMDir(id) + "/qsd.log" }

// CheckSocketPaths reports an error when the sockets of VM id would not fit
// a unix socket address (MaxSocketPath bytes) under this run directory.
func (l Layout) CheckSocketPaths(id string) error {
	p := l.RunVMDir(id) + "/" + longestRunFile
	if len(p) > MaxSocketPath {
		return fmt.Errorf("socket path %s would be %d bytes, more than the %d a unix socket allows: use a shorter run directory (now %d bytes) or VM id",
			p, len(p), MaxSocketPath, len(l.RunDir))
	}
	return nil
}

// uuidLen is the length of a generated VM id.
const uuidLen = 36

// CheckRunDir refuses a run directory too long for the sockets of a VM
// with a generated (UUID, 36-byte) id.
func (l Layout) CheckRunDir() error {
	id := string(make([]byte, uuidLen))
	if err := l.CheckSocketPaths(id); err != nil {
		max := MaxSocketPath - len("/vms/") - uuidLen - 1 - len(longestRunFile)
		return fmt.Errorf("run directory %s is %d bytes; VM sockets need it to be at most %d", l.RunDir, len(l.RunDir), max)
	}
	return nil
}

// StorageDaemon returns the recorded storage daemon, or nil (also for a
// nil rt).
func (rt *Runtime) StorageDaemon() *QSDRuntime {
	if rt == nil {
		return nil
	}
	return rt.QSD
}
