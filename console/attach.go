package console

import (
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"sync"

	"vmhost/internal/nofollow"
)

// AttachName is the attach socket's name in a VM's run directory
// (<run>/vms/<id>/console.attach), where `vmhost console` connects.
const AttachName = "console.attach"

// attachQueue is how many output chunks an attached client may fall
// behind by before it is dropped: a stalled terminal must not hold up the
// log or the guest.
const attachQueue = 256

// attachments is the attach socket of a keeper: every client gets the
// output from its connection on, and what it sends goes to the guest's
// serial port. The log is written first and never waits for a client.
type attachments struct {
	ln      *net.UnixListener
	path    string
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

// listenAttach opens the attach socket at path (mode 0600: root, or the
// agent's user, only), replacing a stale one.
func listenAttach(path string) (*attachments, error) {
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
	// The directory may be a confined VM's, which could put a link there.
	if err := nofollow.Chmod(path, 0o600); err != nil {
		ln.Close()
		return nil, fmt.Errorf("console attach socket: %w", err)
	}
	a := &attachments{ln: ln, path: path, clients: map[*attached]struct{}{}}
	a.wg.Add(1)
	go a.accept()
	return a, nil
}

func (a *attachments) accept() {
	defer a.wg.Done()
	for {
		conn, err := a.ln.Accept()
		if err != nil {
			return // closed
		}
		c := &attached{conn: conn, out: make(chan []byte, attachQueue)}
		a.mu.Lock()
		if a.closed {
			a.mu.Unlock()
			conn.Close()
			return
		}
		a.clients[c] = struct{}{}
		a.mu.Unlock()
		a.wg.Add(2)
		go a.send(c)
		go a.receive(c)
	}
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
	if a == nil {
		return
	}
	a.mu.Lock()
	a.serial = conn
	a.mu.Unlock()
}

// broadcast queues a copy of p for every client; one that has fallen
// attachQueue chunks behind is disconnected.
func (a *attachments) broadcast(p []byte) {
	if a == nil || len(p) == 0 {
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

// close removes the socket and disconnects every client, waiting for their
// goroutines.
func (a *attachments) close() {
	if a == nil {
		return
	}
	a.mu.Lock()
	a.closed = true
	a.serial = nil
	for c := range a.clients {
		delete(a.clients, c)
		close(c.out)
		c.close()
	}
	a.mu.Unlock()
	err := a.ln.Close() // also removes the socket file
	if err != nil && !errors.Is(err, net.ErrClosed) {
		os.Remove(a.path)
	}
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
