// Package chclient drives one Cloud Hypervisor (CH) process through its REST API on a unix
// socket, reads its event-monitor stream, launches and supervises the process, and speaks
// the host side of its hybrid vsock.
//
// The client follows CH v53 (see docs/ref/cloud-hypervisor.md): every request carries a plain
// Content-Length (CH cannot read chunked bodies), each call checks the exact success status,
// and failures come back as *APIError carrying the HTTP status and CH's error chain.
// A 404 (no VM created, or no VM config) satisfies errors.Is(err, ErrNotFound).
//
// # Limits
//
// Only the calls and config fields vmhost uses are typed: vmm.ping, vmm.shutdown and the
// vm.* actions create, boot, info, shutdown, power-button, reboot, pause, resume, delete,
// add-disk, remove-device, resize, counters, snapshot and restore. vm.add-net and
// vm.restore with file descriptors (net_fds), and migration, are not covered.
//
// # Snapshots
//
// Snapshot writes a paused VM into an existing empty directory (FileURL); CH leaves the VM
// paused. Restore is the first call on a fresh process and rebuilds the VM from such a
// directory, paused unless RestoreConfig.Resume. CH writes the files without fsync and
// with O_EXCL, and leaves partial files when it fails: write into a fresh directory, sync
// it, and keep it only once Snapshot has returned.
//
// # Knobs
//
// Client.Dial replaces the unix-socket dialer (tests). Every call takes a context; its
// deadline bounds the whole exchange. Launch takes the binary path and the socket, event and
// log paths; it never searches $PATH on its own.
package chclient
