package console_test

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"vmhost/console"
)

// readUntil reads from c until what it read ends with want.
func readUntil(t *testing.T, r *bufio.Reader, c net.Conn, want string) {
	t.Helper()
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	var got strings.Builder
	for !strings.HasSuffix(got.String(), want) {
		b, err := r.ReadByte()
		if err != nil {
			t.Fatalf("reading until %q: %v (got %q)", want, err, got.String())
		}
		got.WriteByte(b)
	}
}

// serveAttach serves the attach socket in dir with the keepers of keepers
// (by VM id), until the end of the test.
func serveAttach(t *testing.T, dir string, keepers map[string]*console.Keeper) (*console.AttachServer, string) {
	t.Helper()
	path := filepath.Join(dir, console.AttachName)
	srv, err := console.ServeAttach(path, func(id string) (*console.Keeper, error) {
		if k := keepers[id]; k != nil {
			return k, nil
		}
		return nil, fmt.Errorf("no VM %q on this host", id)
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close() })
	return srv, path
}

// dialAttach connects to the attach socket and names VM id; it returns the
// connection and the server's answer line.
func dialAttach(t *testing.T, path, id string) (net.Conn, *bufio.Reader, string) {
	t.Helper()
	c, err := net.Dial("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	fmt.Fprintf(c, "%s\n", id)
	r := bufio.NewReader(c)
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	line, err := r.ReadString('\n')
	if err != nil {
		t.Fatalf("reading the attach answer: %v", err)
	}
	c.SetReadDeadline(time.Time{})
	return c, r, strings.TrimSuffix(line, "\n")
}

// TestAttach: two operators attached through the agent's attach socket
// (mode 0600), naming the VM, see the output from then on, while the log
// keeps all of it; what they type reaches the guest, also after the
// keeper reconnected; a VM that is not there is refused with the reason;
// the keeper's Stop disconnects them, and the server's Close removes the
// socket.
func TestAttach(t *testing.T) {
	dir := shortDir(t)
	sock, logPath := filepath.Join(dir, "serial.sock"), filepath.Join(dir, "console.log")
	srv := listen(t, sock)
	k := start(t, console.Config{Socket: sock, Path: logPath})
	server, attach := serveAttach(t, dir, map[string]*console.Keeper{"vm1": k})
	guest := srv.accept(t)
	fmt.Fprint(guest, "before anyone attached\n")
	waitFor(t, "the first output in the log", func() bool { return output(t, logPath) == "before anyone attached\n" })

	st, err := os.Stat(attach)
	if err != nil {
		t.Fatal(err)
	}
	if st.Mode().Perm() != 0o600 {
		t.Errorf("attach socket mode = %v, want 0600", st.Mode().Perm())
	}
	if _, _, line := dialAttach(t, attach, "vm2"); line != console.AttachError+`no VM "vm2" on this host` {
		t.Errorf("attaching to an unknown VM answered %q", line)
	}
	a, ar, line := dialAttach(t, attach, "vm1")
	if line != console.AttachOK {
		t.Fatalf("attach answered %q", line)
	}
	b, br, _ := dialAttach(t, attach, "vm1")
	// Each types a byte first: once the guest has read it, that client
	// is registered for the output.
	guest.SetReadDeadline(time.Now().Add(10 * time.Second))
	for _, c := range []net.Conn{a, b} {
		fmt.Fprint(c, "x")
		in := make([]byte, 1)
		if _, err := io.ReadFull(guest, in); err != nil || in[0] != 'x' {
			t.Fatalf("guest read %q, %v; want x", in, err)
		}
	}
	fmt.Fprint(guest, "for both\n")
	readUntil(t, ar, a, "for both\n")
	readUntil(t, br, b, "for both\n")

	// Input goes to the guest.
	fmt.Fprint(a, "root\n")
	guest.SetReadDeadline(time.Now().Add(10 * time.Second))
	in := make([]byte, 5)
	if _, err := io.ReadFull(guest, in); err != nil || string(in) != "root\n" {
		t.Fatalf("guest read %q, %v; want root\\n", in, err)
	}
	// The keeper reconnects (a reboot); input follows the new connection.
	guest.Close()
	guest = srv.accept(t)
	fmt.Fprint(guest, "rebooted\n")
	readUntil(t, br, b, "rebooted\n")
	fmt.Fprint(b, "ls\n")
	guest.SetReadDeadline(time.Now().Add(10 * time.Second))
	in = make([]byte, 3)
	if _, err := io.ReadFull(guest, in); err != nil || string(in) != "ls\n" {
		t.Fatalf("guest read after the reconnect %q, %v; want ls\\n", in, err)
	}
	if got := output(t, logPath); !strings.HasPrefix(got, "before anyone attached\nfor both\n") || !strings.HasSuffix(got, "for both\nrebooted\n") {
		t.Errorf("log = %q", got)
	}

	// A client that leaves does not disturb the other.
	a.Close()
	fmt.Fprint(guest, "after a left\n")
	readUntil(t, br, b, "after a left\n")

	k.Stop()
	b.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.ReadAll(br); err != nil {
		t.Errorf("attached client after Stop: %v, want EOF", err)
	}
	// A stopped keeper takes no one.
	c, cr, line := dialAttach(t, attach, "vm1")
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if rest, err := io.ReadAll(cr); line != console.AttachOK || err != nil || len(rest) != 0 {
		t.Errorf("attaching to a stopped keeper: %q then %q, %v; want the connection closed", line, rest, err)
	}
	server.Close()
	if _, err := os.Lstat(attach); !os.IsNotExist(err) {
		t.Errorf("attach socket after Close: %v, want it removed", err)
	}
}

// TestAttachHello: a client that names no VM in time, or sends a line
// longer than any id, is disconnected without an answer; what a client
// sends right after its id line goes to the guest.
func TestAttachHello(t *testing.T) {
	dir := shortDir(t)
	sock, logPath := filepath.Join(dir, "serial.sock"), filepath.Join(dir, "console.log")
	srv := listen(t, sock)
	k := start(t, console.Config{Socket: sock, Path: logPath})
	_, attach := serveAttach(t, dir, map[string]*console.Keeper{"vm1": k})
	guest := srv.accept(t)
	// The keeper forwards input once it reads the connection: wait for
	// that, or "immediate" could arrive while it has no serial yet.
	fmt.Fprint(guest, "up\n")
	waitFor(t, "the keeper to read the guest", func() bool { return output(t, logPath) == "up\n" })

	long, err := net.Dial("unix", attach)
	if err != nil {
		t.Fatal(err)
	}
	defer long.Close()
	fmt.Fprint(long, strings.Repeat("x", 200))
	long.SetReadDeadline(time.Now().Add(10 * time.Second))
	// Closed with bytes unread: a reset, or an end.
	if got, err := io.ReadAll(long); (err != nil && !errors.Is(err, syscall.ECONNRESET)) || len(got) != 0 {
		t.Errorf("an over-long id line got %q, %v; want the connection closed", got, err)
	}

	c, err := net.Dial("unix", attach)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	fmt.Fprint(c, "vm1\nimmediate")
	guest.SetReadDeadline(time.Now().Add(10 * time.Second))
	in := make([]byte, len("immediate"))
	if _, err := io.ReadFull(guest, in); err != nil || string(in) != "immediate" {
		t.Errorf("guest read %q, %v; want what followed the id line", in, err)
	}
}

// TestAttachReplacesAStaleSocket: a socket file left by a killed agent is
// replaced; a regular file in the way is refused and left alone.
func TestAttachReplacesAStaleSocket(t *testing.T) {
	dir := shortDir(t)
	attach := filepath.Join(dir, console.AttachName)
	stale, err := net.ListenUnix("unix", &net.UnixAddr{Name: attach, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	stale.SetUnlinkOnClose(false)
	stale.Close()
	serveAttach(t, dir, nil)
	if _, _, line := dialAttach(t, attach, "vm1"); !strings.HasPrefix(line, console.AttachError) {
		t.Errorf("attach after replacing a stale socket answered %q", line)
	}

	file := filepath.Join(dir, "not-a-socket")
	os.WriteFile(file, nil, 0o600)
	if _, err := console.ServeAttach(file, nil); err == nil || !strings.Contains(err.Error(), "not a socket") {
		t.Errorf("ServeAttach over a regular file = %v, want the path is not a socket", err)
	}
	if fi, err := os.Lstat(file); err != nil || !fi.Mode().IsRegular() {
		t.Errorf("the file in the way = %v, %v; want it left alone", fi, err)
	}
}
