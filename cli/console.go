package cli

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"time"
)

// ConsoleAttachName is the agent's attach socket in its run directory,
// where `vmhost console` names the VM (the console package's AttachName;
// main's tests check they agree, and the handshake's answers).
const ConsoleAttachName = "console.attach"

// The attach handshake (the console package's): the client sends the VM's
// id and a newline; the agent answers ConsoleAttachOK, or ConsoleAttachError and why.
const (
	ConsoleAttachOK    = "ok"
	ConsoleAttachError = "error: "
)

// The escape: Ctrl-] then q detaches; Ctrl-] twice sends one Ctrl-].
const (
	escapeKey  = 0x1d // Ctrl-]
	escapeQuit = 'q'
)

var vmID = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$`)

// consoleCmd attaches the terminal to a VM's serial console through the
// agent's attach socket on this host.
func (e *env) consoleCmd(args []string) error {
	var runDir string
	pos, err := e.parse("console", args, func(fs *flag.FlagSet) {
		fs.StringVar(&runDir, "run-dir", "", "the agent's run directory (default $VMHOST_RUN_DIR, else "+DefaultRunDir+")")
	})
	if err != nil {
		return err
	}
	if len(pos) != 1 {
		return usageError("console: want one VM id")
	}
	id := pos[0]
	if !vmID.MatchString(id) {
		return usageError("console: %q is not a VM id", id)
	}
	if runDir == "" {
		runDir = e.getenv("VMHOST_RUN_DIR")
	}
	if runDir == "" {
		runDir = DefaultRunDir
	}
	conn, err := dialConsole(runDir, id)
	if err != nil {
		return err
	}
	defer conn.Close()
	in, restore, err := terminal(e.stdin)
	if err != nil {
		return err
	}
	defer restore()
	// In raw mode ^C is a byte for the guest, but SIGTERM, SIGHUP (the
	// terminal went away) and a SIGINT sent with kill still end the
	// session with the terminal restored.
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGHUP, syscall.SIGINT)
	defer signal.Stop(sigs)
	fmt.Fprintf(e.stderr, "vmhost: attached to the console of %s; detach with Ctrl-] then q\r\n", id)
	ended := attach(conn, in, e.stdout, sigs, e.ctx.Done())
	fmt.Fprintf(e.stderr, "\r\nvmhost: %s\r\n", ended)
	return nil
}

// dialConsole connects to the agent's attach socket and names VM id,
// turning the usual failures into what the operator should know.
func dialConsole(runDir, id string) (net.Conn, error) {
	path := filepath.Join(runDir, ConsoleAttachName)
	vmDir := filepath.Join(runDir, "vms", id)
	conn, err := net.Dial("unix", path)
	if err != nil {
		switch {
		case errors.Is(err, fs.ErrPermission):
			return nil, fmt.Errorf("console of %s: permission denied on %s: run vmhost console as root (or as the agent's user)", id, path)
		case errors.Is(err, fs.ErrNotExist) || errors.Is(err, syscall.ECONNREFUSED):
			if _, rerr := os.Stat(filepath.Join(runDir, "vms")); rerr != nil {
				return nil, fmt.Errorf("console of %s: no agent run directory at %s (give the agent's --run-dir, or set VMHOST_RUN_DIR); vmhost console works on the agent's host only", id, runDir)
			}
			if _, serr := os.Stat(vmDir); errors.Is(serr, fs.ErrNotExist) {
				return nil, fmt.Errorf("console of %s: no VM %q on this host (nothing in %s)", id, id, vmDir)
			}
			return nil, fmt.Errorf("console of %s: %s (nobody answers on %s)", id, notAttachable(vmDir), path)
		}
		return nil, fmt.Errorf("console of %s: %w", id, err)
	}
	answer, err := consoleHello(conn, id)
	switch {
	case err != nil:
		conn.Close()
		return nil, fmt.Errorf("console of %s: the agent did not answer on %s: %w", id, path, err)
	case answer == ConsoleAttachOK:
		return conn, nil
	}
	conn.Close()
	if why, ok := strings.CutPrefix(answer, ConsoleAttachError); ok {
		return nil, fmt.Errorf("console of %s: %s", id, why)
	}
	return nil, fmt.Errorf("console of %s: unexpected answer %q on %s", id, answer, path)
}

// consoleHello names VM id on conn and returns the agent's answer line;
// it reads byte by byte, so the console's output after it stays unread.
func consoleHello(conn net.Conn, id string) (string, error) {
	conn.SetDeadline(time.Now().Add(10 * time.Second))
	defer conn.SetDeadline(time.Time{})
	if _, err := io.WriteString(conn, id+"\n"); err != nil {
		return "", err
	}
	var line []byte
	b := make([]byte, 1)
	for len(line) < 4096 {
		if _, err := conn.Read(b); err != nil {
			return "", err
		}
		if b[0] == '\n' {
			return string(line), nil
		}
		line = append(line, b[0])
	}
	return "", errors.New("answer line too long")
}

// attach copies the console to out and in to the console, watching in
// for the escape, until the user detaches, the console closes, in ends,
// a signal comes or done closes; it returns why it ended.
func attach(conn net.Conn, in io.Reader, out io.Writer, sigs <-chan os.Signal, done <-chan struct{}) string {
	ended := make(chan string, 3)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		io.Copy(out, conn)
		ended <- "the console closed (the VM stopped, or the agent let go of it)"
	}()
	go func() {
		ended <- forwardInput(conn, in)
	}()
	var why string
	select {
	case why = <-ended:
	case s := <-sigs:
		why = "ended by " + s.String()
	case <-done:
		why = "interrupted"
	}
	conn.Close()
	wg.Wait() // no output after the message
	return why
}

// forwardInput sends what is typed to the console, handling the escape,
// and returns why it stopped.
func forwardInput(conn net.Conn, in io.Reader) string {
	buf := make([]byte, 4096)
	out := make([]byte, 0, 4096)
	escaped := false
	for {
		n, err := in.Read(buf)
		out = out[:0]
		for _, b := range buf[:n] {
			switch {
			case escaped && b == escapeQuit:
				conn.Write(out)
				return "detached"
			case escaped && b == escapeKey:
				out = append(out, escapeKey)
				escaped = false
			case escaped:
				out = append(out, escapeKey, b)
				escaped = false
			case b == escapeKey:
				escaped = true
			default:
				out = append(out, b)
			}
		}
		if len(out) > 0 {
			if _, werr := conn.Write(out); werr != nil {
				return "the console closed"
			}
		}
		if err != nil {
			return "end of input"
		}
	}
}

// notAttachable says why a VM whose run directory exists has no console to
// attach to: Cloud Hypervisor's API socket (ch.sock) exists while the VM
// runs, so without it the VM is not running; with it, the agent that keeps
// the console is not (between a stop and a start of vmhost).
func notAttachable(vmDir string) string {
	if _, err := os.Stat(filepath.Join(vmDir, "ch.sock")); err == nil {
		return "the VM runs but no agent keeps its console (is vmhost serve running?)"
	}
	return "the VM is not running"
}
