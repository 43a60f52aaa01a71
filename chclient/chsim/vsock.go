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
	if !m.s.guestListens(port) {
		// The guest answers RST: the stream closes without OK.
		m.untrack(c)
		return
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
		return
	}
	m.s.serveGuest(port, c, func() { m.untrack(c) })
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

func (s *sim) guestListens(port uint32) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return (s.state == stateRunning || s.state == statePaused) && s.guestPorts[port]
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
