package record

// The kinds of root disk (Spec.Disk.Mode; empty means DiskCopy): the VM's
// own copy of its base image, or a qcow2 overlay whose backing file is the
// base image (an AppVM's build, docs/appvm.md), which the guest reads
// wherever it has not written.
const (
	DiskCopy    = "copy"
	DiskOverlay = "overlay"
)

// RootBacking is the backing file of the VM's root disk: the base image
// (Base.Path) when the root disk is an overlay of it, "" when it is a copy.
// Whoever removes files must keep a backing file while a record names it.
func (r *Record) RootBacking() string {
	if r.Spec.Disk == nil || r.Spec.Disk.Mode != DiskOverlay || r.Base == nil {
		return ""
	}
	return r.Base.Path
}

// DiskMode is the root disk's kind as the view shows it (disk.mode).
func (sp *Spec) DiskMode() string {
	if sp.Disk != nil && sp.Disk.Mode != "" {
		return sp.Disk.Mode
	}
	return DiskCopy
}
