package server

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"

	"vmhost/auth"
	"vmhost/config"
	"vmhost/tap"
)

// Paths of `serve --dev`, relative to the working directory.
const (
	DevDir        = "vmhost-dev"
	DevStateDir   = DevDir + "/state"
	DevRunDir     = DevDir + "/run"
	DevConfigFile = DevDir + "/config.json"
	DevListen     = "127.0.0.1:8080"
	// DevKeyName is the key --dev makes on its first start.
	DevKeyName = "dev"
)

// devRun is what --dev does beyond the defaults: the first key, the
// bridge, the lines for a shell. A nil *devRun (not --dev) does nothing.
type devRun struct {
	// firstStart: the state directory had no keys.json, so a key is made
	// once the start succeeded.
	firstStart bool
	// token is the key made, printed with the shell lines.
	token string
}

// setUpDev fills in the dev defaults of what o leaves empty and writes the
// default config if absent.
func setUpDev(o *Options, log *slog.Logger) (*devRun, error) {
	if o.Listen == "" {
		o.Listen = DevListen
	}
	if o.StateDir == "" {
		o.StateDir = DevStateDir
	}
	if o.RunDir == "" {
		o.RunDir = DevRunDir
		// Socket paths are limited to 107 bytes: under a deep working
		// directory, the run dir moves to a short per-user temp path.
		if abs, err := filepath.Abs(DevRunDir); err == nil && o.CheckRunDir != nil && o.CheckRunDir(abs) != nil {
			o.RunDir = DevFallbackRunDir(o.StateDir)
			log.Info("working directory too deep for VM sockets; dev run dir moved", "run_dir", o.RunDir)
		}
	}
	if o.Simulate == "" {
		o.Simulate = "ch,qsd"
	}
	if o.ConfigPath == "" {
		o.ConfigPath = DevConfigFile
		if err := writeIfAbsent(DevConfigFile, config.DevDefault()); err != nil {
			return nil, err
		}
	}
	if err := os.MkdirAll(o.StateDir, 0o700); err != nil {
		return nil, err
	}
	_, err := os.Lstat(KeysFile(o.StateDir))
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return nil, err
	}
	return &devRun{firstStart: err != nil}, nil
}

// DevFallbackRunDir is the short run directory --dev uses when the working
// directory is too deep for socket paths: per user and per state directory
// (a hash of its absolute path), so two dev agents never share one.
func DevFallbackRunDir(stateDir string) string {
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

// makesKey reports whether a key will be made once the start succeeds.
func (d *devRun) makesKey() bool { return d != nil && d.firstStart }

// makeBridge makes the default network's bridge when running as root,
// marked with the agent id (tap.BridgeAlias), and returns its name; ""
// without root (no taps then) or without a default network.
func (d *devRun) makeBridge(cfg *config.Config, agent string, log *slog.Logger) (string, error) {
	if d == nil || os.Geteuid() != 0 {
		return "", nil
	}
	nw, ok := cfg.Network(cfg.DefaultNetwork)
	if !ok || nw.Bridge == "" {
		return "", nil
	}
	if err := tap.New(&tap.Config{AgentID: agent}).CreateBridge(context.Background(), nw.Bridge); err != nil {
		return "", fmt.Errorf("creating the dev bridge: %w", err)
	}
	log.Info("dev bridge ready", "bridge", nw.Bridge)
	return nw.Bridge, nil
}

// removeBridge removes, at a clean exit, the dev bridge when this agent
// made it and no VM uses it (no interface is its port): VMs outlive the
// agent, and their taps keep it.
func (d *devRun) removeBridge(name, agent string, log *slog.Logger) {
	if d == nil || name == "" {
		return
	}
	removed, err := tap.New(&tap.Config{AgentID: agent}).RemoveBridge(context.Background(), name)
	switch {
	case err != nil:
		log.Error("removing the dev bridge", "bridge", name, "err", err)
	case removed:
		log.Info("removed the dev bridge", "bridge", name)
	default:
		log.Info("kept the dev bridge: a VM still uses it, or another agent made it", "bridge", name)
	}
}

// makeKey makes the readwrite dev key on a first start, once the start
// succeeded, and puts it in use.
func (d *devRun) makeKey(path string, keys *auth.Keyring, log *slog.Logger) error {
	if !d.makesKey() {
		return nil
	}
	if _, err := os.Lstat(path); err == nil {
		return nil // a key was added while the agent started: not a first start after all
	}
	token, err := auth.Add(path, DevKeyName, auth.ScopeReadWrite, nil)
	if err != nil {
		return err
	}
	if err := keys.Reload(); err != nil {
		return err
	}
	log.Info("created dev API key", "name", DevKeyName, "scope", auth.ScopeReadWrite, "keys", path)
	d.token = token
	return nil
}

// printShellLines prints what a shell needs to use the agent: VMHOST_API
// and, on the first start, VMHOST_TOKEN with the key just made (shown
// only this once: keys.json keeps its hash).
func (d *devRun) printShellLines(w io.Writer, scheme, addr string) {
	if d == nil || w == nil {
		return
	}
	api := apiURL(scheme, addr)
	if d.token != "" {
		fmt.Fprintf(w, "# vmhost dev mode: serving, with the new API key %q (readwrite), shown only this once. For a shell:\n", DevKeyName)
		fmt.Fprintf(w, "export VMHOST_API=%s\nexport VMHOST_TOKEN=%s\n", shellQuote(api), d.token)
		return
	}
	fmt.Fprintf(w, "# vmhost dev mode: serving. For a shell:\nexport VMHOST_API=%s\n", shellQuote(api))
	fmt.Fprintf(w, "# VMHOST_TOKEN: the key printed at the first start (or a new one: vmhost key add --dev --name NAME --scope readwrite)\n")
}

// apiURL is what a client sets VMHOST_API to for a listener at addr
// (listenAddr's spelling): the unix socket's absolute path, or the URL,
// with loopback for an address that listens on every interface.
func apiURL(scheme, addr string) string {
	if path, ok := strings.CutPrefix(addr, "unix:"); ok {
		if abs, err := filepath.Abs(path); err == nil {
			path = abs
		}
		return "unix:" + path
	}
	if ap, err := netip.ParseAddrPort(addr); err == nil && ap.Addr().IsUnspecified() {
		lo := netip.IPv6Loopback()
		if ap.Addr().Is4() {
			lo = netip.AddrFrom4([4]byte{127, 0, 0, 1})
		}
		addr = netip.AddrPortFrom(lo, ap.Port()).String()
	} else if host, port, err := net.SplitHostPort(addr); err == nil && host == "" {
		addr = net.JoinHostPort("127.0.0.1", port)
	}
	return scheme + "://" + addr
}

// shellQuote quotes s for a POSIX shell when it holds anything but
// characters that never need it.
func shellQuote(s string) string {
	safe := s != ""
	for _, r := range s {
		if !('a' <= r && r <= 'z' || 'A' <= r && r <= 'Z' || '0' <= r && r <= '9' || strings.ContainsRune("@%+=:,./_-", r)) {
			safe = false
			break
		}
	}
	if safe {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}
