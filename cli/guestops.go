package cli

import (
	"archive/tar"
	"encoding/binary"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"net/url"
	"os"
	"os/signal"
	"path"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"time"
)

// The AppVM guest operations: `vmhost appvm exec`, `cp` and `kill`
// (docs/cli.md). An interactive exec upgrades its HTTP connection to
// vmhost-exec and frames the input and output on it (docs/api.md, Exec):
// 1 byte type, 3 zero bytes, the payload's length (4 bytes, big-endian),
// the payload.

// Frame types of an interactive exec.
const (
	frameStdin       = 0
	frameStdout      = 1
	frameStderr      = 2
	frameResize      = 3
	frameExit        = 4
	frameStdinClosed = 5
	// maxFramePayload is the largest payload the agent takes.
	maxFramePayload = 64 << 10
)

// exitOf turns an exec's exit code into Run's result.
func exitOf(code int) error {
	if code == 0 {
		return nil
	}
	return &exitStatus{code: code}
}

// execResult is the answer of a one-shot exec.
type execResult struct {
	ExitCode  int    `json:"exit_code"`
	Signal    int    `json:"signal"`
	Stdout    string `json:"stdout"`
	Stderr    string `json:"stderr"`
	Truncated bool   `json:"truncated"`
}

// execBody is the request of an exec.
type execBody struct {
	Command     []string `json:"command"`
	Env         []string `json:"env,omitempty"`
	User        string   `json:"user,omitempty"`
	Workdir     string   `json:"workdir,omitempty"`
	TimeoutSecs int      `json:"timeout_secs,omitempty"`
	TTY         bool     `json:"tty,omitempty"`
	Interactive bool     `json:"interactive,omitempty"`
	Cols        int      `json:"cols,omitempty"`
	Rows        int      `json:"rows,omitempty"`
}

type stringList []string

func (l *stringList) String() string     { return strings.Join(*l, ",") }
func (l *stringList) Set(v string) error { *l = append(*l, v); return nil }

// splitShortFlags turns "-it" into "-i" "-t" (as docker exec takes them),
// up to the first argument that is no flag.
func splitShortFlags(args []string) []string {
	var out []string
	for i, a := range args {
		if a == "--" || !strings.HasPrefix(a, "-") {
			return append(out, args[i:]...)
		}
		if a == "-it" || a == "-ti" {
			out = append(out, "-i", "-t")
			continue
		}
		out = append(out, a)
	}
	return out
}

// execCmd runs `vmhost appvm exec [-i] [-t] [flags] ID -- CMD ARGS…`: its
// flags come before the id, and everything after it is the command.
func (e *env) execCmd(args []string) error {
	fs := flag.NewFlagSet("vmhost appvm exec", flag.ContinueOnError)
	fs.SetOutput(e.stderr)
	e.opts.register(fs)
	var interactive, tty bool
	var timeout time.Duration
	var user, workdir string
	var envs stringList
	fs.BoolVar(&interactive, "i", false, "pass this standard input to the command")
	fs.BoolVar(&tty, "t", false, "give the command a terminal: this one goes raw (with -i), and its size follows")
	fs.DurationVar(&timeout, "timeout", 0, "kill the command after this long, 1s..1h (default 60s; with -i or -t, 1h)")
	fs.StringVar(&user, "u", "", "user to run as (default the workload's)")
	fs.StringVar(&workdir, "w", "", "working directory in the AppVM (default the workload's)")
	fs.Var(&envs, "e", "KEY=VALUE added to the workload's environment (repeatable)")
	if err := fs.Parse(splitShortFlags(args)); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return usageError("appvm exec: %v", err)
	}
	rest := fs.Args()
	if len(rest) > 0 && rest[0] == "--" {
		rest = rest[1:]
	}
	if len(rest) < 2 {
		return usageError("appvm exec: want an AppVM id and a command (vmhost appvm exec [-i] [-t] ID -- CMD ARGS…)")
	}
	id, command := rest[0], rest[1:]
	if command[0] == "--" {
		command = command[1:]
	}
	if len(command) == 0 {
		return usageError("appvm exec: want a command after the AppVM id")
	}
	body := execBody{Command: command, Env: envs, User: user, Workdir: workdir, TTY: tty, Interactive: interactive}
	switch {
	case timeout == 0 && (interactive || tty):
		body.TimeoutSecs = 3600
	case timeout != 0 && (timeout < time.Second || timeout > time.Hour):
		return usageError("appvm exec: --timeout %v: want 1s..1h", timeout)
	case timeout != 0:
		body.TimeoutSecs = int((timeout + time.Second - 1) / time.Second)
	}
	if err := e.connect(); err != nil {
		return err
	}
	p := "/api/appvm/vms/" + url.PathEscape(id) + "/exec"
	if !interactive && !tty {
		b, _ := json.Marshal(body)
		_, ans, err := e.client.do(e.ctx, "POST", p, b)
		if err != nil {
			return err
		}
		var r execResult
		if err := json.Unmarshal(ans, &r); err != nil {
			return fmt.Errorf("decoding the exec's answer: %w", err)
		}
		io.WriteString(e.stdout, r.Stdout)
		io.WriteString(e.stderr, r.Stderr)
		if r.Truncated {
			fmt.Fprintln(e.stderr, "vmhost: the output was cut at 1 MiB per stream (use -i to stream it whole)")
		}
		return exitOf(r.ExitCode)
	}
	return e.execInteractive(p, body)
}

// execInteractive runs an exec over the upgraded connection: input (with
// -i) and window size changes (with -t) go up, output comes down, until
// the exit frame.
func (e *env) execInteractive(p string, body execBody) error {
	in, _ := e.stdin.(*os.File)
	if body.TTY {
		for _, f := range []any{e.stdin, e.stdout} {
			if f, ok := f.(*os.File); ok {
				if c, r, ok := terminalSize(f); ok {
					body.Cols, body.Rows = c, r
					break
				}
			}
		}
	}
	b, _ := json.Marshal(body)
	resp, err := e.client.send(e.ctx, "POST", p, b, http.Header{"Connection": {"Upgrade"}, "Upgrade": {"vmhost-exec"}})
	if err != nil {
		return err
	}
	if resp.StatusCode != http.StatusSwitchingProtocols {
		defer resp.Body.Close()
		ans, _ := io.ReadAll(resp.Body)
		return parseAPIError(resp.StatusCode, ans)
	}
	conn, ok := resp.Body.(io.ReadWriteCloser)
	if !ok {
		resp.Body.Close()
		return errors.New("the agent switched protocols but the connection cannot be written")
	}
	defer conn.Close()
	fw := &frameSender{w: conn}
	if body.TTY && body.Interactive && in != nil {
		restore, _, err := rawTerminal(in)
		if err != nil {
			return fmt.Errorf("putting the terminal in raw mode: %w", err)
		}
		defer restore()
	}
	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGHUP, syscall.SIGINT)
	if body.TTY {
		notifyResize(sigs)
	}
	defer signal.Stop(sigs)
	if body.Interactive {
		go func() {
			buf := make([]byte, 32<<10)
			for {
				n, err := e.stdin.Read(buf)
				if n > 0 && fw.send(frameStdin, buf[:n]) != nil {
					return
				}
				if err != nil {
					fw.send(frameStdinClosed, nil)
					return
				}
			}
		}()
	} else {
		fw.send(frameStdinClosed, nil)
	}
	done := make(chan struct{})
	defer close(done)
	var ended sync.Once
	var endedBy os.Signal
	go func() {
		for {
			select {
			case <-done:
				return
			case <-e.ctx.Done():
				conn.Close()
				return
			case s := <-sigs:
				if s == syscall.SIGWINCH {
					if in != nil {
						if c, r, ok := terminalSize(in); ok {
							rs, _ := json.Marshal(map[string]int{"cols": c, "rows": r})
							fw.send(frameResize, rs)
						}
					}
					continue
				}
				// Leaving ends the session: the agent kills the command.
				ended.Do(func() { endedBy = s })
				conn.Close()
				return
			}
		}
	}()
	code, err := readFrames(conn, e.stdout, e.stderr)
	if err != nil {
		if endedBy != nil {
			return fmt.Errorf("ended by %v: the command was killed", endedBy)
		}
		return err
	}
	return exitOf(code)
}

// frameSender writes frames; safe for concurrent use.
type frameSender struct {
	mu sync.Mutex
	w  io.Writer
}

func (f *frameSender) send(t byte, p []byte) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	for first := true; first || len(p) > 0; first = false {
		chunk := p[:min(len(p), maxFramePayload)]
		hdr := [8]byte{t}
		binary.BigEndian.PutUint32(hdr[4:], uint32(len(chunk)))
		if _, err := f.w.Write(append(hdr[:], chunk...)); err != nil {
			return err
		}
		p = p[len(chunk):]
	}
	return nil
}

// readFrames copies the output frames to stdout and stderr until the exit
// frame, and returns the exit code it gives.
func readFrames(r io.Reader, stdout, stderr io.Writer) (int, error) {
	var hdr [8]byte
	buf := make([]byte, maxFramePayload)
	for {
		if _, err := io.ReadFull(r, hdr[:]); err != nil {
			return 0, fmt.Errorf("the connection ended without the command's exit status: %w", err)
		}
		n := binary.BigEndian.Uint32(hdr[4:])
		if hdr[1]|hdr[2]|hdr[3] != 0 || n > maxFramePayload {
			return 0, fmt.Errorf("a malformed frame from the agent (header %x)", hdr)
		}
		p := buf[:n]
		if _, err := io.ReadFull(r, p); err != nil {
			return 0, fmt.Errorf("the connection ended inside a frame: %w", err)
		}
		switch hdr[0] {
		case frameStdout:
			stdout.Write(p)
		case frameStderr:
			stderr.Write(p)
		case frameExit:
			var x struct {
				ExitCode int `json:"exit_code"`
			}
			if err := json.Unmarshal(p, &x); err != nil {
				return 0, fmt.Errorf("decoding the exit frame %q: %w", p, err)
			}
			return x.ExitCode, nil
		default:
			return 0, fmt.Errorf("a frame of type %d from the agent", hdr[0])
		}
	}
}

// remotePath matches ID:/path, the AppVM side of `vmhost appvm cp`.
var remotePath = regexp.MustCompile(`^([A-Za-z0-9][A-Za-z0-9_.-]{0,63}):(/.*)$`)

// cpCmd runs `vmhost appvm cp ID:/PATH LOCAL` and `vmhost appvm cp LOCAL
// ID:/DIR`; LOCAL "-" is a tar archive on stdout or stdin.
func (e *env) cpCmd(args []string) error {
	pos, err := e.parse("appvm cp", args, nil)
	if err != nil {
		return err
	}
	if len(pos) != 2 {
		return usageError("appvm cp: want a source and a destination, one of them ID:/path")
	}
	src, dst := remotePath.FindStringSubmatch(pos[0]), remotePath.FindStringSubmatch(pos[1])
	if (src == nil) == (dst == nil) {
		return usageError("appvm cp: exactly one of %q and %q must be ID:/path (write ./%s for a local path with a colon)", pos[0], pos[1], pos[0])
	}
	if err := e.connect(); err != nil {
		return err
	}
	if src != nil {
		return e.copyOut(src[1], src[2], pos[1])
	}
	return e.copyIn(pos[0], dst[1], dst[2])
}

// copyOut fetches the archive of remote in AppVM id and extracts it at
// local: into it when it is a directory, else as it (the copy takes its
// name).
func (e *env) copyOut(id, remote, local string) error {
	resp, err := e.client.send(e.ctx, "GET", "/api/appvm/vms/"+url.PathEscape(id)+"/files?path="+url.QueryEscape(remote), nil, nil)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(resp.Body)
		return parseAPIError(resp.StatusCode, b)
	}
	if local == "-" {
		if _, err := io.Copy(e.stdout, resp.Body); err != nil {
			return fmt.Errorf("copying %s:%s: %w", id, remote, err)
		}
		return nil
	}
	dir, rename := local, ""
	if fi, err := os.Stat(local); err != nil || !fi.IsDir() {
		if err != nil && !errors.Is(err, fs.ErrNotExist) {
			return err
		}
		// A new name (or a file to replace): the copy becomes it.
		dir, rename = filepath.Dir(local), filepath.Base(local)
	}
	if err := extract(resp.Body, dir, path.Base(remote), rename, e.stderr); err != nil {
		return fmt.Errorf("copying %s:%s to %s: %w", id, remote, local, err)
	}
	return nil
}

// extract writes the archive from r into dir, never outside it (an
// os.Root confines every write, whatever links the archive holds). Its
// members are named from base (the remote path's last element); with
// rename, that first element becomes rename. Device nodes and FIFOs are
// skipped with a warning; owners are not kept (the files are the
// caller's), permissions are.
func extract(r io.Reader, dir, base, rename string, warn io.Writer) error {
	root, err := os.OpenRoot(dir)
	if err != nil {
		return err
	}
	defer root.Close()
	tr := tar.NewReader(r)
	n := 0
	type dirMode struct {
		name string
		mode fs.FileMode
		mt   time.Time
	}
	var dirs []dirMode
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return fmt.Errorf("reading the archive: %w", err)
		}
		name := path.Clean(h.Name)
		if path.IsAbs(name) || name == ".." || strings.HasPrefix(name, "../") || name == "." {
			return fmt.Errorf("the archive holds %q, a name outside the copy", h.Name)
		}
		if rename != "" {
			first, rest, _ := strings.Cut(name, "/")
			if first != base {
				return fmt.Errorf("the archive holds %q, which is not below %q", h.Name, base)
			}
			name = path.Join(rename, rest)
		}
		mode := fs.FileMode(h.Mode) & fs.ModePerm
		switch h.Typeflag {
		case tar.TypeDir:
			if err := root.MkdirAll(name, 0o700); err != nil {
				return err
			}
			dirs = append(dirs, dirMode{name, mode, h.ModTime})
		case tar.TypeReg:
			if err := writeMember(root, name, tr, mode, h.ModTime); err != nil {
				return err
			}
		case tar.TypeSymlink:
			root.Remove(name)
			if err := root.Symlink(h.Linkname, name); err != nil {
				return err
			}
		case tar.TypeLink:
			target := path.Clean(h.Linkname)
			if rename != "" {
				_, rest, _ := strings.Cut(target, "/")
				target = path.Join(rename, rest)
			}
			root.Remove(name)
			if err := root.Link(target, name); err != nil {
				return err
			}
		default:
			fmt.Fprintf(warn, "vmhost: skipping %s: not a file, directory or link\n", h.Name)
			continue
		}
		n++
	}
	if n == 0 {
		return errors.New("the archive is empty")
	}
	// Directories last: their permissions could forbid the writes inside.
	for i := len(dirs) - 1; i >= 0; i-- {
		root.Chmod(dirs[i].name, dirs[i].mode)
		root.Chtimes(dirs[i].name, dirs[i].mt, dirs[i].mt)
	}
	return nil
}

func writeMember(root *os.Root, name string, r io.Reader, mode fs.FileMode, mt time.Time) error {
	if dir := path.Dir(name); dir != "." {
		if err := root.MkdirAll(dir, 0o755); err != nil {
			return err
		}
	}
	// A link left where the file goes is replaced, not written through.
	if fi, err := root.Lstat(name); err == nil && fi.Mode()&fs.ModeSymlink != 0 {
		root.Remove(name)
	}
	f, err := root.OpenFile(name, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return err
	}
	_, err = io.Copy(f, r)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return err
	}
	root.Chmod(name, mode)
	root.Chtimes(name, mt, mt)
	return nil
}

// copyIn sends local (a file or a directory, as a tar archive made here;
// "-": a tar archive read from stdin) into the directory remote of AppVM
// id. The members' owners are root (0:0) in the AppVM, their permissions
// kept.
func (e *env) copyIn(local, id, remote string) error {
	var body io.Reader
	if local == "-" {
		body = e.stdin
	} else {
		if _, err := os.Lstat(local); err != nil {
			return err
		}
		pr, pw := io.Pipe()
		go func() { pw.CloseWithError(writeTar(pw, local, e.stderr)) }()
		defer pr.Close()
		body = pr
	}
	resp, err := e.client.sendReader(e.ctx, "PUT", "/api/appvm/vms/"+url.PathEscape(id)+"/files?path="+url.QueryEscape(remote), body, "application/x-tar", nil)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode/100 != 2 {
		return parseAPIError(resp.StatusCode, b)
	}
	return nil
}

// writeTar writes local, a file or a directory tree, as a tar archive
// whose members are named from local's last element. Links are kept as
// links; what is neither a file, a directory nor a link is skipped with a
// warning.
func writeTar(w io.Writer, local string, warn io.Writer) error {
	tw := tar.NewWriter(w)
	base := filepath.Dir(filepath.Clean(local))
	err := filepath.WalkDir(local, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		fi, err := d.Info()
		if err != nil {
			return err
		}
		link := ""
		switch {
		case fi.Mode().IsRegular(), fi.IsDir():
		case fi.Mode()&fs.ModeSymlink != 0:
			if link, err = os.Readlink(p); err != nil {
				return err
			}
		default:
			fmt.Fprintf(warn, "vmhost: skipping %s: not a file, directory or link\n", p)
			return nil
		}
		h, err := tar.FileInfoHeader(fi, link)
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(base, p)
		if err != nil {
			return err
		}
		h.Name = filepath.ToSlash(rel)
		if fi.IsDir() {
			h.Name += "/"
		}
		h.Uid, h.Gid, h.Uname, h.Gname = 0, 0, "", ""
		h.Format = tar.FormatPAX
		if err := tw.WriteHeader(h); err != nil {
			return err
		}
		if !fi.Mode().IsRegular() {
			return nil
		}
		f, err := os.Open(p)
		if err != nil {
			return err
		}
		defer f.Close()
		_, err = io.CopyN(tw, f, h.Size)
		return err
	})
	if err != nil {
		return err
	}
	return tw.Close()
}

// killCmd runs `vmhost appvm kill ID [--signal SIG]`.
func (e *env) killCmd(args []string) error {
	sig := "KILL"
	pos, err := e.parse("appvm kill", args, func(fs *flag.FlagSet) {
		fs.StringVar(&sig, "signal", sig, "the signal: a name (HUP, SIGTERM) or a number")
		fs.StringVar(&sig, "s", sig, "short for --signal")
	})
	if err != nil {
		return err
	}
	if len(pos) != 1 {
		return usageError("appvm kill: want one AppVM id")
	}
	if err := e.connect(); err != nil {
		return err
	}
	b, _ := json.Marshal(map[string]string{"signal": sig})
	if _, _, err := e.client.do(e.ctx, "POST", "/api/appvm/vms/"+url.PathEscape(pos[0])+"/signal", b); err != nil {
		return err
	}
	e.done(pos[0] + ": signal " + sig + " delivered to the workload")
	return nil
}
