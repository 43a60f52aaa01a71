package chsim_test

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// vhostUserProxy sits between QEMU and a vhost-user backend that offers no dirty
// logging (vhost-device-vsock 0.3.0). It tells QEMU the backend can log
// (VHOST_F_LOG_ALL in GET_FEATURES replies, VHOST_USER_PROTOCOL_F_LOG_SHMFD in
// GET_PROTOCOL_FEATURES replies), strips both from what QEMU sets before it reaches
// the backend, and drops the connection on SET_LOG_BASE / SET_LOG_FD, so a dirty log
// of a running device fails loudly instead of missing the backend's writes. Everything
// else, file descriptors included, passes unchanged both ways.
//
// It lives in the tests only: it answers the first of the two reasons QEMU 7.2 gives
// for not migrating a VM with vhost-user-vsock, and
// TestVhostUserVsockMigrationBlockedInQemu shows that the second (the device's own
// VMState is unmigratable) remains, so the simulator has nothing to gain from it
// (docs/ref/qemu-vhost-user-migration.md).
type vhostUserProxy struct {
	// refused receives the request number of a logging request the proxy refused.
	refused chan uint32
}

// vhost-user requests and bits the proxy rewrites (docs/interop/vhost-user.rst).
const (
	vuGetFeatures         = 1
	vuSetFeatures         = 2
	vuSetLogBase          = 6
	vuSetLogFD            = 7
	vuGetProtocolFeatures = 15
	vuSetProtocolFeatures = 16

	vuLogAll    = 1 << 26 // VHOST_F_LOG_ALL, a virtio feature bit
	vuLogShmfd  = 1 << 1  // VHOST_USER_PROTOCOL_F_LOG_SHMFD
	vuHeaderLen = 12      // request, flags, size: three little-endian u32
	vuMaxFDs    = 32      // more than any request carries (SET_MEM_TABLE: 8)
	vuMaxBody   = 1 << 16 // bigger than any message body QEMU 7.2 sends
)

// vuMsg is one vhost-user message: its header, body and the descriptors that came
// with it.
type vuMsg struct {
	request, flags uint32
	body           []byte
	fds            []int
}

// readVU reads one message from c. The descriptors arrive with the message's first
// bytes; any that come with later bytes are kept too.
func readVU(c *net.UnixConn) (*vuMsg, error) {
	var fds []int
	oob := make([]byte, unix.CmsgSpace(4*vuMaxFDs))
	readFull := func(b []byte) error {
		for got := 0; got < len(b); {
			n, oobn, _, _, err := c.ReadMsgUnix(b[got:], oob)
			if oobn > 0 {
				scms, perr := unix.ParseSocketControlMessage(oob[:oobn])
				if perr != nil {
					return perr
				}
				for _, scm := range scms {
					got, perr := unix.ParseUnixRights(&scm)
					if perr != nil {
						return perr
					}
					fds = append(fds, got...)
				}
			}
			got += n
			if err != nil {
				return err
			}
			if n == 0 {
				return io.ErrUnexpectedEOF
			}
		}
		return nil
	}
	closeFDs := func() {
		for _, fd := range fds {
			unix.Close(fd)
		}
	}
	hdr := make([]byte, vuHeaderLen)
	if err := readFull(hdr); err != nil {
		closeFDs()
		return nil, err
	}
	m := &vuMsg{request: binary.LittleEndian.Uint32(hdr), flags: binary.LittleEndian.Uint32(hdr[4:])}
	size := binary.LittleEndian.Uint32(hdr[8:])
	if size > vuMaxBody {
		closeFDs()
		return nil, fmt.Errorf("vhost-user request %d: body of %d bytes", m.request, size)
	}
	m.body = make([]byte, size)
	if err := readFull(m.body); err != nil {
		closeFDs()
		return nil, err
	}
	m.fds = fds
	return m, nil
}

// writeVU writes m to c with its descriptors, and closes the proxy's copies of them.
func writeVU(c *net.UnixConn, m *vuMsg) error {
	defer func() {
		for _, fd := range m.fds {
			unix.Close(fd)
		}
	}()
	b := make([]byte, vuHeaderLen+len(m.body))
	binary.LittleEndian.PutUint32(b, m.request)
	binary.LittleEndian.PutUint32(b[4:], m.flags)
	binary.LittleEndian.PutUint32(b[8:], uint32(len(m.body)))
	copy(b[vuHeaderLen:], m.body)
	var oob []byte
	if len(m.fds) > 0 {
		oob = unix.UnixRights(m.fds...)
	}
	n, _, err := c.WriteMsgUnix(b, oob, nil)
	if err == nil && n < len(b) {
		_, err = c.Write(b[n:])
	}
	return err
}

// setU64Bits ORs (or clears) bits in a message whose body is one u64.
func (m *vuMsg) setU64Bits(bits uint64, on bool) {
	if len(m.body) != 8 {
		return
	}
	v := binary.LittleEndian.Uint64(m.body)
	if on {
		v |= bits
	} else {
		v &^= bits
	}
	binary.LittleEndian.PutUint64(m.body, v)
}

// serve relays between front (QEMU's end) and back (the backend's) until either
// closes or the proxy refuses a request; then it closes both.
func (p *vhostUserProxy) serve(front, back *net.UnixConn) error {
	defer front.Close()
	defer back.Close()
	errc := make(chan error, 2)
	go func() {
		// Backend to QEMU: on the main socket, replies only.
		for {
			m, err := readVU(back)
			if err != nil {
				errc <- err
				return
			}
			switch m.request {
			case vuGetFeatures:
				m.setU64Bits(vuLogAll, true)
			case vuGetProtocolFeatures:
				m.setU64Bits(vuLogShmfd, true)
			}
			if err := writeVU(front, m); err != nil {
				errc <- err
				return
			}
		}
	}()
	go func() {
		for {
			m, err := readVU(front)
			if err != nil {
				errc <- err
				return
			}
			switch m.request {
			case vuSetFeatures:
				m.setU64Bits(vuLogAll, false)
			case vuSetProtocolFeatures:
				m.setU64Bits(vuLogShmfd, false)
			case vuSetLogBase, vuSetLogFD:
				for _, fd := range m.fds {
					unix.Close(fd)
				}
				if p.refused != nil {
					p.refused <- m.request
				}
				errc <- fmt.Errorf("vhost-user request %d: the backend cannot log dirty pages", m.request)
				return
			}
			if err := writeVU(back, m); err != nil {
				errc <- err
				return
			}
		}
	}()
	err := <-errc
	front.Close()
	back.Close()
	<-errc
	if errors.Is(err, io.EOF) || errors.Is(err, net.ErrClosed) {
		return nil
	}
	return err
}

// listen serves each connection to path by dialling backend for it.
func (p *vhostUserProxy) listen(path, backend string) (net.Listener, error) {
	os.Remove(path)
	l, err := net.Listen("unix", path)
	if err != nil {
		return nil, err
	}
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			b, err := net.Dial("unix", backend)
			if err != nil {
				c.Close()
				continue
			}
			go p.serve(c.(*net.UnixConn), b.(*net.UnixConn))
		}
	}()
	return l, nil
}

// TestVhostUserProxyRewrites drives vhostUserProxy over real socketpairs with a fake
// QEMU and a fake backend: the dirty-log bits are added to the feature replies and
// stripped from what is set, a request's file descriptor reaches the backend as the
// same open file, and SET_LOG_BASE ends the connection without reaching the backend.
func TestVhostUserProxyRewrites(t *testing.T) {
	pair := func() (*net.UnixConn, *net.UnixConn) {
		fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			t.Fatal(err)
		}
		conn := func(fd int) *net.UnixConn {
			f := os.NewFile(uintptr(fd), "vu")
			defer f.Close()
			c, err := net.FileConn(f)
			if err != nil {
				t.Fatal(err)
			}
			return c.(*net.UnixConn)
		}
		return conn(fds[0]), conn(fds[1])
	}
	qemu, front := pair()
	back, backend := pair()
	defer qemu.Close()
	defer backend.Close()
	p := &vhostUserProxy{refused: make(chan uint32, 1)}
	done := make(chan error, 1)
	go func() { done <- p.serve(front, back) }()

	u64 := func(v uint64) []byte { return binary.LittleEndian.AppendUint64(nil, v) }
	send := func(c *net.UnixConn, m *vuMsg) {
		t.Helper()
		if err := writeVU(c, m); err != nil {
			t.Fatal(err)
		}
	}
	recv := func(c *net.UnixConn) *vuMsg {
		t.Helper()
		m, err := readVU(c)
		if err != nil {
			t.Fatal(err)
		}
		return m
	}
	const reply, version = 1 << 2, 1
	const other = 1<<32 | 1<<30 | 1 // VERSION_1, PROTOCOL_FEATURES, a device bit

	// GET_FEATURES: the request passes as it is, the reply gains LOG_ALL.
	send(qemu, &vuMsg{request: vuGetFeatures, flags: version})
	if m := recv(backend); m.request != vuGetFeatures || len(m.body) != 0 {
		t.Fatalf("the backend got %+v", m)
	}
	send(backend, &vuMsg{request: vuGetFeatures, flags: version | reply, body: u64(other)})
	if m := recv(qemu); binary.LittleEndian.Uint64(m.body) != other|vuLogAll || m.flags != version|reply {
		t.Errorf("GET_FEATURES reply = %#x flags %#x, want %#x", binary.LittleEndian.Uint64(m.body), m.flags, other|vuLogAll)
	}
	// GET_PROTOCOL_FEATURES: the reply gains LOG_SHMFD.
	send(qemu, &vuMsg{request: vuGetProtocolFeatures, flags: version})
	recv(backend)
	send(backend, &vuMsg{request: vuGetProtocolFeatures, flags: version | reply, body: u64(1 << 9)})
	if m := recv(qemu); binary.LittleEndian.Uint64(m.body) != 1<<9|vuLogShmfd {
		t.Errorf("GET_PROTOCOL_FEATURES reply = %#x", binary.LittleEndian.Uint64(m.body))
	}
	// SET_FEATURES and SET_PROTOCOL_FEATURES lose them on the way.
	send(qemu, &vuMsg{request: vuSetFeatures, flags: version, body: u64(other | vuLogAll)})
	if m := recv(backend); binary.LittleEndian.Uint64(m.body) != other {
		t.Errorf("SET_FEATURES reached the backend as %#x, want %#x", binary.LittleEndian.Uint64(m.body), uint64(other))
	}
	send(qemu, &vuMsg{request: vuSetProtocolFeatures, flags: version, body: u64(1<<9 | vuLogShmfd)})
	if m := recv(backend); binary.LittleEndian.Uint64(m.body) != 1<<9 {
		t.Errorf("SET_PROTOCOL_FEATURES reached the backend as %#x", binary.LittleEndian.Uint64(m.body))
	}
	// SET_VRING_KICK (12) with an eventfd: the backend gets the same open file.
	efd, err := unix.Eventfd(0, unix.EFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	var sent unix.Stat_t
	unix.Fstat(efd, &sent)
	dup, _ := unix.FcntlInt(uintptr(efd), unix.F_DUPFD_CLOEXEC, 0) // writeVU closes what it sends
	send(qemu, &vuMsg{request: 12, flags: version, body: u64(1), fds: []int{dup}})
	m := recv(backend)
	if len(m.fds) != 1 {
		t.Fatalf("SET_VRING_KICK reached the backend with %d descriptors", len(m.fds))
	}
	var got unix.Stat_t
	unix.Fstat(m.fds[0], &got)
	if got.Ino != sent.Ino || got.Dev != sent.Dev {
		t.Errorf("the backend's descriptor is another file (inode %d, sent %d)", got.Ino, sent.Ino)
	}
	// A count written through the backend's copy is read from QEMU's.
	unix.Write(m.fds[0], u64(7))
	for _, fd := range m.fds {
		unix.Close(fd)
	}
	var count [8]byte
	if n, err := unix.Read(efd, count[:]); err != nil || n != 8 || binary.LittleEndian.Uint64(count[:]) != 7 {
		t.Errorf("QEMU's eventfd reads %v %v, want the count 7 the backend wrote", count, err)
	}
	unix.Close(efd)
	// SET_LOG_BASE: refused, the connection ends, the backend sees only the close.
	logfd, _ := unix.Eventfd(0, unix.EFD_CLOEXEC)
	send(qemu, &vuMsg{request: vuSetLogBase, flags: version, body: make([]byte, 16), fds: []int{logfd}})
	select {
	case r := <-p.refused:
		if r != vuSetLogBase {
			t.Errorf("refused request %d", r)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("SET_LOG_BASE was not refused")
	}
	if m, err := readVU(backend); err == nil {
		t.Errorf("the backend got request %d after SET_LOG_BASE", m.request)
	}
	if _, err := readVU(qemu); err == nil {
		t.Error("QEMU's connection stayed open after SET_LOG_BASE")
	}
	if err := <-done; err == nil || !strings.Contains(err.Error(), "cannot log") {
		t.Errorf("serve = %v", err)
	}
}
