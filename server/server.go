// Package server runs `vmhost serve`: it takes the agent's directories
// (one agent per state and run directory), reads the configuration and the
// API keys, loads the agent id, logs what the host checks of vmhost doctor
// find lacking (and starts anyway), listens (TCP with optional TLS, or a
// unix socket, plus the local socket <run>/api.sock), holds requests at a
// start gate while the service is built and recovers the host, tells systemd
// when it is ready, reloads keys and certificates on SIGHUP, and shuts
// down gracefully on SIGTERM or SIGINT. Under --dev it also fills in the
// dev defaults, makes (and at a clean exit removes) the dev bridge, makes
// the first key, and prints the lines a shell needs.
//
// The service itself (the VM engine, the records, the API handler) is
// built by the caller's function from an Env: package main wires it, this
// package only runs it, so it imports none of the packages above the
// leaves.
//
// # Hostile clients
//
// Only clients with a key can hold the server's connections (conns.go). A
// connection is "keyed" once it carried a request with a valid API key:
// it may idle for two minutes and is never evicted. A request without a
// valid key (a 401 to come, or /healthz) is answered with Connection:
// close. Connections that never carried a key are evicted oldest first:
// a source's own when it holds more than 64 of them, and, when the
// listener's 256 connections are all taken, the busiest source's that are
// over a second old. Headers must arrive within 10 s (64 KiB at most),
// bodies within the API's deadline, and the local socket has connections
// of its own. The HTTP server's complaints about bad clients are logged
// at most 20 a minute.
package server

import (
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"vmhost/agentid"
	"vmhost/auth"
	"vmhost/config"
	"vmhost/doctor"
	"vmhost/internal/dirlock"
	"vmhost/sdnotify"
	"vmhost/store"
)

// shutdownTimeout bounds how long the server waits for in-flight requests
// after SIGTERM or SIGINT before closing their connections.
const shutdownTimeout = 15 * time.Second

// Options are what `vmhost serve` was asked for.
type Options struct {
	// Listen is "host:port", or "unix:/path" for a unix socket.
	Listen     string
	StateDir   string
	RunDir     string
	ConfigPath string // empty: the built-in defaults
	// Dev is --dev: the dev defaults (DevDefaults) fill what is empty.
	Dev bool
	// Simulate lists the programs replaced by their simulators: "ch",
	// "qsd" (comma-separated; "none"; --dev defaults to both).
	Simulate string
	// Simulator is the vmhost executable that runs the simulators; empty
	// means this one.
	Simulator string
	// SimCHArgs are more arguments for `vmhost sim-ch` (its --sim-* flags).
	SimCHArgs []string
	// TLS are the --tls-* flags; each one set overrides its config key.
	TLS TLSFiles
	// Notifier tells systemd (Type=notify) when the server is ready,
	// reloading and stopping; nil sends nothing.
	Notifier *sdnotify.Notifier
	// Log is the agent's log.
	Log *slog.Logger
	// Stdout is where --dev prints the lines a shell needs.
	Stdout io.Writer
	// CheckRunDir says why a run directory (absolute) is too long for the
	// VMs' sockets; --dev then moves its run directory to a short path.
	// Nil: every run directory fits.
	CheckRunDir func(dir string) error
	// Doctor is what of the host checks (package doctor) only the caller
	// knows: the modules an AppVM needs, the jail. Run fills in the
	// configuration, the state directory and the simulated programs, runs
	// the checks once before it listens and logs what they find lacking,
	// then starts all the same (checkHost). Nil runs no checks.
	Doctor *doctor.Host
}

// Env is what the service is built from.
type Env struct {
	StateDir string
	RunDir   string
	Config   *config.Config
	Store    *store.Store // <state>/vms
	Keys     *auth.Keyring
	Log      *slog.Logger
	// AgentID is this agent's id (package agentid), made once per state
	// directory: every host object the agent makes carries it (tap
	// ifaliases and nftables tables through tap.Config.AgentID, cgroup
	// directories), and the agent reaps only objects carrying it.
	AgentID string
	// SimCH and SimQSD run chsim and qsdsim (Simulator, or this
	// executable) instead of the configured binaries; SimCHArgs are more
	// arguments for chsim.
	SimCH, SimQSD bool
	Simulator     string
	SimCHArgs     []string
	// DevBridge is the bridge --dev uses when running as root (the
	// default network's), which the server has made, marked with the
	// agent id, before building the service; empty outside dev mode or
	// without root.
	DevBridge string
	// Dev is --dev: the service lets a newcomer try AppVMs on the
	// simulators (no network by default, no kernel needed, the image's
	// own tree).
	Dev bool
}

// Service is what the server runs: the API handler over the VM services.
type Service struct {
	Handler http.Handler
	// Close stops watching the VMs and releases their process handles;
	// the VMs keep running (KillMode=process) and the next start adopts
	// them.
	Close func() error
	// CloseStreams ends the open event streams (at shutdown, before the
	// server waits for its handlers).
	CloseStreams func()
}

// NewService builds the service from env: it loads the VM records and
// reconciles the host with them (recovery) before it returns.
type NewService func(Env) (*Service, error)

// Run serves until SIGTERM or SIGINT, then shuts down gracefully. SIGHUP
// rereads the keys and the TLS certificate. An error is a failed start or
// a listener that failed.
func Run(o Options, newService NewService) error {
	log := o.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	var dev *devRun
	if o.Dev {
		var err error
		if dev, err = setUpDev(&o, log); err != nil {
			return fmt.Errorf("setting up dev mode: %w", err)
		}
	}
	for _, dir := range []string{o.StateDir, o.RunDir} {
		if err := os.MkdirAll(dir, 0o700); err != nil {
			return fmt.Errorf("creating %s: %w", dir, err)
		}
	}
	stateDir, err := filepath.Abs(o.StateDir)
	if err != nil {
		return err
	}
	runDir, err := filepath.Abs(o.RunDir)
	if err != nil {
		return err
	}
	// One agent per state and run directory, locked before anything in
	// them is read (recovery included): a second agent would adopt, or
	// reap as orphans, the first one's VMs.
	stateLock, err := dirlock.Acquire(stateDir, "state directory")
	if err != nil {
		return err
	}
	defer stateLock.Close()
	if runDir != stateDir {
		runLock, err := dirlock.Acquire(runDir, "run directory")
		if err != nil {
			return err
		}
		defer runLock.Close()
	}
	// --dev's defaults name no host_path_roots (a config file may still).
	cfg := config.Default()
	if o.Dev {
		cfg = config.DevDefault()
	}
	if o.ConfigPath != "" {
		if cfg, err = config.LoadOver(o.ConfigPath, cfg); err != nil {
			return err
		}
	} else {
		log.Info("no --config given; using the built-in defaults")
	}
	tf := TLSFiles{Cert: cfg.TLS.Cert, Key: cfg.TLS.Key, ClientCA: cfg.TLS.ClientCA}
	for _, f := range []struct{ flag, cfg *string }{{&o.TLS.Cert, &tf.Cert}, {&o.TLS.Key, &tf.Key}, {&o.TLS.ClientCA, &tf.ClientCA}} {
		if *f.flag != "" {
			*f.cfg = *f.flag
		}
	}
	var tlsr *tlsReloader
	if tf.enabled() {
		// TLS guards a TCP listener; a unix socket is guarded by its mode
		// (0600) and stays plain HTTP, which is what `vmhost --api unix:`
		// speaks.
		if strings.HasPrefix(o.Listen, "unix:") {
			return fmt.Errorf("TLS is configured but --listen is the unix socket %s: TLS applies to a TCP address (listen on host:port, or drop the tls settings)", o.Listen)
		}
		if tlsr, err = newTLSReloader(tf); err != nil {
			return err
		}
		logCertExpiry(log, tlsr)
	}
	keysPath := KeysFile(stateDir)
	keys, err := auth.Open(keysPath)
	if err != nil {
		return err
	}
	if keys.Len() == 0 && !dev.makesKey() {
		log.Warn("no API keys: every request will be refused; add one with vmhost key add", "keys", keysPath)
	}
	agent, err := agentid.Load(stateDir)
	if err != nil {
		return err
	}
	st, err := store.Open(filepath.Join(stateDir, "vms"))
	if err != nil {
		return err
	}
	defer st.Close()

	// Signals are caught before the service starts, so a SIGTERM during
	// start-up is not lost and does not kill the process mid-recovery.
	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT, syscall.SIGHUP)
	defer signal.Stop(sigs)

	env := Env{StateDir: stateDir, RunDir: runDir, Config: cfg, Store: st, Keys: keys, Log: log, AgentID: agent, Dev: o.Dev,
		Simulator: o.Simulator, SimCHArgs: o.SimCHArgs}
	for _, p := range strings.Split(o.Simulate, ",") {
		switch strings.TrimSpace(p) {
		case "", "none":
		case "ch":
			env.SimCH = true
		case "qsd":
			env.SimQSD = true
		default:
			return fmt.Errorf("--simulate: unknown program %q (want ch, qsd or none)", p)
		}
	}
	if o.Dev {
		if env.DevBridge, err = dev.makeBridge(cfg, agent, log); err != nil {
			return err
		}
	}
	if o.Doctor != nil {
		h := *o.Doctor
		h.Config, h.StateDir, h.RunDir, h.SimulateCH, h.SimulateQSD = cfg, stateDir, runDir, env.SimCH, env.SimQSD
		checkHost(log, doctor.Run(context.Background(), h), o.Dev)
	}

	ln, err := listen(o.Listen)
	if err != nil {
		return err
	}
	listeners := []net.Listener{limitListener(ln, networkLimits)}
	scheme := "http"
	if tlsr != nil {
		listeners[0] = tls.NewListener(listeners[0], tlsr.Config())
		scheme = "https"
	}
	addr := listenAddr(ln)
	local := filepath.Join(runDir, LocalSocket)
	if addr != "unix:"+local {
		if lln, err := listen("unix:" + local); err != nil {
			// The network listener still serves; only the way in that
			// a flood cannot block is missing.
			log.Warn("no local socket", "err", err)
			local = ""
		} else {
			listeners = append(listeners, limitListener(lln, localLimits))
		}
	}
	// The API listens before recovery: /healthz answers 503 until the
	// records are loaded and every VM is reconciled, and other requests
	// wait for that rather than fail.
	gate := newStartGate()
	srv := newHTTPServer(keyedOnly{keys: keys, next: gate}, defaultRequestLimits, log)
	served := make(chan error, len(listeners))
	for _, l := range listeners {
		go func() { served <- srv.Serve(l) }()
	}
	log.Info("serving", "listen", addr, "scheme", scheme, "mutual_tls", tf.ClientCA != "", "local_socket", local,
		"pid", os.Getpid(), "state_dir", stateDir, "run_dir", runDir, "agent_id", agent, "keys", keys.Len())

	svc, err := newService(env)
	if err != nil {
		srv.Close()
		return err
	}
	closeService := func() {
		if svc == nil {
			return
		}
		if err := svc.Close(); err != nil {
			log.Error("releasing VMs", "err", err)
		}
		svc = nil
	}
	defer closeService()
	srv.RegisterOnShutdown(svc.CloseStreams)
	// Startup succeeded: only now is a dev key made and shown, so a start
	// that fails never leaves a key nobody saw.
	if err := dev.makeKey(keysPath, keys, log); err != nil {
		srv.Close()
		return err
	}
	gate.open(svc.Handler)
	// Recovery is over (newService returned) and the listener is up.
	notify(log, o.Notifier, sdnotify.Ready)
	dev.printShellLines(o.Stdout, scheme, addr)

	for {
		select {
		case err := <-served:
			srv.Close()
			return fmt.Errorf("serving: %w", err)
		case sig := <-sigs:
			if sig == syscall.SIGHUP {
				notify(log, o.Notifier, sdnotify.Reloading)
				if err := keys.Reload(); err != nil {
					log.Error("reloading keys; keeping the previous ones", "err", err)
				} else {
					log.Info("reloaded keys", "keys", keys.Len())
				}
				if tlsr != nil {
					if err := tlsr.Reload(); err != nil {
						log.Error("reloading the TLS certificate; keeping the previous one", "err", err)
					} else {
						log.Info("reloaded the TLS certificate", "cert", tf.Cert, "client_ca", tf.ClientCA)
						logCertExpiry(log, tlsr)
					}
				}
				notify(log, o.Notifier, sdnotify.Ready)
				continue
			}
			notify(log, o.Notifier, sdnotify.Stopping)
			log.Info("shutting down", "signal", sig.String())
			ctx, cancel := context.WithTimeout(context.Background(), shutdownTimeout)
			err := srv.Shutdown(ctx)
			cancel()
			if err != nil {
				srv.Close()
				return fmt.Errorf("shutting down: %w", err)
			}
			closeService()
			dev.removeBridge(env.DevBridge, agent, log)
			log.Info("stopped")
			return nil
		}
	}
}

// newHTTPServer is the server of every listener: h under lim, with the
// request's connection in its context (connContext) for keyedOnly.
func newHTTPServer(h http.Handler, lim requestLimits, log *slog.Logger) *http.Server {
	return &http.Server{
		Handler:           h,
		ReadHeaderTimeout: lim.readHeader,
		IdleTimeout:       lim.idle,
		MaxHeaderBytes:    lim.maxHeaderBytes,
		ConnContext:       connContext,
		ErrorLog:          newErrorLog(log),
	}
}

// KeysFile is where the keys of a state directory live.
func KeysFile(stateDir string) string { return filepath.Join(stateDir, "keys.json") }

// notify sends state to systemd, logging (not failing on) an error: a
// service manager that cannot be told is no reason to stop serving.
func notify(log *slog.Logger, n *sdnotify.Notifier, state string) {
	if err := n.Notify(state); err != nil {
		log.Warn("notifying systemd", "state", state, "err", err)
	}
}

// certExpiryWarning is how long before its expiry the certificate in use
// is logged as a warning (at start and on every reload).
const certExpiryWarning = 30 * 24 * time.Hour

func logCertExpiry(log *slog.Logger, r *tlsReloader) {
	na := r.NotAfter()
	switch left := time.Until(na); {
	case na.IsZero():
	case left <= 0:
		log.Error("the TLS certificate has expired: clients will refuse it; renew it and reload", "not_after", na.UTC())
	case left < certExpiryWarning:
		log.Warn("the TLS certificate expires soon: renew it and reload", "not_after", na.UTC())
	default:
		log.Info("TLS certificate", "not_after", na.UTC())
	}
}
