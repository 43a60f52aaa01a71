// Package events is the agent's durable event log (docs/api.md, Events): every
// change a control plane watches for (a VM created, deleted, changing state
// or display state, failing, its guest panicking, an AppVM's heartbeat going
// stale, its workload exiting or its health changing, a volume attached or
// detached, an image ready or failed) gets a sequence number and is appended
// to a file, so a client that reconnects with the last seq it saw resumes
// without loss, across agent restarts.
//
// # Files and durability
//
// Two segments in the log's directory: events.jsonl (current) and
// events.1.jsonl (the one before), one JSON line per event. When the
// current segment holds Keep events it becomes events.1.jsonl and a new
// one starts, so between Keep and 2×Keep events are kept. Each event is
// written with one write(2) as it is published, so an agent killed at any
// point loses nothing it published; a background flusher fsyncs the current
// segment whenever it has unsynced events (group commit: one fsync covers
// every event written before it, and no publisher waits for it). Readers
// see an event only once it is fsynced, so no client ever holds an event a
// power cut could take back, and the seq of an event lost that way is never
// seen twice. Open fsyncs what a killed agent left unsynced and cuts a torn
// last line.
//
// Seq starts at 1, grows by one per event and continues after a restart
// from the last seq found in the files.
package events

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"time"

	"vmhost/internal/atomicfile"
	"vmhost/internal/rotlog"
)

// Type is the kind of an event.
type Type string

// The event types of the API (docs/api.md, Events).
const (
	Created             Type = "created"
	StateChanged        Type = "state_changed"
	DisplayStateChanged Type = "display_state_changed"
	Failed              Type = "failed"
	GuestPanic          Type = "guest_panic"
	HeartbeatStale      Type = "heartbeat_stale"
	WorkloadExit        Type = "workload_exit"
	HealthChanged       Type = "health_changed"
	VolumeAttached      Type = "volume_attached"
	VolumeDetached      Type = "volume_detached"
	Deleted             Type = "deleted"
	ImageReady          Type = "image_ready"
	ImageFailed         Type = "image_failed"
	// A VM's memory and device state saved and its processes gone; a
	// snapshot taken, deleted, or restored onto its VM (snapshot_id).
	Suspended        Type = "suspended"
	SnapshotCreated  Type = "snapshot_created"
	SnapshotDeleted  Type = "snapshot_deleted"
	SnapshotRestored Type = "snapshot_restored"
	// Reset is never stored: the stream sends it to a client whose resume
	// point is no longer kept (or that fell behind), telling it to re-list.
	Reset Type = "reset"
)

// Event is one event. Seq and Time are set by Publish. A VM's events carry
// its id, mode, state and display state as they are after the change; the
// other fields are set by the types that need them. No field ever holds a
// secret: failure summaries and causes are what the VM views show.
type Event struct {
	Seq          uint64    `json:"seq"`
	Time         time.Time `json:"time"`
	Type         Type      `json:"type"`
	VMID         string    `json:"vm_id,omitempty"`
	Mode         string    `json:"mode,omitempty"`
	State        string    `json:"state,omitempty"`
	DisplayState string    `json:"display_state,omitempty"`
	// Labels are the VM's labels as they are after the change (as before
	// it, for deleted).
	Labels map[string]string `json:"labels,omitempty"`
	// PreviousState and PreviousDisplayState are what state_changed and
	// display_state_changed changed from.
	PreviousState        string `json:"previous_state,omitempty"`
	PreviousDisplayState string `json:"previous_display_state,omitempty"`
	// Failure is the failure of a failed event.
	Failure *Failure `json:"failure,omitempty"`
	// ExitCode, ExitSignal and Fatal are a workload_exit's outcome.
	ExitCode   *int   `json:"exit_code,omitempty"`
	ExitSignal int    `json:"exit_signal,omitempty"`
	Fatal      string `json:"fatal,omitempty"`
	// Health is the new health of health_changed.
	Health string `json:"health,omitempty"`
	// VolumeID and Device name the volume of volume_attached and
	// volume_detached.
	VolumeID string `json:"volume_id,omitempty"`
	Device   string `json:"device,omitempty"`
	// ImageID is the image of image_ready and image_failed.
	ImageID string `json:"image_id,omitempty"`
	// SnapshotID is the snapshot of the snapshot_* events.
	SnapshotID string `json:"snapshot_id,omitempty"`
	// Message says why, for image_failed and reset.
	Message string `json:"message,omitempty"`
}

// Failure is a failed event's reason, as the VM view shows it.
type Failure struct {
	Summary    string    `json:"summary"`
	Cause      string    `json:"cause"`
	DetectedAt time.Time `json:"detected_at"`
}

// Publisher takes events; *Log implements it. A nil Publisher is allowed
// by the packages that publish (they skip publishing).
type Publisher interface {
	Publish(Event)
}

// Entry is one stored event as a reader gets it: its seq, its VM and the
// VM's labels (for filters) and its JSON encoding (one line, no newline).
type Entry struct {
	Seq    uint64
	VMID   string
	Labels map[string]string
	JSON   []byte
}

// DefaultKeep is the fewest events kept (events_keep's default and minimum;
// docs/api.md, Events).
const DefaultKeep = 10_000

const (
	currentName  = "events.jsonl"
	previousName = "events.1.jsonl"
)

// Log is the durable event log. It is safe for concurrent use.
type Log struct {
	dir  string
	keep int
	log  *slog.Logger
	now  func() time.Time

	mu sync.Mutex
	// seg is the current segment; Rotate makes it the previous one.
	seg *rotlog.File
	// curCount is how many events the current segment holds.
	curCount int
	// kept are the kept events of both segments, oldest first.
	kept []Entry
	// last is the seq of the newest event published.
	last uint64
	// durable is the seq up to which events are fsynced (and visible).
	durable uint64
	// changed is closed (and replaced) whenever durable advances.
	changed chan struct{}
	// writeFailing is set while writes fail, so the failure is logged
	// once per streak.
	writeFailing bool
	closed       bool

	dirty chan struct{}
	done  chan struct{}
}

// Options tune a Log.
type Options struct {
	// Keep is the fewest events kept; 0 means DefaultKeep. (The agent's
	// config refuses less than DefaultKeep; tests use less.)
	Keep   int
	Logger *slog.Logger
	// Now gives event times; default time.Now.
	Now func() time.Time
}

// Open opens (creating) the log in dir and starts its flusher; Close stops
// it.
func Open(dir string, o Options) (*Log, error) {
	if o.Keep <= 0 {
		o.Keep = DefaultKeep
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("event log: %w", err)
	}
	l := &Log{dir: dir, keep: o.Keep, log: o.Logger, now: o.Now, changed: make(chan struct{}),
		dirty: make(chan struct{}, 1), done: make(chan struct{})}
	prev, _, err := readSegment(filepath.Join(dir, previousName), false)
	if err != nil {
		return nil, err
	}
	cur, good, err := readSegment(filepath.Join(dir, currentName), true)
	if err != nil {
		return nil, err
	}
	for _, e := range append(prev, cur...) {
		if e.Seq > l.last { // a seq that does not grow is not trusted
			l.kept = append(l.kept, e)
			l.last = e.Seq
		}
	}
	l.curCount = len(cur)
	// Segments rotate by count of events (Keep), not by size: Publish
	// calls Rotate.
	seg, err := rotlog.Open(filepath.Join(dir, currentName), rotlog.Options{Previous: filepath.Join(dir, previousName), Sync: true})
	if err != nil {
		return nil, fmt.Errorf("event log: %w", err)
	}
	// Cut a torn last line (an agent killed mid-write, or a power cut),
	// then make what a killed agent left in the page cache durable.
	err = seg.Truncate(good)
	if err == nil {
		err = seg.Sync()
	}
	if err == nil {
		err = atomicfile.SyncDir(dir)
	}
	if err != nil {
		seg.Close()
		return nil, fmt.Errorf("event log: %w", err)
	}
	l.seg = seg
	l.durable = l.last
	go l.flusher()
	return l, nil
}

// readSegment reads the events of one segment and returns how many bytes
// of it are whole, valid lines. A missing file is empty. Only the current
// segment (tornOK) may end in a torn line; elsewhere a bad line is an
// error, since nothing writes there but a rename of a synced segment.
func readSegment(path string, tornOK bool) ([]Entry, int64, error) {
	data, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil, 0, nil
	}
	if err != nil {
		return nil, 0, fmt.Errorf("event log: %w", err)
	}
	var out []Entry
	var good int64
	for len(data) > 0 {
		i := bytes.IndexByte(data, '\n')
		var e Event
		if i < 0 || json.Unmarshal(data[:i], &e) != nil || e.Seq == 0 {
			if tornOK {
				break
			}
			return nil, 0, fmt.Errorf("event log: %s: bad line at byte %d", path, good)
		}
		out = append(out, Entry{Seq: e.Seq, VMID: e.VMID, Labels: e.Labels, JSON: bytes.Clone(data[:i])})
		good += int64(i + 1)
		data = data[i+1:]
	}
	return out, good, nil
}

// Publish gives e the next seq and the current time and appends it. It
// never blocks on readers and never fails: an event that cannot be written
// is still delivered from memory, and the failure is logged once per
// streak of failures. A nil *Log publishes nothing.
func (l *Log) Publish(e Event) {
	if l == nil {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return
	}
	l.last++
	e.Seq = l.last
	e.Time = l.now().UTC()
	line, err := json.Marshal(e)
	if err != nil { // every Event encodes
		panic(err)
	}
	if l.curCount >= l.keep {
		l.rotate()
	}
	_, err = l.seg.Write(append(line, '\n'))
	switch {
	case err != nil && !l.writeFailing:
		l.writeFailing = true
		l.log.Error("writing the event log; events are kept in memory only until writes succeed", "err", err)
	case err == nil && l.writeFailing:
		l.writeFailing = false
		l.log.Info("writing the event log works again")
	}
	l.curCount++
	l.kept = append(l.kept, Entry{Seq: e.Seq, VMID: e.VMID, Labels: e.Labels, JSON: line})
	select {
	case l.dirty <- struct{}{}:
	default:
	}
}

// rotate makes the current segment the previous one and starts a new one;
// l.mu is held. Events of the old previous segment are no longer kept.
func (l *Log) rotate() {
	// The rotation syncs the full segment and the directory. On error the
	// segment we have stays in use: nothing is lost, the file only grows
	// past Keep until a rotation works.
	if err := l.seg.Rotate(); err != nil {
		l.log.Error("rotating the event log", "err", err)
		return
	}
	l.durable = l.last - 1 // everything before the event being published is synced
	drop := len(l.kept) - l.curCount
	l.kept = append([]Entry(nil), l.kept[drop:]...)
	l.curCount = 0
}

// flusher fsyncs the current segment whenever it has unsynced events and
// then makes them visible to readers.
func (l *Log) flusher() {
	defer close(l.done)
	for range l.dirty {
		l.mu.Lock()
		target := l.last
		l.mu.Unlock()
		// Without l.mu: publishers never wait for the fsync. A rotation
		// meanwhile synced the segment it moved.
		if err := l.seg.Sync(); err != nil && !errors.Is(err, os.ErrClosed) {
			l.log.Error("syncing the event log", "err", err)
		}
		l.mu.Lock()
		if target > l.durable {
			l.durable = target
			close(l.changed)
			l.changed = make(chan struct{})
		}
		closed := l.closed
		l.mu.Unlock()
		if closed {
			return
		}
	}
}

// Close syncs and closes the log. Later Publish calls do nothing.
func (l *Log) Close() error {
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		return nil
	}
	l.closed = true
	select {
	case l.dirty <- struct{}{}:
	default:
	}
	l.mu.Unlock()
	<-l.done
	l.mu.Lock()
	defer l.mu.Unlock()
	err := l.seg.Sync()
	if cerr := l.seg.Close(); err == nil {
		err = cerr
	}
	close(l.changed)
	l.changed = make(chan struct{})
	return err
}

// Last is the seq of the newest event readers can see (0 when there is
// none).
func (l *Log) Last() uint64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.durable
}

// After returns up to max visible events with a seq above since, oldest
// first. reset is true when events after since are no longer all kept
// (since is older than the oldest kept event's predecessor) or since is
// beyond the newest event (a log that was removed); the caller then sends
// a reset and continues from Last. changed is closed when more events
// become visible or the log closes.
func (l *Log) After(since uint64, max int) (entries []Entry, reset bool, changed <-chan struct{}) {
	l.mu.Lock()
	defer l.mu.Unlock()
	changed = l.changed
	if since > l.durable {
		return nil, since > l.last, changed
	}
	if len(l.kept) > 0 && since+1 < l.kept[0].Seq {
		return nil, true, changed
	}
	// kept is sorted by seq; find the first above since.
	lo, hi := 0, len(l.kept)
	for lo < hi {
		m := (lo + hi) / 2
		if l.kept[m].Seq <= since {
			lo = m + 1
		} else {
			hi = m
		}
	}
	for i := lo; i < len(l.kept) && l.kept[i].Seq <= l.durable && len(entries) < max; i++ {
		entries = append(entries, l.kept[i])
	}
	return entries, false, changed
}
