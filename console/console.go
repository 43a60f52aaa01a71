// Package console keeps a VM's serial console: it reads what the guest
// prints from Cloud Hypervisor's serial socket (--serial socket=PATH) and
// appends it to a bounded, rotated log, <run>/vms/<id>/console.log, so a
// guest that dies before its agent connects, or a classic guest that never
// boots, can be diagnosed. Tail gives the last lines for a failure summary.
//
// # Reading
//
// CH binds the serial socket at vm.create and serves one client at a time:
// a new client drops the previous one. Start connects (retrying while the
// socket does not exist yet or refuses, from 20 ms up to 500 ms between
// tries), reads continuously so the guest never waits on its serial port,
// and connects again when the connection drops, until its context ends or
// Stop is called. Because a new client drops the old one, an operator who
// attaches to the same socket is dropped again when the keeper reconnects;
// interactive access has to go through the keeper, not beside it.
//
// # Attaching
//
// An agent has one attach socket for all its VMs (ServeAttach; AttachName
// in its run directory, mode 0600), so keeping a console costs no socket
// of its own: a client names the VM, and from then on gets its output,
// and what it writes is sent to the guest's serial port, while the log
// keeps being written. A client that falls behind is disconnected rather
// than slowing the log. `vmhost console ID` is that client.
//
// # The log
//
// Output is appended to Config.Path (mode 0600, also forced on an existing
// file) in its raw bytes, but for the VM's secret values (Config.Redact),
// each replaced by "[redacted]". When the file reaches MaxSize bytes it is renamed
// to Path + ".1" (replacing the previous generation) and a new Path is
// started, so the log never holds more than 2 × MaxSize bytes; the default
// is 1 MiB per file. The cut is at a byte boundary: a line split across the
// two files is joined again by Tail, which reads them in order. Each Start
// first writes a Marker line, so Tail can tell this boot's lines from an
// earlier run's. The writes are plain appends, not atomicfile replacements:
// a log is appended to continuously and a torn last line after a host crash
// is harmless.
package console

import (
	"context"
	"fmt"
	"io"
	"time"

	"vmhost/internal/redact"
	"vmhost/internal/rotlog"

	"vmhost/internal/nofollow"
)

// DefaultMaxSize is the size at which console.log is rotated.
const DefaultMaxSize = 1 << 20

// Marker starts the line Start writes before the output of each run.
const Marker = "--- vmhost: console kept from "

// Retry delays while the socket is missing or refuses.
const (
	firstRetry = 20 * time.Millisecond
	maxRetry   = 500 * time.Millisecond
)

// drainTimeout bounds how long a stopping keeper still reads: output a VMM
// wrote just before it exited (a panic, the last words of a failing boot)
// is still in the socket buffer when the owner sees the exit and stops the
// keeper. Reading it takes no wait at all once CH has closed its end.
const drainTimeout = 500 * time.Millisecond

// Config says what to keep and where.
type Config struct {
	// Socket is the serial console's unix socket, as given to CH.
	Socket string
	// Path is the log file, normally <run>/vms/<id>/console.log; its
	// directory must exist.
	Path string
	// MaxSize is the rotation size in bytes; 0 means DefaultMaxSize.
	MaxSize int64
	// Redact, when set, holds the VM's secret values: each is replaced by
	// "[redacted]" before the log is written (a secret split between two
	// reads of the socket too: the bytes that may begin one wait for the
	// next read, or the keeper's stop). Attached clients get the output
	// as the guest printed it.
	Redact *redact.Set
}

// Keeper copies one VM's serial output to its log until stopped, and to
// the operators attached to it (ServeAttach).
type Keeper struct {
	cancel      context.CancelFunc
	done        chan struct{}
	log         *consoleLog
	attachments attachments
}

// Start opens the log, writes the Marker line and starts copying the
// console socket's output into it in the background until ctx ends or Stop
// is called. It fails only when the log cannot be opened or written.
func Start(ctx context.Context, c Config) (*Keeper, error) {
	if c.MaxSize <= 0 {
		c.MaxSize = DefaultMaxSize
	}
	log, err := openConsoleLog(c.Path, c.MaxSize, c.Redact)
	if err != nil {
		return nil, err
	}
	if _, err := log.Write([]byte(log.lineStart() + Marker + time.Now().UTC().Format(time.RFC3339) + " ---\n")); err != nil {
		log.Close()
		return nil, err
	}
	ctx, cancel := context.WithCancel(ctx)
	k := &Keeper{cancel: cancel, done: make(chan struct{}), log: log}
	go k.run(ctx, c.Socket)
	return k, nil
}

// Stop ends the copy, waits for it and closes the log. Output already sent
// is still read, for up to half a second while the VMM keeps the socket
// open, so the owner can stop the keeper as soon as the VMM exited without
// losing its last lines. It may be called more than once.
func (k *Keeper) Stop() {
	k.cancel()
	<-k.done
}

// Done is closed when the keeper has stopped (its context ended or Stop)
// and the log is closed.
func (k *Keeper) Done() <-chan struct{} { return k.done }

// Err returns the log write error that stopped the keeper, if any; nil
// while it runs or when it stopped because its context ended.
func (k *Keeper) Err() error {
	select {
	case <-k.done:
		return k.log.err
	default:
		return nil
	}
}

func (k *Keeper) run(ctx context.Context, socket string) {
	defer close(k.done)
	defer k.log.Close()
	defer k.attachments.close()
	delay := firstRetry
	for ctx.Err() == nil {
		// The socket is in a directory a confined VM owns: no link is
		// followed.
		conn, err := nofollow.DialUnix(ctx, socket)
		if err != nil {
			// Not there yet, refused, or gone after the VM stopped: the
			// context decides when to give up.
			select {
			case <-ctx.Done():
			case <-time.After(delay):
			}
			delay = min(2*delay, maxRetry)
			continue
		}
		delay = firstRetry
		stop := context.AfterFunc(ctx, func() { conn.SetReadDeadline(time.Now().Add(drainTimeout)) })
		// Copy until the connection drops (VM stopped or rebooting, another
		// client took the socket, or Stop), then connect again.
		k.attachments.setSerial(conn)
		// A small buffer: a serial line is slow, and every running VM
		// has one of these (io.Copy's own would be 32 KiB each).
		io.CopyBuffer(sink{k.log, &k.attachments}, conn, make([]byte, 2048))
		k.attachments.setSerial(nil)
		stop()
		conn.Close()
		if k.log.err != nil {
			return // the log cannot be written: nothing more can be kept
		}
	}
}

// consoleLog is the console's rotlog.File, cut at exactly MaxSize (a
// byte stream), with the last byte written (to start the marker on a new
// line) and the first error, which every later Write returns. Output
// goes through red (secrets replaced) on its way to the file.
type consoleLog struct {
	f    *rotlog.File
	red  *redact.Stream
	last byte
	err  error
}

func openConsoleLog(path string, max int64, secrets *redact.Set) (*consoleLog, error) {
	f, err := rotlog.Open(path, rotlog.Options{MaxBytes: max, Split: true})
	if err != nil {
		return nil, fmt.Errorf("opening console log: %w", err)
	}
	r := &consoleLog{f: f, last: '\n'}
	r.red = secrets.NewStream(fileWriter{r})
	b, ok, err := f.LastByte()
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("reading console log: %w", err)
	}
	if ok {
		r.last = b
	}
	return r, nil
}

// lineStart is "\n" when the log does not end at a line start.
func (r *consoleLog) lineStart() string {
	if r.last != '\n' {
		return "\n"
	}
	return ""
}

// Write appends p with its secrets replaced, rotating as often as needed,
// and returns len(p) when all was written (or held back, as the start of
// a secret). An error is kept: every later Write fails with it.
func (r *consoleLog) Write(p []byte) (int, error) {
	if r.err != nil {
		return 0, r.err
	}
	if _, err := r.red.Write(p); err != nil {
		return 0, err
	}
	return len(p), nil
}

// fileWriter is what the redaction writes to: the file itself.
type fileWriter struct{ r *consoleLog }

func (w fileWriter) Write(p []byte) (int, error) {
	if err := w.r.write(p); err != nil {
		return 0, err
	}
	return len(p), nil
}

func (r *consoleLog) write(p []byte) error {
	if len(p) == 0 {
		return nil
	}
	n, err := r.f.Write(p)
	if n > 0 {
		r.last = p[n-1]
	}
	if err != nil {
		r.err = fmt.Errorf("writing console log: %w", err)
	}
	return r.err
}

// Close writes what the redaction held back (the output ended, so it is
// not a secret) and closes the file.
func (r *consoleLog) Close() {
	if r.err == nil {
		r.red.Flush()
	}
	r.f.Close()
}
