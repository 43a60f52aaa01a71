package qcow2

import (
	"bytes"
	"encoding/json"
	"errors"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"vmhost/internal/atomicfile"
)

// longDir makes a directory under dir whose path is about n bytes long.
func longDir(t *testing.T, dir string, n int) string {
	t.Helper()
	for len(dir) < n-200 {
		dir = filepath.Join(dir, strings.Repeat("d", 180))
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	return dir
}

// TestCreateOverlayMatchesQemuImg compares CreateOverlay byte for byte with
// `qemu-img create -f qcow2 -b BUILD -F qcow2` for several sizes and for
// backing names up to the 1023-byte limit, then has qemu-img check the
// result and follow the chain.
func TestCreateOverlayMatchesQemuImg(t *testing.T) {
	dir := t.TempDir()
	short := filepath.Join(dir, "b.qcow2")
	deep := longDir(t, dir, 1023)
	long := filepath.Join(deep, strings.Repeat("x", 1023-len(deep)-1-len(".qcow2"))+".qcow2")
	if len(long) != 1023 {
		t.Fatalf("long build path is %d bytes, want 1023", len(long))
	}
	for _, build := range []string{short, long} {
		if err := Create(build, 1<<30); err != nil {
			t.Fatal(err)
		}
	}
	for _, tc := range []struct {
		build string
		size  uint64
	}{
		{short, 1 << 30},
		{short, 10 << 30},
		{short, 3000000001}, // rounded up to 3000000512, as qemu-img does
		{short, 8 << 40},
		{long, 20 << 30},
	} {
		name := strconv.Itoa(len(tc.build)) + "-" + strconv.FormatUint(tc.size, 10)
		t.Run(name, func(t *testing.T) {
			want := filepath.Join(dir, "want-"+name)
			got := filepath.Join(dir, "got-"+name)
			qemuImg(t, "create", "-q", "-f", "qcow2", "-b", tc.build, "-F", "qcow2", want, strconv.FormatUint(tc.size, 10))
			if err := CreateOverlay(got, tc.build, tc.size); err != nil {
				t.Fatal(err)
			}
			a, err := os.ReadFile(want)
			if err != nil {
				t.Fatal(err)
			}
			b, err := os.ReadFile(got)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(a, b) {
				t.Errorf("CreateOverlay differs from qemu-img create -b: %d bytes vs %d; first difference at %#x", len(b), len(a), firstDiff(a, b))
			}
			qemuImg(t, "check", "-q", got)
			chain := backingChain(t, got)
			if len(chain) != 2 || chain[0].BackingFilename != tc.build || chain[0].BackingFormat != "qcow2" ||
				chain[1].Filename != tc.build || chain[0].VirtualSize != roundUp(tc.size, 512) {
				t.Errorf("qemu-img info --backing-chain = %+v, want the overlay (%d bytes) over %s", chain, roundUp(tc.size, 512), tc.build)
			}
			h, err := ReadHeaderFile(got)
			if err != nil {
				t.Fatal(err)
			}
			if h.BackingFile != tc.build || h.BackingFormat != "qcow2" {
				t.Errorf("header names %q (format %q), want %q (qcow2)", h.BackingFile, h.BackingFormat, tc.build)
			}
			if err := h.CheckOverlay(tc.build); err != nil {
				t.Errorf("CheckOverlay = %v", err)
			}
			if err := h.CheckBase(); err == nil || !strings.Contains(err.Error(), "backing file") {
				t.Errorf("CheckBase of an overlay = %v, want a backing-file refusal", err)
			}
		})
	}
}

type chainEntry struct {
	Filename        string `json:"filename"`
	VirtualSize     uint64 `json:"virtual-size"`
	BackingFilename string `json:"backing-filename"`
	BackingFormat   string `json:"backing-filename-format"`
}

func backingChain(t *testing.T, path string) []chainEntry {
	t.Helper()
	out, err := exec.Command("qemu-img", "info", "--backing-chain", "--output=json", path).Output()
	if err != nil {
		t.Fatalf("qemu-img info --backing-chain %s: %v", path, err)
	}
	var chain []chainEntry
	if err := json.Unmarshal(out, &chain); err != nil {
		t.Fatalf("qemu-img info: %v\n%s", err, out)
	}
	return chain
}

// TestOverlayReadsThroughToBuild: what qemu-io wrote into the build reads
// back through an overlay, writes to the overlay stay in it, and the
// build's bytes do not change.
func TestOverlayReadsThroughToBuild(t *testing.T) {
	if _, err := exec.LookPath("qemu-io"); err != nil {
		t.Skip("qemu-io not installed (apt-get install qemu-utils)")
	}
	dir := t.TempDir()
	build, overlay := filepath.Join(dir, "build.qcow2"), filepath.Join(dir, "root.qcow2")
	if err := Create(build, 64<<20); err != nil {
		t.Fatal(err)
	}
	qemuIO(t, build, "write -q -P 0xab 0 1M", "write -q -P 0xcd 63M 1M")
	before, err := os.ReadFile(build)
	if err != nil {
		t.Fatal(err)
	}
	if err := CreateOverlay(overlay, build, 1<<30); err != nil {
		t.Fatal(err)
	}
	qemuIO(t, overlay, "read -q -P 0xab 0 1M", "read -q -P 0xcd 63M 1M", "read -q -P 0 64M 1M", "read -q -P 0 1023M 1M",
		"write -q -P 0x11 512K 4K", "write -q -P 0x22 900M 4K")
	qemuIO(t, overlay, "read -q -P 0xab 0 512K", "read -q -P 0x11 512K 4K", "read -q -P 0x22 900M 4K", "read -q -P 0xab 516K 4K")
	qemuImg(t, "check", "-q", overlay)
	after, err := os.ReadFile(build)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(before, after) {
		t.Error("writing through the overlay changed the build")
	}
}

func qemuIO(t *testing.T, path string, cmds ...string) {
	t.Helper()
	args := []string{"-f", "qcow2"}
	for _, c := range cmds {
		args = append(args, "-c", c)
	}
	out, err := exec.Command("qemu-io", append(args, path)...).CombinedOutput()
	// qemu-io exits 0 even when a pattern check fails; it says so.
	if err != nil || len(bytes.TrimSpace(out)) > 0 {
		t.Fatalf("qemu-io %v on %s: %v\n%s", cmds, path, err, out)
	}
}

func TestCreateOverlayRefuses(t *testing.T) {
	dir := t.TempDir()
	build := filepath.Join(dir, "build.qcow2")
	if err := Create(build, 1<<30); err != nil {
		t.Fatal(err)
	}
	nested := filepath.Join(dir, "nested.qcow2")
	if err := CreateOverlay(nested, build, 1<<30); err != nil {
		t.Fatal(err)
	}
	raw := filepath.Join(dir, "raw.img")
	if err := os.WriteFile(raw, make([]byte, 1<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	existing := filepath.Join(dir, "existing.qcow2")
	if err := os.WriteFile(existing, []byte("keep"), 0o600); err != nil {
		t.Fatal(err)
	}
	deep := longDir(t, dir, 1024)
	tooLong := filepath.Join(deep, strings.Repeat("x", 1024-len(deep)-1))
	for _, tc := range []struct {
		name, dst, build string
		size             uint64
		want             string
		is               error
	}{
		{"relative build", "o1", "build.qcow2", 1 << 30, "not a clean absolute path", nil},
		{"unclean build", "o2", dir + "/./build.qcow2", 1 << 30, "not a clean absolute path", nil},
		{"name too long", "o3", tooLong, 1 << 30, "exceeds 1023", nil},
		{"missing build", "o4", filepath.Join(dir, "nope.qcow2"), 1 << 30, "no such file", fs.ErrNotExist},
		{"build not qcow2", "o5", raw, 1 << 30, "not a qcow2 image", ErrNotQcow2},
		{"build is an overlay", "o6", nested, 1 << 30, "has a backing file", nil},
		{"smaller than build", "o7", build, 1<<30 - 512, "smaller than backing file", nil},
		{"beyond MaxSize", "o8", build, MaxSize + 1, "exceeds the maximum", nil},
		{"existing destination", "existing.qcow2", build, 1 << 30, "exists", fs.ErrExist},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dst := filepath.Join(dir, tc.dst)
			err := CreateOverlay(dst, tc.build, tc.size)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("CreateOverlay = %v, want an error containing %q", err, tc.want)
			}
			if tc.is != nil && !errors.Is(err, tc.is) {
				t.Errorf("errors.Is(%v, %v) = false", err, tc.is)
			}
			if tc.dst != "existing.qcow2" {
				if _, err := os.Stat(dst); !errors.Is(err, fs.ErrNotExist) {
					t.Errorf("%s exists after a failed CreateOverlay", dst)
				}
			}
		})
	}
	if b, _ := os.ReadFile(existing); string(b) != "keep" {
		t.Errorf("existing destination overwritten: %q", b)
	}
	ents, _ := os.ReadDir(dir)
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), ".") {
			t.Errorf("temp file %s left behind", e.Name())
		}
	}
}

// TestCheckOverlay: CheckOverlay accepts only an overlay of the named
// build in qcow2 format, and still applies CheckBase's other checks;
// CheckBase keeps refusing every image with a backing file.
func TestCheckOverlay(t *testing.T) {
	dir := t.TempDir()
	build, other := filepath.Join(dir, "build.qcow2"), filepath.Join(dir, "other.qcow2")
	for _, p := range []string{build, other} {
		if err := Create(p, 1<<30); err != nil {
			t.Fatal(err)
		}
	}
	mine := filepath.Join(dir, "mine.qcow2")
	if err := CreateOverlay(mine, build, 2<<30); err != nil {
		t.Fatal(err)
	}
	rawFormat := filepath.Join(dir, "raw-format.qcow2")
	noFormat := filepath.Join(dir, "no-format.qcow2")
	qemuImg(t, "create", "-q", "-f", "qcow2", "-u", "-b", build, "-F", "raw", rawFormat, "1G")
	// Without -F, qemu-img 7.2 refuses; an image from an older qemu-img
	// has no backing-format extension. Make one by hand: drop the
	// extension's type so the walk skips it as unknown.
	b, err := os.ReadFile(mine)
	if err != nil {
		t.Fatal(err)
	}
	copy(b[headerLength:], []byte{0x12, 0x34, 0x56, 0x78})
	if err := os.WriteFile(noFormat, b, 0o600); err != nil {
		t.Fatal(err)
	}
	corrupt := filepath.Join(dir, "corrupt.qcow2")
	b, _ = os.ReadFile(mine)
	b[79] |= IncompatCorrupt
	if err := os.WriteFile(corrupt, b, 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		image, build string
		want         string // "" means accepted
	}{
		{mine, build, ""},
		{mine, other, "backing file is"},
		{mine, build + "x", "backing file is"},
		{build, build, "no backing file"},
		{rawFormat, build, `backing format is "raw"`},
		{noFormat, build, `backing format is ""`},
		{corrupt, build, "marked corrupt"},
	} {
		h, err := ReadHeaderFile(tc.image)
		if err != nil {
			t.Fatal(err)
		}
		err = h.CheckOverlay(tc.build)
		if tc.want == "" && err != nil || tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)) {
			t.Errorf("CheckOverlay(%s) of %s = %v, want %q", filepath.Base(tc.build), filepath.Base(tc.image), err, tc.want)
		}
		if tc.image != build {
			if err := h.CheckBase(); err == nil {
				t.Errorf("CheckBase of %s accepted an image with a backing file", filepath.Base(tc.image))
			}
		}
	}
}

// overlayLoopEnv makes the test binary write overlays in a loop instead of
// running the tests, until it is killed: $VMHOST_TEST_OVERLAY_LOOP names
// the directory, which holds build.qcow2.
const overlayLoopEnv = "VMHOST_TEST_OVERLAY_LOOP"

func init() {
	dir := os.Getenv(overlayLoopEnv)
	if dir == "" {
		return
	}
	os.Stdout.Write([]byte("writing\n"))
	for i := 0; ; i++ {
		p := filepath.Join(dir, "root-"+strconv.Itoa(os.Getpid())+"-"+strconv.Itoa(i)+".qcow2")
		if err := CreateOverlay(p, filepath.Join(dir, "build.qcow2"), 4<<30); err != nil {
			println(err.Error())
			os.Exit(1)
		}
	}
}

// TestCreateOverlayKilled kills (SIGKILL) a process writing overlays in a
// loop 50 times at random moments: every file at a final name is a whole
// overlay qemu-img accepts, and anything else is a temp file
// atomicfile.IsTemp recognises, which a startup sweep removes. (A kill
// tests the publish, not durability across a power loss.)
func TestCreateOverlayKilled(t *testing.T) {
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	build := filepath.Join(dir, "build.qcow2")
	if err := Create(build, 1<<30); err != nil {
		t.Fatal(err)
	}
	for i := range 50 {
		cmd := exec.Command(self, "-test.run=^$")
		cmd.Env = append(os.Environ(), overlayLoopEnv+"="+dir, "GORACE=atexit_sleep_ms=0")
		var out bytes.Buffer
		cmd.Stderr = &out
		started, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		// Killed between 0 and 3 ms into the loop (an overlay takes
		// about 1 ms), so kills land at every step of a write.
		if _, err := started.Read(make([]byte, 8)); err != nil {
			t.Fatalf("writer: %v: %s", err, out.String())
		}
		time.Sleep(time.Duration(i*61%3000) * time.Microsecond)
		cmd.Process.Kill()
		if err := cmd.Wait(); err == nil || !strings.Contains(err.Error(), "killed") {
			t.Fatalf("writer ended with %v before the kill: %s", err, out.String())
		}
	}
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var whole, temps int
	for _, e := range ents {
		p := filepath.Join(dir, e.Name())
		switch {
		case e.Name() == "build.qcow2":
		case atomicfile.IsTemp(e.Name()):
			temps++
		default:
			h, err := ReadHeaderFile(p)
			if err != nil {
				t.Errorf("%s: %v", e.Name(), err)
				continue
			}
			if err := h.CheckOverlay(build); err != nil {
				t.Errorf("%s: %v", e.Name(), err)
			}
			if b, _ := os.ReadFile(p); len(b) != 3*clusterSize+8*8 {
				t.Errorf("%s is %d bytes, want %d", e.Name(), len(b), 3*clusterSize+8*8)
			}
			whole++
		}
	}
	t.Logf("after 50 kills: %d whole overlays, %d temp files", whole, temps)
	if whole == 0 {
		t.Error("no overlay was ever published: the kills came too early to test anything")
	}
	if _, err := exec.LookPath("qemu-img"); err == nil {
		for _, e := range ents {
			if strings.HasPrefix(e.Name(), "root-") {
				qemuImg(t, "check", "-q", filepath.Join(dir, e.Name()))
				break
			}
		}
	}
}
