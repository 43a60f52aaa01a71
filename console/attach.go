package console

import (
	"bufio"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"strings"
	"sync"
	"time"
)

// AttachName is the attach socket's name in the agent's run directory
// (<run>/console.attach), where `vmhost console` connects.
const AttachName = "console.attach"

// The attach handshake: the client sends the VM's id and a newline; the
// server answers one line, AttachOK, or AttachError and why, then (after
// AttachOK) the console's output follows and what the client sends goes to
// the guest's serial port.
const (
	AttachOK    = "ok"
	AttachError = "error: "
)

// maxAttachID bounds the id line (a VM id is at most 64 bytes).
const maxAttachID = 128

// attachHello bounds the wait for a client's id line.
const attachHello = 5 * time.Second

// attachQueue is how many output chunks an attached client may fall
// behind by before it is dropped: a stalled terminal must not hold up the
// log or the guest.
const attachQueue = 256

// AttachServer is an agent's one attach socket: one listener for every VM,
// so a VM costs nothing for attaching until an operator attaches. Find
// gives the keeper of a VM, or the error the client is told.
type AttachServer struct {
	ln   *net.UnixListener
	path string
	find func(id string) (*Keeper, error)
	wg   sync.WaitGroup
}

// ServeAttach listens at path (mode 0600: root, or the agent's user,
// only), replacing a stale socket, and serves attach clients until Close.
func ServeAttach(path string, find func(id string) (*Keeper, error)) (*AttachServer, error) {
	if fi, err := os.Lstat(path); err == nil {
		if fi.Mode().Type() != fs.ModeSocket {
			return nil, fmt.Errorf("console attach socket %s: the path exists and is not a socket", path)
		}
		os.Remove(path)
	}
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("console attach socket: %w", err)
	}
	if err := os.Chmod(path, 0o600); err != nil {
		ln.Close()
		return nil, fmt.Errorf("console attach socket: %w", err)
	}
	s := &AttachServer{ln: ln, path: path, find: find}
	s.wg.Add(1)
	go s.accept()
	return s, nil
}

func (s *AttachServer) accept() {
	defer s.wg.Done()
	for {
		conn, err := s.ln.Accept()
		if err != nil {
			return // closed
		}
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			s.hello(conn)
		}()
	}
}

// hello reads the client's VM id and hands the connection to the VM's
// keeper, or tells the client why not and closes it.
func (s *AttachServer) hello(conn net.Conn) {
	conn.SetDeadline(time.Now().Add(attachHello))
	line, err := bufio.NewReaderSize(&limited{conn, maxAttachID}, maxAttachID).ReadString('\n')
	if err != nil {
		conn.Close()
		return
	}
	k, err := s.find(strings.TrimSuffix(line, "\n"))
	if err != nil {
		fmt.Fprintf(conn, "%s%s\n", AttachError, oneLine(err.Error()))
		conn.Close()
		return
	}
	if _, err := fmt.Fprintf(conn, "%s\n", AttachOK); err != nil {
		conn.Close()
		return
	}
	conn.SetDeadline(time.Time{})
	k.attach(conn)
}

// limited reads at most n bytes byte by byte, so that nothing after the
// id line is taken from the connection.
type limited struct {
	c net.Conn
	n int
}

func (l *limited) Read(p []byte) (int, error) {
	if l.n <= 0 {
		return 0, errors.New("attach id line too long")
	}
	n, err := l.c.Read(p[:1])
	l.n -= n
	return n, err
}

func oneLine(s string) string { return strings.Join(strings.Fields(s), " ") }

// Close stops listening and removes the socket; attached clients stay with
// their keepers.
func (s *AttachServer) Close() error {
	err := s.ln.Close() // also removes the socket file
	if err != nil && !errors.Is(err, net.ErrClosed) {
		os.Remove(s.path)
	}
	s.wg.Wait()
	return nil
}

// attachments are the clients attached to one keeper: every client gets
// the output from its connection on, and what it sends goes to the
// guest's serial port. The log is written first and never waits for a
// client.
type attachments struct {
	mu      sync.Mutex
	serial  net.Conn // the current serial connection, nil between them
	clients map[*attached]struct{}
	closed  bool
	wg      sync.WaitGroup
}

type attached struct {
	conn net.Conn
	out  chan []byte
	once sync.Once
}

func (c *attached) close() { c.once.Do(func() { c.conn.Close() }) }

// attach adds an operator's connection to the keeper's console.
func (k *Keeper) attach(conn net.Conn) {
	a := &k.attachments
	c := &attached{conn: conn, out: make(chan []byte, attachQueue)}
	a.mu.Lock()
	if a.closed {
		a.mu.Unlock()
		conn.Close()
		return
	}
	if a.clients == nil {
		a.clients = map[*attached]struct{}{}
	}
	a.clients[c] = struct{}{}
	a.wg.Add(2)
	a.mu.Unlock()
	go a.send(c)
	go a.receive(c)
}

// send writes the output queued for c until its queue closes.
func (a *attachments) send(c *attached) {
	defer a.wg.Done()
	for b := range c.out {
		if _, err := c.conn.Write(b); err != nil {
			c.close()
		}
	}
	c.close()
}

// receive forwards what c types to the serial connection; input while the
// keeper is between connections is dropped.
func (a *attachments) receive(c *attached) {
	defer a.wg.Done()
	buf := make([]byte, 4096)
	for {
		n, err := c.conn.Read(buf)
		if n > 0 {
			a.mu.Lock()
			serial := a.serial
			a.mu.Unlock()
			if serial != nil {
				serial.Write(buf[:n])
			}
		}
		if err != nil {
			a.drop(c)
			return
		}
	}
}

// drop ends c's queue (once).
func (a *attachments) drop(c *attached) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if _, ok := a.clients[c]; ok {
		delete(a.clients, c)
		close(c.out)
	}
}

// setSerial names the serial connection input goes to (nil: none).
func (a *attachments) setSerial(conn net.Conn) {
	a.mu.Lock()
	a.serial = conn
	a.mu.Unlock()
}

// broadcast queues a copy of p for every client; one that has fallen
// attachQueue chunks behind is disconnected.
func (a *attachments) broadcast(p []byte) {
	if len(p) == 0 {
		return
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	for c := range a.clients {
		select {
		case c.out <- append([]byte(nil), p...):
		default:
			delete(a.clients, c)
			close(c.out)
			c.close()
		}
	}
}

// close disconnects every client, waiting for their goroutines; later
// clients are refused.
func (a *attachments) close() {
	a.mu.Lock()
	a.closed = true
	a.serial = nil
	for c := range a.clients {
		delete(a.clients, c)
		close(c.out)
		c.close()
	}
	a.mu.Unlock()
	a.wg.Wait()
}

// sink is the keeper's output: the log, then the attached clients.
type sink struct {
	log    *consoleLog
	attach *attachments
}

func (s sink) Write(p []byte) (int, error) {
	n, err := s.log.Write(p)
	s.attach.broadcast(p[:n])
	return n, err
}
