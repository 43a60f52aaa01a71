package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"strings"

	"vmhost/appvm"
	"vmhost/config"
	"vmhost/doctor"
	"vmhost/jail"
	"vmhost/proc"
	"vmhost/vm/record"
)

// Where the Debian package puts the agent's configuration and state
// (dist/vmhost.service), which doctor checks unless told otherwise.
const (
	packagedConfig   = "/etc/vmhost/config.json"
	packagedStateDir = "/var/lib/vmhost"
	packagedRunDir   = "/run/vmhost"
)

const doctorUsage = `usage: vmhost doctor [--config FILE] [--state-dir DIR] [--run-dir DIR] [-o table|json]
Checks whether this host can run real VMs (KVM, cloud-hypervisor,
qemu-storage-daemon, the networks' bridges, nftables, the AppVM kernel and
modules, cgroups, the jail's id range, the jail itself on a throwaway
process and on the running VMs' processes, the state directory) and says
how to fix what it lacks. --config defaults to ` + packagedConfig + ` when it
exists (else the built-in configuration), --state-dir to ` + packagedStateDir + `,
--run-dir to ` + packagedRunDir + `.
Exit status 0 when real VMs can run (warnings allowed), 1 when not.
`

// doctorCmd runs `vmhost doctor`: the checks of package doctor, one line
// each.
func doctorCmd(args []string, stdout, stderr io.Writer) int {
	fset := flag.NewFlagSet("vmhost doctor", flag.ContinueOnError)
	fset.SetOutput(stderr)
	fset.Usage = func() { fmt.Fprint(stderr, doctorUsage) }
	configPath := fset.String("config", "", "host configuration file (default "+packagedConfig+" when it exists, else the built-in one)")
	stateDir := fset.String("state-dir", packagedStateDir, "the agent's state directory")
	runDir := fset.String("run-dir", packagedRunDir, "the agent's run directory (the jail's self-test makes a throwaway jail there)")
	output := fset.String("o", "table", "output: table (one line per check) or json")
	if err := fset.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	if fset.NArg() != 0 || (*output != "table" && *output != "json") {
		fmt.Fprint(stderr, doctorUsage)
		return 2
	}
	cfg := config.Default()
	source := "the built-in configuration"
	path := *configPath
	if path == "" {
		if _, err := os.Stat(packagedConfig); err == nil {
			path = packagedConfig
		}
	}
	if path != "" {
		var err error
		if cfg, err = config.Load(path); err != nil {
			fmt.Fprintf(stderr, "vmhost doctor: %v\n", err)
			if errors.Is(err, fs.ErrNotExist) {
				return 2
			}
			return 1
		}
		source = path
	}
	h := doctorHost()
	h.Config, h.StateDir, h.RunDir = cfg, *stateDir, *runDir
	checks := doctor.Run(context.Background(), *h)
	if *output == "json" {
		b, _ := json.MarshalIndent(struct {
			Config string         `json:"config"`
			OK     bool           `json:"ok"`
			Checks []doctor.Check `json:"checks"`
		}{source, !doctor.Failed(checks), checks}, "", "  ")
		stdout.Write(append(b, '\n'))
	} else {
		fmt.Fprintf(stdout, "checking this host against %s (state directory %s)\n", source, *stateDir)
		doctor.Print(stdout, checks)
	}
	if doctor.Failed(checks) {
		if *output == "table" {
			fmt.Fprintln(stdout, "real VMs cannot run on this host until the failures (FAIL) are fixed")
		}
		return 1
	}
	return 0
}

// probeJail proves the jail on this host, as doctor's "jail" check shows:
// a process started in a throwaway jail (jail.Jailer.SelfTest, with an id
// no record of the state directory holds) is checked from inside, and so
// is every live process of the running VMs the records name
// (jail.VM.Verify). The throwaway jail's cgroup is the agent's (from
// <state>/agent_id; "doctor" on a host without one, removed after).
func probeJail(ctx context.Context, h doctor.Host) doctor.JailProbe {
	cfg, stateDir, runDir := h.Config, h.StateDir, h.RunDir
	if runDir == "" {
		runDir = packagedRunDir
	}
	agent, err := os.ReadFile(filepath.Join(stateDir, "agent_id"))
	id := strings.TrimSpace(string(agent))
	if err != nil || id == "" {
		id = "doctor"
	}
	if runDir, err = filepath.Abs(runDir); err != nil {
		return doctor.JailProbe{SelfTest: err}
	}
	j, err := jail.New(cfg.Jail, jail.Host{RunDir: runDir, AgentID: id})
	if err != nil {
		return doctor.JailProbe{SelfTest: err}
	}
	if !j.Enabled() {
		return doctor.JailProbe{Off: j.Off()}
	}
	p := doctor.JailProbe{Layout: j.Layout().String()}
	recs := readRecords(filepath.Join(stateDir, "vms"))
	inUse := map[uint32]bool{}
	for _, r := range recs {
		if r.Jail != nil {
			inUse[r.Jail.UID] = true
		}
	}
	p.SelfTest = j.SelfTest(ctx, inUse)
	if id == "doctor" {
		j.Layout().Cgroup(path.Join(cfg.Jail.CgroupParent, id)).Remove(ctx)
	}
	for _, r := range recs {
		rt := r.Runtime
		if rt == nil || (rt.CH == nil && rt.QSD == nil) {
			continue
		}
		type process struct {
			pid   int
			start uint64
		}
		var ps []process
		if rt.CH != nil && proc.Alive(rt.CH.Pid, rt.CH.StartTime) {
			ps = append(ps, process{rt.CH.Pid, rt.CH.StartTime})
		}
		if rt.QSD != nil && proc.Alive(rt.QSD.Pid, rt.QSD.StartTime) {
			ps = append(ps, process{rt.QSD.Pid, rt.QSD.StartTime})
		}
		if len(ps) == 0 {
			continue
		}
		if r.Jail == nil {
			p.Unconfined = append(p.Unconfined, r.ID)
			continue
		}
		v, verr := j.VM(r.ID, r.Jail.UID)
		for _, x := range ps {
			p.Checked++
			err := verr
			if err == nil {
				err = v.Verify(x.pid)
			}
			if err != nil {
				p.Problems = append(p.Problems, fmt.Sprintf("VM %s: %v", r.ID, err))
			}
		}
	}
	return p
}

// readRecords reads the VM records in dir, leaving out what does not
// decode (the agent reports those).
func readRecords(dir string) []*record.Record {
	files, _ := filepath.Glob(filepath.Join(dir, "*.json"))
	var recs []*record.Record
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		if r, err := record.Decode(b); err == nil {
			recs = append(recs, r)
		}
	}
	return recs
}

// doctorHost is what the host checks need to know of the agent beyond its
// configuration and state directory: the modules an AppVM needs, and the
// jail, which is on whenever the agent runs as root.
func doctorHost() *doctor.Host {
	jail := doctor.DefaultJail()
	jail.Enabled = os.Geteuid() == 0
	jail.Probe = probeJail
	return &doctor.Host{AppVMModules: appvm.AgentModules, Jail: jail, Euid: -1}
}
