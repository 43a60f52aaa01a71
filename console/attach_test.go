package console_test

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
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

// TestAttach: two operators attached to the attach socket (mode 0600) see
// the output from then on, while the log keeps all of it; what they type
// reaches the guest, also after the keeper reconnected; Stop disconnects
// them and removes the socket.
func TestAttach(t *testing.T) {
	dir := shortDir(t)
	sock, logPath, attach := filepath.Join(dir, "serial.sock"), filepath.Join(dir, "console.log"), filepath.Join(dir, console.AttachName)
	srv := listen(t, sock)
	k := start(t, console.Config{Socket: sock, Path: logPath, Attach: attach})
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
	a, err := net.Dial("unix", attach)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	b, err := net.Dial("unix", attach)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	ar, br := bufio.NewReader(a), bufio.NewReader(b)
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
	if _, err := os.Lstat(attach); !os.IsNotExist(err) {
		t.Errorf("attach socket after Stop: %v, want it removed", err)
	}
}

// TestAttachReplacesAStaleSocket: a socket file left by a killed agent is
// replaced; a regular file in the way is refused.
func TestAttachReplacesAStaleSocket(t *testing.T) {
	dir := shortDir(t)
	sock, logPath, attach := filepath.Join(dir, "serial.sock"), filepath.Join(dir, "console.log"), filepath.Join(dir, console.AttachName)
	stale, err := net.ListenUnix("unix", &net.UnixAddr{Name: attach, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	stale.SetUnlinkOnClose(false)
	stale.Close()
	start(t, console.Config{Socket: sock, Path: logPath, Attach: attach})
	c, err := net.Dial("unix", attach)
	if err != nil {
		t.Fatalf("attach after replacing a stale socket: %v", err)
	}
	c.Close()

}

// TestAttachFailureKeepsTheLog: when the attach socket cannot be opened (a
// regular file in the way), the keeper still keeps the log and says why
// attaching is not possible.
func TestAttachFailureKeepsTheLog(t *testing.T) {
	dir := shortDir(t)
	sock, logPath, file := filepath.Join(dir, "serial.sock"), filepath.Join(dir, "console.log"), filepath.Join(dir, "not-a-socket")
	os.WriteFile(file, nil, 0o600)
	srv := listen(t, sock)
	k := start(t, console.Config{Socket: sock, Path: logPath, Attach: file})
	if err := k.AttachErr(); err == nil || !strings.Contains(err.Error(), "not a socket") {
		t.Errorf("AttachErr = %v, want the path is not a socket", err)
	}
	guest := srv.accept(t)
	fmt.Fprint(guest, "still kept\n")
	waitFor(t, "the output in the log", func() bool { return output(t, logPath) == "still kept\n" })
	if fi, err := os.Lstat(file); err != nil || !fi.Mode().IsRegular() {
		t.Errorf("the file in the way = %v, %v; want it left alone", fi, err)
	}
}
