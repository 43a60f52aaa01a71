package jail

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
)

// checkArg0 is the argv[0] of the process SelfTest starts in a jail: it
// reports what it finds there and exits (see selfCheck).
const checkArg0 = "vmhost-jail-check"

// checkReport is what the jailed check process finds about itself.
type checkReport struct {
	Status  string   // /proc/self/status
	Cgroup  string   // /proc/self/cgroup
	MountNS string   // the link /proc/self/ns/mnt
	Root    []string // the names in /
	Err     string
}

// selfCheck runs in the jail SelfTest made and prints a checkReport.
func selfCheck() int {
	var r checkReport
	status, e1 := os.ReadFile("/proc/self/status")
	cgroup, e2 := os.ReadFile("/proc/self/cgroup")
	ns, e3 := os.Readlink("/proc/self/ns/mnt")
	ents, e4 := os.ReadDir("/")
	r.Status, r.Cgroup, r.MountNS = string(status), string(cgroup), ns
	for _, e := range ents {
		r.Root = append(r.Root, e.Name())
	}
	if err := errors.Join(e1, e2, e3, e4); err != nil {
		r.Err = err.Error()
	}
	if err := json.NewEncoder(os.Stdout).Encode(r); err != nil {
		return 1
	}
	return 0
}

// SelfTest proves the jail on this host: it starts this binary in a jail of
// its own (a throwaway VM with an id inUse does not hold), where it reads
// its own status, cgroup, mount namespace and root, and checks them as
// Verify does; then it destroys that jail. It is what doctor runs: nil means
// a VM's processes get their uid, no capability, no_new_privs, their cgroup
// and a root of only what they were given.
func (j *Jailer) SelfTest(ctx context.Context, inUse map[uint32]bool) error {
	if !j.Enabled() {
		return fmt.Errorf("jail: off: %s", j.off)
	}
	id, err := j.AllocateID(inUse)
	if err != nil {
		return fmt.Errorf("jail: self-test: %w", err)
	}
	b := make([]byte, 4)
	rand.Read(b)
	v, err := j.VM("selftest-"+hex.EncodeToString(b), id)
	if err != nil {
		return err
	}
	// The host as it was after: the agent's cgroup too, when the test
	// made it (an agent with no VMs has none; one that fails to start
	// after its self-test, or a doctor run, would leave it).
	made := !j.agentCgroup().Exists()
	defer func() {
		v.Destroy(context.WithoutCancel(ctx))
		if made {
			j.RemoveAgentCgroup()
		}
	}()
	if err := v.Create(Limits{MemoryBytes: 64 << 20, PidsMax: minPidsMax, VCPUs: 1}); err != nil {
		return fmt.Errorf("jail: self-test: %w", err)
	}
	exe, err := filepath.EvalSymlinks(j.host.CheckBinary)
	if err != nil {
		return fmt.Errorf("jail: self-test: %w", err)
	}
	files, err := ExecFiles(exe)
	if err != nil {
		return fmt.Errorf("jail: self-test: %w", err)
	}
	var out, errOut bytes.Buffer
	cmd := exec.CommandContext(ctx, exe)
	cmd.Args = []string{checkArg0}
	cmd.Env = []string{}
	if v, ok := os.LookupEnv("GORACE"); ok {
		// A race-built agent (its tests) passes on the race detector's
		// options: by default it sleeps a second before any exit.
		cmd.Env = append(cmd.Env, "GORACE="+v)
	}
	cmd.Stdout, cmd.Stderr = &out, &errOut
	if err := v.Confine(Exec{Proc: true}).Start(cmd); err != nil {
		return fmt.Errorf("jail: self-test: %w", err)
	}
	if err := cmd.Wait(); err != nil {
		return fmt.Errorf("jail: self-test: the jailed check failed: %w: %s", err, errOut.Bytes())
	}
	var r checkReport
	if err := json.Unmarshal(out.Bytes(), &r); err != nil {
		return fmt.Errorf("jail: self-test: reading the check's report: %w: %q", err, out.Bytes())
	}
	if err := v.checkReport(r, files); err != nil {
		return fmt.Errorf("jail: self-test: a jailed process is not confined: %w", err)
	}
	return nil
}

// checkReport compares what the jailed check found with what its jail
// should give: Verify's checks, and a root holding only the top directories
// of its program's files and /proc.
func (v *VM) checkReport(r checkReport, files []string) error {
	if r.Err != "" {
		return errors.New(r.Err)
	}
	err := v.check(r.Status, []byte(r.Cgroup), r.MountNS)
	// The top of every path a file's bind made in the root (links
	// included), and /proc.
	want := []string{"proc"}
	for _, f := range files {
		_, werr := walkPath(f, nil, func(path, _ string, _ bool) error {
			top, _, _ := strings.Cut(strings.TrimPrefix(path, "/"), "/")
			if !slices.Contains(want, top) {
				want = append(want, top)
			}
			return nil
		})
		err = errors.Join(err, werr)
	}
	slices.Sort(want)
	if got := slices.Sorted(slices.Values(r.Root)); !slices.Equal(got, want) {
		err = errors.Join(err, fmt.Errorf("its root holds %v, want %v", got, want))
	}
	return err
}
