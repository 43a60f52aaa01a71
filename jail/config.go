package jail

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"path"
	"strings"
)

// Config is the agent's "jail" setting (docs/ref/confinement.md). The zero value is
// not usable; start from DefaultConfig.
type Config struct {
	// Enabled turns confinement on (true) or off (false); unset (nil), the
	// agent decides: on, except under the Cloud Hypervisor simulator's
	// process-mode guest, which runs on the host and which a jail cannot
	// host (On, and the agent's wiring). An agent that is not root runs VMs
	// unconfined whatever it says (New reports why).
	Enabled *bool `json:"enabled,omitempty"`
	// IDRange is the inclusive range of the ids given to VMs, each VM one id
	// used as both its uid and its gid.
	IDRange [2]uint32 `json:"id_range"`
	// CgroupParent is the cgroup, relative to each hierarchy's root, under
	// which the agent makes <agent_id>/vm-<id>.
	CgroupParent string `json:"cgroup_parent"`
	// PidsMax is each VM cgroup's pids.max (tasks: processes and threads).
	PidsMax uint64 `json:"pids_max"`
	// MemoryOverheadMB is added to the VM's memory_mb to make its cgroup's
	// memory limit: what Cloud Hypervisor and the storage daemon use beyond
	// guest RAM (their code, page tables, buffers, caches).
	MemoryOverheadMB uint64 `json:"memory_overhead_mb"`
}

// DefaultConfig is the configuration docs/ref/confinement.md shows.
func DefaultConfig() Config {
	return Config{
		IDRange:          [2]uint32{1000000, 1999999},
		CgroupParent:     "vmhost",
		PidsMax:          1024,
		MemoryOverheadMB: 256,
	}
}

// On reports whether c turns confinement on: Enabled, or unset.
func (c Config) On() bool { return c.Enabled == nil || *c.Enabled }

// Bounds of the settings, with the reasons Validate gives.
const (
	// overflowID is (uid_t)-1, which setresuid reads as "leave unchanged".
	overflowID = 1<<32 - 1
	// nobodyID is the overflow uid and gid (nobody, nogroup): files the
	// kernel cannot map show this owner, so a VM must never hold it.
	nobodyID = 65534
	// minPidsMax leaves room for the threads of a small VM: Cloud Hypervisor
	// runs one per vCPU and device plus its own, and the storage daemon's
	// worker pool alone grows to 64.
	minPidsMax = 128
)

// Validate checks c and names the field at fault ("jail.id_range: ...").
func (c Config) Validate() error {
	lo, hi := c.IDRange[0], c.IDRange[1]
	switch {
	case lo == 0:
		return errors.New("jail.id_range: must not include 0 (root)")
	case lo > hi:
		return fmt.Errorf("jail.id_range: first id %d is above last id %d", lo, hi)
	case hi >= overflowID:
		return fmt.Errorf("jail.id_range: last id %d must be below %d", hi, uint32(overflowID))
	case lo <= nobodyID && nobodyID <= hi:
		return fmt.Errorf("jail.id_range: must not include %d (nobody/nogroup)", nobodyID)
	}
	if err := checkCgroupPath(c.CgroupParent); err != nil {
		return fmt.Errorf("jail.cgroup_parent: %w", err)
	}
	if c.PidsMax < minPidsMax {
		return fmt.Errorf("jail.pids_max: %d is below %d, too few for the threads of Cloud Hypervisor and the storage daemon", c.PidsMax, minPidsMax)
	}
	return nil
}

// checkCgroupPath accepts a relative, clean path of plain names: it becomes
// a directory name in every cgroup hierarchy.
func checkCgroupPath(p string) error {
	if p == "" {
		return errors.New("must not be empty")
	}
	if strings.HasPrefix(p, "/") || path.Clean(p) != p {
		return fmt.Errorf("%q must be a clean relative path (like vmhost or machines/vmhost)", p)
	}
	for _, seg := range strings.Split(p, "/") {
		if err := checkName(seg); err != nil {
			return fmt.Errorf("%q: %w", p, err)
		}
	}
	return nil
}

// checkName accepts one path segment made of letters, digits and "._-", not
// starting with a dot: a VM id, an agent id, a cgroup name. Cgroup file
// names are dotted (memory.max), so a dotted name could shadow one.
func checkName(s string) error {
	if s == "" || len(s) > 200 {
		return fmt.Errorf("name %q must have 1 to 200 characters", s)
	}
	if s[0] == '.' {
		return fmt.Errorf("name %q must not start with a dot", s)
	}
	for _, r := range s {
		ok := r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-' || r == '_' || r == '.'
		if !ok {
			return fmt.Errorf("name %q may hold only letters, digits, '-', '_' and '.'", s)
		}
	}
	return nil
}

// ErrNoFreeID reports that every id of the range is held.
var ErrNoFreeID = errors.New("every id of jail.id_range is held by a VM")

// AllocateID returns an id of c.IDRange that inUse does not hold (the ids of
// every record that exists, whatever its state). It starts at a random
// place, so an id freed by a delete is not handed out again at once: any file
// a failed cleanup left owned by it stays out of a new VM's reach for as long
// as the range allows.
func (c Config) AllocateID(inUse map[uint32]bool) (uint32, error) {
	lo, hi := c.IDRange[0], c.IDRange[1]
	if lo == 0 || lo > hi || hi >= overflowID {
		return 0, fmt.Errorf("jail.id_range [%d, %d] is not valid", lo, hi)
	}
	n := uint64(hi-lo) + 1
	start := rand.Uint64N(n)
	for i := uint64(0); i < n; i++ {
		id := lo + uint32((start+i)%n)
		if !inUse[id] && id != nobodyID {
			return id, nil
		}
	}
	return 0, ErrNoFreeID
}
