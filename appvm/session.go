package appvm

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"sync"
	"time"

	"vmhost/appvm/guest/proto"
	"vmhost/config"
	"vmhost/events"
	"vmhost/vm"
	"vmhost/vm/records"
)

// GuestOptions configure Guests. Records, Config and Layout are required;
// zero fields of the rest take the defaults.
type GuestOptions struct {
	// Records owns the records the guest facts are stored in.
	Records *records.Registry
	// Config is the host configuration: appvm_modules go into the
	// initramfs.
	Config *config.Config
	// Layout is where the VMs' files are (workload logs, the initramfs).
	Layout vm.Layout
	// Now gives the time of the guest facts; default time.Now.
	Now func() time.Time
	// Binary is the vmhost binary the initramfs holds as the guest agent;
	// default os.Executable.
	Binary string
	// HeartbeatSecs is the guest agent's heartbeat interval, sent in the
	// Spec; default 5.
	HeartbeatSecs int
	// StaleAfter is how many heartbeat intervals may pass without a
	// heartbeat before a running AppVM shows heartbeat_stale; default 3.
	StaleAfter int
	// HeartbeatPersistEvery bounds how often last_heartbeat_at is written
	// to the record (the live value is kept in memory); default 60s.
	HeartbeatPersistEvery time.Duration
	// LogMaxBytes caps each AppVM's workload log (logs.go); default
	// Config.WorkloadLogMaxBytes, else DefaultLogMaxBytes.
	LogMaxBytes int64
	// HelloTimeout bounds the wait for the guest agent's Hello after it
	// connects; default 30s.
	HelloTimeout time.Duration
	// Logger receives session events; never a secret.
	Logger *slog.Logger
	// Events gets heartbeat_stale events; nil publishes none. (The other
	// AppVM events come from the records: records.Publish.)
	Events events.Publisher
}

func (o *GuestOptions) defaults() {
	if o.HeartbeatSecs <= 0 {
		o.HeartbeatSecs = 5
	}
	if o.StaleAfter <= 0 {
		o.StaleAfter = 3
	}
	if o.HeartbeatPersistEvery <= 0 {
		o.HeartbeatPersistEvery = time.Minute
	}
	if o.LogMaxBytes <= 0 && o.Config != nil {
		o.LogMaxBytes = o.Config.WorkloadLogMaxBytes
	}
	if o.LogMaxBytes <= 0 {
		o.LogMaxBytes = DefaultLogMaxBytes
	}
	if o.HelloTimeout <= 0 {
		o.HelloTimeout = 30 * time.Second
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
}

// Guests is the host end of every AppVM's guest agent: one session per
// AppVM, on the listener of its hybrid vsock port, that sends the spec,
// keeps the workload log and records what the agent reports (heartbeats,
// lease, health, the workload's end) in the record's guest facts. It is
// what the engine drives at the edges of an AppVM's boot (engine.Guest:
// Port, Boot, Adopt, End, Stop, Settle, Mount, Unmount), wired once
// (engine.Options.Guest); Service reads its live facts for the views and
// asks it nothing else. It is safe for concurrent use.
type Guests struct {
	o      GuestOptions
	recs   *records.Registry
	log    *slog.Logger
	initrd initramfsBuild
	// binary is the vmhost binary the initramfs holds.
	binary func() (string, error)

	mu   sync.Mutex
	byID map[string]*session

	// migrateMu serializes the migrations of workload logs of the format
	// before (logmigrate.go).
	migrateMu sync.Mutex
}

// session is the host end for one AppVM: the hybrid vsock listener
// <vsock.sock>_1024, the guest agent's current connection, and the live
// facts that are not written to the record on every message.
type session struct {
	g    *Guests
	id   string
	l    net.Listener
	done chan struct{} // closed by close

	mu sync.Mutex
	nc net.Conn
	// served is closed when the serve of nc has returned.
	served chan struct{}
	// lastHB is the receipt time of the latest heartbeat (wall clock of
	// the service, for the view; mono for staleness).
	lastHB, lastHBMono time.Time
	persistedHB        time.Time
	// upSince is the first heartbeat of the current boot (restart policy:
	// a stable period resets the restart count).
	upSince time.Time
	// resumedMono is when a start from a saved state began this session
	// (Resume): until the restored guest's first heartbeat, staleness
	// counts from there, not from the heartbeat before the suspend.
	resumedMono time.Time
	// stopRequested is set by Shutdown: the workload's end is the
	// operator's doing, never a reason to restart.
	stopRequested bool
	// booted: the boot this session serves is recorded (state running or
	// paused). The guest agent may be quicker than that record write:
	// its workload can end while the record still shows the state before
	// the boot (created, stopped, failed). bootEnd is closed, with
	// endRec, when the record then leaves running and paused: that boot
	// ended (the restart policy waits for it).
	booted  bool
	bootEnd chan struct{}
	endRec  *vm.Record
	closed  bool
	logs    *workloadLog
	// ackTimer sends the LogAck of the chunks stored (a version 3 guest),
	// logAckDelay after the first chunk not acknowledged; ackArmed while
	// it runs; acked is the last Seq acknowledged on this connection.
	ackTimer *time.Timer
	ackArmed bool
	acked    uint64
	// stale fires when no heartbeat came for the stale limit: one
	// heartbeat_stale event per silence, re-armed by each heartbeat.
	stale *time.Timer
	// version is the protocol version of nc's guest (its Hello's V).
	version int
	// mountSeq numbers Mount and Unmount requests; mountWait holds the
	// callers waiting for their MountResult, by Seq.
	mountSeq  uint64
	mountWait map[uint64]chan *proto.MountResult
}

// NewGuests returns the host end of the AppVMs' guest agents; give it to
// the engine (engine.Options.Guest) and to the Service (Config.Guests).
func NewGuests(o GuestOptions) *Guests {
	o.defaults()
	g := &Guests{o: o, recs: o.Records, log: o.Logger.With("component", "appvm-session"), binary: os.Executable, byID: map[string]*session{}}
	if o.Binary != "" {
		g.binary = func() (string, error) { return o.Binary, nil }
	}
	g.recs.Watch(g.followBoots)
	return g
}

// followBoots follows the records' changes (records.Registry.Watch): the
// session of an AppVM learns when its boot is recorded and when it ended.
// Every change is told in order, so a boot that ends at once is not missed.
func (g *Guests) followBoots(c records.Change) {
	if c.New == nil || c.New.Mode != vm.ModeAppVM {
		return
	}
	if ss := g.get(c.New.ID); ss != nil {
		ss.followBoot(c.New)
	}
}

// followBoot notes rec, a new version of the session's record: running or
// paused, its boot is recorded; any other state after that ends the boot.
func (ss *session) followBoot(rec *vm.Record) {
	alive := rec.State == vm.StateRunning || rec.State == vm.StatePaused
	ss.mu.Lock()
	defer ss.mu.Unlock()
	switch {
	case alive:
		ss.booted = true
	case ss.booted && ss.endRec == nil:
		ss.endRec = rec
		close(ss.bootEnd)
	}
}

// bootEnded returns the record of the end of the session's boot, once
// it ended (bootEnd is closed).
func (ss *session) bootEnded() *vm.Record {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	return ss.endRec
}

func (g *Guests) get(id string) *session {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.byID[id]
}

// serve starts the host end for VM id on l, the listener of the guest
// agent's vsock port (made before CH boots, as the guest dials at once),
// replacing a previous one, and accepts guest agent connections until
// forgotten. booted says the boot it serves is recorded already (an
// adopted AppVM); a new boot's is recorded after serve.
func (g *Guests) serve(id string, l net.Listener, booted bool) *session {
	g.forget(id)
	ss := &session{g: g, id: id, l: l, done: make(chan struct{}), booted: booted, bootEnd: make(chan struct{})}
	g.mu.Lock()
	g.byID[id] = ss
	g.mu.Unlock()
	if booted {
		// An end recorded before ss was registered was told to no one.
		if rec := g.recs.Get(id); rec != nil {
			ss.followBoot(rec)
		}
	}
	go ss.accept()
	return ss
}

// forget closes the host end of VM id, if any.
func (g *Guests) forget(id string) {
	g.mu.Lock()
	ss := g.byID[id]
	delete(g.byID, id)
	g.mu.Unlock()
	if ss != nil {
		ss.close()
	}
}

func (ss *session) close() {
	ss.mu.Lock()
	if ss.closed {
		ss.mu.Unlock()
		return
	}
	ss.closed = true
	close(ss.done)
	if ss.stale != nil {
		ss.stale.Stop()
	}
	nc, logs := ss.nc, ss.logs
	ss.nc, ss.logs = nil, nil
	if ss.ackTimer != nil {
		ss.ackTimer.Stop()
	}
	ss.mu.Unlock()
	ss.l.Close()
	if nc != nil {
		nc.Close()
	}
	if logs != nil {
		logs.Close()
	}
}

func (ss *session) accept() {
	for {
		c, err := ss.l.Accept()
		if err != nil {
			return
		}
		ss.mu.Lock()
		if ss.closed {
			ss.mu.Unlock()
			c.Close()
			return
		}
		// One connection per guest: a new one (a redial) replaces the old.
		old := ss.nc
		served := make(chan struct{})
		ss.nc, ss.served = c, served
		ss.mu.Unlock()
		if old != nil {
			old.Close()
		}
		go func() {
			defer close(served)
			ss.serve(c)
		}()
	}
}

// update applies f to the AppVM's guest facts in a new record version.
func (ss *session) update(f func(r *vm.Record, gst *vm.AppVMGuest)) (*vm.Record, error) {
	rec, err := ss.g.recs.Update(ss.id, func(r *vm.Record) {
		if r.AppVM == nil {
			return
		}
		if r.AppVM.Guest == nil {
			r.AppVM.Guest = &vm.AppVMGuest{}
		}
		f(r, r.AppVM.Guest)
	})
	if err != nil {
		ss.g.log.Error("recording guest facts", "id", ss.id, "err", err)
	}
	return rec, err
}

func (ss *session) now() time.Time { return ss.g.o.Now().UTC() }

// serve runs one connection of the guest agent: Hello, the Spec (unless
// it resumes), then its messages until the connection ends.
func (ss *session) serve(c net.Conn) {
	log := ss.g.log.With("id", ss.id)
	defer func() {
		c.Close()
		ss.mu.Lock()
		if ss.nc == c {
			ss.nc = nil
		}
		ss.mu.Unlock()
	}()
	conn := proto.NewConn(c)
	c.SetReadDeadline(time.Now().Add(ss.g.o.HelloTimeout))
	m, err := conn.Recv()
	if err != nil {
		log.Warn("guest agent connection without a hello", "err", err)
		return
	}
	hello, ok := m.(*proto.Hello)
	if !ok {
		log.Warn("guest agent spoke first with something else than hello", "type", m.Type())
		return
	}
	c.SetReadDeadline(time.Time{})
	ss.mu.Lock()
	if ss.nc == c {
		ss.version = hello.V
	}
	ss.mu.Unlock()
	rec := ss.g.recs.Get(ss.id)
	if rec == nil || rec.Mode != vm.ModeAppVM {
		return
	}
	if err := ss.openLogs(rec); err != nil {
		log.Error("workload log unavailable", "err", err)
	}
	ss.beginLogs(hello)
	if hello.Resume {
		log.Info("guest agent resumed", "boot_id", hello.BootID)
		ss.update(func(r *vm.Record, gst *vm.AppVMGuest) {
			gst.LogStreamDetached = false
			gst.BootID = hello.BootID
		})
	} else {
		spec := GuestSpec(rec, ss.g.o.HeartbeatSecs)
		spec.V = hello.V // the same Spec in every version so far
		ss.mu.Lock()
		ss.upSince = time.Time{}
		ss.mu.Unlock()
		// Recorded before it is sent: an agent that dies in between leaves
		// a guest still waiting for its Spec, which dials again and gets
		// it from the next start (never a guest running a spec the record
		// says is pending).
		ss.update(func(r *vm.Record, gst *vm.AppVMGuest) {
			if r.AppVM.SpecGen == rec.AppVM.SpecGen {
				r.AppVM.SpecPending = false // this boot runs the stored spec
			}
			gst.BootID = hello.BootID
			gst.HeartbeatSecs = spec.HeartbeatSecs
			gst.Health, gst.HealthStreak, gst.Lease = "", 0, nil
			gst.LogStreamDetached = false
		})
		if err := conn.Send(spec); err != nil {
			log.Warn("sending the spec to the guest agent", "err", err)
			return
		}
		log.Info("guest agent says hello; spec sent", "boot_id", hello.BootID, "agent_version", hello.AgentVersion)
	}
	for {
		m, err := conn.Recv()
		if err != nil {
			if !errors.Is(err, net.ErrClosed) {
				log.Info("guest agent connection ended", "err", err)
			}
			return
		}
		ss.handle(m, hello.BootID)
	}
}

func (ss *session) openLogs(rec *vm.Record) error {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	if ss.logs != nil || ss.closed {
		return nil
	}
	l := ss.g.o.Layout
	if err := os.MkdirAll(l.VMDir(ss.id), 0o700); err != nil {
		return err
	}
	if err := ss.g.migrateLog(rec); err != nil {
		ss.g.log.Warn("migrating the workload log", "id", ss.id, "err", err)
	}
	w, err := openWorkloadLog(WorkloadLog(l, ss.id), ss.g.o.LogMaxBytes, rec.Secrets.Redactor())
	if err != nil {
		return err
	}
	ss.logs = w
	return nil
}

// beginLogs tells the workload log of a new connection of the guest
// agent (its boot, whether it replays what was not acknowledged, and the
// last Log it numbered, which a restore from a snapshot takes back).
func (ss *session) beginLogs(hello *proto.Hello) {
	ss.mu.Lock()
	w := ss.logs
	ss.acked = 0
	ss.mu.Unlock()
	if w == nil {
		return
	}
	if err := w.Begin(hello.BootID, hello.Resume && hello.V >= proto.Version3, hello.LogSeq); err != nil {
		ss.g.log.Error("writing workload log", "id", ss.id, "err", err)
	}
}

// logAckDelay is how long stored chunks wait for their acknowledgement:
// one fsync and one LogAck cover all the chunks stored meanwhile.
const logAckDelay = 100 * time.Millisecond

// armAck has the chunks stored so far acknowledged to a version 3 guest
// soon (sendLogAck).
func (ss *session) armAck() {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	if ss.version < proto.Version3 || ss.ackArmed || ss.closed {
		return
	}
	ss.ackArmed = true
	if ss.ackTimer == nil {
		ss.ackTimer = time.AfterFunc(logAckDelay, ss.sendLogAck)
		return
	}
	ss.ackTimer.Reset(logAckDelay)
}

// sendLogAck fsyncs the workload log and tells the guest up to which of
// its chunks everything is stored, so that it forgets them (and does not
// replay them to the next agent).
func (ss *session) sendLogAck() {
	ss.mu.Lock()
	ss.ackArmed = false
	w, nc := ss.logs, ss.nc
	ss.mu.Unlock()
	if w == nil || nc == nil {
		return
	}
	seq, err := w.Ack()
	if err != nil {
		ss.g.log.Error("syncing workload log", "id", ss.id, "err", err)
		return
	}
	ss.mu.Lock()
	if seq <= ss.acked || ss.nc != nc {
		ss.mu.Unlock()
		return
	}
	ss.acked = seq
	ss.mu.Unlock()
	if err := sendToGuest(nc, &proto.LogAck{Seq: seq}); err != nil {
		ss.g.log.Warn("acknowledging workload output to the guest agent", "id", ss.id, "err", err)
	}
}

// handle records what one guest message says; boot is the boot id of
// the connection it came on.
func (ss *session) handle(m proto.Message, boot string) {
	switch m := m.(type) {
	case *proto.Heartbeat:
		ss.heartbeat()
	case *proto.Lease:
		at := ss.now()
		ss.update(func(r *vm.Record, gst *vm.AppVMGuest) {
			gst.Lease = &vm.GuestLease{IP: m.IP, Prefix: m.Prefix, Gateway: m.Gateway, DNS: m.DNS, Search: m.Search,
				LeaseSecs: m.LeaseSecs, Hostname: m.Hostname, ReportedAt: at}
		})
	case *proto.Started:
		ss.g.log.Info("workload started", "id", ss.id, "pid", m.PID)
	case *proto.Exit:
		ss.flushLogs()
		ss.update(func(r *vm.Record, gst *vm.AppVMGuest) {
			gst.ExitCode, gst.ExitSignal, gst.Fatal = m.Code, m.Signal, ""
		})
		if m.Code != nil {
			ss.g.log.Info("workload exited", "id", ss.id, "code", *m.Code)
		} else {
			ss.g.log.Info("workload exited", "id", ss.id, "signal", m.Signal)
		}
		ss.ackEnd()
	case *proto.Fatal:
		ss.flushLogs()
		ss.update(func(r *vm.Record, gst *vm.AppVMGuest) {
			gst.ExitCode, gst.ExitSignal, gst.Fatal = nil, 0, m.Message
		})
		ss.g.log.Warn("workload could not start", "id", ss.id, "fatal", m.Message)
		ss.ackEnd()
	case *proto.Health:
		ss.update(func(r *vm.Record, gst *vm.AppVMGuest) {
			gst.Health, gst.HealthStreak = m.Status, uint32(m.Streak)
		})
	case *proto.MountResult:
		ss.mu.Lock()
		ch := ss.mountWait[m.Seq]
		delete(ss.mountWait, m.Seq)
		ss.mu.Unlock()
		if ch != nil {
			ch <- m
		}
	case *proto.Log:
		ss.mu.Lock()
		w := ss.logs
		ss.mu.Unlock()
		if w != nil {
			if err := w.Append(m, boot, ss.now()); err != nil {
				ss.g.log.Error("writing workload log", "id", ss.id, "err", err)
			}
			ss.armAck()
		}
	}
}

// sendToGuest sends one host message on the guest agent's connection nc,
// beside the serve loop reading it: a guest that stops reading fails the
// send after 5 s instead of blocking the caller. (Writes on one net.Conn
// never interleave, so concurrent senders keep their frames whole.)
func sendToGuest(nc net.Conn, m proto.Message) error {
	nc.SetWriteDeadline(time.Now().Add(5 * time.Second))
	defer nc.SetWriteDeadline(time.Time{})
	return proto.NewConn(nc).Send(m)
}

// ackEnd tells the guest that its workload's end is recorded, so that it
// may power off (a version 1 guest does so unasked).
func (ss *session) ackEnd() {
	ss.mu.Lock()
	nc, version := ss.nc, ss.version
	ss.mu.Unlock()
	if nc == nil || version < proto.Version2 {
		return
	}
	if err := sendToGuest(nc, &proto.ExitAck{}); err != nil {
		ss.g.log.Warn("acknowledging the workload's end to the guest agent", "id", ss.id, "err", err)
	}
}

// flushLogs writes the workload output the log held back: the guest sends
// all of it before Exit (or Fatal), so nothing can complete it any more.
func (ss *session) flushLogs() {
	ss.mu.Lock()
	w := ss.logs
	ss.mu.Unlock()
	if w == nil {
		return
	}
	if err := w.Flush(); err != nil {
		ss.g.log.Error("writing workload log", "id", ss.id, "err", err)
	}
	ss.armAck()
}

// heartbeat keeps the receipt time in memory; the record gets the first
// of a boot (with display running: the AppVM's sign of life) and then one
// every HeartbeatPersistEvery.
func (ss *session) heartbeat() {
	now := ss.now()
	rec := ss.g.recs.Get(ss.id)
	limit := ss.g.staleLimit(rec)
	// The guest may be quicker than the boot's record write: until a
	// heartbeat finds the boot recorded, each one is stored, so the first
	// that does turns display running.
	booting := rec != nil && rec.State == vm.StateRunning && rec.DisplayState == vm.DisplayBooting
	ss.mu.Lock()
	first := ss.upSince.IsZero()
	if first {
		ss.upSince = time.Now()
	}
	ss.lastHB, ss.lastHBMono = now, time.Now()
	ss.armStale(limit)
	persist := first || booting || now.Sub(ss.persistedHB) >= ss.g.o.HeartbeatPersistEvery
	if persist {
		ss.persistedHB = now
	}
	ss.mu.Unlock()
	if !persist {
		return
	}
	ss.update(func(r *vm.Record, gst *vm.AppVMGuest) {
		gst.LastHeartbeatAt = &now
		if r.State == vm.StateRunning && r.DisplayState == vm.DisplayBooting {
			r.DisplayState = string(vm.StateRunning)
		}
	})
}

// staleLimit is how long rec's guest may send no heartbeat before it is
// stale: StaleAfter of the interval its Spec asked for.
func (g *Guests) staleLimit(rec *vm.Record) time.Duration {
	interval := time.Duration(g.o.HeartbeatSecs) * time.Second
	if rec != nil && rec.AppVM != nil && rec.AppVM.Guest != nil && rec.AppVM.Guest.HeartbeatSecs > 0 {
		interval = time.Duration(rec.AppVM.Guest.HeartbeatSecs) * time.Second
	}
	return time.Duration(g.o.StaleAfter) * interval
}

// armStale (re)starts the stale timer to fire after d; ss.mu is held.
func (ss *session) armStale(d time.Duration) {
	if ss.closed {
		return
	}
	if ss.stale == nil {
		ss.stale = time.AfterFunc(d, ss.staleFired)
		return
	}
	ss.stale.Reset(d)
}

// staleFired publishes heartbeat_stale for a running AppVM whose guest
// sent nothing for the stale limit, as its view now shows.
func (ss *session) staleFired() {
	rec := ss.g.recs.Get(ss.id)
	if rec == nil || rec.State != vm.StateRunning || rec.AppVM == nil {
		return
	}
	if _, stale := ss.g.liveHeartbeat(rec); !stale {
		return // a heartbeat came as the timer fired
	}
	if p := ss.g.o.Events; p != nil {
		p.Publish(records.VMEvent(events.HeartbeatStale, rec))
	}
}

// liveHeartbeat returns the latest heartbeat time seen by this process
// and whether it is older than the stale limit.
func (g *Guests) liveHeartbeat(rec *vm.Record) (at time.Time, stale bool) {
	limit := g.staleLimit(rec)
	if ss := g.get(rec.ID); ss != nil {
		ss.mu.Lock()
		at, mono, resumed := ss.lastHB, ss.lastHBMono, ss.resumedMono
		ss.mu.Unlock()
		if !at.IsZero() {
			return at, time.Since(mono) > limit
		}
		if !resumed.IsZero() {
			var last time.Time
			if gst := rec.AppVM.Guest; gst != nil && gst.LastHeartbeatAt != nil {
				last = *gst.LastHeartbeatAt
			}
			return last, time.Since(resumed) > limit
		}
	}
	if gst := rec.AppVM.Guest; gst != nil && gst.LastHeartbeatAt != nil {
		return *gst.LastHeartbeatAt, g.o.Now().Sub(*gst.LastHeartbeatAt) > limit
	}
	return time.Time{}, false
}

// Port is the vsock port the guest agent dials (engine.Guest).
func (g *Guests) Port() uint32 { return proto.Port }

// Boot readies the host end of AppVM rec for a boot (engine.Guest): it
// serves the guest agent on l (the engine listened before CH boots, as the
// agent dials at once; Boot owns l from here), forgets the facts of the
// previous boot and its workload's end, and returns the initramfs that
// holds the agent, for a boot of kernel (empty with firmware). The
// initramfs holds the vmhost binary itself as /init, so in production
// that binary must be static (CGO_ENABLED=0).
func (g *Guests) Boot(_ context.Context, rec *vm.Record, kernel string, l net.Listener) (string, error) {
	bin, err := g.binary()
	if err != nil {
		l.Close()
		return "", &vm.HostError{Kind: vm.HostInternal, Op: "booting AppVM " + rec.ID, Err: fmt.Errorf("finding the vmhost binary for the initramfs: %w", err)}
	}
	initrd, err := g.initrd.get(g.o.Layout.RunDir, bin, kernel, g.o.Config.AppVMModules)
	if err != nil {
		l.Close()
		return "", &vm.HostError{Kind: vm.HostInternal, Op: "booting AppVM " + rec.ID, Err: err}
	}
	g.serve(rec.ID, l, false)
	// A new boot: the live facts of the previous one, and its workload's
	// end, no longer hold.
	_, err = g.recs.Update(rec.ID, func(r *vm.Record) {
		if gst := r.AppVM.Guest; gst != nil {
			gst.BootID, gst.LastHeartbeatAt, gst.Lease, gst.Health, gst.HealthStreak, gst.LogStreamDetached = "", nil, nil, "", 0, false
			gst.ExitCode, gst.ExitSignal, gst.Fatal = nil, 0, ""
		}
	})
	if err != nil {
		g.forget(rec.ID)
		return "", &vm.HostError{Kind: vm.HostStorage, Op: "booting AppVM " + rec.ID, Err: err}
	}
	return initrd, nil
}

// End closes the host end of AppVM id, if any (engine.Guest: its boot
// failed, it stopped, it is deleted or rolled back). What the guest
// reported stays recorded.
func (g *Guests) End(id string) { g.forget(id) }

// Settle waits, at most a second, until the guest agent's connection of
// AppVM id has ended (engine.Guest): a guest that powers off right after
// its last messages (the workload's exit) has them recorded before the
// host records its end.
func (g *Guests) Settle(id string) {
	ss := g.get(id)
	if ss == nil {
		return
	}
	ss.mu.Lock()
	nc, served := ss.nc, ss.served
	ss.mu.Unlock()
	if nc == nil {
		return
	}
	t := time.NewTimer(time.Second)
	defer t.Stop()
	select {
	case <-served:
	case <-t.C:
	}
}

// Stop asks the guest agent of AppVM rec to stop the workload (SIGTERM,
// then SIGKILL after its grace) and power off (engine.Guest). The
// workload's end is then the operator's doing, never a reason to restart.
func (g *Guests) Stop(_ context.Context, rec *vm.Record) error {
	id := rec.ID
	ss := g.get(id)
	if ss == nil {
		return fmt.Errorf("stopping AppVM %q: no guest agent session", id)
	}
	ss.mu.Lock()
	ss.stopRequested = true
	nc := ss.nc
	ss.mu.Unlock()
	if nc == nil {
		return fmt.Errorf("stopping AppVM %q: the guest agent is not connected", id)
	}
	if err := sendToGuest(nc, &proto.Stop{}); err != nil {
		return fmt.Errorf("stopping AppVM %q: sending stop to the guest agent: %w", id, err)
	}
	return nil
}

// Adopt serves the guest agent of rec, a running AppVM found at agent
// start, on l (engine.Guest): the agent lost its connection with the
// previous agent process and redials with resume, until which the view
// shows log_stream_detached.
func (g *Guests) Adopt(_ context.Context, rec *vm.Record, l net.Listener) error {
	if rec.State != vm.StateRunning && rec.State != vm.StatePaused {
		l.Close()
		return nil
	}
	ss := g.serve(rec.ID, l, true)
	// A guest that never comes back goes stale counting from the last
	// heartbeat the record has.
	if gst := rec.AppVM.Guest; gst != nil && gst.LastHeartbeatAt != nil {
		ss.mu.Lock()
		ss.armStale(g.staleLimit(rec) - g.o.Now().Sub(*gst.LastHeartbeatAt) + time.Millisecond)
		ss.mu.Unlock()
	}
	_, err := ss.update(func(r *vm.Record, gst *vm.AppVMGuest) { gst.LogStreamDetached = true })
	return err
}

// Resume serves the guest agent of rec, an AppVM whose saved state a
// start restores, on l (engine.Guest), keeping the facts of its boot: the
// restored guest's agent finds its connection reset and redials with
// resume. The time it was suspended does not count against it: staleness
// counts from now until its first heartbeat.
func (g *Guests) Resume(_ context.Context, rec *vm.Record, l net.Listener) error {
	// The run it serves is recorded after (the engine records the VM
	// running once CH has restored it), as a new boot's.
	ss := g.serve(rec.ID, l, false)
	ss.mu.Lock()
	ss.resumedMono = time.Now()
	ss.armStale(g.staleLimit(rec))
	ss.mu.Unlock()
	return nil
}
