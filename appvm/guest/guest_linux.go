package guest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"path"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"vmhost/appvm/guest/proto"
)

// Exit statuses of the agent process in process mode.
const (
	// ExitPoweroff is the status of a guest that powered off.
	ExitPoweroff = 0
	// ExitError is the status of an agent that could not do its job
	// (no host, protocol error).
	ExitError = 1
	// ExitHalted is the status of a process-mode agent ended by
	// HaltSignal (the simulated VM vanished).
	ExitHalted = 3
)

// AgentVersion is reported in Hello.
const AgentVersion = "vmhost-guest/1"

// sendTimeout bounds one message write to the host.
const sendTimeout = 30 * time.Second

// defaultPath is the workload's PATH when its environment has none.
const defaultPath = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

// forwarded are the signals passed on to the workload.
var forwarded = []os.Signal{syscall.SIGTERM, syscall.SIGINT, syscall.SIGHUP, syscall.SIGUSR1, syscall.SIGUSR2}

// options are the command-line settings.
type options struct {
	transport string
	root      string
	chroot    bool
	mounts    bool
	network   bool
	heartbeat time.Duration
	vm        bool
	dialWait  time.Duration
	// listen is where operation connections come from: "vsock" (VM
	// mode's default), "unix:<prefix>" (the unix socket <prefix>_<port>
	// for each vsock port, process mode under chsim), or "" for none.
	listen string

	rootDevice, rootFSType string
	deviceWait             time.Duration
	sysfs                  string
	// vmmFD is the read end of a pipe whose write end the VMM running
	// this process-mode guest holds (-1: none): its end halts the guest.
	vmmFD int
}

// Main runs the agent with args (without the program name and subcommand)
// and returns the process exit status. As PID 1 it never returns: it powers
// the VM off. Flag errors are ignored as PID 1, since the kernel passes
// unknown boot parameters to init as arguments.
func Main(args []string) int {
	log := slog.New(slog.NewTextHandler(os.Stderr, nil)).With("component", "guest")
	pid1 := os.Getpid() == 1
	var o options
	fl := flag.NewFlagSet("guest", flag.ContinueOnError)
	fl.StringVar(&o.transport, "transport", "vsock", "vsock, or unix:<path> to dial a unix socket (process mode)")
	fl.StringVar(&o.root, "root", "", "workload root (VM mode: /mnt/root)")
	fl.BoolVar(&o.chroot, "chroot", false, "process mode: chroot the workload into --root (needs root)")
	fl.BoolVar(&o.mounts, "mounts", false, "process mode: perform tmpfs and data mounts (needs root; use a private mount namespace)")
	fl.BoolVar(&o.network, "network", false, "process mode: configure the Spec's network in this network namespace (needs root)")
	fl.DurationVar(&o.heartbeat, "heartbeat", 5*time.Second, "heartbeat interval unless the Spec sets one")
	fl.DurationVar(&o.dialWait, "dial-timeout", 30*time.Second, "how long to keep dialing the host")
	fl.StringVar(&o.listen, "listen", "", "where the host's operation connections come from: vsock (VM mode's default), unix:<prefix> (the socket <prefix>_<port>), or empty for none")
	fl.StringVar(&o.rootDevice, "root-device", "", "VM mode: root disk device, over vmhost.root= (tests)")
	fl.StringVar(&o.rootFSType, "root-fstype", "", "VM mode: root disk filesystem, over vmhost.rootfstype= (tests)")
	fl.StringVar(&o.sysfs, "sysfs", "/sys", "process mode with --mounts: where to find hot-plugged disks by PCI address (tests)")
	fl.DurationVar(&o.deviceWait, "device-wait", defaultDeviceWait, "how long to wait for each disk and the network interface to appear")
	fl.IntVar(&o.vmmFD, "vmm-fd", -1, "process mode: a pipe from the VMM that runs this guest; when every writer has closed it, the guest halts (as a VMM's end ends a real guest)")
	if pid1 {
		fl.SetOutput(io.Discard)
	}
	if err := fl.Parse(args); err != nil && !pid1 {
		return 2
	}
	var sys system
	// VM mode only as PID 1: its poweroff is reboot(2), which must never
	// reach a host.
	if pid1 {
		o.vm, o.chroot, o.mounts, o.network = true, true, true, true
		if o.listen == "" {
			o.listen = "vsock"
		}
		vs := newVMSystem(log)
		if o.root == "" {
			o.root = vmRoot
		}
		vs.root, vs.flagDev, vs.flagFSType, vs.deviceWait = o.root, o.rootDevice, o.rootFSType, o.deviceWait
		sys = vs
	} else {
		if o.root == "" {
			fmt.Fprintln(os.Stderr, "guest: process mode needs --root")
			return 2
		}
		// A guest's init starts with the kernel's umask, 022; a
		// process-mode agent would inherit its simulator's 077 (Cloud
		// Hypervisor's), and the directories it makes in the root (the
		// working directory, /etc) would shut out a workload user.
		syscall.Umask(0o022)
		ps := &processSystem{mounts: o.mounts, network: o.network, sysfs: o.sysfs, deviceWait: o.deviceWait, log: log}
		ps.haltOnSignal()
		if o.vmmFD >= 0 {
			ps.haltWithVMM(o.vmmFD)
		}
		sys = ps
	}
	a := &agent{opts: o, sys: sys, log: log, mounts: map[string]string{}}
	err := a.run()
	if err != nil {
		log.Error("agent failed", "err", err)
		if o.vm {
			// The serial console is the only witness of a guest that
			// never reached its host: say the cause there plainly.
			reportOnConsole("/dev/console", err)
		}
	}
	code := ExitPoweroff
	if err != nil {
		code = ExitError
	}
	sys.poweroff(code)
	return code
}

// reportOnConsole writes the agent's failure as one plain line to the
// console device (the serial port) before the guest powers off.
func reportOnConsole(console string, err error) {
	f, openErr := os.OpenFile(console, os.O_WRONLY|syscall.O_NOCTTY, 0)
	if openErr != nil {
		fmt.Fprintf(os.Stderr, "vmhost guest agent failed: %v\n", err)
		return
	}
	defer f.Close()
	fmt.Fprintf(f, "vmhost guest agent failed: %v\n", err)
}

// agent is one run of the guest agent.
type agent struct {
	opts   options
	sys    system
	log    *slog.Logger
	reaper *reaper
	bootID string
	logSeq atomic.Uint64

	// cmu guards the connection and the state replayed after a reconnect.
	cmu  sync.Mutex
	nc   net.Conn
	conn *proto.Conn
	// lost is set once the connection failed; sends are dropped until a
	// reconnect succeeds.
	lost bool
	// resumable is set once the Spec is in: from then on a lost connection
	// is redialed.
	resumable bool
	// done ends reconnect attempts when the agent finishes.
	done  chan struct{}
	stops chan *proto.Stop
	// stopped is closed by the first Stop (requestStop): what the guest
	// waits for before the workload starts (a DHCP lease) gives up then.
	stopped  chan struct{}
	stopOnce sync.Once
	// mmu serializes mounts and unmounts of data volumes; mounts maps
	// each data volume's guest mountpoint to its device (the Spec's and
	// the hot-mounted ones).
	mmu    sync.Mutex
	mounts map[string]string
	// dialVsock replaces the AF_VSOCK dial in tests; nil dials for real.
	dialVsock func(port uint32) (net.Conn, error)
	state     struct {
		lease   *proto.Lease
		started *proto.Started
		exit    *proto.Exit
		fatal   *proto.Fatal
		health  *proto.Health
	}
	// acked is closed when the host acknowledges the workload's end.
	acked   chan struct{}
	ackOnce sync.Once

	// hostV is the version of the Spec (the host's, capped at ours); set
	// once, before the workload starts. Under cmu.
	hostV int
	// backlog holds the Log messages a version 3 host has not
	// acknowledged, oldest first, backlogBytes their data. Under cmu.
	backlog      []*proto.Log
	backlogBytes int

	// opsMu guards ops, what operation connections need; nil until the
	// guest is set up.
	opsMu sync.Mutex
	ops   *opsContext
	// workloadPID is the workload's pid once started (0 before).
	workloadPID atomic.Int64
}

// send sends m. While the connection is lost, messages are dropped (the
// workload keeps running); the last Lease, Started, Exit and Health are kept
// and replayed after a reconnect.
func (a *agent) send(m proto.Message) {
	if err := m.Validate(); err != nil {
		a.log.Error("not sending an invalid message", "type", m.Type(), "err", err)
		return
	}
	a.cmu.Lock()
	defer a.cmu.Unlock()
	switch m := m.(type) {
	case *proto.Lease:
		a.state.lease = m
	case *proto.Started:
		a.state.started = m
	case *proto.Exit:
		a.state.exit = m
	case *proto.Fatal:
		a.state.fatal = m
	case *proto.Health:
		a.state.health = m
	case *proto.Log:
		// Numbered under cmu, so that stdout's and stderr's chunks go out
		// in the order of their numbers.
		m.Seq = a.logSeq.Add(1)
		if a.hostV >= proto.Version3 {
			m.At = time.Now().UTC()
			a.keepLocked(m)
		}
	}
	if a.lost {
		return
	}
	// A host that stops reading must not stall the workload's output for
	// good: a write that blocks this long counts as a lost connection.
	a.nc.SetWriteDeadline(time.Now().Add(sendTimeout))
	if err := a.conn.Send(m); err != nil {
		a.lostLocked(a.conn, err)
	}
}

// keepLocked adds m to the replay backlog, dropping the oldest chunks
// beyond MaxLogBacklog bytes. cmu must be held.
func (a *agent) keepLocked(m *proto.Log) {
	a.backlog = append(a.backlog, m)
	a.backlogBytes += len(m.Data)
	drop := 0
	for a.backlogBytes > proto.MaxLogBacklog && drop < len(a.backlog)-1 {
		a.backlogBytes -= len(a.backlog[drop].Data)
		drop++
	}
	if drop > 0 {
		a.backlog = append(a.backlog[:0:0], a.backlog[drop:]...)
	}
}

// logAcked forgets the backlog up to seq.
func (a *agent) logAcked(seq uint64) {
	a.cmu.Lock()
	defer a.cmu.Unlock()
	n := 0
	for n < len(a.backlog) && a.backlog[n].Seq <= seq {
		a.backlogBytes -= len(a.backlog[n].Data)
		n++
	}
	if n > 0 {
		a.backlog = append(a.backlog[:0:0], a.backlog[n:]...)
	}
}

// lostLocked marks conn lost (if it is still the current one) and, after
// the Spec, starts redialing. cmu must be held.
func (a *agent) lostLocked(conn *proto.Conn, err error) {
	if a.lost || conn != a.conn {
		return
	}
	a.lost = true
	a.nc.Close()
	a.log.Error("host connection lost", "err", err)
	if a.resumable {
		go a.reconnect()
	}
}

// reconnect redials the host until it answers (or the agent is done), says
// Hello with Resume set (and, to a version 4 host, the last Log Seq it
// numbered, which a restore from a snapshot may have taken back), and
// replays the state the host would otherwise miss: the last Lease,
// Started, the unacknowledged logs (version 3 hosts), Exit, Fatal and
// Health, in that order.
func (a *agent) reconnect() {
	delay := 100 * time.Millisecond
	for {
		select {
		case <-a.done:
			return
		case <-time.After(delay):
		}
		delay = min(2*delay, 5*time.Second)
		nc, err := a.dialOnce()
		if err != nil {
			continue
		}
		conn := proto.NewConn(nc)
		// The Hello goes out under cmu: no Log is numbered between the
		// LogSeq it says and the replay.
		a.cmu.Lock()
		hello := &proto.Hello{V: proto.Version, AgentVersion: AgentVersion, BootID: a.bootID, Resume: true}
		if a.hostV >= proto.Version4 {
			seq := a.logSeq.Load()
			hello.LogSeq = &seq
		}
		if err := conn.Send(hello); err != nil {
			a.cmu.Unlock()
			nc.Close()
			continue
		}
		var replay []proto.Message
		if a.state.lease != nil {
			replay = append(replay, a.state.lease)
		}
		if a.state.started != nil {
			replay = append(replay, a.state.started)
		}
		for _, m := range a.backlog {
			replay = append(replay, m)
		}
		if a.state.exit != nil {
			replay = append(replay, a.state.exit)
		}
		if a.state.fatal != nil {
			replay = append(replay, a.state.fatal)
		}
		if a.state.health != nil {
			replay = append(replay, a.state.health)
		}
		for _, m := range replay {
			if err = conn.Send(m); err != nil {
				break
			}
		}
		if err != nil {
			a.cmu.Unlock()
			nc.Close()
			continue
		}
		a.nc, a.conn, a.lost = nc, conn, false
		a.cmu.Unlock()
		a.log.Info("host connection resumed")
		go a.receive(conn)
		return
	}
}

func (a *agent) run() error {
	// A failed preparation (say, a root disk that won't mount) is reported
	// to the host as Fatal once connected, so the operator sees why.
	prepErr := a.sys.prepare()
	if prepErr != nil {
		prepErr = fmt.Errorf("preparing the guest: %w", prepErr)
		a.log.Error("guest not prepared", "err", prepErr)
	}
	a.reaper = newReaper()
	defer a.reaper.stop()
	a.done = make(chan struct{})
	defer close(a.done)
	a.stops = make(chan *proto.Stop, 1)
	a.stopped = make(chan struct{})
	a.acked = make(chan struct{})
	go a.watchPowerButton()

	sigs := make(chan os.Signal, 8)
	signal.Notify(sigs, forwarded...)
	defer signal.Stop(sigs)

	nc, err := a.dial()
	if err != nil {
		// Without a host to report to, the preparation failure is the
		// likelier cause (no virtio_pci: neither disk nor vsock).
		if prepErr != nil {
			return fmt.Errorf("%w; then %w", prepErr, err)
		}
		return err
	}
	a.nc, a.conn = nc, proto.NewConn(nc)
	// Listen before the Hello: a host that reads version 3 in it may dial
	// at once.
	if l, err := a.listenOps(); err != nil {
		a.log.Error("operation connections unavailable", "err", err)
	} else if l != nil {
		defer l.Close()
		go a.serveOps(l)
	}
	defer func() {
		a.cmu.Lock()
		a.resumable, a.lost = false, true
		a.nc.Close()
		a.cmu.Unlock()
	}()

	id := make([]byte, 16)
	rand.Read(id)
	a.bootID = hex.EncodeToString(id)
	hbCtx, stopHB := context.WithCancel(context.Background())
	defer stopHB()
	hbInterval := make(chan time.Duration, 1)
	heartbeats := sync.OnceFunc(func() { go a.heartbeats(hbCtx, a.opts.heartbeat, hbInterval) })
	spec, err := a.awaitSpec(heartbeats)
	if err != nil {
		return err
	}
	if spec.HeartbeatSecs > 0 {
		hbInterval <- time.Duration(spec.HeartbeatSecs) * time.Second
	}
	a.cmu.Lock()
	a.hostV = min(spec.V, proto.Version)
	a.resumable = true
	conn := a.conn
	a.cmu.Unlock()
	go a.receive(conn)
	if prepErr != nil {
		a.send(&proto.Fatal{Message: prepErr.Error()})
		return a.idle(spec, sigs, a.stops, false)
	}

	w, err := a.setupAndStart(spec)
	if errors.Is(err, errStopped) {
		return nil
	}
	if err != nil {
		// The message names paths and commands, never secret values.
		a.log.Error("workload not started", "err", err)
		a.send(&proto.Fatal{Message: err.Error()})
		return a.idle(spec, sigs, a.stops, false)
	}
	return a.supervise(spec, w, sigs, a.stops)
}

// awaitSpec says Hello and waits for the host's Spec; started runs once
// the first Hello is out. A connection lost before the Spec came (the host
// agent restarted just then) is dialed again, with a new Hello of the same
// boot, rather than ending the guest: the host's next start sends the Spec.
func (a *agent) awaitSpec(started func()) (*proto.Spec, error) {
	for {
		a.cmu.Lock()
		conn := a.conn
		a.cmu.Unlock()
		err := conn.Send(&proto.Hello{V: proto.Version, AgentVersion: AgentVersion, BootID: a.bootID})
		var m proto.Message
		if err == nil {
			started()
			m, err = conn.Recv()
		}
		if err == nil {
			spec, ok := m.(*proto.Spec)
			if !ok {
				return nil, fmt.Errorf("waiting for the spec: got %s", m.Type())
			}
			return spec, nil
		}
		a.log.Error("host connection lost before the spec came; dialing again", "err", err)
		nc, derr := a.dial()
		if derr != nil {
			return nil, fmt.Errorf("waiting for the spec: %w; then %w", err, derr)
		}
		a.cmu.Lock()
		a.nc.Close()
		a.nc, a.conn, a.lost = nc, proto.NewConn(nc), false
		a.cmu.Unlock()
	}
}

// dial connects to the host, retrying until opts.dialWait passes. An error
// no retry can cure (no AF_VSOCK, no vsock transport) ends it at once.
func (a *agent) dial() (net.Conn, error) {
	deadline := time.Now().Add(a.opts.dialWait)
	delay := 50 * time.Millisecond
	for {
		c, err := a.dialOnce()
		if err == nil {
			return c, nil
		}
		if cause := permanentDialError(err); cause != "" {
			return nil, fmt.Errorf("%w: %s", err, cause)
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("%w (no answer from the host in %s)", err, a.opts.dialWait)
		}
		time.Sleep(delay)
		delay = min(2*delay, time.Second)
	}
}

// permanentDialError explains a dial error that retrying cannot cure, or
// returns "" for one that may pass (the host not listening yet).
func permanentDialError(err error) string {
	switch {
	case errors.Is(err, syscall.EAFNOSUPPORT):
		return "the kernel has no AF_VSOCK (CONFIG_VSOCKETS, CONFIG_VIRTIO_VSOCKETS; or vsock and vmw_vsock_virtio_transport listed in appvm_modules)"
	case errors.Is(err, syscall.ENODEV):
		return "no vsock transport: the VM has no virtio vsock device, or the kernel lacks vmw_vsock_virtio_transport (CONFIG_VIRTIO_VSOCKETS, or the module in appvm_modules)"
	}
	return ""
}

func (a *agent) dialOnce() (net.Conn, error) {
	var c net.Conn
	var err error
	if p, ok := strings.CutPrefix(a.opts.transport, "unix:"); ok {
		c, err = net.Dial("unix", p)
	} else if a.opts.transport == "vsock" {
		dial := a.dialVsock
		if dial == nil {
			dial = dialVsock
		}
		c, err = dial(a.sys.vsockPort())
	} else {
		return nil, fmt.Errorf("unknown transport %q", a.opts.transport)
	}
	if err != nil {
		return nil, fmt.Errorf("dialing the host over %s: %w", a.opts.transport, err)
	}
	return c, nil
}

// receive reads host messages from conn after the Spec: Stop goes to
// a.stops, Mount and Unmount are carried out beside the workload; an
// error marks the connection lost.
func (a *agent) receive(conn *proto.Conn) {
	for {
		m, err := conn.Recv()
		if err != nil {
			a.cmu.Lock()
			a.lostLocked(conn, err)
			a.cmu.Unlock()
			return
		}
		switch m := m.(type) {
		case *proto.Stop:
			a.requestStop(m)
		case *proto.ExitAck:
			a.ackOnce.Do(func() { close(a.acked) })
		case *proto.LogAck:
			a.logAcked(m.Seq)
		case *proto.Mount:
			go a.hotMount(m)
		case *proto.Unmount:
			go a.hotUnmount(m)
		default:
			a.log.Warn("ignoring unexpected message from the host", "type", m.Type())
		}
	}
}

// requestStop hands a Stop (the host's, or the power button's) to the
// supervisor, and ends any wait before the workload starts.
func (a *agent) requestStop(m *proto.Stop) {
	select {
	case a.stops <- m:
	default:
	}
	a.stopOnce.Do(func() { close(a.stopped) })
}

func (a *agent) heartbeats(ctx context.Context, interval time.Duration, change <-chan time.Duration) {
	var seq uint64
	t := time.NewTicker(interval)
	defer t.Stop()
	beat := func() {
		seq++
		a.send(&proto.Heartbeat{Seq: seq, At: time.Now().UTC()})
	}
	beat()
	for {
		select {
		case <-ctx.Done():
			return
		case d := <-change:
			t.Reset(d)
		case <-t.C:
			beat()
		}
	}
}

// workload is a started workload process.
type workload struct {
	pid     int
	status  <-chan syscall.WaitStatus
	logs    sync.WaitGroup
	started time.Time
	acc     account
	env     []string
}

// errStopped reports a Stop that arrived before the workload started.
var errStopped = errors.New("stopped before the workload started")

// setupAndStart prepares the guest and starts the workload.
func (a *agent) setupAndStart(spec *proto.Spec) (*workload, error) {
	root := a.opts.root
	hostname := spec.Hostname
	var lease *proto.Lease
	if a.opts.network {
		// A Stop during the wait for a lease ends it: the guest powers
		// off with its workload never started.
		ctx, cancel := context.WithCancel(context.Background())
		go func() {
			select {
			case <-a.stopped:
				cancel()
			case <-ctx.Done():
			}
		}()
		l, err := a.sys.configureNetwork(ctx, spec.Network, hostname, func(l *proto.Lease) { a.send(l) })
		stopped := ctx.Err() != nil
		cancel()
		if err != nil && stopped {
			return nil, errStopped
		}
		if err != nil {
			return nil, fmt.Errorf("configuring the network: %w", err)
		}
		if l != nil {
			lease = l
			a.send(l)
			if hostname == "" {
				hostname = l.Hostname
			}
		}
	}
	if hostname != "" {
		if err := a.sys.setHostname(hostname); err != nil {
			return nil, fmt.Errorf("setting the hostname: %w", err)
		}
	}
	acc, err := lookupUser(root, spec.User)
	if err != nil {
		return nil, fmt.Errorf("resolving the workload user: %w", err)
	}
	// Mounts first: a file injected under a mountpoint belongs in the
	// mounted file system (a secret on a tmpfs must not reach the root
	// disk below it, where the workload would not even see it).
	for _, t := range spec.TmpfsMounts {
		target, err := mkdirInRoot(root, t.Path)
		if err != nil {
			return nil, err
		}
		if err := a.sys.mountTmpfs(target, t); err != nil {
			return nil, fmt.Errorf("mounting tmpfs at %s: %w", t.Path, err)
		}
	}
	for _, d := range spec.DataMounts {
		target, err := mkdirInRoot(root, d.Mountpoint)
		if err != nil {
			return nil, err
		}
		a.mmu.Lock()
		err = a.sys.mountData(d.Device, target, d.ReadOnly)
		if err == nil {
			a.mounts[d.Mountpoint] = d.Device
		}
		a.mmu.Unlock()
		if err != nil {
			return nil, fmt.Errorf("mounting %s at %s: %w", d.Device, d.Mountpoint, err)
		}
	}
	if err := writeEtc(root, spec, hostname, lease); err != nil {
		return nil, err
	}
	if a.opts.vm {
		// The agent's own /etc, for health checks that resolve names.
		if err := writeEtc("/", spec, hostname, lease); err != nil {
			return nil, err
		}
	}
	owner := -1
	if switchesUsers() {
		owner = int(acc.uid)
	}
	if err := writeInjected(root, spec, owner, int(acc.gid)); err != nil {
		return nil, err
	}
	if err := a.sys.prepareRoot(root); err != nil {
		return nil, err
	}

	select {
	case <-a.stops:
		// Stopped during setup (a long DHCP wait): never start.
		return nil, errStopped
	default:
	}
	env := buildEnv(spec, acc, hostname)
	// From here on the root is what the workload sees: operations may
	// run beside it (even if its own command fails to start).
	a.opsMu.Lock()
	a.ops = &opsContext{spec: spec, env: env, acc: acc}
	a.opsMu.Unlock()
	argv := append(append([]string{}, spec.Entrypoint...), spec.Command...)
	cmd, err := a.command(argv, env, spec.Workdir, acc)
	if err != nil {
		return nil, err
	}
	w := &workload{acc: acc, env: env}
	outR, outW, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	errR, errW, err := os.Pipe()
	if err != nil {
		outR.Close()
		outW.Close()
		return nil, err
	}
	cmd.Stdout, cmd.Stderr = outW, errW
	w.pid, w.status, err = a.reaper.start(cmd)
	outW.Close()
	errW.Close()
	if err != nil {
		outR.Close()
		errR.Close()
		return nil, fmt.Errorf("starting the workload %q: %w", argv[0], err)
	}
	w.started = time.Now()
	a.workloadPID.Store(int64(w.pid))
	// Started goes out before any output: the pipes hold it meanwhile.
	a.send(&proto.Started{PID: w.pid})
	w.logs.Add(2)
	go a.pump(proto.Stdout, outR, &w.logs)
	go a.pump(proto.Stderr, errR, &w.logs)
	return w, nil
}

// command builds the exec.Cmd for argv with the workload's root, user,
// environment and working directory.
func (a *agent) command(argv, env []string, workdir string, acc account) (*exec.Cmd, error) {
	pathEnv := defaultPath
	for _, e := range env {
		if v, ok := strings.CutPrefix(e, "PATH="); ok {
			pathEnv = v
		}
	}
	lookRoot := "/"
	if a.opts.chroot {
		lookRoot = a.opts.root
	}
	guestPath, hostPath, err := lookPath(lookRoot, argv[0], pathEnv)
	if err != nil {
		return nil, err
	}
	if workdir == "" {
		workdir = "/"
	}
	attr := &syscall.SysProcAttr{Setpgid: true}
	if !a.opts.vm {
		// In process mode the agent may be killed outright (the simulator
		// stopping a VM): its workload must not outlive it.
		attr.Pdeathsig = syscall.SIGKILL
	}
	cmd := &exec.Cmd{Path: hostPath, Args: argv, Env: env, SysProcAttr: attr}
	if a.opts.chroot {
		attr.Chroot = a.opts.root
		cmd.Path = guestPath
		if _, err := mkdirInRoot(a.opts.root, workdir); err != nil {
			return nil, err
		}
		cmd.Dir = workdir
	} else {
		dir, err := mkdirInRoot(a.opts.root, workdir)
		if err != nil {
			return nil, err
		}
		cmd.Dir = dir
	}
	if switchesUsers() {
		attr.Credential = &syscall.Credential{Uid: acc.uid, Gid: acc.gid, Groups: acc.groups}
	} else if acc.uid != uint32(os.Geteuid()) {
		a.log.Warn("the agent cannot switch users (not root, or a user namespace of one id): running the workload as itself",
			"wanted_uid", acc.uid, "uid", os.Geteuid())
	}
	return cmd, nil
}

// buildEnv returns the workload environment: PATH, HOSTNAME and HOME
// defaults, then Env, then SecretEnv; a later entry replaces an earlier one
// with the same key.
func buildEnv(spec *proto.Spec, acc account, hostname string) []string {
	var keys []string
	vals := map[string]string{}
	set := func(k, v string) {
		if _, ok := vals[k]; !ok {
			keys = append(keys, k)
		}
		vals[k] = v
	}
	set("PATH", defaultPath)
	if hostname != "" {
		set("HOSTNAME", hostname)
	}
	set("HOME", acc.home)
	for _, e := range spec.Env {
		k, v, _ := strings.Cut(e, "=")
		set(k, v)
	}
	for _, e := range spec.SecretEnv {
		set(e.Key, e.Value.Reveal())
	}
	env := make([]string, len(keys))
	for i, k := range keys {
		env[i] = k + "=" + vals[k]
	}
	return env
}

// pump forwards one output stream as Log chunks.
func (a *agent) pump(stream string, r *os.File, wg *sync.WaitGroup) {
	defer wg.Done()
	defer r.Close()
	buf := make([]byte, proto.MaxLogChunk)
	for {
		n, err := r.Read(buf)
		if n > 0 {
			a.send(&proto.Log{Stream: stream, Data: append([]byte(nil), buf[:n]...)})
		}
		if err != nil {
			return
		}
	}
}

// supervise waits for the workload, forwarding signals and handling Stop,
// runs the health checks, reports the exit, then idles or powers off.
func (a *agent) supervise(spec *proto.Spec, w *workload, sigs <-chan os.Signal, stops <-chan *proto.Stop) error {
	hcCtx, cancelHC := context.WithCancel(context.Background())
	hcDone := make(chan struct{})
	// stopHC returns once the checker is gone, so no Health follows Exit.
	stopHC := func() { cancelHC(); <-hcDone }
	if spec.Healthcheck != nil {
		h := newHealthChecker(a, spec.Healthcheck, w, spec.Workdir)
		go func() { h.run(hcCtx); close(hcDone) }()
	} else {
		close(hcDone)
	}
	defer stopHC()
	stopping := false
	var kill <-chan time.Time
	for {
		select {
		case ws := <-w.status:
			stopHC()
			// Output written just before the exit should precede Exit; an
			// orphan holding the pipes open must not block it for long.
			drained := make(chan struct{})
			go func() { w.logs.Wait(); close(drained) }()
			select {
			case <-drained:
			case <-time.After(time.Second):
			}
			a.send(exitMessage(ws))
			return a.idle(spec, sigs, stops, stopping)
		case s := <-sigs:
			a.reaper.signal(w.pid, s.(syscall.Signal))
		case st := <-stops:
			if stopping {
				continue
			}
			stopping = true
			grace := st.GraceSecs
			if grace == 0 {
				grace = spec.StopGraceSecs
			}
			if grace == 0 {
				grace = 10
			}
			a.reaper.signal(w.pid, syscall.SIGTERM)
			kill = time.After(time.Duration(grace) * time.Second)
		case <-kill:
			a.log.Warn("workload outlived its stop grace; killing it")
			a.reaper.signalGroup(w.pid, syscall.SIGKILL)
		}
	}
}

// idle is the life after the workload: with keepalive (and no Stop) the
// guest stays up, heartbeating, until a Stop or (process mode) SIGTERM or
// SIGINT. Otherwise the guest powers off once the host acknowledged the
// end (a host of protocol version 1 never does: at once), so an end that
// happened while the host agent was down is replayed to the next one and
// not lost with the VM.
func (a *agent) idle(spec *proto.Spec, sigs <-chan os.Signal, stops <-chan *proto.Stop, stopping bool) error {
	if stopping || !spec.Keepalive && spec.V < proto.Version2 {
		return nil
	}
	var acked <-chan struct{}
	if !spec.Keepalive {
		acked = a.acked
	}
	for {
		select {
		case <-acked:
			return nil
		case <-stops:
			return nil
		case s := <-sigs:
			if !a.opts.vm && (s == syscall.SIGTERM || s == syscall.SIGINT) {
				return nil
			}
		}
	}
}

// exitMessage converts a wait status.
func exitMessage(ws syscall.WaitStatus) *proto.Exit {
	if ws.Signaled() {
		return &proto.Exit{Signal: int(ws.Signal())}
	}
	code := ws.ExitStatus()
	return &proto.Exit{Code: &code}
}

// mkdirInRoot creates the guest directory p (and parents, 0755) inside
// root and returns its host path.
func mkdirInRoot(root, p string) (string, error) {
	h, err := inRoot(root, p)
	if err != nil {
		return "", err
	}
	if err := os.MkdirAll(h, 0o755); err != nil {
		return "", fmt.Errorf("creating %s in the workload root: %w", p, err)
	}
	return h, nil
}

// writeEtc writes /etc/hostname, /etc/hosts and (when DNS servers are known)
// /etc/resolv.conf into root.
func writeEtc(root string, spec *proto.Spec, hostname string, lease *proto.Lease) error {
	var ip string
	dns := spec.Network.DNS
	var search []string
	switch {
	case spec.Network.Mode == proto.NetworkStatic:
		ip = spec.Network.IP
	case lease != nil:
		ip, dns, search = lease.IP, lease.DNS, lease.Search
	}
	var hosts strings.Builder
	hosts.WriteString("127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n")
	if hostname != "" {
		if ip == "" {
			ip = "127.0.1.1"
		}
		short, _, _ := strings.Cut(hostname, ".")
		if short != hostname {
			fmt.Fprintf(&hosts, "%s\t%s %s\n", ip, hostname, short)
		} else {
			fmt.Fprintf(&hosts, "%s\t%s\n", ip, hostname)
		}
	}
	for _, h := range spec.ExtraHosts {
		fmt.Fprintf(&hosts, "%s\t%s\n", h.IP, h.Host)
	}
	files := []struct {
		path, content string
	}{{"/etc/hosts", hosts.String()}}
	if hostname != "" {
		files = append(files, struct{ path, content string }{"/etc/hostname", hostname + "\n"})
	}
	if len(dns) > 0 {
		var rc strings.Builder
		if len(search) > 0 {
			fmt.Fprintf(&rc, "search %s\n", strings.Join(search, " "))
		}
		for _, d := range dns {
			fmt.Fprintf(&rc, "nameserver %s\n", d)
		}
		files = append(files, struct{ path, content string }{"/etc/resolv.conf", rc.String()})
	}
	for _, f := range files {
		if err := writeInRoot(root, f.path, 0o644, []byte(f.content), -1, -1); err != nil {
			return err
		}
	}
	return nil
}

// writeInjected writes the config and secret files. With owner >= 0 they
// belong to the workload user, so a 0400 secret is readable by it.
func writeInjected(root string, spec *proto.Spec, owner, group int) error {
	for _, f := range spec.ConfigFiles {
		mode := f.Mode
		if mode == 0 {
			mode = 0o644
		}
		if err := writeInRoot(root, f.Path, mode, []byte(f.Content), owner, group); err != nil {
			return err
		}
	}
	for _, f := range spec.SecretFiles {
		mode := f.Mode
		if mode == 0 {
			mode = 0o400
		}
		if err := writeInRoot(root, f.Path, mode, []byte(f.Content.Reveal()), owner, group); err != nil {
			return err
		}
	}
	return nil
}

// writeInRoot replaces the guest file p inside root. Errors name the path,
// never the content.
func writeInRoot(root, p string, mode uint32, data []byte, uid, gid int) error {
	dir, err := mkdirInRoot(root, path.Dir(p))
	if err != nil {
		return err
	}
	target := filepath.Join(dir, path.Base(p))
	if fi, err := os.Lstat(target); err == nil && !fi.IsDir() {
		// A file of the image is replaced, never written through: a
		// symlink (resolv.conf often is one) could lead out of the root,
		// a hard link would show a secret under another name, and an
		// existing file's looser mode would expose it until the chmod.
		if err := os.Remove(target); err != nil {
			return fmt.Errorf("writing %s: %w", p, err)
		}
	}
	f, err := os.OpenFile(target, os.O_WRONLY|os.O_CREATE|os.O_EXCL|syscall.O_NOFOLLOW, 0o600)
	if err != nil {
		return fmt.Errorf("writing %s: %w", p, err)
	}
	_, werr := f.Write(data)
	if uid >= 0 && werr == nil {
		werr = f.Chown(uid, gid)
	}
	if werr == nil {
		werr = f.Chmod(os.FileMode(mode & 0o777))
		if mode&0o7000 != 0 && werr == nil {
			werr = os.Chmod(target, os.FileMode(mode&0o777)|unixModeBits(mode))
		}
	}
	if err := f.Close(); werr == nil {
		werr = err
	}
	if werr != nil {
		return fmt.Errorf("writing %s: %w", p, werr)
	}
	return nil
}

// unixModeBits converts setuid, setgid and sticky bits to os.FileMode.
func unixModeBits(mode uint32) os.FileMode {
	var m os.FileMode
	if mode&0o4000 != 0 {
		m |= os.ModeSetuid
	}
	if mode&0o2000 != 0 {
		m |= os.ModeSetgid
	}
	if mode&0o1000 != 0 {
		m |= os.ModeSticky
	}
	return m
}
