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
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		return fmt.Errorf("jail: verifying pid %d: %w", pid, err)
	}
	var errs []error
	status := parseStatus(string(b))
	for key, want := range map[string]uint32{"Uid": v.UID, "Gid": v.GID} {
		f := strings.Fields(status[key])
		w := strconv.FormatUint(uint64(want), 10)
		if len(f) != 4 || f[0] != w || f[1] != w || f[2] != w || f[3] != w {
			errs = append(errs, fmt.Errorf("%s is %q, not %s", key, status[key], w))
		}
	}
	for _, key := range []string{"CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"} {
		if c, err := strconv.ParseUint(status[key], 16, 64); err != nil || c != 0 {
			errs = append(errs, fmt.Errorf("%s is %q, not empty", key, status[key]))
		}
	}
	if status["NoNewPrivs"] != "1" {
		errs = append(errs, fmt.Errorf("NoNewPrivs is %q, not 1", status["NoNewPrivs"]))
	}
	if in, err := v.cgroup.Contains(pid); err != nil || !in {
		errs = append(errs, fmt.Errorf("not in cgroup %s (%v)", v.cgroup.Name(), err))
	}
	self, err1 := os.Readlink("/proc/self/ns/mnt")
	its, err2 := os.Readlink("/proc/" + strconv.Itoa(pid) + "/ns/mnt")
	if err := errors.Join(err1, err2); err != nil || self == its {
		errs = append(errs, fmt.Errorf("in the agent's mount namespace (%v)", err))
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("jail: pid %d of VM %s is not confined: %w", pid, v.ID, err)
	}
	return nil
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
