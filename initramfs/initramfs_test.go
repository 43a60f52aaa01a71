package initramfs

import (
	"bytes"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// TestHeaderFields checks every header field of single-entry archives
// against hand-computed values.
func TestHeaderFields(t *testing.T) {
	tests := []struct {
		name  string
		entry Entry
		// want is the header (magic, 13 fields) followed by name and data,
		// padding included.
		want string
	}{
		{
			name:  "dir",
			entry: Dir("/proc", 0o555),
			want: "070701" + "00000001" + "0000416d" + "00000000" + "00000000" + "00000002" + "00000000" +
				"00000000" + "00000000" + "00000000" + "00000000" + "00000000" + "00000005" + "00000000" +
				"proc\x00" + "\x00", // 110+5 = 115, pad to 116
		},
		{
			name:  "file",
			entry: File("a", 0o644, []byte("hello")),
			want: "070701" + "00000001" + "000081a4" + "00000000" + "00000000" + "00000001" + "00000000" +
				"00000005" + "00000000" + "00000000" + "00000000" + "00000000" + "00000002" + "00000000" +
				"a\x00" + "hello" + "\x00\x00\x00", // 112, then 117 -> 120
		},
		{
			name:  "console",
			entry: CharDev("dev/console", 0o600, 5, 1),
			want: "070701" + "00000001" + "00002180" + "00000000" + "00000000" + "00000001" + "00000000" +
				"00000000" + "00000000" + "00000000" + "00000005" + "00000001" + "0000000c" + "00000000" +
				"dev/console\x00" + "\x00\x00", // 122 -> 124
		},
		{
			name:  "symlink",
			entry: Symlink("sbin", "bin"),
			want: "070701" + "00000001" + "0000a1ff" + "00000000" + "00000000" + "00000001" + "00000000" +
				"00000003" + "00000000" + "00000000" + "00000000" + "00000000" + "00000005" + "00000000" +
				"sbin\x00\x00" + "bin\x00",
		},
		{
			name:  "sticky dir",
			entry: Dir("tmp", 0o777|fs.ModeSticky),
			want: "070701" + "00000001" + "000043ff" + "00000000" + "00000000" + "00000002" + "00000000" +
				"00000000" + "00000000" + "00000000" + "00000000" + "00000000" + "00000004" + "00000000" +
				"tmp\x00\x00\x00",
		},
	}
	const trail = "070701" + "00000000" + "00000000" + "00000000" + "00000000" + "00000001" + "00000000" +
		"00000000" + "00000000" + "00000000" + "00000000" + "00000000" + "0000000b" + "00000000" +
		"TRAILER!!!\x00" + "\x00\x00\x00" // 121 -> 124
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var buf bytes.Buffer
			if err := Write(&buf, []Entry{tt.entry}); err != nil {
				t.Fatal(err)
			}
			if got, want := buf.String(), tt.want+trail; got != want {
				t.Errorf("Write() =\n%q\nwant\n%q", got, want)
			}
			if buf.Len()%4 != 0 {
				t.Errorf("archive length %d is not a multiple of 4", buf.Len())
			}
		})
	}
}

func TestWriteRefuses(t *testing.T) {
	bad := []Entry{
		Dir("../etc", 0o755),
		Dir("a/../../b", 0o755),
		File("", 0o644, nil),
		File("TRAILER!!!", 0o644, nil),
		{Name: "p", Mode: fs.ModeNamedPipe},
		Symlink("l", ""),
		FileFrom("x", 0o644, "/nonexistent/file"),
		FileFrom("x", 0o644, "/"),
	}
	for _, e := range bad {
		if err := Write(&bytes.Buffer{}, []Entry{e}); err == nil {
			t.Errorf("Write(%+v) = nil, want error", e)
		}
	}
}

func TestDeterministic(t *testing.T) {
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	var a, b bytes.Buffer
	if err := ForGuestAgent(&a, exe, nil); err != nil {
		t.Fatal(err)
	}
	if err := ForGuestAgent(&b, exe, nil); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(a.Bytes(), b.Bytes()) {
		t.Error("two archives from the same inputs differ")
	}
}

// TestCpioReadsGuestAgent writes the guest-agent initramfs with the test
// binary as /init and reads it back with GNU cpio.
func TestCpioReadsGuestAgent(t *testing.T) {
	cpio, err := exec.LookPath("cpio")
	if err != nil {
		t.Skip("cpio not installed (apt-get install cpio)")
	}
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	img := filepath.Join(t.TempDir(), "initramfs.cpio")
	f, err := os.Create(img)
	if err != nil {
		t.Fatal(err)
	}
	if err := ForGuestAgent(f, exe, nil); err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}

	run := func(stdinPath string, args ...string) []byte {
		t.Helper()
		in, err := os.Open(stdinPath)
		if err != nil {
			t.Fatal(err)
		}
		defer in.Close()
		cmd := exec.Command(cpio, args...)
		cmd.Stdin = in
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("cpio %v: %v\n%s", args, err, stderr.String())
		}
		return out
	}

	list := strings.Fields(string(run(img, "-t", "--quiet")))
	want := []string{"dev", "dev/console", "dev/null", "proc", "sys", "run", "tmp", "etc", "mnt", "mnt/root", "init"}
	if strings.Join(list, " ") != strings.Join(want, " ") {
		t.Errorf("cpio -t = %q, want %q", list, want)
	}

	verbose := string(run(img, "-tv", "--quiet"))
	for _, line := range []string{"crw-------", "5,", "drwxrwxrwt", "-rwxr-xr-x"} {
		if !strings.Contains(verbose, line) {
			t.Errorf("cpio -tv lacks %q:\n%s", line, verbose)
		}
	}

	got := run(img, "-i", "--quiet", "--to-stdout", "init")
	exeBytes, err := os.ReadFile(exe)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, exeBytes) {
		t.Errorf("extracted /init: %d bytes, differs from the %d-byte binary", len(got), len(exeBytes))
	}
}

func BenchmarkForGuestAgent(b *testing.B) {
	exe, err := os.Executable()
	if err != nil {
		b.Fatal(err)
	}
	st, err := os.Stat(exe)
	if err != nil {
		b.Fatal(err)
	}
	b.SetBytes(st.Size())
	for b.Loop() {
		if err := ForGuestAgent(discard{}, exe, nil); err != nil {
			b.Fatal(err)
		}
	}
}

type discard struct{}

func (discard) Write(p []byte) (int, error) { return len(p), nil }

// BenchmarkCpioCreate is the tool a user would otherwise reach for: GNU
// cpio -o -H newc over a tree holding the same binary as init.
func BenchmarkCpioCreate(b *testing.B) {
	cpio, err := exec.LookPath("cpio")
	if err != nil {
		b.Skip("cpio not installed")
	}
	exe, err := os.Executable()
	if err != nil {
		b.Fatal(err)
	}
	data, err := os.ReadFile(exe)
	if err != nil {
		b.Fatal(err)
	}
	dir := b.TempDir()
	for _, d := range []string{"dev", "proc", "sys", "run", "tmp", "etc", "mnt/root"} {
		if err := os.MkdirAll(filepath.Join(dir, d), 0o755); err != nil {
			b.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(dir, "init"), data, 0o755); err != nil {
		b.Fatal(err)
	}
	b.SetBytes(int64(len(data)))
	for b.Loop() {
		cmd := exec.Command(cpio, "-o", "-H", "newc", "--quiet")
		cmd.Dir = dir
		cmd.Stdin = strings.NewReader("dev\nproc\nsys\nrun\ntmp\netc\nmnt\nmnt/root\ninit\n")
		cmd.Stdout = discard{}
		if err := cmd.Run(); err != nil {
			b.Fatal(err)
		}
	}
}

// TestCpioReadsGuestAgentModules checks the module layout: each module as
// lib/modules/<name>.ko and the load order in etc/vmhost-modules.
func TestCpioReadsGuestAgentModules(t *testing.T) {
	cpio, err := exec.LookPath("cpio")
	if err != nil {
		t.Skip("cpio not installed (apt-get install cpio)")
	}
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	mods := []Module{{Name: "virtio", Data: []byte("first")}, {Name: "virtio_blk", Data: []byte("second module")}}
	var buf bytes.Buffer
	if err := ForGuestAgent(&buf, exe, mods); err != nil {
		t.Fatal(err)
	}
	extract := func(args ...string) string {
		t.Helper()
		cmd := exec.Command(cpio, args...)
		cmd.Stdin = bytes.NewReader(buf.Bytes())
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("cpio %v: %v", args, err)
		}
		return string(out)
	}
	list := strings.Fields(extract("-t", "--quiet"))
	for _, want := range []string{"lib", "lib/modules", "lib/modules/virtio.ko", "lib/modules/virtio_blk.ko", "etc/vmhost-modules"} {
		if !slices.Contains(list, want) {
			t.Errorf("archive lacks %s: %q", want, list)
		}
	}
	if got := extract("-i", "--quiet", "--to-stdout", ModuleList); got != "virtio\nvirtio_blk\n" {
		t.Errorf("%s = %q, want the names in load order", ModuleList, got)
	}
	if got := extract("-i", "--quiet", "--to-stdout", "lib/modules/virtio_blk.ko"); got != "second module" {
		t.Errorf("virtio_blk.ko = %q", got)
	}
	if err := ForGuestAgent(&bytes.Buffer{}, exe, []Module{{Name: "../x"}}); err == nil {
		t.Error("a module name with a slash was accepted")
	}
}
