package console_test

import (
	"bytes"
	"context"
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

// shortDir returns a directory whose paths fit a unix socket address.
func shortDir(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "console")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

// waitFor polls cond until it holds, failing after 10 s.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// serialServer stands in for CH's serial socket: it listens on sock and
// hands over each accepted connection.
type serialServer struct {
	l     *net.UnixListener
	conns chan net.Conn
	done  chan struct{}
}

func listen(t *testing.T, sock string) *serialServer {
	t.Helper()
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	s := &serialServer{l: l, conns: make(chan net.Conn, 16), done: make(chan struct{})}
	go func() {
		defer close(s.done)
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			s.conns <- c
		}
	}()
	t.Cleanup(s.close)
	return s
}

// close stops listening (removing the socket, as CH does when the VM
// stops) and closes connections not yet handed over.
func (s *serialServer) close() {
	s.l.Close()
	<-s.done
	for {
		select {
		case c := <-s.conns:
			c.Close()
		default:
			return
		}
	}
}

func (s *serialServer) accept(t *testing.T) net.Conn {
	t.Helper()
	select {
	case c := <-s.conns:
		t.Cleanup(func() { c.Close() })
		return c
	case <-time.After(10 * time.Second):
		t.Fatal("the keeper did not connect")
		return nil
	}
}

func start(t *testing.T, c console.Config) *console.Keeper {
	t.Helper()
	k, err := console.Start(context.Background(), c)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(k.Stop)
	return k
}

func readFile(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	return string(b)
}

// output returns the log without its marker lines.
func output(t *testing.T, path string) string {
	t.Helper()
	all := readFile(t, path+".1") + readFile(t, path)
	var b strings.Builder
	for _, l := range strings.SplitAfter(all, "\n") {
		if !strings.HasPrefix(l, console.Marker) {
			b.WriteString(l)
		}
	}
	return b.String()
}

func TestCopiesOutputToA0600Log(t *testing.T) {
	dir := shortDir(t)
	sock, logPath := filepath.Join(dir, "serial.sock"), filepath.Join(dir, "console.log")
	// An existing log, too open and not ending in a newline: it is kept,
	// made private and the marker starts on a line of its own.
	if err := os.WriteFile(logPath, []byte("earlier run"), 0o644); err != nil {
		t.Fatal(err)
	}
	srv := listen(t, sock)
	k := start(t, console.Config{Socket: sock, Path: logPath})
	c := srv.accept(t)
	fmt.Fprint(c, "Linux version 6.1.0\r\nlogin: ")
	waitFor(t, "the output in the log", func() bool { return strings.HasSuffix(readFile(t, logPath), "login: ") })
	got := readFile(t, logPath)
	if !strings.HasPrefix(got, "earlier run\n"+console.Marker) || !strings.Contains(got, " ---\nLinux version 6.1.0\r\nlogin: ") {
		t.Errorf("log = %q", got)
	}
	st, err := os.Stat(logPath)
	if err != nil {
		t.Fatal(err)
	}
	if st.Mode().Perm() != 0o600 {
		t.Errorf("log mode = %v, want 0600", st.Mode().Perm())
	}
	k.Stop()
	select {
	case <-k.Done():
	default:
		t.Error("Done not closed after Stop")
	}
	if err := k.Err(); err != nil {
		t.Errorf("Err after Stop = %v", err)
	}
}

func TestWaitsForTheSocket(t *testing.T) {
	dir := shortDir(t)
	sock, logPath := filepath.Join(dir, "serial.sock"), filepath.Join(dir, "console.log")
	start(t, console.Config{Socket: sock, Path: logPath})
	// Missing, then a stale socket file that refuses (what a killed CH
	// leaves behind), then listening.
	time.Sleep(100 * time.Millisecond)
	stale, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	stale.SetUnlinkOnClose(false)
	stale.Close()
	time.Sleep(100 * time.Millisecond)
	os.Remove(sock)
	srv := listen(t, sock)
	c := srv.accept(t)
	fmt.Fprint(c, "late boot\n")
	waitFor(t, "the output in the log", func() bool { return output(t, logPath) == "late boot\n" })
}

func TestReconnectsAfterADrop(t *testing.T) {
	dir := shortDir(t)
	sock, logPath := filepath.Join(dir, "serial.sock"), filepath.Join(dir, "console.log")
	srv := listen(t, sock)
	start(t, console.Config{Socket: sock, Path: logPath})
	c := srv.accept(t)
	fmt.Fprint(c, "first connection\n")
	c.Close()
	// The socket disappears for a while too, as across a VM reboot.
	c = srv.accept(t)
	fmt.Fprint(c, "second connection\n")
	c.Close()
	srv.close()
	srv = listen(t, sock)
	c = srv.accept(t)
	fmt.Fprint(c, "third connection\n")
	want := "first connection\nsecond connection\nthird connection\n"
	waitFor(t, "all three connections' output", func() bool { return output(t, logPath) == want })
}

func TestRotationBoundsTheLog(t *testing.T) {
	dir := shortDir(t)
	sock, logPath := filepath.Join(dir, "serial.sock"), filepath.Join(dir, "console.log")
	srv := listen(t, sock)
	const max = 1000
	start(t, console.Config{Socket: sock, Path: logPath, MaxSize: max})
	c := srv.accept(t)
	var sent bytes.Buffer
	for i := 0; sent.Len() < 5*max; i++ {
		fmt.Fprintf(&sent, "line %04d of the guest's boot\r\n", i)
	}
	if _, err := c.Write(sent.Bytes()); err != nil {
		t.Fatal(err)
	}
	last := sent.String()[sent.Len()-33:]
	waitFor(t, "the last line in the log", func() bool { return strings.HasSuffix(readFile(t, logPath), last) })
	cur, old := readFile(t, logPath), readFile(t, logPath+".1")
	if len(cur) > max || len(old) != max {
		t.Errorf("console.log %d bytes, console.log.1 %d bytes; want at most %d and exactly %d", len(cur), len(old), max, max)
	}
	if _, err := os.Stat(logPath + ".2"); !os.IsNotExist(err) {
		t.Errorf("a second rotated generation exists: %v", err)
	}
	// The two files are the last bytes of the stream, in order.
	if kept := old + cur; !strings.HasSuffix(sent.String(), kept) {
		t.Errorf("rotated files %q are not the end of the output", kept)
	}
	for _, p := range []string{logPath, logPath + ".1"} {
		if st, err := os.Stat(p); err != nil {
			t.Error(err)
		} else if st.Mode().Perm() != 0o600 {
			t.Errorf("%s mode = %v, want 0600", p, st.Mode().Perm())
		}
	}
}

// TestNeverStopsReading: a guest that prints far more than the bound is
// never blocked on its serial port; CH would stall its vCPU otherwise.
func TestNeverStopsReading(t *testing.T) {
	dir := shortDir(t)
	sock, logPath := filepath.Join(dir, "serial.sock"), filepath.Join(dir, "console.log")
	srv := listen(t, sock)
	start(t, console.Config{Socket: sock, Path: logPath, MaxSize: 64 << 10})
	c := srv.accept(t)
	// A deadline turns a keeper that stopped reading into a write error
	// instead of a hung test; it is not a speed target.
	c.SetWriteDeadline(time.Now().Add(30 * time.Second))
	chunk := bytes.Repeat([]byte("0123456789abcdef"), 4096) // 64 KiB
	for i := 0; i < 128; i++ {                              // 8 MiB
		if _, err := c.Write(chunk); err != nil {
			t.Fatalf("the guest blocked after %d KiB: %v", i*64, err)
		}
	}
	fmt.Fprint(c, "\nthe end\n")
	waitFor(t, "the last line", func() bool { return strings.HasSuffix(readFile(t, logPath), "\nthe end\n") })
}

func TestStopEndsWaitingAndCopying(t *testing.T) {
	dir := shortDir(t)
	// Waiting for a socket that never appears.
	k := start(t, console.Config{Socket: filepath.Join(dir, "never.sock"), Path: filepath.Join(dir, "a.log")})
	k.Stop()
	// Copying from a connection that stays open.
	sock := filepath.Join(dir, "serial.sock")
	srv := listen(t, sock)
	ctx, cancel := context.WithCancel(context.Background())
	k, err := console.Start(ctx, console.Config{Socket: sock, Path: filepath.Join(dir, "b.log")})
	if err != nil {
		t.Fatal(err)
	}
	c := srv.accept(t)
	cancel()
	select {
	case <-k.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("the keeper did not stop when its context ended")
	}
	// It closed its end: the server side reads EOF.
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := c.Read(make([]byte, 1)); err == nil {
		t.Error("the connection is still open after the keeper stopped")
	}
	k.Stop()
}

// TestStopKeepsTheLastWords: output the VMM wrote before it exited is still
// in the socket buffer when the owner stops the keeper; it must reach the
// log, as it is what explains the failure.
func TestStopKeepsTheLastWords(t *testing.T) {
	dir := shortDir(t)
	sock, logPath := filepath.Join(dir, "serial.sock"), filepath.Join(dir, "console.log")
	srv := listen(t, sock)
	k := start(t, console.Config{Socket: sock, Path: logPath, MaxSize: 4 << 20})
	c := srv.accept(t)
	// More than the socket buffers hold: when Write returns, the keeper
	// has read part of it and the rest waits in the kernel.
	sent := strings.Repeat("boot noise\n", 100000) + "Kernel panic - not syncing: last words\n"
	if _, err := io.WriteString(c, sent); err != nil {
		t.Fatal(err)
	}
	c.Close() // the VMM exits
	k.Stop()
	if got := output(t, logPath); got != sent {
		t.Errorf("log holds %d of the %d bytes sent; ends %q", len(got), len(sent), got[max(0, len(got)-40):])
	}
}

func TestStartFailsWithoutItsDirectory(t *testing.T) {
	_, err := console.Start(context.Background(), console.Config{Socket: "/nonexistent/s", Path: filepath.Join(shortDir(t), "no", "console.log")})
	if err == nil || !strings.Contains(err.Error(), "console log") {
		t.Errorf("Start = %v, want an error about the console log", err)
	}
}

func TestTail(t *testing.T) {
	dir := shortDir(t)
	p := filepath.Join(dir, "console.log")
	write := func(name, s string) {
		t.Helper()
		if err := os.WriteFile(filepath.Join(dir, name), []byte(s), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	if got, err := console.Tail(p, 5); got != "" || err != nil {
		t.Errorf("Tail of a missing log = %q, %v", got, err)
	}
	// An earlier run, then this run's marker; its lines are split across
	// the rotation in the middle of a line, and carry colours, a progress
	// line, a tab, a title escape, a bell and invalid UTF-8.
	write("console.log.1", "old boot line\n"+console.Marker+"2026-11-23T19:00:00Z ---\r\n"+
		"[\x1b[0;32m  OK  \x1b[0m] Started\tudev.\r\nLoading 10%\rLoading 100%\r\n\x1b]0;title\x07\x07mount")
	write("console.log", "ing ext4 on /mnt/root: no such device \xff\r\n\r\n   \r\nvsock: EAFNOSUPPORT\r\n")
	got, err := console.Tail(p, 3)
	if err != nil {
		t.Fatal(err)
	}
	want := "Loading 100% | mounting ext4 on /mnt/root: no such device \uFFFD | vsock: EAFNOSUPPORT"
	if got != want {
		t.Errorf("Tail(3) = %q\nwant        %q", got, want)
	}
	got, _ = console.Tail(p, 100)
	if want := "[ OK ] Started udev. | " + want; got != want {
		t.Errorf("Tail(100) = %q\nwant          %q", got, want)
	}
	// A later run's marker hides everything before it.
	write("console.log", "x\n"+console.Marker+"2026-11-23T20:00:00Z ---\n")
	if got, _ := console.Tail(p, 100); got != "" {
		t.Errorf("Tail right after a new marker = %q, want empty", got)
	}
	// Without any marker (written by something else), all lines count.
	os.Remove(p + ".1")
	write("console.log", "a\nb\nc\n")
	if got, _ := console.Tail(p, 2); got != "b | c" {
		t.Errorf("Tail without a marker = %q", got)
	}
	// A huge line is cut.
	write("console.log", strings.Repeat("ü", 5000)+"\n")
	if got, _ := console.Tail(p, 1); got != strings.Repeat("ü", console.MaxLineRunes-1)+"…" {
		t.Errorf("Tail of a long line = %d runes, want %d ending in …", len([]rune(got)), console.MaxLineRunes)
	}
}

// TestTailOfAKeptLog checks Tail on what a Keeper wrote, rotation included.
func TestTailOfAKeptLog(t *testing.T) {
	dir := shortDir(t)
	sock, logPath := filepath.Join(dir, "serial.sock"), filepath.Join(dir, "console.log")
	if err := os.WriteFile(logPath, []byte("previous run's last words\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	srv := listen(t, sock)
	start(t, console.Config{Socket: sock, Path: logPath, MaxSize: 100})
	c := srv.accept(t)
	for i := 1; i <= 20; i++ {
		fmt.Fprintf(c, "\x1b[1mstep %d\x1b[0m\r\n", i)
	}
	waitFor(t, "step 20", func() bool {
		return strings.HasSuffix(readFile(t, logPath+".1")+readFile(t, logPath), "step 20\x1b[0m\r\n")
	})
	if got, _ := console.Tail(logPath, 3); got != "step 18 | step 19 | step 20" {
		t.Errorf("Tail = %q", got)
	}
}
