package main

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"path"
	"path/filepath"
	"strconv"
	"time"

	"vmhost/api"
	"vmhost/appvm"
	"vmhost/audit"
	"vmhost/chclient/chsim"
	"vmhost/events"
	"vmhost/jail"
	"vmhost/registry"
	"vmhost/tap"
	"vmhost/vm"
	"vmhost/vm/engine"
	"vmhost/vm/records"
)

// service is what serve runs: the API handler over the VM services.
type service struct {
	Handler http.Handler
	// Close stops watching the VMs and releases their process handles;
	// the VMs keep running (KillMode=process) and the next start adopts
	// them.
	Close func() error
	// CloseStreams ends the open event streams (at shutdown, before the
	// server waits for its handlers).
	CloseStreams func()
}

// newService builds the agent bottom-up, in one pass, then runs it: the
// event log; the records' owner (vm/records), loaded from env.Store, which
// the event log follows; the host end of the AppVMs' guest agents; the
// engine over the records (the VMs' host, driving the guest end); the VM
// rules (vm) over the records and the engine; the AppVM service over
// those; the API. Then the engine reconciles the host with the records,
// and what an agent stop cut short (AppVM redeploys and restarts, volume
// changes) is finished. env.SimCH and env.SimQSD run the simulators (this
// executable as `vmhost sim-ch` / `vmhost sim-qsd`) instead of the
// configured binaries. An agent that is not root cannot create taps: a
// create with interfaces then answers 500 NETWORK_ERROR saying so.
func newService(env serveEnv) (*service, error) {
	eo := engine.Options{Config: env.Config, StateDir: env.StateDir, RunDir: env.RunDir, Logger: env.Log}
	if env.SimCH || env.SimQSD {
		exe := env.Simulator
		if exe == "" {
			var err error
			if exe, err = os.Executable(); err != nil {
				return nil, fmt.Errorf("locating the vmhost executable for the simulators: %w", err)
			}
		}
		if env.SimCH {
			j, err := simCHJail(env.SimCHArgs)
			if err != nil {
				return nil, fmt.Errorf("--sim-ch-args: %w", err)
			}
			eo.CH = engine.Program{Binary: exe, PreArgs: append([]string{"sim-ch"}, env.SimCHArgs...), Jail: j}
		}
		if env.SimQSD {
			eo.QSD = engine.Program{Binary: exe, PreArgs: []string{"sim-qsd"}}
		}
	}
	j, appVMsUnconfined, err := newJailer(env)
	if err != nil {
		return nil, err
	}
	eo.Jail, eo.AppVMsUnconfined = j, appVMsUnconfined
	if err := devAppVMs(env, &eo); err != nil {
		return nil, err
	}
	uid := os.Geteuid()
	if uid == 0 {
		eo.Taps = tap.New(&tap.Config{AgentID: env.AgentID})
	} else {
		eo.NoTapsReason = noTapsReason(uid)
	}
	// The event log opens first and follows the records, so what recovery
	// finds (a VM that died while the agent was away) is told like any
	// change.
	evs, err := events.Open(filepath.Join(env.StateDir, "events"), events.Options{Keep: env.Config.EventsKeep, Logger: env.Log.With("component", "events")})
	if err != nil {
		return nil, err
	}
	recs, err := records.Open(env.Store, records.Options{Logger: env.Log})
	if err != nil {
		evs.Close()
		return nil, err
	}
	recs.Watch(records.Publish(evs))
	r := recs.Report()
	env.Log.Info("loaded VM records", "loaded", r.Loaded, "invalid_id", len(r.Invalid),
		"damaged", len(r.Damaged), "undecodable", len(r.Undecodable), "removed_temps", len(r.RemovedTemps))
	guests := appvm.NewGuests(appvm.GuestOptions{Records: recs, Config: env.Config,
		Layout: vm.Layout{StateDir: filepath.Clean(env.StateDir), RunDir: filepath.Clean(env.RunDir)}, Logger: env.Log, Events: evs})
	eo.Records, eo.Guest = recs, guests
	eng, err := engine.New(eo)
	if err != nil {
		evs.Close()
		return nil, err
	}
	vms, err := vm.New(vm.Options{
		StateDir: env.StateDir,
		RunDir:   env.RunDir,
		Config:   env.Config,
		Records:  recs,
		Host:     eng,
		Logger:   env.Log,
		Events:   evs,
		AgentID:  env.AgentID,
	})
	if err != nil {
		evs.Close()
		return nil, err
	}
	// In dev mode an AppVM that names no network gets none: the dev
	// bridge (as root) has no DHCP server, and without root there are no
	// taps at all.
	apps := appvm.New(appvm.Config{VMs: vms, Records: recs, Guests: guests, RootDisks: eng, Dialer: eng, NoDefaultNetwork: env.Dev})
	eng.Recover()
	apps.RecoverRedeploys(context.Background())
	apps.FinishRestarts(context.Background())
	apps.RecoverRestarts()
	vms.RecoverVolumes(context.Background())
	// Registry indexes are read in the background, at once and every
	// refresh_secs: an index that is slow or down never delays the start.
	reg := registry.New(env.Config.Registry.Indexes, nil, env.Log.With("component", "registry"))
	regCtx, stopRegistry := context.WithCancel(context.Background())
	if len(env.Config.Registry.Indexes) > 0 {
		go reg.Run(regCtx, time.Duration(env.Config.Registry.RefreshSecs)*time.Second)
	}
	auditLog, err := audit.Open(filepath.Join(env.StateDir, "audit.log"), env.Config.AuditLogMaxBytes)
	if err != nil {
		stopRegistry()
		return nil, errors.Join(err, eng.Close(), evs.Close())
	}
	// An agent that is not root may not give an image's files their
	// owners nor make its device nodes: it imports without them, as
	// `vmhost image import --ignore-owners --skip-devices` does. The
	// service's importer finishes what imports cut short and removes the
	// builds nothing uses, now and after each commit.
	images, err := apps.NewImporter(appvm.ImportOptions{Logger: env.Log, Events: evs,
		MaxBytes: env.Config.ImageImportMaxBytes, MaxEntries: env.Config.ImageImportMaxEntries,
		IgnoreOwners: uid != 0, SkipDevices: uid != 0})
	if err != nil {
		env.Log.Error("recovering AppVM image imports", "err", err)
	}
	h := api.New(api.Config{Keys: env.Keys, VMs: vms, AppVMs: apps, Images: images, Logger: env.Log,
		Registry: reg, ImageCache: eng.ImageCache(), Events: evs, Audit: auditLog, AgentID: env.AgentID, Version: version})
	return &service{Handler: h, CloseStreams: h.CloseStreams, Close: func() error {
		stopRegistry()
		err := eng.Close()
		return errors.Join(err, evs.Close(), auditLog.Close())
	}}, nil
}

// newJailer returns the VMs' jailer (docs/operating.md, Confinement), and
// says once whether VMs run confined: an agent without root, or with
// jail.enabled false, runs them unconfined. With the Cloud Hypervisor
// simulator's process-mode guests and jail.enabled unset, classic VMs are
// confined and AppVMs are not (the returned reason, processGuestsReason);
// a host where the jail cannot work then runs every VM unconfined, saying
// why, so that serve --dev starts on any Linux machine.
func newJailer(env serveEnv) (j *jail.Jailer, appVMsUnconfined string, err error) {
	runDir, err := filepath.Abs(env.RunDir)
	if err != nil {
		return nil, "", err
	}
	cfg := env.Config.Jail
	processGuests := false
	if env.SimCH && cfg.Enabled == nil && os.Geteuid() == 0 {
		if processGuests, err = chsim.ProcessGuests(env.SimCHArgs); err != nil {
			return nil, "", fmt.Errorf("--sim-ch-args: %w", err)
		}
	}
	host := jail.Host{RunDir: runDir, AgentID: env.AgentID}
	j, err = jail.New(cfg, host)
	if err != nil && processGuests {
		env.Log.Warn("VMs run unconfined", "reason", "the jail cannot work on this host: "+err.Error())
		cfg.Enabled = new(false)
		j, err = jail.New(cfg, host)
		return j, "", err
	}
	if err != nil {
		return nil, "", fmt.Errorf("confining VMs: %w", err)
	}
	if !j.Enabled() {
		env.Log.Warn("VMs run unconfined", "reason", j.Off())
		return j, "", nil
	}
	c := j.Config()
	env.Log.Info("VMs run confined", "cgroups", j.Layout().String(), "id_range", fmt.Sprintf("%d..%d", c.IDRange[0], c.IDRange[1]),
		"cgroup", path.Join(c.CgroupParent, env.AgentID))
	if processGuests {
		env.Log.Warn("AppVMs run unconfined", "reason", processGuestsReason)
		return j, processGuestsReason, nil
	}
	return j, "", nil
}

// processGuestsReason is why an agent whose Cloud Hypervisor is the
// simulator with its default (sim) backend does not confine AppVMs unless
// jail.enabled says true: that simulator's AppVM guest is its guest agent
// running the workload as a host process, which needs what a jail takes
// away (a devpts for terminals, changing to the workload's user).
const processGuestsReason = "the simulator's process-mode guest runs the workload on the host; AppVMs are not confined (jail.enabled true confines them)"

// simCHJail is what `vmhost sim-ch` needs in a VM's jail beyond what Cloud
// Hypervisor gets: the host's /usr (and the top-level links or directories
// of a system without merged /usr), read-only, which stands in for the
// simulated guest's file system (its process-mode guest agent runs the
// workload from it) and holds the qemu backend's firmware; the loader's
// cache; and the programs the qemu backend runs, with their libraries.
func simCHJail(args []string) (jail.Exec, error) {
	var x jail.Exec
	for _, p := range []string{"/usr", "/bin", "/sbin", "/lib", "/lib64", "/etc/ld.so.cache"} {
		if _, err := os.Stat(p); err == nil {
			x.Binds = append(x.Binds, jail.Bind{Path: p, Exec: p != "/etc/ld.so.cache"})
		}
	}
	progs, err := chsim.HostPrograms(args)
	if err != nil {
		return x, err
	}
	for _, p := range progs {
		files, err := jail.ExecFiles(p)
		if err != nil {
			return x, err
		}
		for _, f := range files {
			x.Binds = append(x.Binds, jail.Bind{Path: f, Exec: true})
		}
	}
	x.Devices = []string{"/dev/zero"}
	return x, nil
}

// noTapsReason is why a VM with an interface cannot be created by an agent
// that is not root: classic VMs without nets and cloud_init are left, and
// in dev mode AppVMs, which have no interface unless they name a network.
func noTapsReason(uid int) string {
	return "creating taps needs root (CAP_NET_ADMIN) and this agent runs as uid " + strconv.Itoa(uid) +
		": run vmhost serve as root; without root only classic VMs without nets and without cloud_init can be created, " +
		"and AppVMs in dev mode without network_id or a static address (they get no interface)"
}
