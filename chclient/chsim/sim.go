package chsim

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Config is what Main parses from the command line. Run takes it directly, which is the
// seam for callers that embed the simulator with options no flag expresses.
type Config struct {
	APISocket     string // --api-socket path=… (or a bare path)
	APISocketFD   int    // --api-socket fd=N; -1 when unset
	EventMonitor  string // --event-monitor path=…
	EventFD       int    // --event-monitor fd=N; -1 when unset
	LogFile       string // --log-file; empty means stderr
	Verbosity     int    // number of -v
	NoShutdown    bool   // --no-shutdown: guest poweroff keeps the process (v52+)
	ActivateDelay time.Duration
	NoActivate    bool // the simulated guest never activates its devices on its own
	// PoweroffAtBoot (--sim-poweroff-at-boot): the simulated guest powers
	// off right after vm.boot answers, like a guest whose init exits at once.
	PoweroffAtBoot bool
	GuestPorts     []uint32 // vsock ports the simulated guest listens on from boot

	// GuestVsock, when set, serves a vsock connection that reached guest port port (host
	// initiated after OK, or guest initiated through /sim/v1/vsock/connect). The default
	// echoes bytes back. It is the hook for running a real guest agent behind the
	// simulator's hybrid vsock.
	GuestVsock func(port uint32, conn net.Conn)

	// NoGuestAgent (--sim-no-guest-agent) turns off running the AppVM guest agent.
	// Otherwise, at boot of a VM with a vsock device and an initramfs, the simulator
	// starts `<GuestAgentBinary> guest --transport unix:<vsock socket>_1024 --root
	// <GuestRoot> --heartbeat <GuestHeartbeat>` as a host process (see guest.go).
	NoGuestAgent bool
	// NoGuestNetwork (--sim-no-guest-network) keeps the guest agent in the simulator's
	// network namespace without --network. Otherwise, as root, it runs in a namespace of
	// its own whose eth0 (the VM's MAC) is wired to the VM's first tap.
	NoGuestNetwork bool
	// GuestChroot (--sim-guest-chroot) runs the workload chrooted into GuestRoot, which
	// the host has filled with the VM's root file system (serve --dev does): the image's
	// own tree, so its entrypoint and libraries are found. As root the agent gets
	// --chroot; otherwise it runs in a user namespace of its own that maps root to the
	// simulator's user (and nothing else), where it may chroot (see guest.go).
	GuestChroot bool
	// GuestAgentBinary is the vmhost binary to run; default os.Executable().
	GuestAgentBinary string
	// GuestHeartbeat (--sim-guest-heartbeat) is the agent's heartbeat interval;
	// default DefaultGuestHeartbeat.
	GuestHeartbeat time.Duration

	// Backend (--sim-backend) is BackendSim (the default: a simulated guest) or
	// BackendQemu: vm.boot runs the guest in qemu-system-x86_64 (see doc.go).
	Backend string
	// Qemu (--sim-qemu) is the qemu binary; default qemu-system-x86_64 from PATH.
	Qemu string
	// Accel (--sim-accel) is auto (default), kvm or tcg.
	Accel string
	// VsockBackend (--sim-vsock-backend) is the vhost-device-vsock binary; default from
	// PATH, else DefaultVsockBackend.
	VsockBackend string
}

// keeperArgv is the program and arguments that run this simulator (Main's, without its
// own flags); empty when Run was called directly, which keeps no guest agent.
var keeperArgv []string

// DefaultActivateDelay is how long after boot the simulated guest's drivers activate its
// devices, unless --sim-activate-delay says otherwise.
const DefaultActivateDelay = 200 * time.Millisecond

const usage = `usage: sim-ch --api-socket path=<p>|fd=<n> [--event-monitor path=<p>|fd=<n>] [--log-file <p>] [-v]...
       [--no-shutdown] [--sim-activate-delay <duration>] [--sim-no-activate] [--sim-guest-ports <p,p,…>]
       [--sim-no-guest-agent] [--sim-no-guest-network] [--sim-guest-chroot] [--sim-guest-heartbeat <duration>]
       [--sim-poweroff-at-boot]
       [--sim-backend sim|qemu] [--sim-qemu <path>] [--sim-accel auto|kvm|tcg] [--sim-vsock-backend <path>]
`

// Main runs the simulator with Cloud Hypervisor's own flags (args excludes the program
// name) and returns the process exit code: 0 after vmm.shutdown, SIGTERM/SIGINT or a guest
// poweroff; 1 when it cannot start.
func Main(args []string) int {
	// The command line that runs this simulator, for the keeper of a suspended guest.
	keeperArgv = os.Args[:len(os.Args)-len(args)]
	if len(args) > 0 && args[0] == keeperFlag {
		return runKeeper(args[1:])
	}
	cfg, err := parseArgs(args)
	if err != nil {
		fmt.Fprintf(os.Stderr, "Error: %v\n%s", err, usage)
		return 1
	}
	return Run(cfg)
}

func parseArgs(args []string) (Config, error) {
	cfg := Config{APISocketFD: -1, EventFD: -1, ActivateDelay: DefaultActivateDelay, Backend: BackendSim}
	if len(args) == 0 {
		return cfg, errors.New("no arguments")
	}
	var simOnly, qemuOnly []string // flags that apply to one backend only
	for i := 0; i < len(args); i++ {
		a := args[i]
		name, value, hasValue := strings.Cut(a, "=")
		if !strings.HasPrefix(a, "--") {
			hasValue = false
			name = a
		}
		next := func() (string, error) {
			if hasValue {
				return value, nil
			}
			if i+1 >= len(args) {
				return "", fmt.Errorf("%s needs a value", name)
			}
			i++
			return args[i], nil
		}
		switch {
		case name == "--api-socket":
			v, err := next()
			if err != nil {
				return cfg, err
			}
			p, fd, err := pathOrFD(v, true)
			if err != nil {
				return cfg, fmt.Errorf("parsing --api-socket: %w", err)
			}
			cfg.APISocket, cfg.APISocketFD = p, fd
		case name == "--event-monitor":
			v, err := next()
			if err != nil {
				return cfg, err
			}
			p, fd, err := pathOrFD(v, false)
			if err != nil {
				return cfg, fmt.Errorf("parsing --event-monitor: %w", err)
			}
			cfg.EventMonitor, cfg.EventFD = p, fd
		case name == "--log-file":
			v, err := next()
			if err != nil {
				return cfg, err
			}
			cfg.LogFile = v
		case name == "--no-shutdown":
			cfg.NoShutdown = true
		case name == "--sim-no-guest-agent":
			simOnly = append(simOnly, name)
			cfg.NoGuestAgent = true
		case name == "--sim-no-guest-network":
			simOnly = append(simOnly, name)
			cfg.NoGuestNetwork = true
		case name == "--sim-guest-chroot":
			simOnly = append(simOnly, name)
			cfg.GuestChroot = true
		case name == "--sim-guest-heartbeat":
			simOnly = append(simOnly, name)
			v, err := next()
			if err != nil {
				return cfg, err
			}
			d, err := time.ParseDuration(v)
			if err != nil || d <= 0 {
				return cfg, fmt.Errorf("parsing --sim-guest-heartbeat %q: want a positive duration like 1s", v)
			}
			cfg.GuestHeartbeat = d
		case name == "--sim-no-activate":
			simOnly = append(simOnly, name)
			cfg.NoActivate = true
		case name == "--sim-poweroff-at-boot":
			simOnly = append(simOnly, name)
			cfg.PoweroffAtBoot = true
		case name == "--sim-activate-delay":
			simOnly = append(simOnly, name)
			v, err := next()
			if err != nil {
				return cfg, err
			}
			d, err := time.ParseDuration(v)
			if err != nil || d < 0 {
				return cfg, fmt.Errorf("parsing --sim-activate-delay %q: want a duration like 200ms", v)
			}
			cfg.ActivateDelay = d
		case name == "--sim-guest-ports":
			simOnly = append(simOnly, name)
			v, err := next()
			if err != nil {
				return cfg, err
			}
			for _, f := range strings.Split(v, ",") {
				p, err := strconv.ParseUint(strings.TrimSpace(f), 10, 32)
				if err != nil {
					return cfg, fmt.Errorf("parsing --sim-guest-ports %q: %w", v, err)
				}
				cfg.GuestPorts = append(cfg.GuestPorts, uint32(p))
			}
		case name == "--sim-backend":
			v, err := next()
			if err != nil {
				return cfg, err
			}
			if v != BackendSim && v != BackendQemu {
				return cfg, fmt.Errorf("--sim-backend %q: want sim or qemu", v)
			}
			cfg.Backend = v
		case name == "--sim-qemu", name == "--sim-accel", name == "--sim-vsock-backend":
			v, err := next()
			if err != nil {
				return cfg, err
			}
			qemuOnly = append(qemuOnly, name)
			switch name {
			case "--sim-qemu":
				cfg.Qemu = v
			case "--sim-accel":
				if v != "auto" && v != "kvm" && v != "tcg" {
					return cfg, fmt.Errorf("--sim-accel %q: want auto, kvm or tcg", v)
				}
				cfg.Accel = v
			case "--sim-vsock-backend":
				cfg.VsockBackend = v
			}
		case len(a) >= 2 && a[0] == '-' && a[1] == 'v' && strings.Trim(a[1:], "v") == "":
			cfg.Verbosity += len(a) - 1
		default:
			return cfg, fmt.Errorf("unknown argument %q", a)
		}
	}
	if cfg.APISocket == "" && cfg.APISocketFD < 0 {
		return cfg, errors.New("--api-socket is required")
	}
	if cfg.Backend == BackendQemu && len(simOnly) > 0 {
		return cfg, fmt.Errorf("%s drives the simulated guest; the qemu backend runs a real one", strings.Join(simOnly, ", "))
	}
	if cfg.Backend != BackendQemu && len(qemuOnly) > 0 {
		return cfg, fmt.Errorf("%s needs --sim-backend qemu", strings.Join(qemuOnly, ", "))
	}
	return cfg, nil
}

// pathOrFD parses "path=…,fd=…"; fd wins when both are given. A bare value is a path only
// where CH allows it (--api-socket).
func pathOrFD(v string, bareOK bool) (string, int, error) {
	if !strings.Contains(v, "=") {
		if !bareOK || v == "" {
			return "", -1, fmt.Errorf("%q: expected path=<p> or fd=<n>", v)
		}
		return v, -1, nil
	}
	var path string
	fd := -1
	for _, kv := range strings.Split(v, ",") {
		k, val, _ := strings.Cut(kv, "=")
		switch k {
		case "path":
			path = val
		case "fd":
			n, err := strconv.Atoi(val)
			if err != nil || n < 0 {
				return "", -1, fmt.Errorf("invalid fd %q", val)
			}
			fd = n
		default:
			return "", -1, fmt.Errorf("unknown key %q", k)
		}
	}
	if fd >= 0 {
		return "", fd, nil
	}
	if path == "" {
		return "", -1, errors.New("path or fd required")
	}
	return path, -1, nil
}

type vmState int

const (
	stateNone vmState = iota
	stateCreated
	stateRunning
	statePaused
)

func (s vmState) String() string {
	return [...]string{"None", "Created", "Running", "Paused"}[s]
}

// sim is one simulated VMM process.
type sim struct {
	cfg    Config
	start  time.Time
	logOut io.Writer
	logMu  sync.Mutex
	evMu   sync.Mutex
	evFD   int

	hung     atomic.Bool
	exitOnce sync.Once
	exitCode chan int

	mu        sync.Mutex
	state     vmState
	vm        *vmConfig
	nextID    int               // CH's one counter for generated device ids
	bdfs      map[string]string // device id → PCI address, for the running VM
	order     []string          // virtio device ids in creation order
	activated bool              // the guest's OS is up: its drivers have taken devices
	taken     map[string]bool   // the devices the guest's drivers have (the transport is active)
	bootGen   int               // bumps on every boot/reboot/stop so stale timers do nothing
	serial    *serialPort
	vsock     *vsockMux
	agent     *guestAgent // the AppVM guest agent of this boot, nil when none
	// saved are the state.json files of the states the paused guest was saved as since
	// it last ran (keep_linux.go): its agent is kept for them if the VM stops.
	saved []*os.File
	// agentOnResume: restored without the agent's process; the next resume starts it.
	agentOnResume bool
	guestPorts    map[uint32]bool
	taps          []*os.File
	vhost         map[string]net.Conn // disk id → vhost-user connection
	counters      map[string]map[string]uint64
	// refuseEject (/sim/v1/eject): the simulated guest ignores eject requests, so
	// vm.remove-device on a booted VM removes nothing.
	refuseEject bool
	// hogged is memory /sim/v1/hog allocated, kept so it stays charged.
	hogged [][]byte
	// ignorePowerButton (/sim/v1/power-button): the simulated classic guest's OS ignores
	// the ACPI power button, as one without acpid or systemd-logind would.
	ignorePowerButton bool

	// The qemu backend (Config.Backend == BackendQemu).
	accel   string   // "kvm" or "tcg", resolved at start
	qemuLog *os.File // qemu's and vhost-device-vsock's output
	qemu    *qemuVM  // the running VM's qemu, nil when none
}

// Run starts the simulator and blocks until it exits, returning the exit code.
func Run(cfg Config) int {
	s := &sim{cfg: cfg, start: time.Now(), logOut: os.Stderr, evFD: -1, exitCode: make(chan int, 1),
		guestPorts: map[uint32]bool{}}
	for _, p := range cfg.GuestPorts {
		s.guestPorts[p] = true
	}
	// Catch SIGTERM/SIGINT before the API socket exists: a supervisor may signal as soon
	// as the socket answers.
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT)
	// CH sets its umask so the sockets it creates are private.
	syscall.Umask(0o077)
	if cfg.LogFile != "" {
		f, err := os.OpenFile(cfg.LogFile, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
		if err != nil {
			fmt.Fprintf(os.Stderr, "Error: opening log file %s: %v\n", cfg.LogFile, err)
			return 1
		}
		defer f.Close()
		s.logOut = f
	}
	if err := s.openEvents(); err != nil {
		s.logf(0, "Error: %v", err)
		return 1
	}
	if s.qemuMode() {
		accel, why, err := resolveAccel(cfg.Accel)
		if err == nil {
			err = s.openQemuLog()
		}
		if err != nil {
			s.logf(0, "Error: %v", err)
			return 1
		}
		if s.qemuLog != os.Stderr {
			defer s.qemuLog.Close()
		}
		s.accel = accel
		s.logf(1, "qemu backend: accelerator %s (%s)", accel, why)
	}
	l, unlock, err := s.listen()
	if err != nil {
		s.logf(0, "Error: %v", err)
		return 1
	}
	defer unlock()
	s.emit("vmm", "starting", nil)
	s.logf(1, "API server listening, pid %d", os.Getpid())

	go func() {
		sig := <-sigs
		s.logf(1, "received signal %v, shutting down", sig)
		s.terminate(0)
	}()
	go s.serve(l)

	code := <-s.exitCode
	l.Close()
	if cfg.APISocket != "" {
		os.Remove(cfg.APISocket)
	}
	s.evMu.Lock()
	if s.evFD >= 0 {
		unix.Close(s.evFD)
		s.evFD = -1
	}
	s.evMu.Unlock()
	return code
}

// listen binds the API socket the way v53 does: take a write lock on <path>.lock (a second
// instance fails), remove a stale socket, bind and listen. With fd=N the inherited socket is
// already listening.
func (s *sim) listen() (net.Listener, func(), error) {
	if s.cfg.APISocketFD >= 0 {
		f := os.NewFile(uintptr(s.cfg.APISocketFD), "api-socket")
		l, err := net.FileListener(f)
		f.Close()
		if err != nil {
			return nil, nil, fmt.Errorf("using API socket fd %d: %w", s.cfg.APISocketFD, err)
		}
		return l, func() {}, nil
	}
	path := s.cfg.APISocket
	lock, err := os.OpenFile(path+".lock", os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, nil, fmt.Errorf("opening API socket lock %s.lock: %w", path, err)
	}
	if err := unix.Flock(int(lock.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		lock.Close()
		return nil, nil, fmt.Errorf("API socket %s is already in use by another running instance", path)
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		lock.Close()
		return nil, nil, fmt.Errorf("removing stale API socket %s: %w", path, err)
	}
	l, err := net.Listen("unix", path)
	if err != nil {
		lock.Close()
		return nil, nil, fmt.Errorf("binding API socket %s: %w", path, err)
	}
	// The .lock file is never deleted, as in v53.
	return l, func() { lock.Close() }, nil
}

func (s *sim) openEvents() error {
	switch {
	case s.cfg.EventFD >= 0:
		s.evFD = s.cfg.EventFD
	case s.cfg.EventMonitor != "":
		fd, err := unix.Open(s.cfg.EventMonitor, unix.O_WRONLY|unix.O_CREAT|unix.O_TRUNC|unix.O_CLOEXEC, 0o600)
		if err != nil {
			return fmt.Errorf("opening event monitor %s: %w", s.cfg.EventMonitor, err)
		}
		s.evFD = fd
	default:
		return nil
	}
	// CH writes events without blocking and drops what does not fit.
	return unix.SetNonblock(s.evFD, true)
}

type eventTimestamp struct {
	Secs  uint64 `json:"secs"`
	Nanos uint32 `json:"nanos"`
}

type eventRecord struct {
	Timestamp  eventTimestamp    `json:"timestamp"`
	Source     string            `json:"source"`
	Event      string            `json:"event"`
	Properties map[string]string `json:"properties"`
}

// emit writes one event to the monitor, pretty-printed and followed by a blank line, and
// logs it at info level.
func (s *sim) emit(source, event string, props map[string]string) {
	d := time.Since(s.start)
	rec := eventRecord{Timestamp: eventTimestamp{Secs: uint64(d / time.Second), Nanos: uint32(d % time.Second)},
		Source: source, Event: event, Properties: props}
	data, _ := json.MarshalIndent(rec, "", "  ")
	data = append(data, '\n', '\n')
	s.evMu.Lock()
	if s.evFD >= 0 {
		unix.Write(s.evFD, data) // errors are dropped, as CH does
	}
	s.evMu.Unlock()
	s.logf(1, "Event: source = %s event = %s", source, event)
}

// logf writes a log line at level (0 warn/error, 1 info, 2 debug) if -v allows it.
func (s *sim) logf(level int, format string, args ...any) {
	if level > s.cfg.Verbosity {
		return
	}
	names := [...]string{"WARN", "INFO", "DEBUG"}
	lv := names[min(level, 2)]
	s.logMu.Lock()
	defer s.logMu.Unlock()
	fmt.Fprintf(s.logOut, "cloud-hypervisor: %.6fs: <chsim> %s:chsim -- %s\n",
		time.Since(s.start).Seconds(), lv, fmt.Sprintf(format, args...))
}

// terminate runs the VMM exit path once: stop and drop the VM (events vm shutdown, vm
// deleted), then vmm shutdown, then Run returns code.
func (s *sim) terminate(code int) {
	s.exitOnce.Do(func() {
		s.mu.Lock()
		if s.state == stateRunning || s.state == statePaused {
			s.stopLocked()
		}
		if s.state != stateNone {
			s.dropConfigLocked()
		}
		s.emit("vmm", "shutdown", nil)
		s.mu.Unlock()
		s.exitCode <- code
	})
}
