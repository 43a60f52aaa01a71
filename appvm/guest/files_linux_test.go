package guest

import (
	"archive/tar"
	"bytes"
	"context"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"testing"
	"time"

	"vmhost/appvm/guest/proto"
)

// tarMember is one entry of an archive, as a test sees it.
type tarMember struct {
	name, link string
	typ        byte
	mode       int64
	uid, gid   int
	uname      string
	body       string
}

func readTar(t *testing.T, b []byte) []tarMember {
	t.Helper()
	tr := tar.NewReader(bytes.NewReader(b))
	var out []tarMember
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return out
		}
		if err != nil {
			t.Fatalf("reading the archive: %v", err)
		}
		body, _ := io.ReadAll(tr)
		out = append(out, tarMember{name: h.Name, link: h.Linkname, typ: h.Typeflag, mode: h.Mode, uid: h.Uid, gid: h.Gid, uname: h.Uname + h.Gname, body: string(body)})
	}
}

func (h *fakeHost) getFiles(p string) ([]byte, error) {
	var buf bytes.Buffer
	err := proto.GetFiles(context.Background(), h.dialOp(), p, &buf)
	return buf.Bytes(), err
}

// TestGetFiles: a directory comes out as a tar archive with members named
// relative to its parent, owners as numbers, links as links, a second name
// of a file as a hard link; secret files (by path, and by inode under
// another name) are left out; a secret path is refused, a missing one is
// not found.
func TestGetFiles(t *testing.T) {
	root := t.TempDir()
	app := filepath.Join(root, "srv/app")
	os.MkdirAll(filepath.Join(app, "sub"), 0o755)
	os.WriteFile(filepath.Join(app, "a.txt"), []byte("alpha"), 0o640)
	os.WriteFile(filepath.Join(app, "sub/b.txt"), []byte("beta"), 0o600)
	os.Symlink("a.txt", filepath.Join(app, "cur"))
	os.Link(filepath.Join(app, "a.txt"), filepath.Join(app, "hard"))
	syscall.Mkfifo(filepath.Join(app, "fifo"), 0o600)
	h, _ := running(t, &proto.Spec{
		SecretFiles: []proto.SecretFile{{Path: "/srv/app/secret.key", Content: proto.NewSecret("top-secret-content")}},
	}, agentOpts{root: root})
	// Another name for the secret, made by the workload.
	if err := os.Link(filepath.Join(app, "secret.key"), filepath.Join(app, "sub/alias")); err != nil {
		t.Fatal(err)
	}
	b, err := h.getFiles("/srv/app")
	if err != nil {
		t.Fatal(err)
	}
	uid, gid := os.Getuid(), os.Getgid()
	want := []tarMember{
		{name: "app/", typ: tar.TypeDir, mode: 0o755},
		{name: "app/a.txt", typ: tar.TypeReg, mode: 0o640, body: "alpha"},
		{name: "app/cur", typ: tar.TypeSymlink, mode: 0o777, link: "a.txt"},
		{name: "app/fifo", typ: tar.TypeFifo, mode: 0o600},
		{name: "app/hard", typ: tar.TypeLink, mode: 0o640, link: "app/a.txt"},
		{name: "app/sub/", typ: tar.TypeDir, mode: 0o755},
		{name: "app/sub/b.txt", typ: tar.TypeReg, mode: 0o600, body: "beta"},
	}
	for i := range want {
		want[i].uid, want[i].gid = uid, gid
	}
	got := readTar(t, b)
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("archive:\n%v\nwant\n%v", got, want)
	}
	if bytes.Contains(b, []byte("top-secret-content")) {
		t.Error("the archive holds the secret")
	}

	b, err = h.getFiles("/srv/app/a.txt")
	if got := readTar(t, b); err != nil || len(got) != 1 || got[0].name != "a.txt" || got[0].body != "alpha" {
		t.Errorf("a single file: %v, %v", got, err)
	}
	b, err = h.getFiles("/")
	if got := readTar(t, b); err != nil || len(got) < 3 || got[0].name != "./" || !strings.Contains(fmt.Sprint(got), "{./srv/app/a.txt ") {
		t.Errorf("the root: %v, %v", got, err)
	}
	_, err = h.getFiles("/srv/app/secret.key")
	wantOpError(t, err, proto.ErrBadRequest, "is a secret file")
	_, err = h.getFiles("/srv/app/sub/alias")
	wantOpError(t, err, proto.ErrBadRequest, "is a secret file")
	_, err = h.getFiles("/srv/nope")
	wantOpError(t, err, proto.ErrNotFound, "/srv/nope does not exist")
	_, err = h.getFiles("/srv/app/a.txt/x")
	wantOpError(t, err, proto.ErrNotFound, "does not exist")
}

// tree lists everything below dir with its type, mode and content.
func tree(t *testing.T, dir string) string {
	t.Helper()
	var lines []string
	filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			// Something removed while the walk ran.
			return nil
		}
		fi, err := os.Lstat(p)
		if err != nil {
			// Listed, then removed before this look (a staging
			// directory the agent is removing): it is gone.
			return nil
		}
		line := fmt.Sprintf("%s %v", strings.TrimPrefix(p, dir), fi.Mode())
		if fi.Mode().IsRegular() {
			b, _ := os.ReadFile(p)
			line += " " + string(b)
		}
		if fi.Mode()&fs.ModeSymlink != 0 {
			l, _ := os.Readlink(p)
			line += " -> " + l
		}
		lines = append(lines, line)
		return nil
	})
	sort.Strings(lines)
	return strings.Join(lines, "\n")
}

type putMember struct {
	name, link string
	typ        byte
	mode       int64
	body       string
}

func makeTar(t *testing.T, ms ...putMember) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, m := range ms {
		mode := m.mode
		if mode == 0 {
			mode = 0o644
		}
		h := &tar.Header{Name: m.name, Linkname: m.link, Typeflag: m.typ, Mode: mode, ModTime: time.Unix(1700000000, 0)}
		if m.typ == tar.TypeReg {
			h.Size = int64(len(m.body))
		}
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		io.WriteString(tw, m.body)
	}
	tw.Close()
	return buf.Bytes()
}

func (h *fakeHost) putFiles(dir string, max int64, archive []byte) (*proto.PutResult, error) {
	return proto.PutFiles(context.Background(), h.dialOp(), dir, max, bytes.NewReader(archive))
}

// TestPutFiles extracts archives into a directory of the root: files,
// directories, links and modes land, existing directories are merged
// into; every broken rule is refused with nothing written, however late in
// the archive it comes.
func TestPutFiles(t *testing.T) {
	root := t.TempDir()
	dest := filepath.Join(root, "srv")
	os.MkdirAll(filepath.Join(dest, "keep"), 0o755)
	os.WriteFile(filepath.Join(dest, "keep/old"), []byte("old"), 0o644)
	os.WriteFile(filepath.Join(dest, "plain"), []byte("x"), 0o644)
	h, _ := running(t, &proto.Spec{}, agentOpts{root: root})
	reg := func(name, body string, mode int64) putMember {
		return putMember{name: name, typ: tar.TypeReg, body: body, mode: mode}
	}
	res, err := h.putFiles("/srv", 1<<20, makeTar(t,
		putMember{name: "./", typ: tar.TypeDir},
		putMember{name: "app/", typ: tar.TypeDir, mode: 0o750},
		reg("app/run.sh", "#!/bin/sh\necho hi\n", 0o755),
		putMember{name: "app/link", typ: tar.TypeSymlink, link: "run.sh"},
		putMember{name: "app/again", typ: tar.TypeLink, link: "app/run.sh"},
		reg("keep/new", "new", 0o600),
		reg("deep/er/file", "d", 0o644),
	))
	if err != nil {
		t.Fatal(err)
	}
	if res.Members != 7 || res.Bytes != int64(len("#!/bin/sh\necho hi\n")+4) {
		t.Errorf("result %+v", res)
	}
	want := strings.Join([]string{
		" drwxr-xr-x",
		"/app drwxr-x---",
		"/app/again -rwxr-xr-x #!/bin/sh\necho hi\n",
		"/app/link Lrwxrwxrwx -> run.sh",
		"/app/run.sh -rwxr-xr-x #!/bin/sh\necho hi\n",
		"/deep drwxr-xr-x",
		"/deep/er drwxr-xr-x",
		"/deep/er/file -rw-r--r-- d",
		"/keep drwxr-xr-x",
		"/keep/new -rw------- new",
		"/keep/old -rw-r--r-- old",
		"/plain -rw-r--r-- x",
	}, "\n")
	if got := tree(t, dest); got != want {
		t.Errorf("destination:\n%s\nwant\n%s", got, want)
	}
	if fi, _ := os.Stat(filepath.Join(dest, "app/run.sh")); fi.ModTime().Unix() != 1700000000 {
		t.Errorf("mtime %v", fi.ModTime())
	}

	before := tree(t, dest)
	many := make([]putMember, 0, 60)
	for i := range 50 {
		many = append(many, reg(fmt.Sprintf("bulk/f%d", i), strings.Repeat("z", 1000), 0o644))
	}
	refusals := []struct {
		name    string
		members []putMember
		max     int64
		want    string
	}{
		{"absolute name", []putMember{reg("ok", "1", 0), reg("/etc/evil", "x", 0)}, 0, "absolute name"},
		{"dot dot", []putMember{reg("ok", "1", 0), reg("a/../../evil", "x", 0)}, 0, ".. segment"},
		{"symlink leaving", []putMember{reg("ok", "1", 0), {name: "l", typ: tar.TypeSymlink, link: "../../etc"}}, 0, "leaves /srv"},
		{"absolute symlink", []putMember{{name: "l", typ: tar.TypeSymlink, link: "/etc/passwd"}}, 0, "leaves /srv"},
		{"write through a symlink", []putMember{{name: "l", typ: tar.TypeSymlink, link: "keep"}, reg("l/x", "x", 0)}, 0, "below the link"},
		{"hard link out", []putMember{reg("ok", "1", 0), {name: "h", typ: tar.TypeLink, link: "../plain"}}, 0, "not an earlier file"},
		{"device node", append(append([]putMember{}, many...), putMember{name: "null", typ: tar.TypeChar}), 0, "device nodes"},
		{"over the cap", many, 20000, "exceed"},
		{"file over an existing directory", []putMember{reg("ok", "1", 0), reg("keep", "x", 0)}, 0, "would replace an existing directory"},
	}
	for _, tt := range refusals {
		t.Run(tt.name, func(t *testing.T) {
			max := tt.max
			if max == 0 {
				max = 1 << 20
			}
			_, err := h.putFiles("/srv", max, makeTar(t, tt.members...))
			wantOpError(t, err, proto.ErrBadRequest, tt.want)
			if got := tree(t, dest); got != before {
				t.Errorf("the refused archive wrote:\n%s\nbefore:\n%s", got, before)
			}
		})
	}
	_, err = h.putFiles("/srv", 1<<20, []byte(strings.Repeat("junk", 300)))
	wantOpError(t, err, proto.ErrBadRequest, "not a valid tar archive")
	_, err = h.putFiles("/nowhere", 1<<20, makeTar(t, reg("x", "x", 0)))
	wantOpError(t, err, proto.ErrNotFound, "does not exist")
	_, err = h.putFiles("/srv/plain", 1<<20, makeTar(t, reg("x", "x", 0)))
	wantOpError(t, err, proto.ErrBadRequest, "not a directory")

	// A host that goes away in the middle leaves nothing either.
	c := h.dialOp()
	fc := proto.NewFrameConn(c)
	fc.WriteJSON(proto.FrameRequest, &proto.Request{PutFiles: &proto.PutFilesRequest{Path: "/srv", MaxBytes: 1 << 20}})
	half := makeTar(t, many...)
	fc.WriteFrame(proto.FrameData, half[:len(half)/2])
	eventually(t, "the staging directory", func() bool { return strings.Contains(tree(t, dest), stagingPrefix) })
	c.Close()
	eventually(t, "the staging directory to go", func() bool { return tree(t, dest) == before })
}

// TestSignalOp delivers a signal to the workload; once it has exited,
// there is no workload to signal.
func TestSignalOp(t *testing.T) {
	h, _ := running(t, &proto.Spec{Command: sh(`trap 'echo got-usr1; exit 5' USR1; echo ready; while :; do sleep 0.05; done`)}, agentOpts{})
	h.waitLog("ready")
	if err := proto.Signal(context.Background(), h.dialOp(), int(syscall.SIGUSR1)); err != nil {
		t.Fatal(err)
	}
	var out strings.Builder
	for {
		m := h.next()
		if l, ok := m.(*proto.Log); ok {
			out.Write(l.Data)
		}
		if exit, ok := m.(*proto.Exit); ok {
			if exit.Code == nil || *exit.Code != 5 || !strings.Contains(out.String(), "got-usr1") {
				t.Errorf("exit %+v, output %q; want the trap's code 5", exit, out.String())
			}
			break
		}
	}
	err := proto.Signal(context.Background(), h.dialOp(), int(syscall.SIGUSR1))
	wantOpError(t, err, proto.ErrInvalidState, "no workload runs")
}

// TestFilesLargeRoundTrip copies 32 MiB in and out: the archive goes in
// chunks, the file arrives whole, comes back byte for byte, and the agent
// holds none of it in memory (its peak RSS barely moves).
func TestFilesLargeRoundTrip(t *testing.T) {
	const size = 32 << 20
	root := t.TempDir()
	h, _ := running(t, &proto.Spec{}, agentOpts{root: root})
	agent := h.cmd.Process.Pid
	if err := os.WriteFile(fmt.Sprintf("/proc/%d/clear_refs", agent), []byte("5"), 0); err != nil {
		t.Skipf("cannot reset the peak RSS: %v", err)
	}
	rssBefore := procField(t, fmt.Sprintf("/proc/%d/status", agent), "VmRSS")
	content := bytes.Repeat([]byte("0123456789abcdef"), size/16)
	content[size/2] = 'X'
	// The archive streams from a pipe: the client never holds it whole.
	pr, pw := io.Pipe()
	go func() {
		tw := tar.NewWriter(pw)
		tw.WriteHeader(&tar.Header{Name: "big.bin", Typeflag: tar.TypeReg, Mode: 0o600, Size: size})
		tw.Write(content)
		pw.CloseWithError(tw.Close())
	}()
	res, err := proto.PutFiles(context.Background(), h.dialOp(), "/", size+1<<20, pr)
	if err != nil || res.Bytes != size {
		t.Fatalf("put: %+v, %v", res, err)
	}
	if got, err := os.ReadFile(filepath.Join(root, "big.bin")); err != nil || !bytes.Equal(got, content) {
		t.Fatalf("the file in the root: %d bytes, %v", len(got), err)
	}
	b, err := h.getFiles("/big.bin")
	if err != nil {
		t.Fatal(err)
	}
	if got := readTar(t, b); len(got) != 1 || got[0].body != string(content) {
		t.Errorf("the file out differs")
	}
	peak := procField(t, fmt.Sprintf("/proc/%d/status", agent), "VmHWM")
	t.Logf("agent RSS %d kB before, peak %d kB while %d MiB went in and out", rssBefore, peak, size>>20)
	if grew := peak - rssBefore; grew > 32<<10 {
		t.Errorf("the agent's RSS grew by %d kB: it buffers", grew)
	}
}
