package appvm

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"path/filepath"

	"vmhost/follow"
	"vmhost/vm"
)

// Limits of GET /api/appvm/vms/{id}/logs (docs/api.md, Workload logs).
const (
	DefaultLogTail = 100
	MaxLogTail     = 10_000
)

// maxLogLine bounds a stored line a reader takes: far above the longest
// the writer makes (a chunk of proto.MaxLogChunk bytes, escaped, with the
// chunks a secret spans), so only damage reaches it.
const maxLogLine = 16 << 20

// LogQuery selects the chunks of a workload log read.
type LogQuery struct {
	// SinceSeq, when set, starts after the chunk of that seq (at the
	// oldest chunk kept, when that one is gone); otherwise the read
	// starts with the last Tail chunks (0: none).
	SinceSeq *uint64
	Tail     int
	// Stream is proto.Stdout, proto.Stderr, or "" for both.
	Stream string
	// Follow goes on with the chunks stored next.
	Follow bool
}

// Logs writes the chunks of AppVM id's workload log that q selects to w,
// one JSON object (LogChunk) per line, and calls flush after each batch.
// With q.Follow it goes on with each chunk stored next until ctx ends or
// the AppVM is deleted; a reader slower than the writer never holds it
// back (it reads the files at its own pace), and one that falls behind by
// more than the log keeps goes on with the oldest chunk kept: the seq
// numbers then jump. An unknown id (or a classic VM's) is an error that
// satisfies errors.Is(err, fs.ErrNotExist), before anything is written.
func (s *Service) Logs(ctx context.Context, id string, q LogQuery, w io.Writer, flush func()) error {
	var changed <-chan struct{}
	if q.Follow {
		// Before the record is read: a deletion after it is told.
		c, stop := s.vms.Follow(id)
		defer stop()
		changed = c
	}
	rec, err := s.Get(id)
	if err != nil {
		return err
	}
	path := WorkloadLog(s.vms.Layout(), id)
	if err := s.guests.migrateLog(rec); err != nil {
		s.guests.log.Warn("migrating the workload log", "id", id, "err", err)
	}
	r, err := s.vms.OpenLog(path)
	if err != nil {
		return fmt.Errorf("opening the workload log: %w", err)
	}
	defer r.Close()
	var from int64
	var after uint64
	if q.SinceSeq != nil {
		after = *q.SinceSeq
		from, err = sincePos(r, after)
	} else {
		from, err = tailPos(r, q.Tail, q.Stream)
	}
	if err != nil {
		return fmt.Errorf("reading the workload log: %w", err)
	}
	r.SetPos(from)
	lr := &lineReader{r: r}
	enc := json.NewEncoder(w)
	enc.SetEscapeHTML(false)
	for {
		for {
			line, err := lr.next()
			if err == io.EOF {
				break
			}
			if err != nil {
				return fmt.Errorf("reading the workload log: %w", err)
			}
			ll, ok := decodeLine(line)
			if !ok || ll.Seq <= after || (q.Stream != "" && ll.Stream != q.Stream) {
				continue
			}
			after = ll.Seq
			if err := enc.Encode(LogChunk{Seq: ll.Seq, Time: ll.Time, Stream: ll.Stream, Data: ll.Data}); err != nil {
				return err // the client went away
			}
		}
		flush()
		if !q.Follow {
			return nil
		}
		select {
		case <-ctx.Done():
			return nil
		case <-r.Changed():
		case <-changed:
			if s.recs.Get(id) == nil {
				q.Follow = false // deleted: what is left, then the end
				continue
			}
			// The VM directory may have been made since (an AppVM
			// created without a boot has none).
			r.Rewatch()
		}
	}
}

// decodeLine decodes a stored line. A line that does not decode may be
// the torn end of a file run into the next line (an agent killed in a
// write just before a rotation): the last line start in it is tried.
func decodeLine(line []byte) (*logLine, bool) {
	var ll logLine
	if json.Unmarshal(line, &ll) == nil {
		return &ll, true
	}
	if i := bytes.LastIndex(line, []byte(`{"seq":`)); i > 0 && json.Unmarshal(line[i:], &ll) == nil {
		return &ll, true
	}
	return nil, false
}

// lineReader splits what a follow.Reader reads into lines; a line not
// ended yet waits for the rest.
type lineReader struct {
	r          *follow.Reader
	buf        []byte
	start, end int
	skipping   bool // inside a line longer than maxLogLine
}

// next returns the next complete line without its newline (valid until
// the next call), or io.EOF when none is complete yet.
func (lr *lineReader) next() ([]byte, error) {
	for {
		if i := bytes.IndexByte(lr.buf[lr.start:lr.end], '\n'); i >= 0 {
			line := lr.buf[lr.start : lr.start+i]
			lr.start += i + 1
			if lr.skipping {
				lr.skipping = false
				continue
			}
			return line, nil
		}
		if lr.start > 0 {
			lr.end = copy(lr.buf, lr.buf[lr.start:lr.end])
			lr.start = 0
		}
		if lr.end == len(lr.buf) {
			if len(lr.buf) >= maxLogLine {
				lr.skipping, lr.end = true, 0
			} else {
				lr.buf = append(lr.buf, make([]byte, max(64<<10, len(lr.buf)))...)
			}
		}
		n, err := lr.r.Read(lr.buf[lr.end:])
		lr.end += n
		if err != nil {
			return nil, err
		}
	}
}

// tailPos returns where the last n lines of stream (any when "") start
// in r as it was opened. A line not ended yet is not counted.
func tailPos(r *follow.Reader, n int, stream string) (int64, error) {
	size := r.Size()
	if n <= 0 {
		return size, nil
	}
	x := size // data holds r's bytes [x, x+len(data))
	var data []byte
	trimmed := false // data ends at the end of a complete line
	count := 0
	for {
		if trimmed && len(data) > 0 {
			body := data[:len(data)-1]
			i := bytes.LastIndexByte(body, '\n')
			if i >= 0 || x == 0 {
				start := x + int64(i) + 1
				if lineMatches(body[i+1:], stream) {
					if count++; count == n {
						return start, nil
					}
				}
				data = data[:i+1]
				continue
			}
		}
		if x == 0 {
			return 0, nil
		}
		off := max(0, x-64<<10)
		block := make([]byte, x-off, int(x-off)+len(data))
		if _, err := r.ReadAt(block, off); err != nil && err != io.EOF {
			return 0, err
		}
		data = append(block, data...)
		x = off
		if !trimmed {
			if i := bytes.LastIndexByte(data, '\n'); i >= 0 {
				data, trimmed = data[:i+1], true
			}
		}
	}
}

func lineMatches(line []byte, stream string) bool {
	if stream == "" {
		return true
	}
	var ll struct {
		Stream string `json:"stream"`
	}
	return json.Unmarshal(line, &ll) == nil && ll.Stream == stream
}

// sincePos returns where the first line whose seq is above since starts
// in r as it was opened (its end when there is none): a binary search,
// as the seqs only grow along the log.
func sincePos(r *follow.Reader, since uint64) (int64, error) {
	size := r.Size()
	lo, hi := int64(0), size
	for lo < hi {
		mid := lo + (hi-lo)/2
		_, seq, ok, err := lineAfter(r, mid, size)
		if err != nil {
			return 0, err
		}
		if !ok || seq > since {
			hi = mid
		} else {
			lo = mid + 1
		}
	}
	start, _, _, err := lineAfter(r, lo, size)
	return start, err
}

// lineAfter returns the start and seq of the first readable line that
// starts at or after off; ok is false when there is none before size.
func lineAfter(r *follow.Reader, off, size int64) (start int64, seq uint64, ok bool, err error) {
	start = off
	if off > 0 {
		if start, err = nextLineStart(r, off-1, size); err != nil {
			return 0, 0, false, err
		}
	}
	head := make([]byte, 32)
	for start < size {
		n, err := r.ReadAt(head, start)
		if err != nil && err != io.EOF {
			return 0, 0, false, err
		}
		next, err := nextLineStart(r, start, size)
		if err != nil {
			return 0, 0, false, err
		}
		if seq, ok := parseSeq(head[:n]); ok {
			return start, seq, true, nil
		}
		// Not written by this writer's field order: decode it whole.
		line := make([]byte, next-start)
		if _, err := r.ReadAt(line, start); err != nil && err != io.EOF {
			return 0, 0, false, err
		}
		if ll, ok := decodeLine(bytes.TrimSuffix(line, []byte("\n"))); ok {
			return start, ll.Seq, true, nil
		}
		start = next
	}
	return size, 0, false, nil
}

// nextLineStart returns the position after the first newline at or after
// off (size when there is none).
func nextLineStart(r *follow.Reader, off, size int64) (int64, error) {
	buf := make([]byte, 4096)
	for off < size {
		n, err := r.ReadAt(buf[:min(int64(len(buf)), size-off)], off)
		if i := bytes.IndexByte(buf[:n], '\n'); i >= 0 {
			return off + int64(i) + 1, nil
		}
		if err != nil && err != io.EOF {
			return 0, err
		}
		if n == 0 {
			break
		}
		off += int64(n)
	}
	return size, nil
}

// migrateLog migrates rec's workload log of the format before, once
// (migrateLegacyLog), whoever comes first: the session that writes it or
// a reader.
func (g *Guests) migrateLog(rec *vm.Record) error {
	g.migrateMu.Lock()
	defer g.migrateMu.Unlock()
	return migrateLegacyLog(filepath.Dir(WorkloadLog(g.o.Layout, rec.ID)), rec.Secrets.Redactor())
}
