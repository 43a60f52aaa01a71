package chclient

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"path/filepath"
	"strings"
)

// The files CH v53 writes into a snapshot directory (vmm/src/migration/mod.rs,
// vmm/src/memory_manager.rs). CH creates each with O_EXCL, so a directory that already
// holds one fails the snapshot; it writes them without fsync.
const (
	SnapshotConfigFile = "config.json"   // the VM config, with generated ids and defaults
	SnapshotStateFile  = "state.json"    // the device, vCPU and memory-layout state tree
	SnapshotMemoryFile = "memory-ranges" // guest RAM, the ranges of state.json back to back
)

// Memory restore modes for RestoreConfig.MemoryRestoreMode.
const (
	// MemoryRestoreCopy reads the whole memory file into guest RAM before the restore
	// answers (CH's default).
	MemoryRestoreCopy = "Copy"
	// MemoryRestoreOnDemand maps guest RAM empty and fills pages from the file on first
	// touch (userfaultfd); the restore fails where userfaultfd is unavailable, and it
	// cannot be combined with Prefault.
	MemoryRestoreOnDemand = "OnDemand"
)

// VmSnapshotConfig is the body of vm.snapshot.
type VmSnapshotConfig struct {
	DestinationURL string `json:"destination_url"`
}

// RestoreConfig is the body of vm.restore. Zero fields are omitted and take CH's defaults:
// no prefault, Copy, and the VM left Paused.
type RestoreConfig struct {
	// SourceURL is the snapshot directory as FileURL gives it.
	SourceURL string `json:"source_url"`
	// Prefault populates guest RAM up front (Copy mode only).
	Prefault bool `json:"prefault,omitempty"`
	// MemoryRestoreMode is MemoryRestoreCopy or MemoryRestoreOnDemand; empty means Copy.
	MemoryRestoreMode string `json:"memory_restore_mode,omitempty"`
	// Resume runs the VM once restored; without it the VM is Paused and ResumeVM runs it.
	Resume bool `json:"resume,omitempty"`
}

// FileURL turns an absolute directory path into the file:// URL vm.snapshot and vm.restore
// take. CH strips the "file://" prefix and uses the rest as a path, without unescaping, so
// the path goes in verbatim.
func FileURL(dir string) (string, error) {
	if !filepath.IsAbs(dir) {
		return "", fmt.Errorf("snapshot directory %q is not an absolute path", dir)
	}
	return "file://" + dir, nil
}

// Snapshot writes the paused VM's config, device state and memory into the existing, empty
// directory destinationURL names (vm.snapshot). CH refuses a VM that is not Paused (500,
// "Trying to snapshot while VM is running", or "VM is not running" before a boot) and leaves
// it Paused afterwards. A failure while writing can leave some of the files behind. The
// call returns once every byte is written, which for a large guest takes a while: give ctx
// a deadline fit for the guest's memory size.
func (c *Client) Snapshot(ctx context.Context, destinationURL string) error {
	if !strings.HasPrefix(destinationURL, "file://") {
		return fmt.Errorf("cloud hypervisor vm.snapshot: destination %q is not a file:// URL", destinationURL)
	}
	_, _, err := c.send(ctx, http.MethodPut, "vm.snapshot", &VmSnapshotConfig{DestinationURL: destinationURL}, http.StatusNoContent)
	return err
}

// Restore rebuilds the VM from a snapshot directory (vm.restore). It must be the first
// call on a fresh process: CH refuses it once a VM config exists ("VM is already created").
// CH reopens what the config names (disk images, vhost-user sockets, taps by name, the
// serial and vsock sockets, which must not exist), so everything a boot needs must be in
// place again. The VM is Paused afterwards unless cfg.Resume. On failure CH drops the
// config it read, and the process is fit for another attempt.
func (c *Client) Restore(ctx context.Context, cfg *RestoreConfig) error {
	if cfg == nil {
		return errors.New("cloud hypervisor vm.restore: nil config")
	}
	if !strings.HasPrefix(cfg.SourceURL, "file://") {
		return fmt.Errorf("cloud hypervisor vm.restore: source %q is not a file:// URL", cfg.SourceURL)
	}
	if cfg.Prefault && cfg.MemoryRestoreMode == MemoryRestoreOnDemand {
		return errors.New("cloud hypervisor vm.restore: prefault cannot be combined with on-demand memory restore")
	}
	_, _, err := c.send(ctx, http.MethodPut, "vm.restore", cfg, http.StatusNoContent)
	return err
}
