package ociimage

import (
	"archive/tar"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
)

// childEnv makes the test binary run one Import as childMain instead of
// the tests; the unprivileged test starts it as another user.
const childEnv = "OCIIMAGE_TEST_CHILD"

type childRequest struct {
	Src, Dst string
	Opts     Options
}

type childResult struct {
	Err            string
	SkippedDevices int
}

func TestMain(m *testing.M) {
	if req := os.Getenv(childEnv); req != "" {
		os.Exit(childMain(req))
	}
	os.Exit(m.Run())
}

func childMain(reqJSON string) int {
	var req childRequest
	if err := json.Unmarshal([]byte(reqJSON), &req); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	var res childResult
	img, err := Import(context.Background(), req.Src, req.Dst, req.Opts)
	if err != nil {
		res.Err = err.Error()
	} else {
		res.SkippedDevices = img.SkippedDevices
	}
	json.NewEncoder(os.Stdout).Encode(res)
	return 0
}

// TestImportUnprivileged runs Import as nobody (uid 65534) in a child
// process: owners and device nodes fail the import unless IgnoreOwners and
// SkipDevices allow otherwise.
func TestImportUnprivileged(t *testing.T) {
	requireTools(t)
	if os.Geteuid() != 0 {
		t.Skip("needs root to start the import as another user (run go test as root)")
	}
	const nobody = 65534
	// A world-readable work dir, since t.TempDir's parents are private to
	// root; the test binary is copied there for the same reason.
	work, err := os.MkdirTemp("", "ociimage-unpriv-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(work) })
	if err := os.Chmod(work, 0o755); err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(work, "ociimage.test")
	copyFile(t, os.Args[0], bin, 0o755)
	images := filepath.Join(work, "images")
	if err := os.Mkdir(images, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(images, nobody, nobody); err != nil {
		t.Fatal(err)
	}
	files, _ := newLayout(t, true, layerTar(t,
		fileEnt("mine", "1", 0o4755, nobody, nobody),
		fileEnt("theirs", "2", 0o644, 1000, 1000),
		dirEnt("dev/", 0o755, 0, 0),
		ent{hdr: tar.Header{Typeflag: tar.TypeFifo, Name: "dev/fifo", Mode: 0o600}},
		ent{hdr: tar.Header{Typeflag: tar.TypeChar, Name: "dev/null", Mode: 0o666, Devmajor: 1, Devminor: 3}},
	)).files(t)
	src := filepath.Join(work, "layout")
	writeDir(t, src, files)

	run := func(name string, opts Options) childResult {
		t.Helper()
		req, _ := json.Marshal(childRequest{Src: src, Dst: filepath.Join(images, name), Opts: opts})
		cmd := exec.Command(bin)
		cmd.Env = append(os.Environ(), childEnv+"="+string(req))
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: nobody, Gid: nobody}}
		var stderr strings.Builder
		cmd.Stderr = &stderr
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("child import as nobody: %v: %s", err, stderr.String())
		}
		var res childResult
		if err := json.Unmarshal(out, &res); err != nil {
			t.Fatalf("child output %q: %v", out, err)
		}
		return res
	}

	res := run("strict", Options{})
	if !strings.Contains(res.Err, `setting owner of "theirs" needs root (CAP_CHOWN), or import with --ignore-owners`) {
		t.Errorf("Import as nobody = %q, want a CAP_CHOWN failure", res.Err)
	}
	res = run("owners", Options{IgnoreOwners: true})
	if !strings.Contains(res.Err, `creating device node "dev/null" needs root (CAP_MKNOD), or import with --skip-devices`) {
		t.Errorf("Import as nobody with IgnoreOwners = %q, want a CAP_MKNOD failure", res.Err)
	}
	for _, name := range []string{"strict", "owners"} {
		if _, err := os.Stat(filepath.Join(images, name)); !os.IsNotExist(err) {
			t.Errorf("failed import left %s behind (stat: %v)", name, err)
		}
	}

	res = run("lenient", Options{IgnoreOwners: true, SkipDevices: true})
	if res.Err != "" || res.SkippedDevices != 1 {
		t.Fatalf("Import as nobody with IgnoreOwners and SkipDevices = %+v, want success with 1 skipped device", res)
	}
	raw := rawImage(t, &Image{RootfsPath: filepath.Join(images, "lenient", RootfsName)})
	for _, w := range []struct {
		path     string
		typ      string
		mode     int64
		uid, gid int
	}{
		{"/", "directory", 0o755, 0, 0}, // mkfs -E root_owner
		{"/mine", "regular", 0o4755, nobody, nobody},
		{"/theirs", "regular", 0o644, nobody, nobody},
		{"/dev/fifo", "FIFO", 0o600, nobody, nobody},
	} {
		got := stat(t, raw, w.path)
		if got.typ != w.typ || got.mode != w.mode || got.uid != w.uid || got.gid != w.gid {
			t.Errorf("%s: type %s mode %#o owner %d:%d, want %s %#o %d:%d", w.path, got.typ, got.mode, got.uid, got.gid, w.typ, w.mode, w.uid, w.gid)
		}
	}
	if exists(t, raw, "/dev/null") {
		t.Errorf("/dev/null exists; it should have been skipped")
	}
}

func copyFile(t *testing.T, from, to string, mode os.FileMode) {
	t.Helper()
	in, err := os.Open(from)
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	out, err := os.OpenFile(to, os.O_WRONLY|os.O_CREATE|os.O_EXCL, mode)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.Copy(out, in); err != nil {
		t.Fatal(err)
	}
	if err := out.Close(); err != nil {
		t.Fatal(err)
	}
}
