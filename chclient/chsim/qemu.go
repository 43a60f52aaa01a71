package chsim

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"vmhost/qmp"
)

// The qemu backend (--sim-backend qemu) runs the booted VM as a real guest in
// qemu-system-x86_64 behind the same API and event stream; see doc.go.

// Backend names for --sim-backend.
const (
	BackendSim  = "sim"
	BackendQemu = "qemu"
)

// DefaultVsockBackend is where e2e/realguest/fetch-vhost-device-vsock.sh unpacks
// vhost-device-vsock; used when --sim-vsock-backend is not given and none is on PATH.
const DefaultVsockBackend = "/var/cache/vmhost-lane/vhost-device-vsock/usr/bin/vhost-device-vsock"

// activationPoll is how often the backend asks qemu for the status of each virtio device.
const activationPoll = 100 * time.Millisecond

// qemuVM is one qemu process (and its vhost-device-vsock) running the booted VM. It lives
// from vm.boot to the VM's stop; guest reboots happen inside it.
type qemuVM struct {
	s      *sim
	cmd    *exec.Cmd
	exited chan struct{} // closed once qemu has been waited for
	stderr *tailBuffer   // the end of qemu's output, for boot errors
	client *qmp.Client
	serial net.Conn // the backend's end of the serial relay; nil without a Socket serial

	devMu   sync.Mutex   // guards devices and seq: hot-plug changes them while the poll reads
	devices []qemuDevice // the devices the poll watches
	seq     int          // numbers hot-plugged devices, so a re-plugged id is a new device

	hot map[string]*hotDisk // CH id → disk hot-plugged into this qemu; guarded by s.mu

	vsock   *vsockBackend // nil without vsock, and while the device is unplugged
	vsockIn bool          // the vsock device is plugged into qemu (qemu_vsock.go)

	stopping atomic.Bool   // set before the backend ends qemu itself
	stopPoll chan struct{} // closed by stop

	pollMu     sync.Mutex
	active     map[qemuDevice]bool // DRIVER_OK last seen
	pollFailed bool                // a status query failed (logged once)
}

// tailBuffer keeps the last bytes written to it.
type tailBuffer struct {
	mu  sync.Mutex
	buf []byte
}

func (t *tailBuffer) Write(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.buf = append(t.buf, p...)
	if len(t.buf) > 4096 {
		t.buf = t.buf[len(t.buf)-4096:]
	}
	return len(p), nil
}

func (t *tailBuffer) String() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return strings.TrimSpace(string(t.buf))
}

// resolveAccel turns --sim-accel into the accelerator qemu gets, with the reason.
func resolveAccel(want string) (string, string, error) {
	switch want {
	case "kvm":
		return "kvm", "--sim-accel kvm", nil
	case "tcg":
		return "tcg", "--sim-accel tcg", nil
	case "", "auto":
		if ok, why := kvmBootsStockKernels(); !ok {
			return "tcg", why, nil
		}
		return "kvm", "/dev/kvm is usable", nil
	}
	return "", "", fmt.Errorf("--sim-accel %q: want auto, kvm or tcg", want)
}

// openQemuLog opens where qemu and vhost-device-vsock write: <log file without
// .log>.qemu.log beside the log file, or the process's stderr without one.
func (s *sim) openQemuLog() error {
	if s.cfg.LogFile == "" {
		s.qemuLog = os.Stderr
		return nil
	}
	path := strings.TrimSuffix(s.cfg.LogFile, ".log") + ".qemu.log"
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_TRUNC|os.O_APPEND, 0o600)
	if err != nil {
		return fmt.Errorf("opening qemu log %s: %w", path, err)
	}
	s.qemuLog = f
	return nil
}

func (s *sim) qemuMode() bool { return s.cfg.Backend == BackendQemu }

// bootQemuLocked starts qemu for the validated config whose devices have ids and PCI
// addresses. It returns CH's error chain below "The VM could not boot", or nil once the
// guest runs.
func (s *sim) bootQemuLocked() []string {
	q, err := s.startQemu(nil)
	if err != nil {
		s.logf(0, "Error: booting in qemu: %v", err)
		return []string{"Error starting the VM in qemu", err.Error()}
	}
	s.qemu = q
	s.state = stateRunning
	s.bootGen++
	if b := s.vm.Balloon; b != nil && b.Size > 0 {
		// CH boots with the balloon at its configured size; qemu's starts
		// empty until told.
		keep := s.vm.Memory.Size - min(b.Size, s.vm.Memory.Size)
		if err := s.qmpArgsLocked("balloon", map[string]uint64{"value": keep}, nil); err != nil {
			s.logf(0, "Error: sizing the balloon in qemu: %v", err)
		}
	}
	return nil
}

// startQemu starts vhost-device-vsock (for a vsock device) and qemu, stopped; connects to
// qemu's monitor and serial port; checks that every watched device can be queried; and
// lets the guest run. With incoming (a restore), qemu loads the guest from that migration
// stream instead, and the guest stays stopped: the caller polls the devices and lets it
// run. startQemu closes incoming. On failure nothing it started is left running.
func (s *sim) startQemu(incoming *os.File) (_ *qemuVM, err error) {
	if incoming != nil {
		defer incoming.Close()
	}
	bin := s.cfg.Qemu
	if bin == "" {
		bin = "qemu-system-x86_64"
	}
	path, err := exec.LookPath(bin)
	if err != nil {
		return nil, fmt.Errorf("finding qemu: %w", err)
	}
	q := &qemuVM{s: s, exited: make(chan struct{}), stderr: &tailBuffer{}, stopPoll: make(chan struct{}),
		active: map[qemuDevice]bool{}, hot: map[string]*hotDisk{}}
	defer func() {
		if err != nil {
			q.stop()
		}
	}()

	// A restore's qemu starts without the vsock device, which qemu cannot migrate: the
	// resume plugs it in (qemu_vsock.go).
	l := qemuLaunch{Accel: s.accel, SerialFD: -1, NoVsock: incoming != nil}
	if v := s.vm.Vsock; v != nil && incoming == nil {
		vu, err := q.startVsockBackend(v)
		if err != nil {
			return nil, err
		}
		l.VsockBackend = vu
	}

	// QMP and the serial port reach qemu through socketpairs: no paths to race for or
	// leave behind, and the backend is the monitor's only client from the start.
	qmpParent, qmpChild, err := socketpair("qmp")
	if err != nil {
		return nil, err
	}
	// The child's ends are closed here once qemu has them (or failed to start): held open,
	// they would hide qemu's exit from the monitor connection.
	defer qmpChild.Close()
	extra := []*os.File{qmpChild}
	l.QMPFD = 3
	var serialParent *os.File
	if s.vm.Serial.Mode == "Socket" {
		var serialChild *os.File
		serialParent, serialChild, err = socketpair("serial")
		if err != nil {
			qmpParent.Close()
			return nil, err
		}
		defer serialChild.Close()
		extra = append(extra, serialChild)
		l.SerialFD = 4
	}
	l.TapMTU = map[string]int{}
	for _, n := range s.vm.Net {
		if n.Tap != nil && n.Mtu == nil {
			if ifi, err := net.InterfaceByName(*n.Tap); err == nil {
				l.TapMTU[*n.Tap] = ifi.MTU
			}
		}
	}
	args, devs, err := qemuArgs(s.vm, s.bdfs, l)
	if err != nil {
		qmpParent.Close()
		if serialParent != nil {
			serialParent.Close()
		}
		return nil, err
	}
	q.devices = devs
	q.vsockIn = s.vm.Vsock != nil && incoming == nil
	if incoming != nil {
		args = append(args, "-incoming", fmt.Sprintf("fd:%d", 3+len(extra)))
		extra = append(extra, incoming)
	}
	s.logf(1, "starting %s %s", path, strings.Join(args, " "))
	cmd := exec.Command(path, args...)
	cmd.ExtraFiles = extra
	cmd.Stdout = s.qemuLog
	cmd.Stderr = io.MultiWriter(s.qemuLog, q.stderr)
	cmd.SysProcAttr = childProcAttr()
	err = cmd.Start()
	for _, f := range extra {
		f.Close()
	}
	if err != nil {
		qmpParent.Close()
		if serialParent != nil {
			serialParent.Close()
		}
		return nil, fmt.Errorf("starting qemu: %w", err)
	}
	q.cmd = cmd
	go func() {
		cmd.Wait()
		close(q.exited)
		if !q.stopping.Load() {
			s.qemuDied(q)
		}
	}()
	s.logf(1, "qemu started, pid %d, accelerator %s", cmd.Process.Pid, s.accel)

	if serialParent != nil {
		conn, err := fileConn(serialParent)
		if err != nil {
			qmpParent.Close()
			return nil, err
		}
		q.serial = conn
		q.relaySerial(s.serial)
	}
	conn, err := fileConn(qmpParent)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	client, err := qmp.New(ctx, conn)
	if err != nil {
		return nil, q.failure(fmt.Errorf("connecting to qemu's monitor: %w", err))
	}
	q.client = client
	go q.watchEvents()
	if incoming != nil {
		// The stream holds the guest's memory: as long as reading it takes.
		lctx, lcancel := context.WithTimeout(context.Background(), migrationTimeout)
		defer lcancel()
		if err := q.waitMigration(lctx); err != nil {
			return nil, q.failure(fmt.Errorf("loading the guest from its migration stream: %w", err))
		}
	}
	if err := q.checkVirtioPaths(ctx); err != nil {
		return nil, err
	}
	if incoming != nil {
		return q, nil
	}
	if err := client.Execute(ctx, "cont", nil, nil); err != nil {
		return nil, q.failure(err)
	}
	go q.pollActivation()
	return q, nil
}

// failure adds what qemu said to err once qemu has exited (or after a moment).
func (q *qemuVM) failure(err error) error {
	select {
	case <-q.exited:
		return fmt.Errorf("qemu exited (%v): %s", q.cmd.ProcessState, q.stderr.String())
	case <-time.After(time.Second):
	}
	if out := q.stderr.String(); out != "" {
		return fmt.Errorf("%w: qemu: %s", err, out)
	}
	return err
}

func fileConn(f *os.File) (net.Conn, error) {
	defer f.Close()
	c, err := net.FileConn(f)
	if err != nil {
		return nil, fmt.Errorf("using socket %s: %w", f.Name(), err)
	}
	return c, nil
}

// vsockBackend is one vhost-device-vsock process.
type vsockBackend struct {
	cmd      *exec.Cmd
	exited   chan struct{}
	files    []string    // sockets to remove when it stops
	stopping atomic.Bool // set before the backend ends it
}

// startVsockBackend runs vhost-device-vsock for CH's hybrid vsock and returns its
// vhost-user socket once it listens.
func (q *qemuVM) startVsockBackend(v *vsockConfig) (string, error) {
	bin := q.s.cfg.VsockBackend
	if bin == "" {
		if p, err := exec.LookPath("vhost-device-vsock"); err == nil {
			bin = p
		} else {
			bin = DefaultVsockBackend
		}
	}
	if _, err := os.Stat(bin); err != nil {
		return "", fmt.Errorf("vsock needs vhost-device-vsock (--sim-vsock-backend; e2e/realguest/fetch-vhost-device-vsock.sh fetches it): %w", err)
	}
	vu := v.Socket + ".vhost-user"
	os.Remove(vu) // ours: a stale one would fail the bind
	cmd := exec.Command(bin, vsockBackendArgs(v.Cid, vu, v.Socket)...)
	out := &tailBuffer{}
	cmd.Stdout = q.s.qemuLog
	cmd.Stderr = io.MultiWriter(q.s.qemuLog, out)
	cmd.SysProcAttr = childProcAttr()
	q.s.logf(1, "starting %s %s", bin, strings.Join(cmd.Args[1:], " "))
	if err := cmd.Start(); err != nil {
		return "", fmt.Errorf("starting vhost-device-vsock: %w", err)
	}
	b := &vsockBackend{cmd: cmd, exited: make(chan struct{}), files: []string{vu, v.Socket}}
	q.vsock = b
	go func() {
		err := cmd.Wait()
		close(b.exited)
		if !b.stopping.Load() && !q.stopping.Load() {
			q.s.logf(0, "vhost-device-vsock exited (%v): the guest's vsock is gone", err)
		}
	}()
	deadline := time.Now().Add(5 * time.Second)
	for {
		if fi, err := os.Stat(vu); err == nil && fi.Mode()&os.ModeSocket != 0 {
			return vu, nil
		}
		select {
		case <-b.exited:
			return "", fmt.Errorf("vhost-device-vsock exited at start: %s", out.String())
		case <-time.After(10 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			return "", fmt.Errorf("vhost-device-vsock did not create %s", vu)
		}
	}
}

// stopVsockBackend ends the running vhost-device-vsock, if any, and removes its sockets
// (CH unlinks the vsock socket when the device goes away).
func (q *qemuVM) stopVsockBackend() {
	b := q.vsock
	if b == nil {
		return
	}
	q.vsock = nil
	b.stopping.Store(true)
	b.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-b.exited:
	case <-time.After(2 * time.Second):
		b.cmd.Process.Kill()
		<-b.exited
	}
	for _, f := range b.files {
		os.Remove(f)
	}
}

// relaySerial copies the guest's serial output to the CH serial socket (which buffers
// until a client connects, as v53 does) and the client's input to the guest.
func (q *qemuVM) relaySerial(p *serialPort) {
	conn := q.serial
	p.setInput(func(b []byte) { conn.Write(b) })
	go func() {
		b := make([]byte, 4096)
		for {
			n, err := conn.Read(b)
			if n > 0 {
				p.write(b[:n])
			}
			if err != nil {
				return
			}
		}
	}()
}

// stop ends qemu and its vsock backend and removes what they leave behind. It is
// idempotent and may be called with s.mu held: nothing it waits for takes s.mu.
func (q *qemuVM) stop() {
	if q.stopping.Swap(true) {
		return
	}
	close(q.stopPoll)
	if q.cmd != nil {
		if q.client != nil {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			q.client.Execute(ctx, "quit", nil, nil)
			cancel()
		}
		select {
		case <-q.exited:
		case <-time.After(5 * time.Second):
			q.s.logf(0, "qemu did not quit; killing it")
			q.cmd.Process.Kill()
			<-q.exited
		}
	}
	if q.client != nil {
		q.client.Close()
	}
	if q.serial != nil {
		q.serial.Close()
	}
	q.stopVsockBackend()
}

// qemuDied handles qemu exiting when the backend did not end it: the VMM has crashed.
// Like a crashed cloud-hypervisor, the process goes away without further events (exit 1).
func (s *sim) qemuDied(q *qemuVM) {
	s.mu.Lock()
	if s.qemu != q {
		s.mu.Unlock()
		return
	}
	s.logf(0, "Error: qemu exited unexpectedly (%v): %s", q.cmd.ProcessState, q.stderr.String())
	s.releaseLocked()
	s.mu.Unlock()
	s.exitOnce.Do(func() { s.exitCode <- 1 })
}

// watchEvents turns qemu's QMP events into CH's events.
func (q *qemuVM) watchEvents() {
	for ev := range q.client.Events() {
		var data struct {
			Guest  bool   `json:"guest"`
			Reason string `json:"reason"`
			Device string `json:"device"` // DEVICE_DELETED: the qemu id (none for a device's parts)
		}
		json.Unmarshal(ev.Data, &data)
		switch ev.Name {
		case "SHUTDOWN":
			// -action shutdown=pause: qemu stops and waits for the backend's decision.
			if data.Guest {
				q.s.logf(1, "qemu: guest shutdown (%s)", data.Reason)
				q.pollOnce()
				q.s.qemuGuestPoweroff(q)
			}
		case "RESET":
			if data.Guest {
				q.s.logf(1, "qemu: guest reset (%s)", data.Reason)
				q.s.mu.Lock()
				if q.s.qemu == q && (q.s.state == stateRunning || q.s.state == statePaused) {
					q.s.emit("vm", "rebooting", nil)
					q.s.emit("vm", "rebooted", nil)
				}
				q.s.mu.Unlock()
			}
		case "DEVICE_DELETED":
			if data.Device != "" {
				q.s.qemuDeviceDeleted(q, data.Device)
			}
		case "GUEST_PANICKED", "GUEST_CRASHLOADED":
			event := "panic"
			if ev.Name == "GUEST_CRASHLOADED" {
				event = "crash_loaded"
			}
			q.s.mu.Lock()
			if q.s.qemu == q {
				q.s.emit("guest", "panic", map[string]string{"event": event})
			}
			q.s.mu.Unlock()
		}
	}
}

// qemuGuestPoweroff is the guest's ACPI poweroff, which qemu reported and paused on.
func (s *sim) qemuGuestPoweroff(q *qemuVM) {
	s.mu.Lock()
	if s.qemu != q || s.state != stateRunning && s.state != statePaused {
		s.mu.Unlock()
		return
	}
	if s.cfg.NoShutdown {
		s.stopLocked()
		s.mu.Unlock()
		return
	}
	s.mu.Unlock()
	s.terminate(0)
}

// pollActivation reports the guest's drivers taking up (DRIVER_OK) and resetting the
// virtio devices, as qemu sees them, until the VM stops.
func (q *qemuVM) pollActivation() {
	t := time.NewTicker(activationPoll)
	defer t.Stop()
	for {
		select {
		case <-q.stopPoll:
			return
		case <-q.client.Done():
			return
		case <-t.C:
			q.pollOnce()
		}
	}
}

// pollOnce asks qemu for each virtio device's status and emits activated for a
// device whose driver has set DRIVER_OK since the last poll (except a vhost-user
// disk, as CH), reset for one whose status went back. A change undone between two
// polls is not seen.
func (q *qemuVM) pollOnce() { q.poll(false) }

// poll is pollOnce; locked says the caller holds s.mu (a restore, before the background
// poll starts).
func (q *qemuVM) poll(locked bool) {
	q.pollMu.Lock()
	defer q.pollMu.Unlock()
	q.devMu.Lock()
	devs := slices.Clone(q.devices)
	q.devMu.Unlock()
	for d := range q.active {
		if !slices.Contains(devs, d) {
			delete(q.active, d) // unplugged
		}
	}
	for _, d := range devs {
		if !d.virtio {
			continue
		}
		ok, err := q.driverOK(d)
		if err != nil {
			if d.hot {
				// Ejected since the snapshot: qemu no longer has it.
				continue
			}
			if !q.stopping.Load() && !errors.Is(err, qmp.ErrClosed) && !q.pollFailed {
				q.pollFailed = true // once: it would repeat every poll
				q.s.logf(0, "querying the status of %s: %v", d.chID, err)
			}
			return
		}
		if ok == q.active[d] {
			continue
		}
		q.active[d] = ok
		event := "reset"
		if ok {
			event = "activated"
		}
		if ok && d.vhostUser {
			// CH v53's vhost-user-blk announces no activation (its reset it does).
			continue
		}
		if !locked {
			q.s.mu.Lock()
		}
		// A device ejected meanwhile has had its device-removed: nothing follows it.
		if q.s.qemu == q && q.hasDevice(d) {
			q.s.emit("virtio-device", event, map[string]string{"id": d.chID})
		}
		if !locked {
			q.s.mu.Unlock()
		}
	}
}

// addDevice adds a hot-plugged device to the ones the poll watches.
func (q *qemuVM) addDevice(d qemuDevice) {
	q.devMu.Lock()
	defer q.devMu.Unlock()
	q.seq++
	d.seq = q.seq
	q.devices = append(q.devices, d)
}

// dropDevice stops watching the device with CH id chID.
func (q *qemuVM) dropDevice(chID string) {
	q.devMu.Lock()
	defer q.devMu.Unlock()
	q.devices = slices.DeleteFunc(q.devices, func(d qemuDevice) bool { return d.chID == chID })
}

// hasDevice reports whether d is still watched.
func (q *qemuVM) hasDevice(d qemuDevice) bool {
	q.devMu.Lock()
	defer q.devMu.Unlock()
	return slices.Contains(q.devices, d)
}

// checkVirtioPaths makes sure qemu can report the status of every virtio device the
// backend watches (x-query-virtio is new in qemu 7.2), so that activation events cannot be
// missing silently.
func (q *qemuVM) checkVirtioPaths(ctx context.Context) error {
	var list []struct {
		Path string `json:"path"`
	}
	if err := q.client.Execute(ctx, "x-query-virtio", nil, &list); err != nil {
		return fmt.Errorf("asking qemu for its virtio devices (qemu 7.2 or later is needed): %w", err)
	}
	known := map[string]bool{}
	for _, d := range list {
		known[d.Path] = true
	}
	for _, d := range q.devices {
		if d.virtio && !known[d.qomPath()] {
			return fmt.Errorf("qemu lists no virtio device %s at %s", d.chID, d.qomPath())
		}
	}
	return nil
}

func (q *qemuVM) driverOK(d qemuDevice) (bool, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	var st struct {
		Status struct {
			Statuses []string `json:"statuses"`
		} `json:"status"`
	}
	if err := q.client.Execute(ctx, "x-query-virtio-status", map[string]string{"path": d.qomPath()}, &st); err != nil {
		return false, err
	}
	for _, s := range st.Status.Statuses {
		if strings.HasPrefix(s, "VIRTIO_CONFIG_S_DRIVER_OK") {
			return true, nil
		}
	}
	return false, nil
}

// qmpLocked runs one QMP command on the running VM's qemu.
func (s *sim) qmpLocked(cmd string) error { return s.qmpArgsLocked(cmd, nil, nil) }

// qmpArgsLocked runs one QMP command with arguments and decodes its return
// into out (nil: ignored).
func (s *sim) qmpArgsLocked(cmd string, args, out any) error {
	if s.qemu == nil || s.qemu.client == nil {
		return errors.New("qemu is not running")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	return s.qemu.client.Execute(ctx, cmd, args, out)
}

// notInQemu answers a call the qemu backend does not support on a booted VM.
func notInQemu(op, what string) response {
	return apiError(http.StatusInternalServerError, op, "the qemu backend does not support "+what)
}

// rebootQemuLocked is vm.reboot: a system reset in the same qemu, as CH re-creates the VM
// in the same process. A paused VM runs again.
func (s *sim) rebootQemuLocked() []string {
	s.emit("vm", "rebooting", nil)
	if err := s.qemuPlugVsockLocked(); err != nil {
		return []string{"Error rebooting the VM in qemu", err.Error()}
	}
	if err := s.qmpLocked("system_reset"); err != nil {
		return []string{"Error rebooting the VM in qemu", err.Error()}
	}
	if s.state == statePaused {
		if err := s.qmpLocked("cont"); err != nil {
			return []string{"Error rebooting the VM in qemu", err.Error()}
		}
	}
	s.state = stateRunning
	s.emit("vm", "rebooted", nil)
	return nil
}

func (s *sim) buildVersion() string {
	if s.qemuMode() {
		return "v53.0-chsim-qemu"
	}
	return "v53.0-chsim"
}

// ProcessGuests reports whether the simulator, run with the flags args
// (its --sim-* flags), runs its guests as processes on the host (the sim
// backend, whose AppVM guest agent runs the workload as a host process)
// rather than in qemu.
func ProcessGuests(args []string) (bool, error) {
	cfg, err := parseArgs(append(slices.Clip(args), "--api-socket", "path=/dev/null"))
	if err != nil {
		return false, err
	}
	return cfg.Backend != BackendQemu, nil
}

// HostPrograms lists the programs the simulator, run with the flags args
// (its --sim-* flags; the rest may be left out), starts on the host
// besides itself, found as it finds them: with the qemu backend, qemu and
// vhost-device-vsock. The agent makes them reachable where the simulator
// runs confined. A program that cannot be found is left out: the boot that
// needs it fails then, saying so.
func HostPrograms(args []string) ([]string, error) {
	cfg, err := parseArgs(append(slices.Clip(args), "--api-socket", "path=/dev/null"))
	if err != nil {
		return nil, err
	}
	if cfg.Backend != BackendQemu {
		return nil, nil
	}
	var progs []string
	qemu := cfg.Qemu
	if qemu == "" {
		qemu = "qemu-system-x86_64"
	}
	if p, err := exec.LookPath(qemu); err == nil {
		progs = append(progs, p)
	}
	vsock := cfg.VsockBackend
	if vsock == "" {
		if p, err := exec.LookPath("vhost-device-vsock"); err == nil {
			vsock = p
		} else {
			vsock = DefaultVsockBackend
		}
	}
	if _, err := os.Stat(vsock); err == nil {
		progs = append(progs, vsock)
	}
	return progs, nil
}
