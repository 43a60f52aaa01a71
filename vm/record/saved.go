package record

import "time"

// Saved state: suspend, snapshots and restore (docs/api.md, Suspend and
// snapshots).
//
// A VM's memory and device state, as Cloud Hypervisor's vm.snapshot writes
// them, live in one of two places: the VM's suspend directory
// (Layout.SuspendDir), valid while Record.Suspended says so, and a
// snapshot's memory directory (Layout.SnapshotMemory). Cloud Hypervisor
// writes them into a fresh directory under the VM's save directory
// (Layout.SaveDir); the agent syncs them and renames the directory into
// place. Every operation that changes a VM's disks or saved state records
// its intent (Record.Saving) first, so that recovery finishes or undoes
// it: the saved state is then complete or absent, never half, and the
// VM's disks are the old ones or the restored ones, never a mix.

// Suspension is a VM's saved state waiting in its suspend directory.
type Suspension struct {
	// At is when the state was saved.
	At time.Time `json:"at"`
	// Snapshot is the snapshot the state came from, when a restore put it
	// there (empty after a suspend).
	Snapshot string `json:"snapshot,omitempty"`
}

// SaveOp is an operation on a VM's saved state or disks in progress
// (Record.Saving).
type SaveOp struct {
	Kind string `json:"kind"` // Save*
	// Snapshot is the snapshot being taken (SaveSnapshot) or restored
	// (SaveRestore).
	Snapshot string `json:"snapshot,omitempty"`
	// Resume is set when the operation paused a running VM: undone or
	// finished, it resumes it.
	Resume bool `json:"resume,omitempty"`
	// Staged is set once a restore's copies (and its saved state) are
	// complete beside the VM's own: from then on recovery rolls the
	// restore forward; before, it removes them.
	Staged bool `json:"staged,omitempty"`
}

// Kinds of SaveOp.
const (
	// SaveSuspend: the VM is paused and its state being saved; complete
	// once its suspend directory exists, then its processes are stopped.
	SaveSuspend = "suspend"
	// SaveSnapshot: the VM is paused for a snapshot's copies.
	SaveSnapshot = "snapshot"
	// SaveRestore: a snapshot's disks (and state) replace the VM's.
	SaveRestore = "restore"
	// SaveResume: a start restored the VM from its saved state, paused,
	// and recorded it running; it is resumed next.
	SaveResume = "resume"
)

// SuspendDir is where a suspended VM's state waits.
func (l Layout) SuspendDir(id string) string { return l.StateDir + "/vms/" + id + "/suspend" }

// SuspendNext is a restore's saved state, staged beside SuspendDir.
func (l Layout) SuspendNext(id string) string { return l.StateDir + "/vms/" + id + "/suspend.next" }

// SaveDir holds the fresh directories Cloud Hypervisor writes a VM's state
// into (it must be writable by, and visible to, the VM's hypervisor).
func (l Layout) SaveDir(id string) string { return l.StateDir + "/vms/" + id + "/save" }

// Staged is the name a restore stages the copy of a VM's disk at path
// under, before it replaces path.
func Staged(path string) string { return path + ".restore" }

// SnapshotsDir holds the snapshots (package snapshot).
func (l Layout) SnapshotsDir() string { return l.StateDir + "/snapshots" }

// SnapshotDir is snapshot sid's directory.
func (l Layout) SnapshotDir(sid string) string { return l.StateDir + "/snapshots/" + sid }

// SnapshotDisk is the copy of disk diskID ("root", "data0", …) in snapshot
// sid.
func (l Layout) SnapshotDisk(sid, diskID string) string {
	return l.StateDir + "/snapshots/" + sid + "/disks/" + diskID + ".qcow2"
}

// SnapshotMemory is the saved state of snapshot sid, when it has one.
func (l Layout) SnapshotMemory(sid string) string {
	return l.StateDir + "/snapshots/" + sid + "/memory"
}

// RootDiskID is the id of the root disk among a snapshot's disks.
const RootDiskID = "root"
