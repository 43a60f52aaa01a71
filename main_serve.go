package main

import (
	"context"
	"crypto/sha256"
	"crypto/tls"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"vmhost/auth"
	"vmhost/config"
	"vmhost/internal/dirlock"
	"vmhost/sdnotify"
	"vmhost/store"
	"vmhost/vm"
)

// Paths of `serve --dev`, relative to the working directory.
const (
	devDir        = "vmhost-dev"
	devStateDir   = devDir + "/state"
	devRunDir     = devDir + "/run"
	devConfigFile = devDir + "/config.json"
	devListen     = "127.0.0.1:8080"
	devKeyName    = "dev"
)

// HTTP server limits. A request's headers must arrive within
// readHeaderTimeout and its body within api.DefaultBodyReadTimeout (set
// per body by the API, since a server-wide ReadTimeout would also end the
// event stream); an idle keep-alive connection is closed after
// idleTimeout. At most maxConnections connections are open at once (idle
// ones included): beyond that, new ones wait in the listen backlog until
// one closes, so a flood of clients cannot use up the file descriptors the
// agent's VMs need.
const (
	readHeaderTimeout = 10 * time.Second
	idleTimeout       = 2 * time.Minute
	maxConnections    = 256
)

// shutdownTimeout bounds how long serve waits for in-flight requests after
// SIGTERM or SIGINT before closing their connections.
const shutdownTimeout = 15 * time.Second

// serveOptions are the flags of serve.
type serveOptions struct {
	listen     string
	stateDir   string
	runDir     string
	configPath string
	dev        bool
	// simulate lists the programs replaced by their simulators: "ch",
	// "qsd" (comma-separated; --dev defaults to both).
	simulate string
	// tls are the --tls-* flags; each set one overrides its config key.
	tls tlsFiles
	// notifier tells systemd (Type=notify) when serve is ready, reloading
	// and stopping; it sends nothing outside systemd.
	notifier *sdnotify.Notifier
}

// serveEnv is what the wiring of the API (newService) gets from serve.
type serveEnv struct {
	StateDir string
	RunDir   string
	Config   *config.Config
	Store    *store.Store // <state>/vms
	Keys     *auth.Keyring
	Log      *slog.Logger
	// SimCH and SimQSD run chsim and qsdsim (this executable) instead of
	// the configured binaries.
	SimCH, SimQSD bool
	// DevBridge is the bridge --dev creates when running as root; empty
	// outside dev mode.
	DevBridge string
}

func serve(args []string, stdout, stderr io.Writer) int {
	var o serveOptions
	fl := flag.NewFlagSet("vmhost serve", flag.ContinueOnError)
	fl.SetOutput(stderr)
	fl.StringVar(&o.listen, "listen", "", `address to serve on: "host:port", or "unix:/path" for a unix socket (dev default `+devListen+`)`)
	fl.StringVar(&o.stateDir, "state-dir", "", "directory of VM records, disks, images and keys.json")
	fl.StringVar(&o.runDir, "run-dir", "", "directory of runtime sockets and logs (e.g. /run/vmhost)")
	fl.StringVar(&o.configPath, "config", "", "host configuration file (JSON); none = built-in defaults")
	fl.BoolVar(&o.dev, "dev", false, "development mode: state, run dir and config under ./"+devDir+"/, a readwrite key printed on first start, simulators for ch and qsd, and (as root) the default network's bridge")
	fl.StringVar(&o.tls.Cert, "tls-cert", "", "PEM certificate (chain) to serve HTTPS with; overrides the config's tls.cert; reloaded on SIGHUP")
	fl.StringVar(&o.tls.Key, "tls-key", "", "PEM private key of --tls-cert; overrides tls.key")
	fl.StringVar(&o.tls.ClientCA, "tls-client-ca", "", "PEM CA certificate(s): require a client certificate signed by one of them (mutual TLS, on top of the bearer key); overrides tls.client_ca")
	fl.StringVar(&o.simulate, "simulate", "", `run simulators instead of real programs: "ch", "qsd" or "ch,qsd" (--dev default "ch,qsd"; "none" for the real ones)`)
	if err := fl.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	if fl.NArg() > 0 {
		fmt.Fprintf(stderr, "vmhost serve: unexpected argument %q\n", fl.Arg(0))
		return 2
	}
	log := slog.New(slog.NewTextHandler(stderr, nil))
	n, err := sdnotify.FromEnv()
	if err != nil {
		log.Warn("not notifying systemd", "err", err)
	}
	o.notifier = n
	if o.dev {
		if err := setUpDev(&o, stdout, log); err != nil {
			log.Error("setting up dev mode", "err", err)
			return 1
		}
	}
	for _, req := range []struct{ name, val string }{{"--listen", o.listen}, {"--state-dir", o.stateDir}, {"--run-dir", o.runDir}} {
		if req.val == "" {
			fmt.Fprintf(stderr, "vmhost serve: %s is required (or use --dev)\n", req.name)
			return 2
		}
	}
	if err := runServer(o, log); err != nil {
		log.Error("serve", "err", err)
		return 1
	}
	return 0
}

// setUpDev fills in the dev defaults, writes the default config if absent
// and, on first start (no keys.json yet), creates a readwrite key and
// prints it.
func setUpDev(o *serveOptions, stdout io.Writer, log *slog.Logger) error {
	if o.listen == "" {
		o.listen = devListen
	}
	if o.stateDir == "" {
		o.stateDir = devStateDir
	}
	if o.runDir == "" {
		o.runDir = devRunDir
		// Socket paths are limited to 107 bytes: under a deep working
		// directory, the run dir moves to a short per-user temp path.
		if abs, err := filepath.Abs(devRunDir); err == nil && (vm.Layout{RunDir: abs}).CheckRunDir() != nil {
			o.runDir = devFallbackRunDir(o.stateDir)
			log.Info("working directory too deep for VM sockets; dev run dir moved", "run_dir", o.runDir)
		}
	}
	if o.simulate == "" {
		o.simulate = "ch,qsd"
	}
	if o.configPath == "" {
		o.configPath = devConfigFile
		if err := writeIfAbsent(devConfigFile, config.DevDefault()); err != nil {
			return err
		}
	}
	if err := os.MkdirAll(o.stateDir, 0o700); err != nil {
		return err
	}
	path := keysFile(o.stateDir)
	if _, err := os.Lstat(path); err == nil || !errors.Is(err, fs.ErrNotExist) {
		return err // nil: keys exist, not a first start
	}
	token, err := auth.Add(path, devKeyName, auth.ScopeReadWrite, nil)
	if err != nil {
		return err
	}
	log.Info("created dev API key", "name", devKeyName, "scope", auth.ScopeReadWrite, "keys", path)
	fmt.Fprintf(stdout, "vmhost dev mode: API key %q (readwrite), shown only this once:\n%s\n", devKeyName, token)
	return nil
}

// devFallbackRunDir is the short run directory --dev uses when the working
// directory is too deep for socket paths: per user and per state directory
// (a hash of its absolute path), so two dev agents never share one.
func devFallbackRunDir(stateDir string) string {
	abs, err := filepath.Abs(stateDir)
	if err != nil {
		abs = stateDir
	}
	sum := sha256.Sum256([]byte(abs))
	return filepath.Join(os.TempDir(), fmt.Sprintf("vmhost-dev-%d-%s", os.Getuid(), hex.EncodeToString(sum[:4])))
}

// writeIfAbsent writes cfg to path, creating its directory, unless the file
// exists.
func writeIfAbsent(path string, cfg *config.Config) error {
	data, err := cfg.Marshal()
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return err
	}
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if errors.Is(err, fs.ErrExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("writing dev config: %w", err)
	}
	if _, err := f.Write(data); err != nil {
		f.Close()
		return fmt.Errorf("writing dev config: %w", err)
	}
	return f.Close()
}

// runServer serves until SIGTERM or SIGINT, then shuts down gracefully.
// SIGHUP rereads keys.json.
func runServer(o serveOptions, log *slog.Logger) error {
	for _, dir := range []string{o.stateDir, o.runDir} {
		if err := os.MkdirAll(dir, 0o700); err != nil {
			return fmt.Errorf("creating %s: %w", dir, err)
		}
	}
	stateDir, err := filepath.Abs(o.stateDir)
	if err != nil {
		return err
	}
	runDir, err := filepath.Abs(o.runDir)
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
	if o.dev {
		cfg = config.DevDefault()
	}
	if o.configPath != "" {
		if cfg, err = config.LoadOver(o.configPath, cfg); err != nil {
			return err
		}
	} else {
		log.Info("no --config given; using the built-in defaults")
	}
	tf := tlsFiles{Cert: cfg.TLS.Cert, Key: cfg.TLS.Key, ClientCA: cfg.TLS.ClientCA}
	for _, f := range []struct{ flag, cfg *string }{{&o.tls.Cert, &tf.Cert}, {&o.tls.Key, &tf.Key}, {&o.tls.ClientCA, &tf.ClientCA}} {
		if *f.flag != "" {
			*f.cfg = *f.flag
		}
	}
	var tlsr *tlsReloader
	if tf.enabled() {
		// TLS guards a TCP listener; a unix socket is guarded by its mode
		// (0600) and stays plain HTTP, which is what `vmhost --api unix:`
		// speaks.
		if strings.HasPrefix(o.listen, "unix:") {
			return fmt.Errorf("TLS is configured but --listen is the unix socket %s: TLS applies to a TCP address (listen on host:port, or drop the tls settings)", o.listen)
		}
		if tlsr, err = newTLSReloader(tf); err != nil {
			return err
		}
		logCertExpiry(log, tlsr)
	}
	keys, err := auth.Open(keysFile(stateDir))
	if err != nil {
		return err
	}
	if keys.Len() == 0 {
		log.Warn("no API keys: every request will be refused; add one with vmhost key add", "keys", keysFile(stateDir))
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

	env := serveEnv{StateDir: stateDir, RunDir: runDir, Config: cfg, Store: st, Keys: keys, Log: log}
	for _, p := range strings.Split(o.simulate, ",") {
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
	if o.dev {
		if nw, ok := cfg.Network(cfg.DefaultNetwork); ok {
			env.DevBridge = nw.Bridge
		}
	}
	ln, err := listen(o.listen)
	if err != nil {
		return err
	}
	ln = limitListener(ln, maxConnections)
	scheme := "http"
	if tlsr != nil {
		ln = tls.NewListener(ln, tlsr.Config())
		scheme = "https"
	}
	// The API listens before recovery: /healthz answers 503 until the
	// records are loaded and every VM is reconciled, and other requests
	// wait for that rather than fail.
	gate := newStartGate()
	srv := &http.Server{
		Handler:           gate,
		ReadHeaderTimeout: readHeaderTimeout,
		IdleTimeout:       idleTimeout,
		ErrorLog:          slog.NewLogLogger(log.Handler(), slog.LevelWarn),
	}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()
	addr := ln.Addr().String()
	if ln.Addr().Network() == "unix" {
		addr = "unix:" + addr // the --listen spelling
	}
	log.Info("serving", "listen", addr, "scheme", scheme, "mutual_tls", tf.ClientCA != "", "pid", os.Getpid(), "state_dir", stateDir, "run_dir", runDir, "keys", keys.Len())

	svc, err := newService(env)
	if err != nil {
		srv.Close()
		return err
	}
	defer func() {
		if err := svc.Close(); err != nil {
			log.Error("releasing VMs", "err", err)
		}
	}()
	srv.RegisterOnShutdown(svc.CloseStreams)
	gate.open(svc.Handler)
	// Recovery is over (newService returned) and the listener is up.
	notify(log, o.notifier, sdnotify.Ready)

	for {
		select {
		case err := <-served:
			return fmt.Errorf("serving: %w", err)
		case sig := <-sigs:
			if sig == syscall.SIGHUP {
				notify(log, o.notifier, sdnotify.Reloading)
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
				notify(log, o.notifier, sdnotify.Ready)
				continue
			}
			notify(log, o.notifier, sdnotify.Stopping)
			log.Info("shutting down", "signal", sig.String())
			ctx, cancel := context.WithTimeout(context.Background(), shutdownTimeout)
			err := srv.Shutdown(ctx)
			cancel()
			if err != nil {
				srv.Close()
				return fmt.Errorf("shutting down: %w", err)
			}
			log.Info("stopped")
			return nil
		}
	}
}

// listen opens the listening socket. "unix:/path" listens on a unix socket
// (mode 0600): a stale socket file is removed, but if something answers on
// it, listen refuses rather than steal the path from a running server.
func listen(addr string) (net.Listener, error) {
	path, ok := strings.CutPrefix(addr, "unix:")
	if !ok {
		ln, err := net.Listen("tcp", addr)
		if err != nil {
			return nil, fmt.Errorf("listening on %s: %w", addr, err)
		}
		return ln, nil
	}
	if c, err := net.DialTimeout("unix", path, time.Second); err == nil {
		c.Close()
		return nil, fmt.Errorf("listening on %s: another server is answering there", path)
	}
	if fi, err := os.Lstat(path); err == nil {
		if fi.Mode().Type() != fs.ModeSocket {
			return nil, fmt.Errorf("listening on %s: the path exists and is not a socket", path)
		}
		if err := os.Remove(path); err != nil {
			return nil, fmt.Errorf("removing stale socket %s: %w", path, err)
		}
	}
	ln, err := net.Listen("unix", path)
	if err != nil {
		return nil, fmt.Errorf("listening on %s: %w", path, err)
	}
	if err := os.Chmod(path, 0o600); err != nil {
		ln.Close()
		return nil, fmt.Errorf("listening on %s: %w", path, err)
	}
	return ln, nil
}

// limitListener returns ln accepting at most n connections that are open
// at once: Accept waits for one to close first.
func limitListener(ln net.Listener, n int) net.Listener {
	return &limitedListener{Listener: ln, slots: make(chan struct{}, n), closed: make(chan struct{})}
}

type limitedListener struct {
	net.Listener
	slots     chan struct{} // one token per open connection
	closed    chan struct{}
	closeOnce sync.Once
}

func (l *limitedListener) Accept() (net.Conn, error) {
	select {
	case l.slots <- struct{}{}:
	case <-l.closed:
		return nil, net.ErrClosed
	}
	c, err := l.Listener.Accept()
	if err != nil {
		<-l.slots
		return nil, err
	}
	return &limitedConn{Conn: c, release: sync.OnceFunc(func() { <-l.slots })}, nil
}

// Close also ends an Accept waiting for a free slot.
func (l *limitedListener) Close() error {
	l.closeOnce.Do(func() { close(l.closed) })
	return l.Listener.Close()
}

// limitedConn gives its slot back when closed (once, however often Close
// is called).
type limitedConn struct {
	net.Conn
	release func()
}

func (c *limitedConn) Close() error {
	err := c.Conn.Close()
	c.release()
	return err
}

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
