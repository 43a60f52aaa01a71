package api

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"time"

	"vmhost/appvm"
	"vmhost/appvm/guest/proto"
	"vmhost/events"
	"vmhost/openapi"
	"vmhost/vm"
)

// The guest operations that read (docs/api.md, Guest operations): wait
// for a display state, the serial console log, the workload logs. The
// two streams among them end when the client goes, the VM is deleted or
// the agent shuts down (CloseStreams).

// CodeTimeout is the code of a wait that ran out of time (408).
const CodeTimeout = "TIMEOUT"

// Bounds of GET …/wait's timeout_secs.
const (
	defaultWaitSecs = 60
	maxWaitSecs     = 600
)

// waitStates are the values GET …/wait's for takes: the display states
// and deleted.
var waitStates = []string{string(vm.StateCreated), string(vm.StateRunning), string(vm.StatePaused), string(vm.StateStopped),
	string(vm.StateFailed), vm.DisplayBooting, vm.DisplayDownloading, vm.DisplayCreating, vm.DisplayProvisionFailed, "deleted"}

func init() {
	errType := reflect.TypeOf(errorBody{})
	waitQuery := []openapi.Param{
		{Name: "for", Description: "display states (comma-separated) to wait for: " + strings.Join(waitStates, ", ")},
		{Name: "timeout_secs", Integer: true, Description: fmt.Sprintf("1..%d, default %d", maxWaitSecs, defaultWaitSecs)}}
	consoleQuery := []openapi.Param{
		{Name: "tail_bytes", Integer: true, Description: fmt.Sprintf("the last bytes to start with, 0..%d, default %d", vm.MaxConsoleTail, vm.DefaultConsoleTail)},
		{Name: "follow", Description: "true: go on with what the guest prints until the client goes or the VM is deleted"}}
	consoleOK := []openapi.Response{{Status: 200, ContentType: "text/plain", Description: "the console output, secrets replaced by [redacted]"}}
	timeout := openapi.Response{Status: http.StatusRequestTimeout, Type: errType, Description: "TIMEOUT: no state asked for within timeout_secs"}
	for pattern, d := range map[string]routeDoc{
		"GET /api/vms/{id}/wait": {summary: "Wait until a classic VM is in one of the display states asked for", tag: "vms",
			ok: []openapi.Response{jsonOK(200, vm.View{}), {Status: 204, Description: "deleted, as asked"}, timeout}, query: waitQuery},
		"GET /api/appvm/vms/{id}/wait": {summary: "Wait until an AppVM is in one of the display states asked for", tag: "appvms",
			ok: []openapi.Response{jsonOK(200, appvm.View{}), {Status: 204, Description: "deleted, as asked"}, timeout}, query: waitQuery},
		"GET /api/vms/{id}/console":       {summary: "Read (and follow) a classic VM's serial console log", tag: "vms", ok: consoleOK, query: consoleQuery},
		"GET /api/appvm/vms/{id}/console": {summary: "Read (and follow) an AppVM's serial console log", tag: "appvms", ok: consoleOK, query: consoleQuery},
		"GET /api/appvm/vms/{id}/logs": {summary: "Read (and follow) an AppVM's workload output", tag: "appvms",
			ok: []openapi.Response{{Status: 200, ContentType: "application/x-ndjson", Description: `one {"seq","time","stream","data"} per line and chunk of output`}},
			query: []openapi.Param{
				{Name: "tail", Integer: true, Description: fmt.Sprintf("the last chunks to start with when since_seq is absent, 0..%d, default %d", appvm.MaxLogTail, appvm.DefaultLogTail)},
				{Name: "since_seq", Integer: true, Description: "start after the chunk of this seq (at the oldest one kept when it is gone)"},
				{Name: "stream", Description: "stdout or stderr (default both)"},
				{Name: "follow", Description: "true: go on with the chunks that come until the client goes or the AppVM is deleted"}}},
	} {
		routeDocs[pattern] = d
	}
}

// waitVM answers GET /api/{family}/{id}/wait (docs/api.md, Wait).
func waitVM(mode vm.Mode) func(*Server, http.ResponseWriter, *http.Request) {
	return func(s *Server, w http.ResponseWriter, r *http.Request) {
		q := r.URL.Query()
		want := map[string]bool{}
		if !q.Has("for") {
			writeError(w, http.StatusBadRequest, CodeBadRequest, "for: required (display states, comma-separated, or deleted)")
			return
		}
		for _, st := range strings.Split(q.Get("for"), ",") {
			if !slices.Contains(waitStates, st) {
				writeError(w, http.StatusBadRequest, CodeBadRequest, fmt.Sprintf("for: %q is not one of %s", st, strings.Join(waitStates, ", ")))
				return
			}
			want[st] = true
		}
		secs, ok := intParam(w, q.Get("timeout_secs"), "timeout_secs", defaultWaitSecs, 1, maxWaitSecs)
		if !ok {
			return
		}
		ctx, cancel := context.WithTimeout(r.Context(), time.Duration(secs)*time.Second)
		defer cancel()
		stop := context.AfterFunc(s.streamsCtx, cancel)
		defer stop()
		id := r.PathValue("id")
		rec, err := s.vms.Await(ctx, mode, id, func(rec *vm.Record) bool {
			if rec == nil {
				return want["deleted"]
			}
			return want[rec.DisplayState]
		})
		switch {
		case err == nil && rec == nil:
			w.WriteHeader(http.StatusNoContent)
		case err == nil && mode == vm.ModeAppVM:
			writeJSON(w, http.StatusOK, s.apps.View(rec, vm.ViewOptions{DiskBytes: true}))
		case err == nil:
			writeView(w, http.StatusOK, s.vms.ViewJSON(rec, vm.ViewOptions{DiskBytes: true}))
		case errors.Is(err, fs.ErrNotExist):
			writeError(w, http.StatusNotFound, CodeNotFound, notFoundMessage(mode))
		case s.streamsCtx.Err() != nil:
			writeError(w, http.StatusRequestTimeout, CodeTimeout, "the agent is shutting down: ask again")
		case r.Context().Err() != nil:
			// The client went away: nobody reads an answer.
		default:
			writeError(w, http.StatusRequestTimeout, CodeTimeout, fmt.Sprintf("no display state of %s within %d s", q.Get("for"), secs))
		}
	}
}

func notFoundMessage(mode vm.Mode) string {
	if mode == vm.ModeAppVM {
		return "no AppVM has this id"
	}
	return "no classic VM has this id"
}

// consoleLog answers GET /api/{family}/{id}/console (docs/api.md, Console log).
func consoleLog(mode vm.Mode) func(*Server, http.ResponseWriter, *http.Request) {
	return func(s *Server, w http.ResponseWriter, r *http.Request) {
		q := r.URL.Query()
		tail, ok := intParam(w, q.Get("tail_bytes"), "tail_bytes", vm.DefaultConsoleTail, 0, vm.MaxConsoleTail)
		if !ok {
			return
		}
		follow, ok := boolParam(w, q.Get("follow"), "follow")
		if !ok {
			return
		}
		id := r.PathValue("id")
		if _, err := s.vms.Get(mode, id); err != nil {
			writeError(w, http.StatusNotFound, CodeNotFound, notFoundMessage(mode))
			return
		}
		sw := s.startStream(w, "text/plain")
		defer sw.end()
		ctx, cancel := s.streamContext(r)
		defer cancel()
		if err := s.vms.Console(ctx, mode, id, int64(tail), follow, sw, sw.flush); err != nil {
			s.log.Debug("console log stream ended", "id", id, "err", err)
		}
	}
}

// workloadLogs answers GET /api/appvm/vms/{id}/logs (docs/api.md, Workload logs).
func (s *Server) workloadLogs(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	lq := appvm.LogQuery{}
	var ok bool
	if lq.Tail, ok = intParam(w, q.Get("tail"), "tail", appvm.DefaultLogTail, 0, appvm.MaxLogTail); !ok {
		return
	}
	if v := q.Get("since_seq"); v != "" {
		n, err := strconv.ParseUint(v, 10, 64)
		if err != nil {
			writeError(w, http.StatusBadRequest, CodeBadRequest, fmt.Sprintf("since_seq: %q is not a chunk seq", v))
			return
		}
		lq.SinceSeq = &n
	}
	switch lq.Stream = q.Get("stream"); lq.Stream {
	case "", proto.Stdout, proto.Stderr:
	default:
		writeError(w, http.StatusBadRequest, CodeBadRequest, fmt.Sprintf("stream: %q is not stdout or stderr", lq.Stream))
		return
	}
	if lq.Follow, ok = boolParam(w, q.Get("follow"), "follow"); !ok {
		return
	}
	id := r.PathValue("id")
	if _, err := s.apps.Get(id); err != nil {
		writeError(w, http.StatusNotFound, CodeNotFound, notFoundMessage(vm.ModeAppVM))
		return
	}
	sw := s.startStream(w, "application/x-ndjson")
	defer sw.end()
	ctx, cancel := s.streamContext(r)
	defer cancel()
	if err := s.apps.Logs(ctx, id, lq, sw, sw.flush); err != nil {
		s.log.Debug("workload log stream ended", "id", id, "err", err)
	}
}

// intParam parses an integer query parameter within [lo, hi] (def when
// absent); it answers 400 itself and returns false when it is not.
func intParam(w http.ResponseWriter, v, name string, def, lo, hi int) (int, bool) {
	if v == "" {
		return def, true
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < lo || n > hi {
		writeError(w, http.StatusBadRequest, CodeBadRequest, fmt.Sprintf("%s: %q is not an integer in %d..%d", name, v, lo, hi))
		return 0, false
	}
	return n, true
}

// boolParam parses a true|false query parameter (false when absent).
func boolParam(w http.ResponseWriter, v, name string) (bool, bool) {
	switch v {
	case "", "false":
		return false, true
	case "true":
		return true, true
	}
	writeError(w, http.StatusBadRequest, CodeBadRequest, fmt.Sprintf("%s: %q is not true or false", name, v))
	return false, false
}

// streamWriter writes a long answer: buffered, each write to the client
// bounded by events.WriteTimeout (a client that reads nothing for that
// long is dropped rather than holding the handler), flushed to the client
// at each flush.
type streamWriter struct {
	rc  *http.ResponseController
	bw  *bufio.Writer
	err error
}

// startStream answers 200 with contentType and returns the writer of the
// body.
func (s *Server) startStream(w http.ResponseWriter, contentType string) *streamWriter {
	h := w.Header()
	h.Set("Content-Type", contentType)
	h.Set("Cache-Control", "no-store")
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("X-Accel-Buffering", "no") // proxies must not hold output back
	w.WriteHeader(http.StatusOK)
	sw := &streamWriter{rc: http.NewResponseController(w)}
	sw.bw = bufio.NewWriterSize(deadlineWriter{w: w, rc: sw.rc}, 32<<10)
	return sw
}

func (sw *streamWriter) Write(p []byte) (int, error) {
	if sw.err != nil {
		return 0, sw.err
	}
	n, err := sw.bw.Write(p)
	sw.err = err
	return n, err
}

func (sw *streamWriter) flush() {
	if sw.err == nil {
		sw.err = sw.bw.Flush()
	}
	if sw.err == nil {
		sw.err = sw.rc.Flush()
	}
}

// end flushes what is left and lifts the write deadline, for the next
// request on the connection.
func (sw *streamWriter) end() {
	sw.flush()
	sw.rc.SetWriteDeadline(time.Time{})
}

// deadlineWriter sets the write deadline before each write to the client.
type deadlineWriter struct {
	w  io.Writer
	rc *http.ResponseController
}

func (d deadlineWriter) Write(p []byte) (int, error) {
	if err := d.rc.SetWriteDeadline(time.Now().Add(events.WriteTimeout)); err != nil && !errors.Is(err, http.ErrNotSupported) {
		return 0, err
	}
	return d.w.Write(p)
}
