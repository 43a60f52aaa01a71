package proto

import (
	"archive/tar"
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"strings"
	"testing"
	"time"
)

func TestFrameRoundTrip(t *testing.T) {
	a, b := net.Pipe()
	defer a.Close()
	defer b.Close()
	big := bytes.Repeat([]byte{7}, MaxPayload)
	go func() {
		fc := NewFrameConn(a)
		fc.WriteFrame(FrameStdout, []byte("out"))
		fc.WriteFrame(FrameStdinClosed, nil)
		fc.WriteFrame(FrameData, big)
		fc.WriteJSON(FrameResize, &Resize{Cols: 100, Rows: 30})
	}()
	fc := NewFrameConn(b)
	want := []struct {
		t FrameType
		p string
	}{{FrameStdout, "out"}, {FrameStdinClosed, ""}, {FrameData, string(big)}, {FrameResize, `{"cols":100,"rows":30}`}}
	for _, w := range want {
		typ, p, err := fc.ReadFrame()
		if err != nil || typ != w.t || string(p) != w.p {
			t.Fatalf("ReadFrame() = %d, %d bytes, %v; want %d, %d bytes", typ, len(p), err, w.t, len(w.p))
		}
	}
	if err := NewFrameConn(&bytes.Buffer{}).WriteFrame(FrameData, append(big, 0)); !errors.Is(err, ErrFrameTooLarge) {
		t.Errorf("writing %d bytes: %v, want ErrFrameTooLarge", len(big)+1, err)
	}
}

// TestFrameHeader pins the header layout the API's exec frames share: type,
// three zero bytes, big-endian length.
func TestFrameHeader(t *testing.T) {
	var buf bytes.Buffer
	NewFrameConn(&buf).WriteFrame(FrameStderr, []byte("ab"))
	if got := buf.Bytes(); !bytes.Equal(got, []byte{2, 0, 0, 0, 0, 0, 0, 2, 'a', 'b'}) {
		t.Errorf("frame = %v", got)
	}
	hdr := func(b0, b1 byte, n uint32) []byte {
		h := []byte{b0, b1, 0, 0, 0, 0, 0, 0}
		binary.BigEndian.PutUint32(h[4:], n)
		return h
	}
	for _, tc := range []struct {
		name string
		in   []byte
		want error
	}{
		{"padding not zero", hdr(1, 1, 0), ErrMalformedFrame},
		{"too large", hdr(1, 0, MaxPayload+1), ErrFrameTooLarge},
		{"cut payload", append(hdr(1, 0, 5), 'x'), io.ErrUnexpectedEOF},
		{"cut header", []byte{1, 0}, io.ErrUnexpectedEOF},
		{"empty", nil, io.EOF},
	} {
		if _, _, err := NewFrameConn(bytes.NewBuffer(tc.in)).ReadFrame(); !errors.Is(err, tc.want) {
			t.Errorf("%s: ReadFrame() = %v, want %v", tc.name, err, tc.want)
		}
	}
}

func TestDecodeRequest(t *testing.T) {
	ok := []string{
		`{"exec":{"command":["sh"],"timeout_secs":60}}`,
		`{"exec":{"command":["sh"],"env":["A=1"],"user":"app","workdir":"/w","tty":true,"cols":80,"rows":24,"timeout_secs":3600}}`,
		`{"get_files":{"path":"/"}}`,
		`{"get_files":{"path":"/etc/app"}}`,
		`{"put_files":{"path":"/srv","max_bytes":1024}}`,
		`{"signal":{"signal":64}}`,
	}
	for _, s := range ok {
		if _, err := DecodeRequest([]byte(s)); err != nil {
			t.Errorf("DecodeRequest(%s) = %v", s, err)
		}
	}
	bad := map[string]string{
		`{}`: "0 operations",
		`{"signal":{"signal":1},"get_files":{"path":"/"}}`:             "2 operations",
		`{"exec":{"command":[],"timeout_secs":1}}`:                     "empty command",
		`{"exec":{"command":["sh"]}}`:                                  "timeout_secs 0",
		`{"exec":{"command":["sh"],"timeout_secs":3601}}`:              "timeout_secs 3601",
		`{"exec":{"command":["sh"],"env":["1A=x"],"timeout_secs":1}}`:  "not KEY=VALUE",
		`{"exec":{"command":["sh"],"workdir":"rel","timeout_secs":1}}`: "not an absolute",
		`{"exec":{"command":["sh"],"cols":70000,"timeout_secs":1}}`:    "terminal size",
		`{"get_files":{"path":"/a/../b"}}`:                             "segment",
		`{"put_files":{"path":"/srv","max_bytes":0}}`:                  "max_bytes",
		`{"signal":{"signal":65}}`:                                     "1..64",
		`{"resize":{"cols":1}}`:                                        "unknown field",
		`{"signal":{"signal":1}} x`:                                    "trailing",
	}
	for s, want := range bad {
		if _, err := DecodeRequest([]byte(s)); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("DecodeRequest(%s) = %v, want an error containing %q", s, err, want)
		}
	}
}

func TestExecExitValidate(t *testing.T) {
	for _, e := range []ExecExit{{}, {ExitCode: intp(1), Signal: 9}, {ExitCode: intp(256)}, {Signal: -1}} {
		if e.Validate() == nil {
			t.Errorf("%+v validates", e)
		}
	}
	for _, e := range []ExecExit{{ExitCode: intp(0)}, {Signal: 9, TimedOut: true}} {
		if err := e.Validate(); err != nil {
			t.Errorf("%+v: %v", e, err)
		}
	}
}

// member is one entry of a test archive.
type member struct {
	name, link string
	typ        byte
	body       string
}

func archive(t *testing.T, ms ...member) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, m := range ms {
		h := &tar.Header{Name: m.name, Linkname: m.link, Typeflag: m.typ, Mode: 0o644, Size: int64(len(m.body))}
		if m.typ != tar.TypeReg {
			h.Size = 0
		}
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		if h.Size > 0 {
			tw.Write([]byte(m.body))
		}
	}
	tw.Close()
	return buf.Bytes()
}

// TestTarRules checks every rule of TarChecker through CheckTar, as the
// host runs it on an archive headed for /srv.
func TestTarRules(t *testing.T) {
	reg := func(name, body string) member { return member{name: name, typ: tar.TypeReg, body: body} }
	dir := func(name string) member { return member{name: name, typ: tar.TypeDir} }
	sym := func(name, target string) member { return member{name: name, typ: tar.TypeSymlink, link: target} }
	hard := func(name, target string) member { return member{name: name, typ: tar.TypeLink, link: target} }
	tests := []struct {
		name    string
		members []member
		max     int64  // 0: 1 MiB
		want    string // "" accepts
	}{
		{"plain tree", []member{dir("./"), dir("app/"), reg("app/a.txt", "hello"), sym("app/cur", "a.txt"),
			sym("app/abs", "/srv/app/a.txt"), hard("app/b.txt", "app/a.txt"), {name: "app/fifo", typ: tar.TypeFifo}}, 0, ""},
		{"link up within", []member{dir("a/b/"), sym("a/b/up", "../../x")}, 0, ""},
		{"same name twice", []member{reg("f", "1"), reg("f", "2")}, 0, ""},
		{"absolute name", []member{reg("/etc/passwd", "x")}, 0, "absolute name"},
		{"dot dot", []member{reg("a/../../etc/passwd", "x")}, 0, ".. segment"},
		{"dot dot alone", []member{reg("..", "x")}, 0, ".. segment"},
		{"symlink out relative", []member{sym("l", "../etc")}, 0, "leaves /srv"},
		{"symlink out absolute", []member{sym("l", "/etc/shadow")}, 0, "leaves /srv"},
		{"symlink to the sibling dir", []member{sym("l", "/srvx")}, 0, "leaves /srv"},
		{"symlink empty", []member{sym("l", "")}, 0, "without a target"},
		{"below a symlink", []member{sym("l", "sub"), reg("l/f", "x")}, 0, "below the link"},
		{"below a file", []member{reg("f", "x"), reg("f/g", "x")}, 0, "below the file"},
		{"hard link outside", []member{hard("h", "/etc/shadow")}, 0, "not an earlier file"},
		{"hard link up", []member{hard("h", "../x")}, 0, "not an earlier file"},
		{"hard link forward", []member{hard("h", "f"), reg("f", "x")}, 0, "not an earlier file"},
		{"hard link to a link", []member{sym("s", "f"), hard("h", "s")}, 0, "not an earlier file"},
		{"hard link to itself", []member{reg("f", "x"), hard("f", "f")}, 0, "not an earlier file"},
		{"char device", []member{{name: "null", typ: tar.TypeChar}}, 0, "device nodes"},
		{"block device", []member{{name: "sda", typ: tar.TypeBlock}}, 0, "device nodes"},
		{"file over a dir", []member{reg("d/f", "x"), reg("d", "x")}, 0, "replaces an earlier directory"},
		{"dir over a link", []member{sym("d", "x"), dir("d/")}, 0, "another type"},
		{"the dir itself as a file", []member{reg(".", "")}, 0, "not a directory"},
		{"contents over the cap", []member{reg("a", strings.Repeat("x", 2001))}, 2000, "contents exceed 2000 bytes"},
		{"archive over the cap", []member{reg("a", "x")}, 1000, "exceeds 1000 bytes"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			max := tt.max
			if max == 0 {
				max = 1 << 20
			}
			err := CheckTar(bytes.NewReader(archive(t, tt.members...)), "/srv", max)
			if tt.want == "" {
				if err != nil {
					t.Fatalf("CheckTar = %v, want nil", err)
				}
				return
			}
			var oe *OpError
			if !errors.As(err, &oe) || oe.Code != ErrBadRequest || !strings.Contains(oe.Message, tt.want) {
				t.Fatalf("CheckTar = %v, want a bad request containing %q", err, tt.want)
			}
		})
	}
	if err := CheckTar(strings.NewReader(strings.Repeat("junk", 200)), "/srv", 1<<20); err == nil || !strings.Contains(err.Error(), "not a valid tar archive") {
		t.Errorf("junk: %v", err)
	}
	// The whole tree of the root is "/": every absolute link stays in.
	if err := CheckTar(bytes.NewReader(archive(t, sym("l", "/etc/x"))), "/", 1<<20); err != nil {
		t.Errorf("link under /: %v", err)
	}
}

func TestTarCheckerCounts(t *testing.T) {
	tr := tar.NewReader(bytes.NewReader(archive(t, member{name: "d/", typ: tar.TypeDir}, member{name: "d/f", typ: tar.TypeReg, body: "abc"})))
	c := NewTarChecker("/x", 100)
	var names []string
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		n, err := c.Check(h)
		if err != nil {
			t.Fatal(err)
		}
		names = append(names, n)
	}
	if strings.Join(names, ",") != "d,d/f" || c.Members() != 2 || c.Bytes() != 3 {
		t.Errorf("names %q, members %d, bytes %d", names, c.Members(), c.Bytes())
	}
}

// TestLogAtOmittedForOldHosts: a Log without At (what a version 2 host
// gets) has no "at" field, so the old host's strict decoding takes it.
func TestLogAtOmittedForOldHosts(t *testing.T) {
	b, err := Marshal(&Log{Stream: Stdout, Data: []byte("x"), Seq: 1})
	if err != nil {
		t.Fatal(err)
	}
	if bytes.Contains(b, []byte(`"at"`)) {
		t.Errorf("frame %s has an at field", b)
	}
	b, _ = Marshal(&Log{Stream: Stdout, Data: []byte("x"), Seq: 1, At: time.Unix(1, 0)})
	if !bytes.Contains(b, []byte(`"at":"1970-01-01T00:00:01Z"`)) {
		t.Errorf("frame %s lacks at", b)
	}
}
