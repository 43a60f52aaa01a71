package main

import (
	"bufio"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"
)

// openPTY opens a pseudo-terminal pair through /dev/ptmx's ioctls.
func openPTY(t *testing.T) (master, slave *os.File) {
	t.Helper()
	m, err := os.OpenFile("/dev/ptmx", os.O_RDWR|unix.O_NOCTTY, 0)
	if err != nil {
		t.Skipf("no pseudo-terminals here: %v", err)
	}
	fd := int(m.Fd())
	if err := unix.IoctlSetPointerInt(fd, unix.TIOCSPTLCK, 0); err != nil {
		t.Fatal(err)
	}
	n, err := unix.IoctlGetInt(fd, unix.TIOCGPTN)
	if err != nil {
		t.Fatal(err)
	}
	s, err := os.OpenFile("/dev/pts/"+strconv.Itoa(n), os.O_RDWR|unix.O_NOCTTY, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close(); s.Close() })
	return m, s
}

func termios(t *testing.T, f *os.File) *unix.Termios {
	t.Helper()
	tio, err := unix.IoctlGetTermios(int(f.Fd()), unix.TCGETS)
	if err != nil {
		t.Fatal(err)
	}
	return tio
}

// TestConsoleRawTerminal runs `vmhost console` on a real pty: while
// attached the terminal is raw (no echo, no line editing, no signals from
// ^C), output and input pass, and the terminal is restored both after
// Ctrl-] q and after SIGTERM.
func TestConsoleRawTerminal(t *testing.T) {
	cwd, runDir, _ := consoleAgent(t)
	master, slave := openPTY(t)
	before := termios(t, slave)
	if before.Lflag&unix.ICANON == 0 || before.Lflag&unix.ECHO == 0 {
		t.Fatalf("a new pty is not canonical with echo: lflag %#x", before.Lflag)
	}
	// The master's reader: everything the console prints.
	out := &lockedBuffer{}
	go func() {
		b := make([]byte, 4096)
		for {
			n, err := master.Read(b)
			out.Write(b[:n])
			if err != nil {
				return
			}
		}
	}()

	for _, end := range []string{"escape", "SIGTERM"} {
		cmd := exec.Command(binary(t), "console", "c1", "--run-dir", runDir)
		cmd.Dir = cwd
		cmd.Stdin, cmd.Stdout = slave, slave
		errPipe, err := cmd.StderrPipe()
		if err != nil {
			t.Fatal(err)
		}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		stderr := bufio.NewReader(errPipe)
		line, err := stderr.ReadString('\n')
		if err != nil || !strings.Contains(line, "attached to the console of c1") {
			cmd.Process.Kill()
			cmd.Wait()
			t.Fatalf("%s: console said %q, %v", end, line, err)
		}
		// The terminal is raw once the client says it is attached.
		raw := termios(t, slave)
		if raw.Lflag&(unix.ICANON|unix.ECHO|unix.ISIG) != 0 || raw.Oflag&unix.OPOST != 0 {
			t.Errorf("%s: attached terminal lflag %#x oflag %#x, want raw", end, raw.Lflag, raw.Oflag)
		}
		mark := "pty-" + end
		waitFor(t, func() bool {
			master.WriteString(mark + "\r")
			return strings.Contains(out.String(), mark)
		}, "the echo through the pty")
		switch end {
		case "escape":
			master.WriteString("\x1dq")
		case "SIGTERM":
			cmd.Process.Signal(syscall.SIGTERM)
		}
		rest, _ := stderr.ReadString(0)
		if err := cmd.Wait(); err != nil {
			t.Errorf("%s: vmhost console = %v; stderr %q", end, err, rest)
		}
		after := termios(t, slave)
		if after.Lflag != before.Lflag || after.Iflag != before.Iflag || after.Oflag != before.Oflag || after.Cflag != before.Cflag {
			t.Errorf("%s: terminal not restored: lflag %#x iflag %#x oflag %#x, want %#x %#x %#x", end, after.Lflag, after.Iflag, after.Oflag, before.Lflag, before.Iflag, before.Oflag)
		}
	}
}
