package appvm

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"vmhost/appvm/guest/proto"
	"vmhost/internal/atomicfile"
	"vmhost/internal/redact"
)

// migrateLegacyLog turns the workload log of vmhost before chunked logs
// (raw output in workload.log and workload.log.1, both streams mixed, env
// secrets replaced but not secret file contents) into the current one in
// dir: a chunk per line of output (at most proto.MaxLogChunk bytes), as
// stdout, timed by its file's modification time, numbered from 1, with
// every secret red knows replaced. The new log is written whole and
// renamed into place before the old files go, so an agent killed meanwhile
// finds either the old files (and migrates again) or the new log (and
// removes what is left of the old). Nothing to migrate is no error.
func migrateLegacyLog(dir string, red *redact.Set) error {
	legacy := filepath.Join(dir, legacyLogName)
	gens := []string{legacy + ".1", legacy}
	var found []string
	for _, p := range gens {
		if _, err := os.Lstat(p); err == nil {
			found = append(found, p)
		}
	}
	if len(found) == 0 {
		return nil
	}
	target := filepath.Join(dir, logName)
	if _, err := os.Lstat(target); err == nil {
		return removeAll(found)
	}
	var lines []logLine
	var whole []byte
	var bounds []int
	var times []time.Time
	for _, p := range found {
		b, err := os.ReadFile(p)
		if err != nil {
			return fmt.Errorf("migrating the workload log: %w", err)
		}
		st, err := os.Stat(p)
		if err != nil {
			return fmt.Errorf("migrating the workload log: %w", err)
		}
		whole = append(whole, b...)
		bounds = append(bounds, len(whole))
		times = append(times, st.ModTime().UTC())
	}
	// Redacted as one text: a secret may run across the rotation.
	spans := red.Spans(whole)
	gen := 0
	for start := 0; start < len(whole); {
		end := start + min(len(whole)-start, proto.MaxLogChunk)
		if i := bytes.IndexByte(whole[start:end], '\n'); i >= 0 {
			end = start + i + 1
		}
		for _, sp := range spans { // never cut a secret in two
			if sp.Start < end && end < sp.End {
				end = sp.End
			}
		}
		for gen < len(bounds)-1 && start >= bounds[gen] {
			gen++
		}
		var in []redact.Span
		for _, sp := range spans {
			if sp.Start >= start && sp.End <= end {
				in = append(in, redact.Span{Start: sp.Start - start, End: sp.End - start})
			}
		}
		data := redact.AppendReplaced(nil, whole[start:end], in)
		lines = append(lines, logLine{Seq: uint64(len(lines) + 1), Time: times[gen], Stream: proto.Stdout, Data: string(data)})
		start = end
	}
	err := atomicfile.Create(target, 0o600, func(f *os.File) error {
		w := bufio.NewWriter(f)
		enc := json.NewEncoder(w)
		enc.SetEscapeHTML(false)
		for i := range lines {
			if err := enc.Encode(&lines[i]); err != nil {
				return err
			}
		}
		return w.Flush()
	})
	if err != nil && !errors.Is(err, os.ErrExist) {
		return fmt.Errorf("migrating the workload log: %w", err)
	}
	return removeAll(found)
}

func removeAll(paths []string) error {
	var errs []error
	for _, p := range paths {
		if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}
