// Package jail confines the processes vmhost starts for a VM (Cloud
// Hypervisor, qemu-storage-daemon, their simulators) so that a guest that
// escapes its hypervisor finds an unprivileged, fenced process, not root
// (docs/ref/confinement.md).
//
// Each VM gets one id of its own from jail.id_range, used as the uid and the
// gid of its processes; one cgroup, <cgroup_parent>/<agent_id>/vm-<id>, that
// limits its memory, tasks and CPU share, counts what it uses, and is how
// its processes are found and killed; and, per process, a private mount
// namespace whose root is a small tmpfs over <run>/jail/<id> holding only
// the files, directories and device nodes that process was given, each at
// the same absolute path as on the host, so command lines need no rewriting.
//
// A process is started jailed from an OS thread of the agent's made for it
// (Confinement.Start): the thread joins the VM's v1 cgroups, takes a mount
// namespace of its own, builds the root and pivots into it, empties its
// bounding, ambient and inheritable capabilities and sets no_new_privs; the
// program is cloned from that thread into a new IPC namespace (and, with
// cgroup v2, straight into its cgroup: CLONE_INTO_CGROUP), switched to the
// VM's uid and gid, which empties its remaining capabilities, and exec'd.
// It inherits everything else from the thread, which then ends. So the
// program runs confined from its first instruction, and nothing else is
// exec'd on the way: the jail costs a start about what the mounts cost.
//
// The agent keeps root. Without root, or off Linux, confinement is off and
// New says why.
package jail

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
)

// errLinuxOnly is what the confinement calls answer off Linux.
var errLinuxOnly = fmt.Errorf("confinement is Linux-only: %w", errors.ErrUnsupported)

// Host is what a Jailer needs to know of the agent and its host.
type Host struct {
	RunDir  string // the agent's run directory; jail roots are <RunDir>/jail/<vm_id>
	AgentID string // this agent's id (docs/design.md §2), a segment of every VM's cgroup
	// Layout is where the cgroup hierarchies are; nil means DetectLayout.
	Layout *Layout
	// CheckBinary is the program SelfTest runs jailed: any program that
	// links this package. Empty means this binary (/proc/self/exe, which
	// stays valid when the file is replaced).
	CheckBinary string
}

// Jailer makes and finds the jails of one agent's VMs.
type Jailer struct {
	cfg    Config
	host   Host
	layout Layout
	off    string
}

// New returns the agent's Jailer. When confinement cannot be on (not root,
// not Linux, or disabled in the configuration) it returns a Jailer whose
// Off says why, to be logged once; VMs then run unconfined. It fails when
// confinement should be on but the configuration or the host cannot give it
// (an invalid setting, no cgroup hierarchy for a controller).
func New(cfg Config, h Host) (*Jailer, error) {
	j := &Jailer{cfg: cfg, host: h}
	switch {
	case !cfg.On():
		j.off = "jail.enabled is false: VMs run unconfined, as root, with every capability"
		return j, nil
	case runtime.GOOS != "linux":
		j.off = "confinement is Linux-only: VMs run unconfined"
		return j, nil
	case os.Geteuid() != 0:
		j.off = fmt.Sprintf("the agent does not run as root: VMs run unconfined, as the agent's uid %d, with no uid of their own, no cgroup and no private root", os.Geteuid())
		return j, nil
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if err := checkName(h.AgentID); err != nil {
		return nil, fmt.Errorf("jail: agent id: %w", err)
	}
	if !filepath.IsAbs(h.RunDir) {
		return nil, fmt.Errorf("jail: run directory %q is not absolute", h.RunDir)
	}
	if h.Layout != nil {
		if err := h.Layout.check(); err != nil {
			return nil, fmt.Errorf("jail: %w", err)
		}
		j.layout = *h.Layout
	} else {
		l, err := DetectLayout()
		if err != nil {
			return nil, fmt.Errorf("jail: %w (set jail.enabled to false to run VMs unconfined)", err)
		}
		j.layout = l
	}
	if j.host.CheckBinary == "" {
		j.host.CheckBinary = "/proc/self/exe"
	}
	return j, nil
}

// Enabled reports whether VMs are confined.
func (j *Jailer) Enabled() bool { return j.off == "" }

// Off says why VMs run unconfined, "" when they are confined.
func (j *Jailer) Off() string { return j.off }

// Config returns the configuration the Jailer was made with.
func (j *Jailer) Config() Config { return j.cfg }

// Layout returns the cgroup hierarchies VMs' cgroups live in.
func (j *Jailer) Layout() Layout { return j.layout }

// AllocateID returns a free id for a new VM (see Config.AllocateID).
func (j *Jailer) AllocateID(inUse map[uint32]bool) (uint32, error) {
	return j.cfg.AllocateID(inUse)
}

// CgroupName is the cgroup of VM vmID: <cgroup_parent>/<agent_id>/vm-<id>.
func (j *Jailer) CgroupName(vmID string) string {
	return path.Join(j.cfg.CgroupParent, j.host.AgentID, "vm-"+vmID)
}

// agentCgroup is the cgroup holding this agent's VMs' cgroups.
func (j *Jailer) agentCgroup() *Cgroup {
	return j.layout.Cgroup(path.Join(j.cfg.CgroupParent, j.host.AgentID))
}

// RemoveAgentCgroup removes this agent's cgroup, the parent of its VMs',
// when it holds none (in no hierarchy): an agent that ends without VMs
// leaves nothing behind. With a VM's cgroup in it, it is kept, for the
// VMs outlive the agent and the next start adopts them. It reports
// whether the cgroup is gone.
func (j *Jailer) RemoveAgentCgroup() (bool, error) {
	if !j.Enabled() {
		return true, nil
	}
	c := j.agentCgroup()
	if vms, err := c.Children(); err != nil || len(vms) > 0 {
		return false, err
	}
	for _, d := range c.dirs() {
		// A VM's cgroup made meanwhile makes it busy: kept, as it should.
		if err := os.Remove(d); err != nil && !errors.Is(err, fs.ErrNotExist) && !errors.Is(err, syscall.EBUSY) {
			return false, fmt.Errorf("jail: removing the agent's cgroup %s: %w", d, err)
		}
	}
	return !c.Exists(), nil
}

// Leftovers lists the ids of the VMs that have a cgroup under this agent's,
// for the agent to reap those no record names. Other agents' cgroups are not
// looked at.
func (j *Jailer) Leftovers() ([]string, error) {
	if !j.Enabled() {
		return nil, nil
	}
	names, err := j.agentCgroup().Children()
	if err != nil {
		return nil, fmt.Errorf("jail: listing VM cgroups: %w", err)
	}
	var ids []string
	for _, n := range names {
		if id, ok := strings.CutPrefix(n, "vm-"); ok && checkName(id) == nil {
			ids = append(ids, id)
		}
	}
	return ids, nil
}

// Destroy destroys the jail of VM vmID (see VM.Destroy) without its id:
// the way to reap a cgroup Leftovers lists that no record names.
func (j *Jailer) Destroy(ctx context.Context, vmID string) error {
	if !j.Enabled() {
		return nil
	}
	if err := checkName(vmID); err != nil {
		return fmt.Errorf("jail: VM id: %w", err)
	}
	v := &VM{ID: vmID, Root: filepath.Join(j.host.RunDir, "jail", vmID), cgroup: j.layout.Cgroup(j.CgroupName(vmID))}
	return v.Destroy(ctx)
}

// VM returns the jail of VM vmID whose processes run as id (uid and gid).
// Nothing is made: Create makes it, and a VM found after an agent restart is
// reached this way too.
func (j *Jailer) VM(vmID string, id uint32) (*VM, error) {
	if !j.Enabled() {
		return nil, fmt.Errorf("jail: VMs run unconfined: %s", j.off)
	}
	if err := checkName(vmID); err != nil {
		return nil, fmt.Errorf("jail: VM id: %w", err)
	}
	if id == 0 || id >= overflowID || id == nobodyID {
		return nil, fmt.Errorf("jail: VM %s: id %d cannot be a VM's uid", vmID, id)
	}
	return &VM{
		ID:     vmID,
		UID:    id,
		GID:    id,
		Root:   filepath.Join(j.host.RunDir, "jail", vmID),
		cgroup: j.layout.Cgroup(j.CgroupName(vmID)),
	}, nil
}

// VM is the jail of one VM.
type VM struct {
	ID       string
	UID, GID uint32
	// Root is the directory a jailed process's root is mounted on, in its
	// own mount namespace only: on the host it stays an empty directory.
	Root string

	cgroup *Cgroup
}

// Cgroup returns the VM's cgroup: its processes, counters and limits.
func (v *VM) Cgroup() *Cgroup { return v.cgroup }

// Create makes the VM's cgroup with lim and its (empty) root directory. It
// may be called again (a create resumed after a crash): what exists is kept
// and the limits are written again. The cgroup comes first, so that a crash
// at any point leaves either nothing or a cgroup Leftovers finds.
func (v *VM) Create(lim Limits) error {
	if err := v.cgroup.Create(lim); err != nil {
		return fmt.Errorf("jail: %w", err)
	}
	if err := os.MkdirAll(v.Root, 0o755); err != nil {
		return fmt.Errorf("jail: creating %s: %w", v.Root, err)
	}
	return nil
}

// Destroy kills every process in the VM's cgroup (a child Cloud Hypervisor
// forked, a stuck storage daemon, anything that double-forked), removes the
// root directory and then the cgroup from every hierarchy: a crash at any
// point leaves the cgroup for Leftovers to find, or nothing. Each jailed
// process's root lives in its own mount namespace and goes with its last
// process, so nothing else is left. Destroying what is gone already
// succeeds.
func (v *VM) Destroy(ctx context.Context) error {
	if err := v.cgroup.Kill(ctx); err != nil {
		return fmt.Errorf("jail: %w", err)
	}
	if err := os.Remove(v.Root); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("jail: removing %s: %w", v.Root, err)
	}
	if err := v.cgroup.Remove(ctx); err != nil {
		return fmt.Errorf("jail: %w", err)
	}
	return nil
}

// Exec says what one jailed process gets besides its program: the program
// (the executable the command names), its ELF interpreter and the shared
// libraries it links are added read-only by Confine.
type Exec struct {
	// Binds are files and directories of the host shown at the same path.
	// Each must exist; a directory shows what is created in it later too.
	// The process's permissions on them are the host's (see Own).
	Binds []Bind
	// Devices are character device nodes (/dev/kvm, /dev/net/tun,
	// /dev/vfio/12, /dev/urandom...) made in the jail's /dev with the host
	// node's numbers. Those any process may use (null, zero, full, random,
	// urandom) are root's with mode 0666; every other one is the VM's own:
	// its uid and gid, mode 0600, so no supplementary group is needed.
	Devices []string
	// Proc mounts a /proc that shows only the processes of the VM's uid
	// (hidepid=invisible, subset=pid: no /proc/sys, no kernel tunables).
	Proc bool
	// Groups are supplementary groups; normally none.
	Groups []uint32
	// MemlockBytes, when not zero, is the process's RLIMIT_MEMLOCK (soft and
	// hard), set by the agent as soon as the process runs. A VM with VFIO
	// devices needs its guest memory there: the type1 IOMMU charges the
	// memory it pins to that limit, which a process without CAP_IPC_LOCK
	// cannot raise itself.
	MemlockBytes uint64
}

// Bind is one file or directory of the host shown inside the jail.
type Bind struct {
	Path     string // absolute; a symbolic link on the way is reproduced inside
	Writable bool   // else mounted read-only
	Exec     bool   // else mounted noexec
}

// publicDevices are the device nodes every process may use.
var publicDevices = map[string]bool{
	"/dev/null": true, "/dev/zero": true, "/dev/full": true, "/dev/random": true, "/dev/urandom": true,
}

// Confine returns how to start one process in the VM's jail with x, for
// proc.SpawnConfig.Confine.
func (v *VM) Confine(x Exec) *Confinement {
	return &Confinement{vm: v, x: x}
}

// Confinement starts a process jailed (see Start).
type Confinement struct {
	vm *VM
	x  Exec
}

// rootSpec is what a jailed process's root holds.
type rootSpec struct {
	UID, GID uint32 // the owner of the VM's own device nodes
	Root     string // where the root is mounted, links resolved
	Binds    []Bind
	// Programs are the program's own files (itself, its loader, its
	// libraries), bound read-only and executable; their paths are walked
	// with what earlier starts saw (programPaths).
	Programs []string
	// Devices are the device nodes, each with its owner decided.
	Devices []rootDevice
	Proc    bool
}

type rootDevice struct {
	Path    string
	Private bool // the VM's own: uid:gid 0600; else root's 0666
}
