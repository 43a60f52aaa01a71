package engine

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"vmhost/chclient"
	"vmhost/internal/nofollow"
	"vmhost/qmp"
	"vmhost/vm/record"
)

// Supervision of running VMs (docs/design.md §5).
//
// Every running or paused VM has one monitor. It owns the VM's live
// process handles (Cloud Hypervisor and qemu-storage-daemon) from watch
// until it concludes or unwatch takes them back. It notices, and records
// as state and failure_reason:
//
//   - CH exiting: by a signal (failed, process_signal, ch_crash); with a
//     non-zero code (failed, process_exit, ch_crash); with code 0 after the
//     VM shut down (stopped, guest_shutdown, or operator_shutdown while an
//     ACPI shutdown was pending); with code 0 without that (failed,
//     process_exit, unknown). An adopted CH's exit status cannot be read, so
//     its event stream decides: `vm shutdown` then `vmm shutdown` is a clean
//     poweroff; anything else is missing_pid (the contract's process_exit
//     needs a code), ch_crash.
//   - the API socket gone (socket_gone) or refusing connections
//     (socket_dead), both ch_crash; pings unanswered for ping_timeout_secs
//     while the process lives (ping_timeout, vmm_hang);
//   - the root disk file gone (disk_missing, detail.path);
//   - qemu-storage-daemon exiting (failed, missing_pid, since qmp does not
//     expose QSD's exit status; cause unknown; the summary names
//     qemu-storage-daemon and the lost disks);
//   - events: a classic VM's first `virtio-device activated`, of any device,
//     since its last `vm booting` or `vm rebooting` turns display booting
//     into running (Cloud Hypervisor announces the devices it implements
//     itself: the balloon every VM has, the seed disk, the NICs; not the
//     vhost-user root disk); `guest panic` sets guest_panicked_at (the
//     state stays running).
//
// A failed or stopped VM runs nothing: after recording the verdict the
// monitor stops whatever is left (CH by SIGTERM then SIGKILL, QSD by QMP
// quit) and clears the runtime identity. Taps and disks stay; they belong
// to the record. Process deaths are seen at once (pidfd or wait); socket,
// disk and event-file changes when inotify reports them (filewatch.go),
// and in a sweep every sweepEvery; pings every ping_interval_secs.

const (
	// sweepEvery is how often a monitor checks its files and events
	// without being poked: the safety net for what inotify misses.
	sweepEvery = 30 * time.Second
	// pollEvery is how often a monitor without inotify watches checks.
	pollEvery = 100 * time.Millisecond
	// exitGrace is how long a socket problem waits for the process to exit
	// before it is blamed on the socket: a clean exit unlinks the socket
	// before the process is gone, and a dying process refuses first.
	exitGrace = 500 * time.Millisecond
	// stopGrace is how long a process that is being stopped gets per
	// signal.
	stopGrace = 2 * time.Second
)

// watchers is the set of monitors, one per watched VM.
type watchers struct {
	mu sync.Mutex
	m  map[string]*monitor
	wg sync.WaitGroup
	// closed: Close has begun; a VM booted meanwhile is left running
	// unwatched, as every VM is at Close (wg is waited on).
	closed bool
	// factsEvery overrides defaultFactsInterval (tests).
	factsEvery time.Duration
	// recovery is what New's reconciliation did (recover.go).
	recovery RecoveryReport
}

// monitor supervises one running VM.
type monitor struct {
	e         *Engine
	id        string
	ch        *chclient.Process
	qsd       *qmp.QSD // nil when the VM has no storage daemon
	apiSocket string
	events    string
	rootDisk  string // "" when there is none to watch
	chStart   time.Time
	// sockIno is the API socket's inode when watching began: a socket
	// file replaced under the same name is probed at once.
	sockIno uint64

	ctx    context.Context
	cancel context.CancelFunc
	found  chan finding
	ended  chan struct{} // closed when the monitor's goroutines are done
	// poked wakes the loop to check files and read events (filewatch.go).
	poked chan struct{}
	// polling is set when the files could not be watched: the loop then
	// checks every pollEvery.
	polling bool
	// evFile and evReader follow CH's event file (nil until it exists).
	evFile   *os.File
	evReader *chclient.EventReader
	evWarned bool
	// alive: the stream shows a device activated since the guest's last
	// (re)boot. It is judged at the end of each read that holds an
	// activation, so a replay of the whole stream after an agent restart,
	// or a read that holds an activation and a reboot after it, follows
	// the latest boot only.
	alive bool
	// checks counts the loop's file checks (tests: an idle VM has none).
	checks atomic.Int64
}

// finding is a problem a check goroutine reports to the monitor's loop.
type finding struct {
	kind string
	err  error
}

// watch starts supervising the VM id that was just booted. ch is its
// Cloud Hypervisor and qsd its storage daemon (nil when it has none); the
// monitor owns them until it concludes or unwatch returns them. A VM
// already watched keeps its monitor, and ch and qsd are released (not
// stopped). A guest panic recorded for an earlier boot is cleared.
func (e *Engine) watch(id string, ch *chclient.Process, qsd *qmp.QSD) {
	if r := e.recs.Get(id); r != nil && r.GuestPanickedAt != nil {
		if _, err := e.recs.Update(id, func(r *record.Record) { r.GuestPanickedAt = nil }); err != nil {
			e.log.Error("clearing the guest panic of an earlier boot", "id", id, "err", err)
		}
	}
	e.supervise(id, ch, qsd)
}

// supervise starts the monitor of a running VM (watch after a boot; the
// recovery after adopting the processes).
func (e *Engine) supervise(id string, ch *chclient.Process, qsd *qmp.QSD) {
	rec := e.recs.Get(id)
	if rec == nil {
		e.log.Error("watch: no record; processes left running unwatched", "id", id)
		return
	}
	m := &monitor{
		e: e, id: id, ch: ch, qsd: qsd,
		apiSocket: ch.APISocket,
		events:    e.layout().Events(id),
		chStart:   processStartWall(ch.StartTime),
		found:     make(chan finding, 4),
		ended:     make(chan struct{}),
		poked:     make(chan struct{}, 1),
	}
	if rt := rec.Runtime; rt != nil && rt.CH != nil && rt.CH.EventsPath != "" {
		m.events = rt.CH.EventsPath
	}
	if p := e.layout().RootDisk(id); fileExists(p) {
		m.rootDisk = p
	}
	m.sockIno = inode(m.apiSocket)
	m.watchFiles()
	m.ctx, m.cancel = context.WithCancel(context.Background())
	w := &e.mon
	w.mu.Lock()
	if w.m == nil {
		w.m = map[string]*monitor{}
	}
	if _, dup := w.m[id]; dup || w.closed {
		w.mu.Unlock()
		if !dup {
			e.log.Info("watch: the engine is closing; the VM runs on unwatched until the next start adopts it", "id", id)
		} else {
			e.log.Error("watch: VM already watched; new handles released", "id", id)
		}
		m.unwatchFiles()
		ch.Close()
		if qsd != nil {
			qsd.Close()
		}
		return
	}
	w.m[id] = m
	w.wg.Add(1)
	w.mu.Unlock()
	go func() {
		defer w.wg.Done()
		m.run()
	}()
}

// unwatch stops supervising id and hands its processes back (a planned
// stop, or a delete): the caller stops or releases them. It returns nils
// when id is not watched, e.g. because its monitor already concluded.
func (e *Engine) unwatch(id string) (*chclient.Process, *qmp.QSD) {
	w := &e.mon
	w.mu.Lock()
	m := w.m[id]
	delete(w.m, id)
	w.mu.Unlock()
	if m == nil {
		return nil, nil
	}
	m.cancel()
	<-m.ended
	return m.ch, m.qsd
}

// updateWatched stores f applied to the record of id if id is still
// watched, and reports whether it was. A monitor records its verdict under
// the same lock (conclude), so an action's write never lands on a VM whose
// end is already recorded.
func (e *Engine) updateWatched(id string, f func(*record.Record)) (bool, error) {
	e.mon.mu.Lock()
	defer e.mon.mu.Unlock()
	if e.mon.m[id] == nil {
		return false, nil
	}
	_, err := e.recs.Update(id, f)
	return true, err
}

// watched reports whether id has a monitor.
func (e *Engine) watched(id string) bool {
	e.mon.mu.Lock()
	defer e.mon.mu.Unlock()
	return e.mon.m[id] != nil
}

// Close stops supervising every VM and releases the process handles and
// connections without stopping anything: VMs keep running, as they do
// when the agent exits (KillMode=process), and the next New adopts them.
// Monitors that are concluding (stopping processes of a failed VM) finish
// first.
func (e *Engine) Close() error {
	w := &e.mon
	w.mu.Lock()
	ms := w.m
	w.m = nil
	w.closed = true
	w.mu.Unlock()
	for _, m := range ms {
		m.cancel()
	}
	for _, m := range ms {
		<-m.ended
		m.ch.Close()
		if m.qsd != nil {
			m.qsd.Close()
		}
	}
	w.wg.Wait()
	// The storage daemons of created VMs stay too; only the engine's
	// connections to them go.
	e.mu.Lock()
	for id, q := range e.live {
		q.Close()
		delete(e.live, id)
	}
	e.mu.Unlock()
	if e.fw != nil {
		e.fw.close()
	}
	e.closeConsoles()
	if j := e.jailer(); j != nil {
		if _, err := j.RemoveAgentCgroup(); err != nil {
			e.log.Warn("leaving the agent's cgroup", "err", err)
		}
	}
	return nil
}

func (m *monitor) run() {
	defer close(m.ended)
	defer m.unwatchFiles()
	var helpers sync.WaitGroup
	helpers.Add(2)
	go func() { defer helpers.Done(); m.ping() }()
	go func() { defer helpers.Done(); m.facts() }()
	defer helpers.Wait()

	var qsdDone <-chan struct{}
	if m.qsd != nil {
		qsdDone = m.qsd.Done()
	}
	every := sweepEvery
	if m.polling {
		every = pollEvery
	}
	tick := time.NewTicker(every)
	defer tick.Stop()
	m.readEvents() // what CH wrote before the watch began
	for {
		check := false
		select {
		case <-m.ctx.Done():
			return
		case <-m.ch.Done():
			m.conclude(m.exitVerdict())
			return
		case <-qsdDone:
			m.conclude(m.qsdVerdict())
			return
		case f := <-m.found:
			if v, ok := m.confirm(f); ok {
				m.conclude(v)
				return
			}
		case <-m.poked:
			check = true
		case <-tick.C:
			check = true
		}
		if !check {
			continue
		}
		m.checks.Add(1)
		m.readEvents()
		if f, bad := m.checkFiles(); bad {
			if v, ok := m.confirm(f); ok {
				m.conclude(v)
				return
			}
		}
	}
}

// watchFiles asks the engine's inotify watcher to poke m when its run
// directory or root disk changes; without it, m polls.
func (m *monitor) watchFiles() {
	fw := m.e.fw
	if fw == nil {
		m.polling = true
		return
	}
	watches := map[string]uint32{filepath.Dir(m.apiSocket): dirMask, filepath.Dir(m.events): dirMask}
	if m.rootDisk != "" {
		watches[m.rootDisk] = diskMask
	}
	if err := fw.add(m, watches); err != nil {
		m.polling = true
		m.e.log.Warn("cannot watch the VM's files with inotify; polling them instead", "id", m.id, "err", err)
	}
}

// unwatchFiles ends m's inotify watches and closes its event file.
func (m *monitor) unwatchFiles() {
	if m.e.fw != nil {
		m.e.fw.remove(m)
	}
	if m.evFile != nil {
		m.evFile.Close()
		m.evFile, m.evReader = nil, nil
	}
}

// checkFiles looks for the API socket and the root disk.
func (m *monitor) checkFiles() (finding, bool) {
	fi, err := os.Lstat(m.apiSocket)
	if errors.Is(err, fs.ErrNotExist) {
		return finding{kind: record.KindSocketGone, err: err}, true
	}
	if st, ok := statT(fi); ok && st.Ino != m.sockIno {
		// Replaced: a new file nobody may listen on.
		c, err := dialRunFile(m.apiSocket)
		if errors.Is(err, syscall.ECONNREFUSED) {
			return finding{kind: record.KindSocketDead, err: err}, true
		}
		if err == nil {
			c.Close()
			m.sockIno = st.Ino
		}
	}
	if m.rootDisk != "" {
		if _, err := os.Stat(m.rootDisk); errors.Is(err, fs.ErrNotExist) {
			return finding{kind: record.KindDiskMissing, err: err}, true
		}
	}
	return finding{}, false
}

// probeSocket looks at the API socket as it is now: gone, refusing
// connections, or fine.
func (m *monitor) probeSocket() (kind string, bad bool) {
	if _, err := os.Lstat(m.apiSocket); errors.Is(err, fs.ErrNotExist) {
		return record.KindSocketGone, true
	}
	c, err := dialRunFile(m.apiSocket)
	if errors.Is(err, syscall.ECONNREFUSED) {
		return record.KindSocketDead, true
	}
	if err == nil {
		c.Close()
		m.sockIno = inode(m.apiSocket)
	}
	return "", false
}

// confirm turns a finding into a verdict. A socket problem first waits
// exitGrace for the process to exit, since exiting is the likelier cause
// and says more; a disk problem stands on its own.
func (m *monitor) confirm(f finding) (verdict, bool) {
	if f.kind != record.KindDiskMissing {
		t := time.NewTimer(exitGrace)
		defer t.Stop()
		select {
		case <-m.ctx.Done():
			return verdict{}, false
		case <-m.ch.Done():
			return m.exitVerdict(), true
		case <-t.C:
		}
		if f.kind == record.KindSocketGone || f.kind == record.KindSocketDead {
			// Seen at once (inotify), a socket may have been in the
			// middle of a replacement: what it is now decides.
			kind, bad := m.probeSocket()
			if !bad {
				return verdict{}, false
			}
			f.kind = kind
		}
	}
	now := m.e.o.Now().UTC()
	fail := func(summary, cause string, d record.FailureDetail) (verdict, bool) {
		return verdict{state: record.StateFailed, reason: &record.FailureReason{DetectedAt: now, Summary: summary, Detail: d, Cause: cause}}, true
	}
	pid := m.ch.Pid
	switch f.kind {
	case record.KindSocketGone:
		return fail(fmt.Sprintf("cloud-hypervisor pid %d is running but its API socket %s is gone", pid, m.apiSocket),
			record.CauseCHCrash, record.FailureDetail{Kind: record.KindSocketGone})
	case record.KindSocketDead:
		return fail(fmt.Sprintf("cloud-hypervisor pid %d is running but its API socket %s refuses connections", pid, m.apiSocket),
			record.CauseCHCrash, record.FailureDetail{Kind: record.KindSocketDead})
	case record.KindPingTimeout:
		return fail(fmt.Sprintf("cloud-hypervisor pid %d did not answer vmm.ping within %ds", pid, m.e.pingTimeoutSecs()),
			record.CauseVMMHang, record.FailureDetail{Kind: record.KindPingTimeout})
	case record.KindDiskMissing:
		return fail(fmt.Sprintf("root disk %s is gone", m.rootDisk),
			record.CauseDiskMissing, record.FailureDetail{Kind: record.KindDiskMissing, Path: m.rootDisk})
	}
	return verdict{}, false
}

// verdict is what a monitor concludes: the state to record and why.
type verdict struct {
	state  record.State
	reason *record.FailureReason
}

// exitVerdict explains an exited CH; call it only after ch.Done.
func (m *monitor) exitVerdict() verdict {
	now := m.e.o.Now().UTC()
	ev := scanEvents(m.events)
	pid := m.ch.Pid
	stopped := func(code *int) verdict {
		rec := m.e.recs.Get(m.id)
		v := verdict{state: record.StateStopped, reason: &record.FailureReason{DetectedAt: now,
			Summary: "the guest powered off", Detail: record.FailureDetail{Kind: record.KindProcessExit, Code: code}, Cause: record.CauseGuestShutdown}}
		if rec != nil && rec.ShuttingDown {
			v.reason.Summary = "the guest powered off after an ACPI shutdown request"
			v.reason.Cause = record.CauseOperatorShutdown
		}
		return v
	}
	failed := func(summary, cause string, d record.FailureDetail) verdict {
		return verdict{state: record.StateFailed, reason: &record.FailureReason{DetectedAt: now, Summary: summary, Detail: d, Cause: cause}}
	}
	st, known := m.ch.Exit()
	switch {
	case !known && ev.poweredOff():
		zero := 0 // a `vmm shutdown` event comes only from CH's clean exit path, which exits 0
		return stopped(&zero)
	case !known:
		return failed(fmt.Sprintf("cloud-hypervisor pid %d (adopted after an agent restart) exited without a clean shutdown in its event stream; its exit status cannot be read", pid),
			record.CauseCHCrash, record.FailureDetail{Kind: record.KindMissingPID})
	case st.Signaled():
		sig := int(st.Signal)
		return failed(fmt.Sprintf("cloud-hypervisor pid %d was killed by signal %d (%v)", pid, sig, st.Signal),
			record.CauseCHCrash, record.FailureDetail{Kind: record.KindProcessSignal, Signum: &sig})
	case st.Code != 0:
		code := st.Code
		return failed(fmt.Sprintf("cloud-hypervisor pid %d exited with code %d%s", pid, code, logHint(m.e.lay.CHLog(m.id))),
			record.CauseCHCrash, record.FailureDetail{Kind: record.KindProcessExit, Code: &code})
	case ev.vmShutdown:
		zero := 0
		return stopped(&zero)
	default:
		zero := 0
		return failed(fmt.Sprintf("cloud-hypervisor pid %d exited with code 0 although the VM had not shut down", pid),
			record.CauseUnknown, record.FailureDetail{Kind: record.KindProcessExit, Code: &zero})
	}
}

// qsdVerdict explains an exited qemu-storage-daemon.
func (m *monitor) qsdVerdict() verdict {
	pid := 0
	if m.qsd != nil {
		pid = m.qsd.Pid
	}
	return verdict{state: record.StateFailed, reason: &record.FailureReason{
		DetectedAt: m.e.o.Now().UTC(),
		Summary: fmt.Sprintf("storage failed: qemu-storage-daemon pid %d exited, so the VM lost its root disk and volumes%s",
			pid, logHint(m.e.lay.QSDLog(m.id))),
		Detail: record.FailureDetail{Kind: record.KindMissingPID},
		Cause:  record.CauseUnknown,
	}}
}

// logHint gives "; log: <last line>" for a log file's last non-empty line.
func logHint(path string) string {
	b, err := nofollow.ReadFile(path)
	if err != nil {
		return ""
	}
	b = bytes.TrimRight(b, "\n")
	if i := bytes.LastIndexByte(b, '\n'); i >= 0 {
		b = b[i+1:]
	}
	if len(b) == 0 {
		return ""
	}
	if len(b) > 200 {
		b = b[len(b)-200:]
	}
	return "; log: " + oneLine(string(b))
}

// conclude records v, then stops what is left of the VM's processes and
// clears its runtime identity. It does nothing when the VM was unwatched
// meanwhile (a planned stop won the race). The verdict is recorded while
// the watched set is still locked, so an action that finds the VM
// unwatched (Stop) also finds it ended, never still running.
func (m *monitor) conclude(v verdict) {
	w, e := &m.e.mon, m.e
	if rec := e.recs.Get(m.id); rec != nil {
		if g := e.guest(rec); g != nil {
			g.Settle(m.id)
		}
	}
	w.mu.Lock()
	if w.m[m.id] != m {
		w.mu.Unlock()
		return
	}
	delete(w.m, m.id)
	m.cancel()
	_, err := e.recs.Update(m.id, func(r *record.Record) {
		r.State = v.state
		r.DisplayState = string(v.state)
		r.FailureReason = v.reason
		r.PID = 0
		r.ShuttingDown = false
	})
	w.mu.Unlock()
	if err != nil {
		e.log.Error("recording VM end", "id", m.id, "state", v.state, "err", err)
	}
	lvl := e.log.Error
	if v.state == record.StateStopped {
		lvl = e.log.Info
	}
	lvl("VM ended", "id", m.id, "state", v.state, "kind", v.reason.Detail.Kind, "cause", v.reason.Cause, "summary", v.reason.Summary)
	// The cleanup holds the VM's action lock, so a start that follows the
	// verdict at once waits for it rather than see its new processes
	// killed with the old ones (the VM's cgroup is emptied).
	unlock := e.recs.Lock(m.id)
	defer unlock()
	if r := e.recs.Get(m.id); r != nil && (r.State == record.StateRunning || r.State == record.StatePaused) {
		// Booted again before the lock came: only this monitor's own
		// processes go (that boot stopped what was recorded).
		if err := terminate(m.ch.Done(), m.ch.Signal); err != nil {
			e.log.Error("stopping cloud-hypervisor", "id", m.id, "pid", m.ch.Pid, "err", err)
		}
		m.ch.Close()
		if m.qsd != nil {
			ctx, cancel := context.WithTimeout(context.Background(), 2*stopGrace)
			m.qsd.Quit(ctx)
			cancel()
		}
		return
	}
	e.stopProcesses(m.id, m.ch, m.qsd)
	e.killJail(e.recs.Get(m.id)) // a stopped or failed VM runs nothing
}

// stopProcesses ends ch and qsd (either may be nil or already gone),
// releases them, and clears their identity from the record. Without qsd,
// a storage daemon the record names is stopped if it still runs (one
// adopted by pid only, whose monitor did not answer).
func (e *Engine) stopProcesses(id string, ch *chclient.Process, qsd *qmp.QSD) {
	if ch != nil {
		if err := terminate(ch.Done(), ch.Signal); err != nil {
			e.log.Error("stopping cloud-hypervisor", "id", id, "pid", ch.Pid, "err", err)
		}
		ch.Close()
	}
	if qsd != nil {
		select {
		case <-qsd.Done():
			qsd.Close()
		default:
			ctx, cancel := context.WithTimeout(context.Background(), 2*stopGrace)
			if err := qsd.Quit(ctx); err != nil {
				e.log.Warn("stopping qemu-storage-daemon", "id", id, "pid", qsd.Pid, "err", err)
			}
			cancel()
		}
	}
	var recorded *record.QSDRuntime
	if qsd == nil {
		if r := e.recs.Get(id); r != nil && r.Runtime.StorageDaemon() != nil {
			recorded = r.Runtime.QSD
			e.stopRecordedQSD(id, recorded)
		}
	}
	_, err := e.recs.Update(id, func(r *record.Record) {
		if rt := r.Runtime; rt != nil {
			if ch != nil && rt.CH != nil && rt.CH.Pid == ch.Pid {
				rt.CH = nil
			}
			if recorded != nil && rt.QSD != nil && rt.QSD.Pid == recorded.Pid && rt.QSD.StartTime == recorded.StartTime {
				rt.QSD = nil
			}
			if qsd != nil && rt.QSD != nil && rt.QSD.Pid == qsd.Pid {
				rt.QSD = nil
			}
		}
	})
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		e.log.Error("clearing process identity", "id", id, "err", err)
	}
}

// terminate sends SIGTERM, then SIGKILL after stopGrace, and waits for
// done.
func terminate(done <-chan struct{}, signal func(syscall.Signal) error) error {
	for _, sig := range []syscall.Signal{syscall.SIGTERM, syscall.SIGKILL} {
		select {
		case <-done:
			return nil
		default:
		}
		if err := signal(sig); err != nil && !errors.Is(err, os.ErrProcessDone) {
			return fmt.Errorf("sending %v: %w", sig, err)
		}
		t := time.NewTimer(stopGrace)
		select {
		case <-done:
			t.Stop()
			return nil
		case <-t.C:
		}
	}
	select {
	case <-done:
		return nil
	case <-time.After(stopGrace):
		return errors.New("still running after SIGKILL")
	}
}

// report hands a finding to the loop without blocking.
func (m *monitor) report(f finding) {
	select {
	case m.found <- f:
	default:
	}
}

// ping sends vmm.ping every ping interval over a kept-alive connection
// (chclient.Pinger: a failure re-dials; a socket file replaced by one that
// refuses connections is probed when inotify reports it).
func (m *monitor) ping() {
	c := chclient.NewPinger(m.apiSocket)
	defer c.Close()
	interval := time.Duration(m.e.o.Config.PingIntervalSecs) * time.Second
	if interval <= 0 {
		interval = time.Second
	}
	timeout := time.Duration(m.e.pingTimeoutSecs()) * time.Second
	// Every monitor pings on the same beat (whole multiples of the
	// interval on the wall clock), so the agent wakes once per interval
	// for all of them instead of once per VM at scattered times: 100 idle
	// VMs cost 5 ms of CPU per second this way, 31 ms scattered
	// (bench/idle-cpu.sh).
	align := time.NewTimer(time.Until(time.Now().Truncate(interval).Add(interval)))
	select {
	case <-m.ctx.Done():
		align.Stop()
		return
	case <-align.C:
	}
	t := time.NewTicker(interval)
	defer t.Stop()
	for first := true; ; first = false {
		if !first { // the first ping goes out on the first beat
			select {
			case <-m.ctx.Done():
				return
			case <-t.C:
			}
		}
		ctx, cancel := context.WithTimeout(m.ctx, timeout)
		err := c.Ping(ctx)
		cancel()
		switch {
		case err == nil, m.ctx.Err() != nil:
		case errors.Is(err, syscall.ENOENT):
			m.report(finding{kind: record.KindSocketGone, err: err})
		case errors.Is(err, syscall.ECONNREFUSED):
			m.report(finding{kind: record.KindSocketDead, err: err})
		case errors.Is(err, context.DeadlineExceeded):
			m.report(finding{kind: record.KindPingTimeout, err: err})
		}
	}
}

func (e *Engine) pingTimeoutSecs() int {
	if t := e.o.Config.PingTimeoutSecs; t > 0 {
		return t
	}
	return 10
}

// readEvents reads what CH appended to its event file since the last read
// (from its start the first time: replaying it after an agent restart is
// harmless, every effect is idempotent) and records the guest's sign of
// life and its panics.
func (m *monitor) readEvents() {
	if m.evFile == nil {
		f, err := nofollow.Open(m.events)
		if err != nil {
			if !m.evWarned {
				m.evWarned = true
				m.e.log.Warn("cannot open the CH event stream yet", "id", m.id, "err", err)
			}
			return
		}
		m.evFile, m.evReader = f, chclient.NewEventReader(f)
		m.evReader.Skip = unwatchedEvent
	}
	activations := false // in this read
	for {
		ev, err := m.evReader.Next()
		if err == nil {
			activations = activations || ev.Source == "virtio-device" && ev.Event == "activated"
			m.onEvent(ev)
			continue
		}
		if errors.As(err, new(*chclient.MalformedEventError)) {
			m.e.log.Warn("malformed CH event", "id", m.id, "err", err)
			continue
		}
		if !errors.Is(err, io.EOF) {
			m.e.log.Warn("reading the CH event stream", "id", m.id, "err", err)
		}
		if activations && m.alive {
			m.showedLife()
		}
		return // the end of what CH wrote so far
	}
}

// unwatchedEvent reports whether a raw event is surely none of those
// onEvent acts on, so replaying a stream after an agent restart decodes
// only those: boots (booting, rebooting), activations, device removals,
// guest panics.
func unwatchedEvent(raw []byte) bool {
	for _, w := range [][]byte{[]byte("activated"), []byte("booting"), []byte("device-removed"), []byte("panic")} {
		if bytes.Contains(raw, w) {
			return false
		}
	}
	return true
}

// showedLife turns a booting classic VM's display running. An AppVM's sign
// of life is its guest agent's first heartbeat (docs/design.md §5), which
// package appvm records; its devices activating only means its kernel
// found them.
func (m *monitor) showedLife() {
	m.update(func(r *record.Record) func(*record.Record) {
		if r.Mode == record.ModeAppVM || r.State != record.StateRunning || r.DisplayState != record.DisplayBooting {
			return nil
		}
		return func(r *record.Record) { r.DisplayState = string(record.StateRunning) }
	})
}

func (m *monitor) onEvent(ev chclient.Event) {
	switch {
	case ev.Source == "vm" && (ev.Event == "booting" || ev.Event == "rebooting"):
		m.alive = false
	case ev.Source == "virtio-device" && ev.Event == "activated":
		m.alive = true
	case ev.Source == "vm" && ev.Event == "device-removed":
		m.e.deviceRemoved(m.id, ev.Properties["id"])
	case ev.Source == "guest" && ev.Event == "panic":
		// The event's time, not the time it was read, so replaying the
		// stream after a restart gives the same value.
		at := m.chStart.Add(ev.Timestamp).UTC().Truncate(time.Millisecond)
		m.update(func(r *record.Record) func(*record.Record) {
			if r.GuestPanickedAt != nil && !at.After(*r.GuestPanickedAt) {
				return nil
			}
			return func(r *record.Record) { r.GuestPanickedAt = &at }
		})
		m.e.log.Warn("guest panicked", "id", m.id, "event", ev.Properties["event"])
	}
}

// update stores a change of the VM's record: change looks at the record
// (never modifying it) and returns what to set, or nil when nothing is to
// change, in which case nothing is written. Replaying an event stream
// after an agent restart then costs a look per event, not a copy.
func (m *monitor) update(change func(*record.Record) func(*record.Record)) {
	if cur := m.e.recs.Get(m.id); cur == nil || change(cur) == nil {
		return
	}
	if _, err := m.e.recs.Update(m.id, func(r *record.Record) {
		if set := change(r); set != nil {
			set(r)
		}
	}); err != nil {
		m.e.log.Error("recording VM event", "id", m.id, "err", err)
	}
}

// eventSummary is what a whole event stream says about how CH ended.
type eventSummary struct {
	vmShutdown  bool // the VM shut down and was not booted again
	vmmShutdown bool // CH went through its clean exit path
}

// poweredOff reports whether the stream shows a clean VM shutdown and VMM
// exit.
func (e eventSummary) poweredOff() bool { return e.vmShutdown && e.vmmShutdown }

// scanEvents reads the event file at path to its end.
func scanEvents(path string) eventSummary {
	var sum eventSummary
	f, err := nofollow.Open(path)
	if err != nil {
		return sum
	}
	defer f.Close()
	er := chclient.NewEventReader(bufio.NewReader(f))
	for {
		ev, err := er.Next()
		if errors.Is(err, io.EOF) {
			return sum
		}
		if err != nil {
			if errors.As(err, new(*chclient.MalformedEventError)) {
				continue
			}
			return sum
		}
		switch {
		case ev.Source == "vm" && ev.Event == "shutdown":
			sum.vmShutdown = true
		case ev.Source == "vm" && (ev.Event == "booting" || ev.Event == "booted"):
			sum.vmShutdown = false
		case ev.Source == "vmm" && ev.Event == "shutdown":
			sum.vmmShutdown = true
		}
	}
}

// clockTicks is USER_HZ, the unit of /proc/PID/stat's start time; it is
// 100 on every Linux architecture Go supports.
const clockTicks = 100

var (
	bootTimeOnce sync.Once
	bootTime     time.Time
)

// processStartWall converts a start time in clock ticks since boot to wall
// time (to about a second: btime in /proc/stat is whole seconds).
func processStartWall(ticks uint64) time.Time {
	bootTimeOnce.Do(func() {
		b, err := os.ReadFile("/proc/stat")
		if err != nil {
			return
		}
		for line := range bytes.SplitSeq(b, []byte("\n")) {
			if v, ok := bytes.CutPrefix(line, []byte("btime ")); ok {
				if n, err := strconv.ParseInt(string(bytes.TrimSpace(v)), 10, 64); err == nil {
					bootTime = time.Unix(n, 0)
				}
			}
		}
	})
	return bootTime.Add(time.Duration(ticks) * time.Second / clockTicks)
}

// dialRunFile dials a socket of a VM's run directory, which the VM owns
// when it is confined: a link there is never followed (it could lead to
// another VM's socket).
func dialRunFile(path string) (net.Conn, error) {
	d := nofollow.Dialer{Dialer: net.Dialer{Timeout: time.Second}}
	return d.DialUnix(context.Background(), path)
}

// inode returns the inode of path (not following a symlink), or 0.
func inode(path string) uint64 {
	fi, err := os.Lstat(path)
	if err != nil {
		return 0
	}
	st, _ := statT(fi)
	return st.Ino
}

func statT(fi fs.FileInfo) (*syscall.Stat_t, bool) {
	if fi == nil {
		return nil, false
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	return st, ok
}

func fileExists(path string) bool {
	_, err := os.Stat(path)
	return err == nil
}

func oneLine(s string) string { return strings.Join(strings.Fields(s), " ") }
