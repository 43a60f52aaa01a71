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

	"vmhost/appvm"
	"vmhost/config"
	"vmhost/doctor"
)

// Where the Debian package puts the agent's configuration and state
// (dist/vmhost.service), which doctor checks unless told otherwise.
const (
	packagedConfig   = "/etc/vmhost/config.json"
	packagedStateDir = "/var/lib/vmhost"
)

const doctorUsage = `usage: vmhost doctor [--config FILE] [--state-dir DIR] [-o table|json]
Checks whether this host can run real VMs (KVM, cloud-hypervisor,
qemu-storage-daemon, the networks' bridges, nftables, the AppVM kernel and
modules, cgroups, the jail's id range, the state directory) and says how to
fix what it lacks. --config defaults to ` + packagedConfig + ` when it exists
(else the built-in configuration), --state-dir to ` + packagedStateDir + `.
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
	h.Config, h.StateDir = cfg, *stateDir
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

// doctorHost is what the host checks need to know of the agent beyond its
// configuration and state directory: the modules an AppVM needs, and the
// jail, which is on whenever the agent runs as root.
func doctorHost() *doctor.Host {
	jail := doctor.DefaultJail()
	jail.Enabled = os.Geteuid() == 0
	return &doctor.Host{AppVMModules: appvm.AgentModules, Jail: jail, Euid: -1}
}
