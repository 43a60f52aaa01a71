package chclient

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/textproto"
	"os"
	"strconv"
	"strings"

	"vmhost/internal/nofollow"
)

// The supervisor's frequent reads (vmm.ping of every VM every second,
// vm.counters of every VM per metrics scrape) go over rawConn: a plain
// HTTP/1.1 GET written and parsed by hand on a unix connection. Through
// net/http each cost the agent about ten times the CPU (a Transport, its
// goroutines and timers per call; measured with bench/idle-cpu.sh and
// BenchmarkMetricsScrape). Only what Cloud Hypervisor's micro_http
// answers is understood: a status line, headers, a Content-Length body.

// rawConn is one kept-alive connection to a CH API socket. It is not safe
// for concurrent use.
type rawConn struct {
	socket string
	conn   net.Conn
	br     *bufio.Reader
}

// get sends GET /api/v1/<route> and returns the status and body. Any
// error closes the connection (the next get dials again) and wraps the
// dial's errno (ENOENT: no socket; ECONNREFUSED: nobody listens) or
// context.DeadlineExceeded when ctx ended first.
func (r *rawConn) get(ctx context.Context, route string) (int, []byte, error) {
	status, body, err := r.exchange(ctx, route)
	if err != nil {
		r.close()
		if ctx.Err() != nil || errors.Is(err, os.ErrDeadlineExceeded) {
			err = context.DeadlineExceeded
		}
		return 0, nil, fmt.Errorf("cloud hypervisor %s: %w", route, err)
	}
	return status, body, nil
}

func (r *rawConn) exchange(ctx context.Context, route string) (int, []byte, error) {
	if r.conn == nil {
		c, err := nofollow.DialUnix(ctx, r.socket)
		if err != nil {
			return 0, nil, err
		}
		r.conn, r.br = c, bufio.NewReaderSize(c, 512)
	}
	deadline, _ := ctx.Deadline() // zero: none
	if err := r.conn.SetDeadline(deadline); err != nil {
		return 0, nil, err
	}
	if _, err := io.WriteString(r.conn, "GET /api/v1/"+route+" HTTP/1.1\r\nHost: localhost\r\nAccept: application/json\r\n\r\n"); err != nil {
		return 0, nil, err
	}
	tp := textproto.NewReader(r.br)
	line, err := tp.ReadLine()
	if err != nil {
		return 0, nil, err
	}
	proto, rest, _ := strings.Cut(line, " ")
	code, _, _ := strings.Cut(rest, " ")
	status, err := strconv.Atoi(code)
	if !strings.HasPrefix(proto, "HTTP/1.") || err != nil {
		return 0, nil, fmt.Errorf("not an HTTP/1 status line: %q", line)
	}
	length := 0
	for {
		h, err := tp.ReadLine()
		if err != nil {
			return 0, nil, err
		}
		if h == "" {
			break
		}
		if k, v, ok := strings.Cut(h, ":"); ok && strings.EqualFold(strings.TrimSpace(k), "Content-Length") {
			if length, err = strconv.Atoi(strings.TrimSpace(v)); err != nil || length < 0 || length > maxRawBody {
				return 0, nil, fmt.Errorf("bad Content-Length %q", v)
			}
		}
	}
	body := make([]byte, length)
	if _, err := io.ReadFull(r.br, body); err != nil {
		return 0, nil, err
	}
	return status, body, nil
}

// maxRawBody bounds what a raw read accepts (vm.counters of a VM with
// many devices is a few KiB).
const maxRawBody = 1 << 20

func (r *rawConn) close() {
	if r.conn != nil {
		r.conn.Close()
		r.conn, r.br = nil, nil
	}
}

// Pinger sends vmm.ping over one kept-alive connection. A failure closes
// it and the next ping dials again, so a socket that stops accepting is
// still noticed then. A Pinger is not safe for concurrent use.
type Pinger struct{ c rawConn }

// NewPinger returns a Pinger for the API socket at socketPath; nothing is
// dialed until the first Ping.
func NewPinger(socketPath string) *Pinger { return &Pinger{rawConn{socket: socketPath}} }

// Ping sends vmm.ping and reads the answer, which must be 200, within ctx.
// Errors are rawConn.get's.
func (p *Pinger) Ping(ctx context.Context) error {
	status, _, err := p.c.get(ctx, "vmm.ping")
	if err == nil && status != 200 {
		p.c.close()
		err = fmt.Errorf("cloud hypervisor vmm.ping: answered %d", status)
	}
	return err
}

// Close drops the connection; the Pinger stays usable.
func (p *Pinger) Close() { p.c.close() }

// ReadCounters reads vm.counters from the API socket at socketPath over a
// connection of its own: device id → counter name → value.
func ReadCounters(ctx context.Context, socketPath string) (map[string]map[string]uint64, error) {
	c := rawConn{socket: socketPath}
	defer c.close()
	status, body, err := c.get(ctx, "vm.counters")
	if err != nil {
		return nil, err
	}
	if status != 200 {
		return nil, &APIError{Method: "GET", Path: "vm.counters", Status: status, Body: errorChain(body)}
	}
	var out map[string]map[string]uint64
	if err := json.Unmarshal(body, &out); err != nil {
		return nil, fmt.Errorf("cloud hypervisor vm.counters: %w", err)
	}
	return out, nil
}
