package chsim

import (
	"fmt"
	"net"
	"os"
	"sync"
)

// serialPort is the serial console in Socket mode: CH binds the path (which must not exist),
// serves one client at a time (a new one drops the old), buffers output until a client
// connects, and unlinks the path when the VM stops.
type serialPort struct {
	path string
	l    net.Listener

	mu     sync.Mutex
	client net.Conn
	buf    []byte
	input  func([]byte) // where client input goes; nil: echoed, as the simulated guest's tty
}

func openSerial(path string) (*serialPort, error) {
	if _, err := os.Lstat(path); err == nil {
		return nil, fmt.Errorf("Error creating serial socket %s: Address in use (os error 98)", path)
	}
	l, err := net.Listen("unix", path)
	if err != nil {
		return nil, fmt.Errorf("Error creating serial socket %s: %w", path, err)
	}
	p := &serialPort{path: path, l: l}
	go p.accept()
	return p, nil
}

func (p *serialPort) accept() {
	for {
		c, err := p.l.Accept()
		if err != nil {
			return
		}
		p.mu.Lock()
		if p.client != nil {
			p.client.Close()
		}
		p.client = c
		if len(p.buf) > 0 {
			c.Write(p.buf)
			p.buf = nil
		}
		p.mu.Unlock()
		go p.readInput(c)
	}
}

// readInput passes what the client types to the guest: to qemu's serial port, or echoed as
// the simulated guest's tty would.
func (p *serialPort) readInput(c net.Conn) {
	b := make([]byte, 512)
	for {
		n, err := c.Read(b)
		if n > 0 {
			p.mu.Lock()
			input := p.input
			p.mu.Unlock()
			if input != nil {
				input(b[:n])
			} else {
				p.write(b[:n])
			}
		}
		if err != nil {
			return
		}
	}
}

func (p *serialPort) setInput(fn func([]byte)) {
	p.mu.Lock()
	p.input = fn
	p.mu.Unlock()
}

func (p *serialPort) write(b []byte) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.client != nil {
		if _, err := p.client.Write(b); err == nil {
			return
		}
		p.client.Close()
		p.client = nil
	}
	const maxBuffered = 64 << 10
	p.buf = append(p.buf, b...)
	if len(p.buf) > maxBuffered {
		p.buf = p.buf[len(p.buf)-maxBuffered:]
	}
}

func (p *serialPort) close() {
	p.l.Close()
	os.Remove(p.path)
	p.mu.Lock()
	if p.client != nil {
		p.client.Close()
		p.client = nil
	}
	p.mu.Unlock()
}

// serialWrite is the guest printing to its serial port.
func (s *sim) serialWrite(text string) {
	if s.serial != nil {
		s.serial.write([]byte(text))
	}
}
