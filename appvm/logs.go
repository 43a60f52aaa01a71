package appvm

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"sync"
	"time"

	"vmhost/appvm/guest/proto"
	"vmhost/internal/redact"
	"vmhost/internal/rotlog"
	"vmhost/vm"
)

// DefaultLogMaxBytes is the size cap of an AppVM's workload log (both of
// its generations together): config workload_log_max_bytes.
const DefaultLogMaxBytes = 64 << 20

// The workload log of an AppVM is <state>/vms/<id>/workload.ndjson, one
// JSON object per line and per chunk of output (logLine), rotated to
// workload.ndjson.1 when a write would take it past half the cap, so at
// most about the cap is kept and the oldest chunks go first. Files are
// 0600. A log of the format before (raw output in workload.log) is
// migrated at its first open (migrateLegacyLog).
const (
	logName       = "workload.ndjson"
	legacyLogName = "workload.log"
)

// WorkloadLog is the path of an AppVM's workload log (rotated to
// WorkloadLog+".1").
func WorkloadLog(l vm.Layout, id string) string { return l.VMDir(id) + "/" + logName }

// logLine is one stored chunk: what GET /api/appvm/vms/{id}/logs answers
// (LogChunk) and the guest's numbers that make a replay after an agent
// restart store nothing twice. Boot is the guest agent's boot id; GuestOut
// and GuestErr are the guest's Log.Seq of the last chunk of each stream of
// that boot stored in this line or before it.
type logLine struct {
	Seq      uint64    `json:"seq"`
	Time     time.Time `json:"time"`
	Stream   string    `json:"stream"`
	Data     string    `json:"data"`
	Boot     string    `json:"boot,omitempty"`
	GuestOut uint64    `json:"gout,omitempty"`
	GuestErr uint64    `json:"gerr,omitempty"`
}

// LogChunk is one chunk of workload output as the API answers it (docs/api.md,
// Workload logs): data is the output as UTF-8, bytes that are not UTF-8
// replaced by U+FFFD, secrets by [redacted].
type LogChunk struct {
	Seq    uint64    `json:"seq"`
	Time   time.Time `json:"time"`
	Stream string    `json:"stream"`
	Data   string    `json:"data"`
}

// workloadLog writes an AppVM's workload output to its log: it numbers
// the chunks (seq, one more per stored chunk, across boots and agent
// restarts), replaces secrets before anything is stored, and keeps what
// lets the host acknowledge chunks to the guest and drop those a guest
// replays. It is safe for concurrent use.
//
// A chunk is stored whole, in one line, or not at all, so that "stored"
// is exact per guest chunk: a chunk whose end may begin a secret (or cuts
// a UTF-8 character in two) is held back, whole, until the next chunk of
// its stream shows how it goes on; chunks that one secret (or character)
// spans are stored together in one line. The guest numbers its chunks
// across both streams (Log.Seq); per stream, the chunks are stored in
// order, so "stored up to n" per stream says exactly which chunks a
// replay may skip, and the acknowledgement is the number below the oldest
// chunk still held (or the newest received).
type workloadLog struct {
	red *redact.Set

	mu sync.Mutex
	f  *rotlog.File // nil once closed
	// seq is the number of the last stored line.
	seq uint64
	// boot is the guest boot whose output comes; stored is the guest's
	// number of the last chunk stored per stream (0 stdout, 1 stderr) of
	// that boot, received the highest one received.
	boot     string
	stored   [2]uint64
	received uint64
	// held are the chunks per stream held back, oldest first.
	held [2][]heldChunk
	buf  bytes.Buffer
}

// heldChunk is a chunk of output not stored yet.
type heldChunk struct {
	gseq uint64
	at   time.Time
	data []byte
}

func streamIndex(s string) int {
	if s == proto.Stderr {
		return 1
	}
	return 0
}

var streamNames = [2]string{proto.Stdout, proto.Stderr}

// openWorkloadLog opens the log at path, capped at max bytes for its two
// generations (DefaultLogMaxBytes when max ≤ 0), replacing the values of
// red. It takes the numbering up where the log left it; a torn last line
// (an agent killed in the middle of a write) is cut off.
func openWorkloadLog(path string, max int64, red *redact.Set) (*workloadLog, error) {
	if max <= 0 {
		max = DefaultLogMaxBytes
	}
	// Sync: a rotation's rename must not lose chunks the guest was told
	// are stored.
	f, err := rotlog.Open(path, rotlog.Options{MaxBytes: max / 2, Sync: true})
	if err != nil {
		return nil, fmt.Errorf("opening workload log: %w", err)
	}
	l := &workloadLog{red: red, f: f}
	last, err := l.lastLine(path)
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("opening workload log: %w", err)
	}
	if last != nil {
		l.seq, l.boot = last.Seq, last.Boot
		l.stored = [2]uint64{last.GuestOut, last.GuestErr}
		// Every chunk up to the lower of the two is stored, whatever its
		// stream: the only safe acknowledgement before the next chunks.
		l.received = min(last.GuestOut, last.GuestErr)
	}
	return l, nil
}

// lastLine returns the last stored line of the log (nil when it has
// none), cutting off a torn end of the current generation.
func (l *workloadLog) lastLine(path string) (*logLine, error) {
	end, size, err := readLastLine(path)
	if err != nil {
		return nil, err
	}
	if end < size {
		if err := l.f.Truncate(end); err != nil {
			return nil, err
		}
	}
	if end > 0 {
		line, err := lastLineOf(path, end)
		if err != nil || line != nil {
			return line, err
		}
	}
	prevEnd, _, err := readLastLine(path + ".1")
	if err != nil || prevEnd == 0 {
		return nil, err
	}
	return lastLineOf(path+".1", prevEnd)
}

// readLastLine returns where the complete lines of the file at path end
// (after its last newline) and its size; a missing file is empty.
func readLastLine(path string) (end, size int64, err error) {
	f, err := os.Open(path)
	if errors.Is(err, os.ErrNotExist) {
		return 0, 0, nil
	}
	if err != nil {
		return 0, 0, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return 0, 0, err
	}
	size = st.Size()
	buf := make([]byte, 64<<10)
	for off := size; off > 0; {
		n := min(int64(len(buf)), off)
		off -= n
		if _, err := f.ReadAt(buf[:n], off); err != nil {
			return 0, 0, err
		}
		if i := bytes.LastIndexByte(buf[:n], '\n'); i >= 0 {
			return off + int64(i) + 1, size, nil
		}
	}
	return 0, size, nil
}

// lastLineOf decodes the last line of the file at path that ends at end;
// nil when it does not decode (a damaged log starts numbering again).
func lastLineOf(path string, end int64) (*logLine, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var line []byte
	buf := make([]byte, 64<<10)
	for off := end - 1; off > 0; { // end-1: the line's own newline
		n := min(int64(len(buf)), off)
		off -= n
		if _, err := f.ReadAt(buf[:n], off); err != nil {
			return nil, err
		}
		if i := bytes.LastIndexByte(buf[:n], '\n'); i >= 0 {
			line = append(append([]byte(nil), buf[i+1:n]...), line...)
			break
		}
		line = append(append([]byte(nil), buf[:n]...), line...)
	}
	if len(line) == 0 && end > 0 {
		line = make([]byte, end-1)
		if _, err := f.ReadAt(line, 0); err != nil && err != io.EOF {
			return nil, err
		}
	}
	var ll logLine
	if json.Unmarshal(line, &ll) != nil {
		return nil, nil
	}
	return &ll, nil
}

// Begin is told each connection of the guest agent: the boot it belongs
// to, whether the guest replays the chunks not acknowledged (a version 3
// guest resuming), and the number of the last chunk the guest numbered
// (numbered, a version 4 guest resuming; nil when it does not say). A new
// boot ends the previous one's streams; the same boot replayed drops what
// was held, which comes again.
//
// A guest numbers its chunks in one timeline, so its count is never
// behind what was stored of its boot, unless it went back to a snapshot
// with memory: then the chunks stored above its count are output of the
// timeline the restore discarded, and stay in the log as they are; the
// guest's numbers above its count are new output, stored after them. The
// numbering is taken back to the guest's: what was stored up to it is
// the output before the snapshot, which a replay may resend.
func (l *workloadLog) Begin(boot string, replay bool, numbered *uint64) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if boot != l.boot {
		err := l.flushLocked()
		l.boot, l.stored, l.received = boot, [2]uint64{}, 0
		return err
	}
	if numbered != nil && *numbered < max(l.stored[0], l.stored[1]) {
		// What was held back is dropped, never stored: the part of the
		// discarded timeline could complete a secret the snapshot's part
		// began, and the snapshot's part comes again in the replay.
		n := *numbered
		l.stored = [2]uint64{min(l.stored[0], n), min(l.stored[1], n)}
		replay = true
	}
	if replay {
		l.held = [2][]heldChunk{}
		l.received = min(l.stored[0], l.stored[1])
	}
	return nil
}

// Append takes one Log message of the guest's boot boot, received at
// recv (its time unless it carries At). A chunk of this boot already
// stored (a replay) is dropped, and so is one of another boot than the
// last Begin's (a late message of a connection from before a reboot).
func (l *workloadLog) Append(m *proto.Log, boot string, recv time.Time) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.f == nil {
		return os.ErrClosed
	}
	if boot != l.boot {
		return nil
	}
	s := streamIndex(m.Stream)
	if m.Seq != 0 {
		if m.Seq <= l.stored[s] {
			return nil
		}
		if h := l.held[s]; len(h) > 0 && m.Seq <= h[len(h)-1].gseq {
			return nil
		}
		l.received = max(l.received, m.Seq)
	}
	at := m.At
	if at.IsZero() {
		at = recv
	}
	l.held[s] = append(l.held[s], heldChunk{gseq: m.Seq, at: at.UTC(), data: m.Data})
	return l.storeHeld(s, false)
}

// Flush stores every chunk held back: the streams ended (the workload
// exited), so a secret they began never completed.
func (l *workloadLog) Flush() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.f == nil {
		return os.ErrClosed
	}
	return l.flushLocked()
}

func (l *workloadLog) flushLocked() error {
	return errors.Join(l.storeHeld(0, true), l.storeHeld(1, true))
}

// storeHeld stores the held chunks of stream s that are final (all of
// them with final), in as few lines as the secrets and characters
// spanning them need. l.mu is held.
func (l *workloadLog) storeHeld(s int, final bool) error {
	chunks := l.held[s]
	if len(chunks) == 0 {
		return nil
	}
	var buf []byte
	ends := make([]int, len(chunks))
	for i, c := range chunks {
		buf = append(buf, c.data...)
		ends[i] = len(buf)
	}
	var spans []redact.Span
	cut := len(buf)
	if final {
		spans = l.red.Spans(buf)
	} else {
		spans, cut = l.red.Scan(buf)
		spans, cut = runeCut(buf, spans, cut)
	}
	start, first := 0, 0
	var err error
	for i := range chunks {
		end := ends[i]
		if end > cut {
			break
		}
		if i < len(chunks)-1 && (crossed(spans, end) || splitsRune(buf, end)) {
			continue // stored with the next chunk
		}
		var in []redact.Span // no span crosses start or end
		for _, sp := range spans {
			if sp.Start >= start && sp.End <= end {
				in = append(in, redact.Span{Start: sp.Start - start, End: sp.End - start})
			}
		}
		data := redact.AppendReplaced(nil, buf[start:end], in)
		if werr := l.writeLine(s, chunks[first].at, data, chunks[i].gseq); werr != nil {
			err = werr
		}
		start, first = end, i+1
	}
	l.held[s] = append([]heldChunk(nil), chunks[first:]...)
	return err
}

// runeCut moves cut back before a UTF-8 character it would cut in two,
// and before a span the move then crosses.
func runeCut(buf []byte, spans []redact.Span, cut int) ([]redact.Span, int) {
	n := incompleteRune(buf[:cut])
	if n == 0 {
		return spans, cut
	}
	cut -= n
	for i, sp := range spans {
		if sp.End > cut {
			cut = min(cut, sp.Start)
			return spans[:i], cut
		}
	}
	return spans, cut
}

// incompleteRune returns the length of the start of a multi-byte UTF-8
// character at the end of p that lacks its last bytes (0 when p ends
// with a whole character or with bytes that are not UTF-8).
func incompleteRune(p []byte) int {
	for i := len(p) - 1; i >= 0 && i >= len(p)-3; i-- {
		c := p[i]
		switch {
		case c < 0x80:
			return 0
		case c >= 0xC0:
			need := 0
			switch {
			case c < 0xE0:
				need = 2
			case c < 0xF0:
				need = 3
			case c < 0xF8:
				need = 4
			}
			if len(p)-i < need {
				return len(p) - i
			}
			return 0
		}
	}
	return 0
}

// splitsRune reports whether a chunk boundary at b cuts a UTF-8
// character of buf in two.
func splitsRune(buf []byte, b int) bool {
	return b < len(buf) && incompleteRune(buf[:b]) > 0 && buf[b]&0xC0 == 0x80
}

// crossed reports whether a span runs across b.
func crossed(spans []redact.Span, b int) bool {
	for _, sp := range spans {
		if sp.Start < b && b < sp.End {
			return true
		}
	}
	return false
}

// writeLine stores one line of stream s whose last guest chunk is gseq.
// l.mu is held.
func (l *workloadLog) writeLine(s int, at time.Time, data []byte, gseq uint64) error {
	stored := l.stored
	if gseq != 0 {
		stored[s] = gseq
	}
	line := logLine{Seq: l.seq + 1, Time: at, Stream: streamNames[s], Data: string(data),
		Boot: l.boot, GuestOut: stored[0], GuestErr: stored[1]}
	l.buf.Reset()
	enc := json.NewEncoder(&l.buf)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(&line); err != nil { // invalid UTF-8 becomes U+FFFD here
		return fmt.Errorf("encoding workload log line: %w", err)
	}
	n, err := l.f.Write(l.buf.Bytes())
	if n < l.buf.Len() {
		return fmt.Errorf("writing workload log: %w", err)
	}
	l.seq, l.stored = line.Seq, stored
	if err != nil {
		return fmt.Errorf("writing workload log (the chunk is stored): %w", err)
	}
	return nil
}

// Ack returns the guest number up to which every chunk of the current
// boot is stored, and fsyncs the log first, so that an acknowledged chunk
// survives a power cut as well as an agent restart.
func (l *workloadLog) Ack() (uint64, error) {
	l.mu.Lock()
	if l.f == nil {
		l.mu.Unlock()
		return 0, os.ErrClosed
	}
	a := l.received
	for _, h := range l.held {
		if len(h) > 0 && h[0].gseq > 0 {
			a = min(a, h[0].gseq-1)
		}
	}
	f := l.f
	l.mu.Unlock()
	if err := f.Sync(); err != nil {
		return 0, err
	}
	return a, nil
}

// Close closes the file. Chunks still held back (whole chunks whose end
// may start a secret or cuts a character) are not stored: a version 3
// guest replays them to the next agent; an older guest's are lost.
func (l *workloadLog) Close() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.f == nil {
		return nil
	}
	err := l.f.Close()
	l.f = nil
	return err
}

// parseSeq reads the seq of a stored line from its start ({"seq":N,…}),
// without decoding the rest.
func parseSeq(line []byte) (uint64, bool) {
	rest, ok := bytes.CutPrefix(line, []byte(`{"seq":`))
	if !ok {
		return 0, false
	}
	i := bytes.IndexByte(rest, ',')
	if i < 0 {
		return 0, false
	}
	n, err := strconv.ParseUint(string(rest[:i]), 10, 64)
	return n, err == nil
}
