package chclient

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/textproto"
	"os"
	"strconv"
	"strings"
	"time"
)

// pingRequest is vmm.ping as Cloud Hypervisor's micro_http wants it: a
// plain HTTP/1.1 GET, kept alive.
const pingRequest = "GET /api/v1/vmm.ping HTTP/1.1\r\nHost: localhost\r\nAccept: application/json\r\n\r\n"

// Pinger sends vmm.ping over one kept-alive connection: a supervisor pings
// every VM every second, and a request through net/http costs the agent
// about ten times the CPU of these few bytes (measured with
// bench/idle-cpu.sh). Any failure closes the connection and the next ping
// dials again, so a socket that stops accepting is still noticed then. A
// Pinger is not safe for concurrent use.
type Pinger struct {
	socket string
	conn   net.Conn
	br     *bufio.Reader
}

// NewPinger returns a Pinger for the API socket at socketPath; nothing is
// dialed until the first Ping.
func NewPinger(socketPath string) *Pinger { return &Pinger{socket: socketPath} }

// Ping sends vmm.ping and reads the answer, which must be 200, within ctx.
// Errors wrap the dial's errno (ENOENT: no socket; ECONNREFUSED: nobody
// listens) or context.DeadlineExceeded when ctx ended first.
func (p *Pinger) Ping(ctx context.Context) error {
	err := p.ping(ctx)
	if err != nil {
		p.Close()
		if ctx.Err() != nil || errors.Is(err, os.ErrDeadlineExceeded) {
			return fmt.Errorf("vmm.ping: %w", context.DeadlineExceeded)
		}
	}
	return err
}

func (p *Pinger) ping(ctx context.Context) error {
	if p.conn == nil {
		var d net.Dialer
		c, err := d.DialContext(ctx, "unix", p.socket)
		if err != nil {
			return fmt.Errorf("vmm.ping: %w", err)
		}
		p.conn, p.br = c, bufio.NewReaderSize(c, 512)
	}
	deadline, ok := ctx.Deadline()
	if !ok {
		deadline = time.Time{}
	}
	if err := p.conn.SetDeadline(deadline); err != nil {
		return err
	}
	if _, err := io.WriteString(p.conn, pingRequest); err != nil {
		return fmt.Errorf("vmm.ping: %w", err)
	}
	tp := textproto.NewReader(p.br)
	status, err := tp.ReadLine()
	if err != nil {
		return fmt.Errorf("vmm.ping: %w", err)
	}
	if proto, code, _ := strings.Cut(status, " "); !strings.HasPrefix(proto, "HTTP/1.") || !strings.HasPrefix(code, "200") {
		return fmt.Errorf("vmm.ping: answered %q", status)
	}
	length := 0
	for {
		line, err := tp.ReadLine()
		if err != nil {
			return fmt.Errorf("vmm.ping: %w", err)
		}
		if line == "" {
			break
		}
		if k, v, ok := strings.Cut(line, ":"); ok && strings.EqualFold(strings.TrimSpace(k), "Content-Length") {
			if length, err = strconv.Atoi(strings.TrimSpace(v)); err != nil || length < 0 {
				return fmt.Errorf("vmm.ping: bad Content-Length %q", v)
			}
		}
	}
	if _, err := p.br.Discard(length); err != nil {
		return fmt.Errorf("vmm.ping: %w", err)
	}
	return nil
}

// Close drops the connection; the Pinger stays usable.
func (p *Pinger) Close() {
	if p.conn != nil {
		p.conn.Close()
		p.conn, p.br = nil, nil
	}
}
