package chsim

import (
	"bytes"
	"fmt"
	"io"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"
)

// vsockMux is the host end of CH's hybrid vsock: it listens on vsock.socket, reads
// "CONNECT <port>\n", asks the simulated guest, and answers "OK <hostport>\n" or closes.
type vsockMux struct {
	s    *sim
	path string
	l    net.Listener

	mu       sync.Mutex
	conns    map[net.Conn]bool
	nextPort uint32
	closed   bool
}

const firstHostPort = 1 << 30

func (s *sim) openVsock(path string) (*vsockMux, error) {
	// CH binds without removing anything: a leftover socket fails the boot.
	l, err := net.Listen("unix", path)
	if err != nil {
		return nil, fmt.Errorf("binding vsock socket %s: %w", path, err)
	}
	m := &vsockMux{s: s, path: path, l: l, conns: map[net.Conn]bool{}, nextPort: firstHostPort}
	go m.accept()
	return m, nil
}

func (m *vsockMux) accept() {
	for {
		c, err := m.l.Accept()
		if err != nil {
			return
		}
		if !m.track(c) {
			c.Close()
			return
		}
		go m.handshake(c)
	}
}

func (m *vsockMux) track(c net.Conn) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return false
	}
	m.conns[c] = true
	return true
}

func (m *vsockMux) untrack(c net.Conn) {
	m.mu.Lock()
	delete(m.conns, c)
	m.mu.Unlock()
	c.Close()
}

// readCommand reads one byte at a time up to '\n' so nothing after the command is
// consumed; the whole command must fit in 32 bytes.
func readCommand(c net.Conn) (string, error) {
	var line []byte
	b := make([]byte, 1)
	for len(line) < 32 {
		if _, err := io.ReadFull(c, b); err != nil {
			return "", err
		}
		if b[0] == '\n' {
			return string(line), nil
		}
		line = append(line, b[0])
	}
	return "", fmt.Errorf("command longer than 32 bytes")
}

func parseConnect(cmd string) (uint32, bool) {
	const prefix = "connect "
	if len(cmd) < len(prefix) || !strings.EqualFold(cmd[:len(prefix)], prefix) {
		return 0, false
	}
	p, err := strconv.ParseUint(strings.TrimSpace(cmd[len(prefix):]), 10, 32)
	return uint32(p), err == nil
}

func (m *vsockMux) handshake(c net.Conn) {
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	cmd, err := readCommand(c)
	c.SetReadDeadline(time.Time{})
	port, ok := parseConnect(cmd)
	if err != nil || !ok {
		m.untrack(c)
		return
	}
	listens, agentPort := m.s.guestListens(port)
	if !listens {
		// The guest answers RST: the stream closes without OK.
		m.untrack(c)
		return
	}
	var agent net.Conn
	if agentPort != "" {
		// The guest agent accepts (or refuses: RST) within CH's request timeout.
		a, err := net.DialTimeout("unix", agentPort, connRequestTimeout)
		if err != nil || !m.track(a) {
			if a != nil {
				a.Close()
			}
			m.untrack(c)
			return
		}
		agent = a
	}
	m.mu.Lock()
	hostPort := m.nextPort
	m.nextPort++
	if m.nextPort >= 1<<31 {
		m.nextPort = firstHostPort
	}
	m.mu.Unlock()
	if _, err := fmt.Fprintf(c, "OK %d\n", hostPort); err != nil {
		m.untrack(c)
		if agent != nil {
			m.untrack(agent)
		}
		return
	}
	if agent != nil {
		m.splice(c, agent)
		return
	}
	m.s.serveGuest(port, c, func() { m.untrack(c) })
}

// connRequestTimeout is CH's CONN_REQUEST_TIMEOUT_MS: a guest that does not answer a
// host-initiated connection within it gets the stream closed without OK.
const connRequestTimeout = 2 * time.Second

// splice carries bytes both ways between the host's stream and the guest agent's
// connection until both directions ended. An end of one direction is passed on as a
// half-close, as v53 does (a host shutdown(SHUT_WR) reaches the guest as
// VSOCK_OP_SHUTDOWN with SEND, and the guest's shutdown of its send side shuts down the
// write side of the host's stream).
func (m *vsockMux) splice(host, guest net.Conn) {
	done := make(chan struct{}, 2)
	pipe := func(dst, src net.Conn) {
		io.Copy(dst, src)
		if cw, ok := dst.(interface{ CloseWrite() error }); ok {
			cw.CloseWrite()
		}
		done <- struct{}{}
	}
	go pipe(guest, host)
	go pipe(host, guest)
	<-done
	<-done
	m.untrack(host)
	m.untrack(guest)
}

// close unlinks the socket and drops every connection, as when the device shuts down.
func (m *vsockMux) close() {
	m.mu.Lock()
	m.closed = true
	conns := m.conns
	m.conns = map[net.Conn]bool{}
	m.mu.Unlock()
	m.l.Close()
	os.Remove(m.path)
	for c := range conns {
		c.Close()
	}
}

// guestListens reports whether a program of the running (or paused) guest listens on
// port: one the simulator serves (--sim-guest-ports, /sim/v1/vsock/listen), or the guest
// agent's, whose unix socket it returns.
func (s *sim) guestListens(port uint32) (bool, string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.state != stateRunning && s.state != statePaused {
		return false, ""
	}
	if s.guestPorts[port] {
		return true, ""
	}
	if s.agent != nil {
		p := fmt.Sprintf("%s_%d", s.agent.listen, port)
		if fi, err := os.Stat(p); err == nil && fi.Mode().Type() == os.ModeSocket {
			return true, p
		}
	}
	return false, ""
}

// serveGuest hands a connection that reached guest port to the guest program.
func (s *sim) serveGuest(port uint32, c net.Conn, done func()) {
	defer done()
	if s.cfg.GuestVsock != nil {
		s.cfg.GuestVsock(port, c)
		return
	}
	io.Copy(c, c)
}

// guestConnect is the guest dialling host port P: CH connects to <socket>_P.
func (s *sim) guestConnect(port uint32, payload []byte) error {
	s.mu.Lock()
	m := s.vsock
	s.mu.Unlock()
	if m == nil {
		return fmt.Errorf("the VM has no vsock device")
	}
	c, err := net.Dial("unix", fmt.Sprintf("%s_%d", m.path, port))
	if err != nil {
		return fmt.Errorf("connection refused by the host: %w", err)
	}
	if !m.track(c) {
		c.Close()
		return fmt.Errorf("vsock device is shutting down")
	}
	if len(payload) > 0 {
		if _, err := io.Copy(c, bytes.NewReader(payload)); err != nil {
			m.untrack(c)
			return err
		}
	}
	go s.serveGuest(port, c, func() { m.untrack(c) })
	return nil
}
