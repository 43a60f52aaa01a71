package qmp

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"vmhost/proc"
	"vmhost/qcow2"
)

// Node and object names of the root disk in every QSD vmhost starts. Export
// ids and node names are separate namespaces in QSD, so the export and its
// top node share the name "root".
const (
	RootExportID      = "root"
	RootNode          = "root" // the throttle filter, top of the root disk
	RootQcow2Node     = "root-qcow2"
	RootFileNode      = "root-file"
	RootThrottleGroup = "root-tg"
	// The backing chain of a root disk that is an overlay: the build,
	// opened read-only, with no backing of its own.
	RootBaseNode     = "root-base"
	RootBaseFileNode = "root-base-file"
)

// maxSocketPath is the longest unix socket path the kernel accepts
// (sun_path is 108 bytes including the terminating NUL).
const maxSocketPath = 107

// RootDisk is the VM's root disk: an agent-owned qcow2 image served through
// a throttle filter.
type RootDisk struct {
	Path   string // the qcow2 image
	Socket string // the vhost-user-blk socket to create
	// Backing, when set, is the build that Path is an overlay of (an
	// absolute path, the name Path's header gives): QSD opens it
	// read-only as the overlay's backing node, and the guest reads it
	// wherever it has not written. Empty means Path stands alone and any
	// backing file its header names is ignored ("backing": null);
	// LaunchQSD refuses a Path whose header disagrees with Backing.
	Backing string
	// Size, when not 0, is the virtual size the disk must have before it is
	// exported: LaunchQSD grows the image to it and refuses to shrink. It
	// must be a multiple of 512.
	Size      uint64
	Limits    ThrottleLimits // initial limits; 0 means unlimited
	NumQueues int            // 0 means 1
}

// DataDisk is a VM data volume, exported directly from its qcow2 node.
type DataDisk struct {
	ID     string // export id and qcow2 node name, e.g. "data0"
	Path   string // the qcow2 image
	Socket string // the vhost-user-blk socket to create
	// Readonly exports the volume read-only: the guest sees a read-only
	// disk, and writes are refused by the export.
	Readonly bool
}

func (d DataDisk) fileNode() string { return d.ID + "-file" }

// QSDConfig says how to run one qemu-storage-daemon.
type QSDConfig struct {
	// Binary is qemu-storage-daemon, or a simulator taking the same flags.
	Binary string
	// PreArgs come before QSD's own flags, e.g. {"sim-qsd"} to run the
	// simulator as `vmhost sim-qsd`.
	PreArgs []string
	// Env is the child's environment; nil means the agent's.
	Env []string

	Root RootDisk
	Data []DataDisk

	QMPSocket string // the monitor socket to create
	PidFile   string // written and locked by QSD
	LogFile   string // QSD's stdout and stderr, appended

	// Confine, when set, starts QSD confined (package jail gives the VM's
	// jail); nil starts it as the agent's own child.
	Confine proc.Confiner
}

// Args returns QSD's command line (without PreArgs) for cfg. Options are
// processed left to right, so every node comes before what uses it. All
// but the chardev use QSD's JSON syntax, which needs no comma escaping and
// is the only way to say "backing": null. When withRootExport is false the
// root export is left out, to be added once the disk has its size.
//
// The root disk's graph is root (throttle, in group root-tg) → root-qcow2
// → root-file; with a Backing, root-qcow2's backing is root-base (qcow2,
// read-only, "backing": null) → root-base-file (read-only), so the throttle
// group limits every read and write the guest makes, whichever image
// serves it, and nothing can write the build.
func (cfg *QSDConfig) Args(withRootExport bool) []string {
	js := func(v any) string {
		b, err := json.Marshal(v)
		if err != nil {
			panic(err) // only maps of strings, numbers and bools
		}
		return string(b)
	}
	r := cfg.Root
	limits := map[string]uint64{}
	if r.Limits.BpsTotal != 0 {
		limits["bps-total"] = r.Limits.BpsTotal
	}
	if r.Limits.IopsTotal != 0 {
		limits["iops-total"] = r.Limits.IopsTotal
	}
	var args []string
	rootQcow2 := Qcow2Node(RootQcow2Node, RootFileNode)
	if r.Backing != "" {
		args = append(args,
			"--blockdev", js(ReadOnly(FileNode(RootBaseFileNode, r.Backing))),
			"--blockdev", js(ReadOnly(Qcow2Node(RootBaseNode, RootBaseFileNode))))
		rootQcow2 = Qcow2OverlayNode(RootQcow2Node, RootFileNode, RootBaseNode)
	}
	args = append(args,
		"--blockdev", js(FileNode(RootFileNode, r.Path)),
		"--blockdev", js(rootQcow2),
		"--object", js(map[string]any{"qom-type": "throttle-group", "id": RootThrottleGroup, "limits": limits}),
		"--blockdev", js(ThrottleNode(RootNode, RootThrottleGroup, RootQcow2Node)))
	if withRootExport {
		args = append(args, "--export", js(cfg.rootExport()))
	}
	for _, d := range cfg.Data {
		args = append(args,
			"--blockdev", js(FileNode(d.fileNode(), d.Path)),
			"--blockdev", js(Qcow2Node(d.ID, d.fileNode())),
			"--export", js(dataExport(d)))
	}
	// wait=off: otherwise QSD blocks until a QMP client connects.
	args = append(args,
		"--chardev", "socket,id=qmp,path="+strings.ReplaceAll(cfg.QMPSocket, ",", ",,")+",server=on,wait=off",
		"--monitor", "chardev=qmp",
		"--pidfile", cfg.PidFile)
	return args
}

func (cfg *QSDConfig) rootExport() VhostUserBlkExport {
	return VhostUserBlkExport{ID: RootExportID, NodeName: RootNode, Socket: cfg.Root.Socket, Writable: true, NumQueues: max(cfg.Root.NumQueues, 1)}
}

func dataExport(d DataDisk) VhostUserBlkExport {
	return VhostUserBlkExport{ID: d.ID, NodeName: d.ID, Socket: d.Socket, Writable: !d.Readonly, NumQueues: 1}
}

func (cfg *QSDConfig) check() error {
	paths := []string{cfg.QMPSocket, cfg.Root.Socket}
	for _, d := range cfg.Data {
		paths = append(paths, d.Socket)
		if d.ID == "" || d.ID == RootNode || d.ID == RootExportID || strings.HasPrefix(d.ID, "root-") {
			return fmt.Errorf("data disk id %q is empty or clashes with the root disk's names", d.ID)
		}
	}
	for _, p := range paths {
		if p == "" {
			return errors.New("a socket path is empty")
		}
		if len(p) > maxSocketPath {
			return fmt.Errorf("socket path %s is %d bytes, more than the %d a unix socket allows", p, len(p), maxSocketPath)
		}
	}
	if cfg.Root.Size%512 != 0 {
		return fmt.Errorf("root disk size %d is not a multiple of 512", cfg.Root.Size)
	}
	if b := cfg.Root.Backing; b != "" && (!filepath.IsAbs(b) || filepath.Clean(b) != b) {
		return fmt.Errorf("root disk backing file %q is not a clean absolute path", b)
	}
	return nil
}

// checkRootChain refuses a root disk whose header names another backing
// file than cfg.Root.Backing: opened with "backing": null, an overlay would
// show the guest zeros wherever it has not written, and opened over
// another build, another image's data. A header that cannot be read is
// left to QSD, which reports it in its own words.
func (cfg *QSDConfig) checkRootChain() error {
	h, err := qcow2.ReadHeaderFile(cfg.Root.Path)
	if err != nil || h.BackingFile == cfg.Root.Backing {
		return nil
	}
	if cfg.Root.Backing == "" {
		return fmt.Errorf("root disk %s is an overlay of %s, but no backing file was given", cfg.Root.Path, h.BackingFile)
	}
	if h.BackingFileOffset == 0 {
		return fmt.Errorf("root disk %s has no backing file, but %s was given", cfg.Root.Path, cfg.Root.Backing)
	}
	return fmt.Errorf("root disk %s is an overlay of %s, not of %s", cfg.Root.Path, h.BackingFile, cfg.Root.Backing)
}

// process is what QSD needs of a child it started or adopted.
type process struct {
	done    <-chan struct{}
	signal  func(syscall.Signal) error
	release func() // frees what watching the process holds
}

// QSD is a running qemu-storage-daemon and the one QMP connection to it.
// Its methods are safe for concurrent use. One adopted after an agent
// restart (AdoptQSD) dials its monitor on the first command.
type QSD struct {
	Pid       int
	StartTime uint64 // field 22 of /proc/PID/stat

	socket string // the QMP socket, for a connection dialled late
	mu     sync.Mutex
	client *Client // nil until dialled
	proc   process
}

// LaunchQSD starts QSD for cfg in its own session, waits for its QMP socket
// (failing fast with the log tail if it exits first), connects, and, when
// cfg.Root.Size is set, grows the root disk to that size before exporting
// it. On failure the process is killed.
//
// Growing happens inside QSD (block_resize of the throttle node, then
// block-export-add) rather than by rewriting the qcow2 file by hand: QEMU
// already knows how to grow the L1 table, relocate it and fix refcounts for
// any image it can open, and the export must come after the resize anyway,
// since a 7.2 export never reports a new size.
func LaunchQSD(ctx context.Context, cfg QSDConfig) (_ *QSD, err error) {
	if err := cfg.check(); err != nil {
		return nil, fmt.Errorf("launching qemu-storage-daemon: %w", err)
	}
	if err := cfg.checkRootChain(); err != nil {
		return nil, fmt.Errorf("launching qemu-storage-daemon: %w", err)
	}
	grow := cfg.Root.Size != 0
	child, err := proc.Spawn(proc.SpawnConfig{
		Path:    cfg.Binary,
		Args:    append(append([]string(nil), cfg.PreArgs...), cfg.Args(!grow)...),
		Env:     cfg.Env,
		LogFile: cfg.LogFile,
		Confine: cfg.Confine,
	})
	if err != nil {
		return nil, fmt.Errorf("launching qemu-storage-daemon: %w", err)
	}
	q := &QSD{Pid: child.Pid, StartTime: child.StartTime, socket: cfg.QMPSocket, proc: process{
		done:    child.Done(),
		signal:  func(s syscall.Signal) error { return child.Signal(s) },
		release: func() {},
	}}
	defer func() {
		if err != nil {
			q.kill()
			err = fmt.Errorf("launching qemu-storage-daemon: %w", err)
		}
	}()
	if q.client, err = dialStarting(ctx, cfg.QMPSocket, child.Done(), cfg.LogFile); err != nil {
		return nil, err
	}
	if grow {
		if err := q.growRoot(ctx, cfg.Root.Size); err != nil {
			return nil, err
		}
		if err := q.client.BlockExportAdd(ctx, cfg.rootExport()); err != nil {
			return nil, fmt.Errorf("exporting root disk: %w", err)
		}
	}
	return q, nil
}

// dialStarting connects to the monitor of a QSD that is starting, retrying
// while the socket is missing or not yet listening. It fails at once with a
// *proc.EarlyExitError carrying the log tail if the process exits first.
// It dials no probe connection of its own (as proc.WaitSocket would): a
// monitor serves one client at a time, and a probe that connects and
// leaves makes QSD juggle two sessions at startup.
func dialStarting(ctx context.Context, path string, exited <-chan struct{}, logPath string) (*Client, error) {
	tick := time.NewTicker(2 * time.Millisecond)
	defer tick.Stop()
	for {
		c, err := Dial(ctx, path)
		if err == nil {
			return c, nil
		}
		if !errors.Is(err, syscall.ENOENT) && !errors.Is(err, syscall.ECONNREFUSED) {
			select {
			case <-exited:
				return nil, &proc.EarlyExitError{Socket: path, LogTail: proc.LogTail(logPath, 20)}
			default:
			}
			return nil, err
		}
		select {
		case <-exited:
			return nil, &proc.EarlyExitError{Socket: path, LogTail: proc.LogTail(logPath, 20)}
		case <-ctx.Done():
			if tail := proc.LogTail(logPath, 20); tail != "" {
				return nil, fmt.Errorf("waiting for %s: %w; log tail:\n%s", path, ctx.Err(), tail)
			}
			return nil, fmt.Errorf("waiting for %s: %w", path, ctx.Err())
		case <-tick.C:
		}
	}
}

// growRoot resizes the root disk's top node to size, refusing to shrink
// (QEMU would shrink, even to 0).
func (q *QSD) growRoot(ctx context.Context, size uint64) error {
	cur, err := q.NodeSize(ctx, RootNode)
	if err != nil {
		return err
	}
	switch {
	case size < cur:
		return fmt.Errorf("refusing to shrink root disk from %d to %d bytes", cur, size)
	case size > cur:
		c, err := q.Client(ctx)
		if err != nil {
			return err
		}
		if err := c.BlockResize(ctx, RootNode, size); err != nil {
			return fmt.Errorf("growing root disk from %d to %d bytes: %w", cur, size, err)
		}
	}
	return nil
}

// AdoptQSD takes over a QSD started before an agent restart: it checks
// that pid still has startTime (fs.ErrNotExist when gone,
// proc.ErrIdentityMismatch when the pid was reused) and watches it from
// then on (Done). Its monitor on qmpSocket is dialled on the first command
// only: a monitor serves one client at a time, and most adopted daemons
// are never asked anything. Close the result to detach without stopping
// QSD.
func AdoptQSD(qmpSocket string, pid int, startTime uint64) (*QSD, error) {
	a, err := proc.Adopt(pid, startTime)
	if err != nil {
		return nil, fmt.Errorf("attaching to qemu-storage-daemon: %w", err)
	}
	return &QSD{Pid: pid, StartTime: startTime, socket: qmpSocket, proc: process{
		done:    a.Done(),
		signal:  a.Signal,
		release: func() { a.Close() },
	}}, nil
}

// AttachQSD is AdoptQSD that connects to the monitor at once, for a caller
// about to use it.
func AttachQSD(ctx context.Context, qmpSocket string, pid int, startTime uint64) (*QSD, error) {
	q, err := AdoptQSD(qmpSocket, pid, startTime)
	if err != nil {
		return nil, err
	}
	if _, err := q.Client(ctx); err != nil {
		q.Close()
		return nil, err
	}
	return q, nil
}

// Client returns the QMP connection, dialling it on first use; it stays
// owned by q.
func (q *QSD) Client(ctx context.Context) (*Client, error) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.client == nil {
		c, err := Dial(ctx, q.socket)
		if err != nil {
			return nil, fmt.Errorf("attaching to qemu-storage-daemon pid %d: %w", q.Pid, err)
		}
		q.client = c
	}
	return q.client, nil
}

// Done is closed when the process has exited.
func (q *QSD) Done() <-chan struct{} { return q.proc.done }

// NodeSize returns the virtual size of a block node.
func (q *QSD) NodeSize(ctx context.Context, node string) (uint64, error) {
	c, err := q.Client(ctx)
	if err != nil {
		return 0, err
	}
	nodes, err := c.QueryNamedBlockNodes(ctx)
	if err != nil {
		return 0, err
	}
	for _, n := range nodes {
		if n.NodeName == node {
			return n.Image.VirtualSize, nil
		}
	}
	return 0, fmt.Errorf("block node %q: %w", node, os.ErrNotExist)
}

// SetRootLimits changes the root disk's bytes/s and IOPS limits at run
// time; 0 means unlimited.
func (q *QSD) SetRootLimits(ctx context.Context, l ThrottleLimits) error {
	c, err := q.Client(ctx)
	if err == nil {
		err = c.SetThrottleLimits(ctx, RootThrottleGroup, l)
	}
	if err != nil {
		return fmt.Errorf("setting root disk limits: %w", err)
	}
	return nil
}

// RootLimits reads the root disk's limits back.
func (q *QSD) RootLimits(ctx context.Context) (ThrottleLimits, error) {
	c, err := q.Client(ctx)
	if err != nil {
		return ThrottleLimits{}, err
	}
	return c.ThrottleLimits(ctx, RootThrottleGroup)
}

// AddDataExport opens a data volume and exports it. If a step fails, the
// nodes already added are removed again.
func (q *QSD) AddDataExport(ctx context.Context, d DataDisk) error {
	if len(d.Socket) > maxSocketPath {
		return fmt.Errorf("adding data export %s: socket path %s is longer than %d bytes", d.ID, d.Socket, maxSocketPath)
	}
	c, err := q.Client(ctx)
	if err != nil {
		return fmt.Errorf("adding data export %s: %w", d.ID, err)
	}
	if err := c.BlockdevAdd(ctx, FileNode(d.fileNode(), d.Path)); err != nil {
		return fmt.Errorf("adding data export %s: %w", d.ID, err)
	}
	if err := c.BlockdevAdd(ctx, Qcow2Node(d.ID, d.fileNode())); err != nil {
		return errors.Join(fmt.Errorf("adding data export %s: %w", d.ID, err), c.BlockdevDel(ctx, d.fileNode()))
	}
	if err := c.BlockExportAdd(ctx, dataExport(d)); err != nil {
		return errors.Join(fmt.Errorf("adding data export %s: %w", d.ID, err),
			c.BlockdevDel(ctx, d.ID), c.BlockdevDel(ctx, d.fileNode()))
	}
	return nil
}

// DataExports lists the daemon's exports (the root's among them).
func (q *QSD) DataExports(ctx context.Context) ([]BlockExport, error) {
	c, err := q.Client(ctx)
	if err != nil {
		return nil, err
	}
	return c.QueryBlockExports(ctx)
}

// RemoveDataExport deletes what QSD holds of data export id, whatever
// part of it is there: the export (dropping a connected front-end), its
// qcow2 node and its file node, which releases the image. So it also
// clears what an AddDataExport cut short left (a file node without the
// rest, which would make the next AddDataExport of id fail with
// "Duplicate nodes"); with nothing of id there it does nothing.
func (q *QSD) RemoveDataExport(ctx context.Context, id string) error {
	c, err := q.Client(ctx)
	if err != nil {
		return fmt.Errorf("removing data export %s: %w", id, err)
	}
	exports, err := c.QueryBlockExports(ctx)
	if err != nil {
		return fmt.Errorf("removing data export %s: %w", id, err)
	}
	if slices.ContainsFunc(exports, func(x BlockExport) bool { return x.ID == id }) {
		if err := c.BlockExportDel(ctx, id); err != nil {
			return fmt.Errorf("removing data export %s: %w", id, err)
		}
	}
	nodes, err := c.QueryNamedBlockNodes(ctx)
	if err != nil {
		return fmt.Errorf("removing data export %s: %w", id, err)
	}
	for _, n := range []string{id, DataDisk{ID: id}.fileNode()} { // top first: the qcow2 node uses the file node
		if !slices.ContainsFunc(nodes, func(b BlockNode) bool { return b.NodeName == n }) {
			continue
		}
		if err := c.BlockdevDel(ctx, n); err != nil {
			return fmt.Errorf("removing data export %s: %w", id, err)
		}
	}
	return nil
}

// Flush writes what QSD holds in memory for the VM's disks (qcow2's L2
// and refcount caches, above all) to their image files, so that a copy of
// the files taken now has every write QSD has completed: one
// blockdev-reopen of the top node of every export with the options it
// already has, which QEMU (6.1 on) begins by flushing each node and its
// children (docs/ref/qsd-qmp-qcow2.md, Flushing). Nothing else changes.
// The caller keeps the guest from writing meanwhile (a paused VM).
func (q *QSD) Flush(ctx context.Context) error {
	c, err := q.Client(ctx)
	if err != nil {
		return err
	}
	exports, err := c.QueryBlockExports(ctx)
	if err != nil {
		return fmt.Errorf("flushing the disks of qemu-storage-daemon pid %d: %w", q.Pid, err)
	}
	var options []map[string]any
	for _, e := range exports {
		if e.NodeName == RootNode {
			options = append(options, ThrottleNode(RootNode, RootThrottleGroup, RootQcow2Node))
			continue
		}
		options = append(options, Qcow2Node(e.NodeName, DataDisk{ID: e.NodeName}.fileNode()))
	}
	if len(options) == 0 {
		return nil
	}
	if err := c.Execute(ctx, "blockdev-reopen", map[string]any{"options": options}, nil); err != nil {
		return fmt.Errorf("flushing the disks of qemu-storage-daemon pid %d: %w", q.Pid, err)
	}
	return nil
}

// Quit asks QSD to exit over QMP and waits for the process to end. QSD
// removes its sockets and pidfile. If ctx ends first, or QMP fails, QSD is
// sent SIGTERM (which QSD handles like quit), then SIGKILL after a second.
func (q *QSD) Quit(ctx context.Context) error {
	c, qerr := q.Client(ctx)
	if qerr == nil {
		qerr = c.Quit(ctx)
	}
	if qerr == nil {
		select {
		case <-q.proc.done:
			q.closeClient()
			q.proc.release()
			return nil
		case <-ctx.Done():
			qerr = ctx.Err()
		}
	}
	q.closeClient()
	q.proc.signal(syscall.SIGTERM)
	select {
	case <-q.proc.done:
	case <-time.After(time.Second):
		q.proc.signal(syscall.SIGKILL)
		<-q.proc.done
	}
	q.proc.release()
	return fmt.Errorf("stopping qemu-storage-daemon pid %d: quit: %w (signalled instead)", q.Pid, qerr)
}

// Close detaches from QSD without stopping it.
func (q *QSD) Close() error {
	err := q.closeClient()
	q.proc.release()
	return err
}

// closeClient closes the QMP connection, if one was dialled.
func (q *QSD) closeClient() error {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.client == nil {
		return nil
	}
	return q.client.Close()
}

// kill ends a QSD that failed to launch.
func (q *QSD) kill() {
	q.closeClient()
	q.proc.signal(syscall.SIGKILL)
	<-q.proc.done
}
