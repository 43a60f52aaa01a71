package jail

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
)

// Verify reports every way in which process pid is not confined as the
// VM's jail confines: its uids and gids, a capability left in any set,
// no_new_privs unset, not in the VM's cgroup, or in the agent's own mount
// namespace. It returns nil for a process the jail started; the agent
// checks adopted processes with it, and doctor shows what it finds.
func (v *VM) Verify(pid int) error {
	proc := "/proc/" + strconv.Itoa(pid)
	status, err := os.ReadFile(proc + "/status")
	if err != nil {
		return fmt.Errorf("jail: verifying pid %d: %w", pid, err)
	}
	cgroup, err := os.ReadFile(proc + "/cgroup")
	if err != nil {
		return fmt.Errorf("jail: verifying pid %d: %w", pid, err)
	}
	ns, err := os.Readlink(proc + "/ns/mnt")
	if err != nil {
		return fmt.Errorf("jail: verifying pid %d: %w", pid, err)
	}
	if err := v.check(string(status), cgroup, ns); err != nil {
		return fmt.Errorf("jail: pid %d of VM %s is not confined: %w", pid, v.ID, err)
	}
	return nil
}

// check compares what /proc says of a process (its status, its cgroup file,
// the link naming its mount namespace) with the VM's jail.
func (v *VM) check(status string, cgroup []byte, mountNS string) error {
	var errs []error
	st := parseStatus(status)
	for key, want := range map[string]uint32{"Uid": v.UID, "Gid": v.GID} {
		f := strings.Fields(st[key])
		w := strconv.FormatUint(uint64(want), 10)
		if len(f) != 4 || f[0] != w || f[1] != w || f[2] != w || f[3] != w {
			errs = append(errs, fmt.Errorf("%s is %q, not %s", key, st[key], w))
		}
	}
	for _, key := range []string{"CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"} {
		if c, err := strconv.ParseUint(st[key], 16, 64); err != nil || c != 0 {
			errs = append(errs, fmt.Errorf("%s is %q, not empty", key, st[key]))
		}
	}
	if st["NoNewPrivs"] != "1" {
		errs = append(errs, fmt.Errorf("NoNewPrivs is %q, not 1", st["NoNewPrivs"]))
	}
	if missing := v.cgroup.notIn(cgroup); len(missing) > 0 {
		errs = append(errs, fmt.Errorf("not in cgroup %s in hierarchies %s", v.cgroup.Name(), strings.Join(missing, ", ")))
	}
	if self, err := os.Readlink("/proc/self/ns/mnt"); err != nil || self == mountNS {
		errs = append(errs, fmt.Errorf("in the agent's mount namespace (%v)", err))
	}
	return errors.Join(errs...)
}

// parseStatus reads the "Key:\tvalue" lines of /proc/PID/status.
func parseStatus(s string) map[string]string {
	m := map[string]string{}
	for _, line := range strings.Split(s, "\n") {
		if k, val, ok := strings.Cut(line, ":"); ok {
			m[k] = strings.TrimSpace(val)
		}
	}
	return m
}
