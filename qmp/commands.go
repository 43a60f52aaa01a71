package qmp

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
)

// Version is the return of query-version.
type Version struct {
	QEMU struct {
		Major int `json:"major"`
		Minor int `json:"minor"`
		Micro int `json:"micro"`
	} `json:"qemu"`
	Package string `json:"package"`
}

// QueryVersion runs query-version, QSD's cheapest liveness probe (QSD has
// no query-status).
func (c *Client) QueryVersion(ctx context.Context) (*Version, error) {
	var v Version
	if err := c.Execute(ctx, "query-version", nil, &v); err != nil {
		return nil, err
	}
	return &v, nil
}

// BlockExport is one entry of query-block-exports.
type BlockExport struct {
	ID           string `json:"id"`
	Type         string `json:"type"`
	NodeName     string `json:"node-name"`
	ShuttingDown bool   `json:"shutting-down"`
}

// QueryBlockExports lists the exports, newest first (QSD's order).
func (c *Client) QueryBlockExports(ctx context.Context) ([]BlockExport, error) {
	var out []BlockExport
	if err := c.Execute(ctx, "query-block-exports", nil, &out); err != nil {
		return nil, err
	}
	return out, nil
}

// ImageInfo is the "image" member of a block node.
type ImageInfo struct {
	Filename    string `json:"filename"`
	Format      string `json:"format"`
	VirtualSize uint64 `json:"virtual-size"`
	ClusterSize uint64 `json:"cluster-size,omitempty"`
	ActualSize  uint64 `json:"actual-size,omitempty"`
	DirtyFlag   bool   `json:"dirty-flag,omitempty"`
	// What the image's header names as its backing file and format (set
	// even when the node was opened with "backing": null).
	BackingFilename       string `json:"backing-filename,omitempty"`
	BackingFilenameFormat string `json:"backing-filename-format,omitempty"`
}

// BlockNode is one entry of query-named-block-nodes.
type BlockNode struct {
	NodeName    string    `json:"node-name"`
	Drv         string    `json:"drv"` // "throttle", "qcow2", "file"
	RO          bool      `json:"ro"`
	File        string    `json:"file"`
	BackingFile string    `json:"backing_file,omitempty"` // the file of the backing node attached, if any
	Image       ImageInfo `json:"image"`
}

// QueryNamedBlockNodes lists every block node, flat, top node first.
func (c *Client) QueryNamedBlockNodes(ctx context.Context) ([]BlockNode, error) {
	var out []BlockNode
	if err := c.Execute(ctx, "query-named-block-nodes", map[string]any{"flat": true}, &out); err != nil {
		return nil, err
	}
	return out, nil
}

// UnixSocketAddress is QMP's flat SocketAddress of type unix.
type UnixSocketAddress struct {
	Type string `json:"type"` // "unix"
	Path string `json:"path"`
}

// VhostUserBlkExport is the argument of block-export-add for a
// vhost-user-blk export on a unix socket.
type VhostUserBlkExport struct {
	ID        string
	NodeName  string
	Socket    string
	Writable  bool
	NumQueues int // 0: QSD's default of 1
}

// MarshalJSON encodes the export in QSD's block-export-add (and --export
// JSON) shape.
func (e VhostUserBlkExport) MarshalJSON() ([]byte, error) {
	type wire struct {
		Type      string            `json:"type"`
		ID        string            `json:"id"`
		NodeName  string            `json:"node-name"`
		Addr      UnixSocketAddress `json:"addr"`
		Writable  bool              `json:"writable"`
		NumQueues int               `json:"num-queues,omitempty"`
	}
	return json.Marshal(wire{"vhost-user-blk", e.ID, e.NodeName, UnixSocketAddress{"unix", e.Socket}, e.Writable, e.NumQueues})
}

// BlockExportAdd adds an export. The socket appears once it returns.
func (c *Client) BlockExportAdd(ctx context.Context, e VhostUserBlkExport) error {
	return c.Execute(ctx, "block-export-add", e, nil)
}

// BlockExportDel deletes the export id and waits for its
// BLOCK_EXPORT_DELETED event, after which its node may be deleted. A
// connected vhost-user front-end is dropped at once.
func (c *Client) BlockExportDel(ctx context.Context, id string) error {
	deleted := make(chan struct{})
	var once bool
	stop := c.watch(func(ev Event) {
		if ev.Name != "BLOCK_EXPORT_DELETED" || once {
			return
		}
		var d struct {
			ID string `json:"id"`
		}
		if json.Unmarshal(ev.Data, &d) == nil && d.ID == id {
			once = true
			close(deleted)
		}
	})
	defer stop()
	if err := c.Execute(ctx, "block-export-del", map[string]any{"id": id}, nil); err != nil {
		return err
	}
	select {
	case <-deleted:
		return nil
	case <-c.done:
		return fmt.Errorf("qmp block-export-del: waiting for BLOCK_EXPORT_DELETED of %q: %w", id, c.Err())
	case <-ctx.Done():
		return fmt.Errorf("qmp block-export-del: waiting for BLOCK_EXPORT_DELETED of %q: %w", id, ctx.Err())
	}
}

// FileNode returns blockdev-add options for a file node.
func FileNode(nodeName, filename string) map[string]any {
	return map[string]any{"driver": "file", "node-name": nodeName, "filename": filename}
}

// Qcow2Node returns blockdev-add options for a qcow2 node on file. Its
// backing is null: QSD would otherwise open a backing file named in the
// header silently (as extra read-only nodes named #block<N>).
func Qcow2Node(nodeName, file string) map[string]any {
	return map[string]any{"driver": "qcow2", "node-name": nodeName, "file": file, "backing": nil}
}

// Qcow2OverlayNode returns blockdev-add options for a qcow2 node on file
// whose backing is the existing node backing. QSD takes the node given
// whatever file the header names: the caller checks that they agree.
func Qcow2OverlayNode(nodeName, file, backing string) map[string]any {
	return map[string]any{"driver": "qcow2", "node-name": nodeName, "file": file, "backing": backing}
}

// ReadOnly marks blockdev-add options read-only and returns them: the node
// opens its file O_RDONLY (the only way to open an immutable file) and
// refuses writes.
func ReadOnly(options map[string]any) map[string]any {
	options["read-only"] = true
	return options
}

// ThrottleNode returns blockdev-add options for a throttle filter in group
// over file.
func ThrottleNode(nodeName, group, file string) map[string]any {
	return map[string]any{"driver": "throttle", "node-name": nodeName, "throttle-group": group, "file": file}
}

// BlockdevAdd adds a block node; options is the blockdev-add argument
// object, e.g. from FileNode or Qcow2Node.
func (c *Client) BlockdevAdd(ctx context.Context, options any) error {
	return c.Execute(ctx, "blockdev-add", options, nil)
}

// BlockdevDel deletes a node nothing uses any more.
func (c *Client) BlockdevDel(ctx context.Context, nodeName string) error {
	return c.Execute(ctx, "blockdev-del", map[string]any{"node-name": nodeName}, nil)
}

// BlockResize sets the virtual size of nodeName, which should be the top
// node of its export (a throttle filter caches the size of what is below
// it). QEMU accepts shrinks, even to 0: callers enforce grow-only.
func (c *Client) BlockResize(ctx context.Context, nodeName string, size uint64) error {
	return c.Execute(ctx, "block_resize", map[string]any{"node-name": nodeName, "size": size}, nil)
}

// ThrottleLimits are the throttle-group limits vmhost manages; 0 means
// unlimited.
type ThrottleLimits struct {
	BpsTotal  uint64
	IopsTotal uint64
}

// throttleWire is every key SetThrottleLimits sends. Keys left out keep
// their old values in QEMU, so a change could fail on a leftover (ref §4):
// every managed key goes out with an explicit value.
type throttleWire struct {
	BpsTotal           uint64 `json:"bps-total"`
	BpsTotalMax        uint64 `json:"bps-total-max"`
	BpsTotalMaxLength  uint64 `json:"bps-total-max-length"`
	BpsRead            uint64 `json:"bps-read"`
	BpsWrite           uint64 `json:"bps-write"`
	IopsTotal          uint64 `json:"iops-total"`
	IopsTotalMax       uint64 `json:"iops-total-max"`
	IopsTotalMaxLength uint64 `json:"iops-total-max-length"`
	IopsRead           uint64 `json:"iops-read"`
	IopsWrite          uint64 `json:"iops-write"`
}

// SetThrottleLimits changes the limits of throttle group id at run time
// with qom-set (the x-* properties can only be set at creation). They take
// effect at once.
func (c *Client) SetThrottleLimits(ctx context.Context, group string, l ThrottleLimits) error {
	w := throttleWire{BpsTotal: l.BpsTotal, BpsTotalMaxLength: 1, IopsTotal: l.IopsTotal, IopsTotalMaxLength: 1}
	return c.Execute(ctx, "qom-set", map[string]any{"path": "/objects/" + group, "property": "limits", "value": w}, nil)
}

// ThrottleLimits reads the limits of throttle group id back with qom-get
// (query-named-block-nodes does not show them).
func (c *Client) ThrottleLimits(ctx context.Context, group string) (ThrottleLimits, error) {
	var w throttleWire
	if err := c.Execute(ctx, "qom-get", map[string]any{"path": "/objects/" + group, "property": "limits"}, &w); err != nil {
		return ThrottleLimits{}, err
	}
	return ThrottleLimits{BpsTotal: w.BpsTotal, IopsTotal: w.IopsTotal}, nil
}

// Job is one entry of query-jobs.
type Job struct {
	ID              string `json:"id"`
	Type            string `json:"type"`
	Status          string `json:"status"`
	CurrentProgress int64  `json:"current-progress"`
	TotalProgress   int64  `json:"total-progress"`
	Error           string `json:"error,omitempty"`
}

// QueryJobs lists the jobs QEMU knows.
func (c *Client) QueryJobs(ctx context.Context) ([]Job, error) {
	var out []Job
	if err := c.Execute(ctx, "query-jobs", nil, &out); err != nil {
		return nil, err
	}
	return out, nil
}

// JobDismiss removes a concluded job.
func (c *Client) JobDismiss(ctx context.Context, id string) error {
	return c.Execute(ctx, "job-dismiss", map[string]any{"id": id}, nil)
}

// JobError is a job that concluded with an error; QEMU reports the reason
// only in query-jobs, never in the events.
type JobError struct {
	ID  string
	Msg string
}

func (e *JobError) Error() string { return fmt.Sprintf("job %s failed: %s", e.ID, e.Msg) }

// BlockdevCreate runs blockdev-create as job jobID with the given options,
// waits until the job concludes, dismisses it, and returns a *JobError
// carrying the reason if it failed.
func (c *Client) BlockdevCreate(ctx context.Context, jobID string, options any) error {
	concluded := make(chan struct{})
	var seen bool
	// Watch before executing: the events can come before the return.
	stop := c.watch(func(ev Event) {
		if ev.Name != "JOB_STATUS_CHANGE" || seen {
			return
		}
		var d struct {
			ID     string `json:"id"`
			Status string `json:"status"`
		}
		if json.Unmarshal(ev.Data, &d) == nil && d.ID == jobID && d.Status == "concluded" {
			seen = true
			close(concluded)
		}
	})
	defer stop()
	if err := c.Execute(ctx, "blockdev-create", map[string]any{"job-id": jobID, "options": options}, nil); err != nil {
		return err
	}
	select {
	case <-concluded:
	case <-c.done:
		return fmt.Errorf("qmp blockdev-create: waiting for job %s: %w", jobID, c.Err())
	case <-ctx.Done():
		return fmt.Errorf("qmp blockdev-create: waiting for job %s: %w", jobID, ctx.Err())
	}
	jobs, err := c.QueryJobs(ctx)
	if err != nil {
		return err
	}
	var jobErr error
	for _, j := range jobs {
		if j.ID == jobID && j.Error != "" {
			jobErr = &JobError{ID: jobID, Msg: j.Error}
		}
	}
	if err := c.JobDismiss(ctx, jobID); err != nil {
		return errors.Join(jobErr, err)
	}
	return jobErr
}

// CreateQcow2 creates a blank qcow2 image of size bytes at path through
// QEMU's own code (two blockdev-create jobs, ref §3); the result is
// byte-identical to `qemu-img create -f qcow2`. tag names the temporary
// node and jobs and must be unique among concurrent calls.
func (c *Client) CreateQcow2(ctx context.Context, tag, path string, size uint64) error {
	if err := c.BlockdevCreate(ctx, tag+"-mkfile", map[string]any{"driver": "file", "filename": path, "size": 0}); err != nil {
		return fmt.Errorf("creating %s: %w", path, err)
	}
	node := tag + "-new"
	if err := c.BlockdevAdd(ctx, FileNode(node, path)); err != nil {
		return fmt.Errorf("creating %s: %w", path, err)
	}
	err := c.BlockdevCreate(ctx, tag+"-mkqcow2", map[string]any{"driver": "qcow2", "file": node, "size": size})
	if derr := c.BlockdevDel(ctx, node); err == nil {
		err = derr
	}
	if err != nil {
		return fmt.Errorf("creating %s: %w", path, err)
	}
	return nil
}

// Quit asks QEMU to exit. QSD removes its exports (one BLOCK_EXPORT_DELETED
// each), answers, and closes the connection, which often shows up as a
// reset rather than EOF; a connection that ends before the answer counts as
// success too, since the process is going away either way. Callers wait for
// the process itself.
func (c *Client) Quit(ctx context.Context) error {
	if err := c.Err(); err != nil {
		return fmt.Errorf("qmp quit: %w", err)
	}
	err := c.Execute(ctx, "quit", nil, nil)
	if errors.Is(err, ErrClosed) {
		return nil
	}
	return err
}
