package disk

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"

	"vmhost/internal/atomicfile"
	"vmhost/qcow2"
)

func needTool(tb testing.TB, name string) string {
	tb.Helper()
	p, err := exec.LookPath(name)
	if err != nil {
		tb.Skipf("%s not installed (apt-get install qemu-utils coreutils)", name)
	}
	return p
}

func run(tb testing.TB, name string, args ...string) {
	tb.Helper()
	if out, err := exec.Command(name, args...).CombinedOutput(); err != nil {
		tb.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
}

// makeSparseBase writes a qcow2 with 2 GiB virtual size whose metadata is
// preallocated (so the file is 2 GiB long, mostly holes) holding 300 MiB of
// data in 1 MiB writes at random offsets: the shape that shows whether a
// copy keeps holes.
func makeSparseBase(tb testing.TB, path string) {
	tb.Helper()
	needTool(tb, "qemu-io")
	run(tb, "qemu-img", "create", "-q", "-f", "qcow2", "-o", "preallocation=metadata", path, "2G")
	r := rand.New(rand.NewPCG(1, 2))
	args := []string{"-f", "qcow2"}
	for _, mib := range r.Perm(2048)[:300] {
		args = append(args, "-c", fmt.Sprintf("write -q -P %d %dM 1M", mib%251+1, mib))
	}
	run(tb, "qemu-io", append(args, path)...)
}

var (
	baseOnce sync.Once
	baseDir  string
)

// sparseBase returns a shared sparse base image, made once per test binary.
func sparseBase(tb testing.TB) string {
	tb.Helper()
	needTool(tb, "qemu-img")
	baseOnce.Do(func() {
		d, err := os.MkdirTemp("", "diskbase")
		if err != nil {
			tb.Fatal(err)
		}
		makeSparseBase(tb, filepath.Join(d, "base.qcow2"))
		baseDir = d
	})
	if baseDir == "" {
		tb.Fatal("building the base image failed earlier")
	}
	return filepath.Join(baseDir, "base.qcow2")
}

func TestMain(m *testing.M) {
	code := m.Run()
	if baseDir != "" {
		os.RemoveAll(baseDir)
	}
	os.Exit(code)
}

func allocatedBytes(tb testing.TB, path string) int64 {
	tb.Helper()
	st, err := os.Stat(path)
	if err != nil {
		tb.Fatal(err)
	}
	return st.Sys().(*syscall.Stat_t).Blocks * 512
}

func TestCopySparse(t *testing.T) {
	src := sparseBase(t)
	dst := filepath.Join(t.TempDir(), "root.qcow2")
	if err := Copy(context.Background(), src, dst); err != nil {
		t.Fatal(err)
	}
	run(t, "qemu-img", "compare", "-q", src, dst)
	run(t, "qemu-img", "check", "-q", dst)
	srcSt, _ := os.Stat(src)
	dstSt, err := os.Stat(dst)
	if err != nil {
		t.Fatal(err)
	}
	if srcSt.Size() != dstSt.Size() {
		t.Errorf("copy is %d bytes long, source %d", dstSt.Size(), srcSt.Size())
	}
	if dstSt.Mode().Perm() != 0o600 {
		t.Errorf("copy mode = %v, want 0600", dstSt.Mode().Perm())
	}
	sa, da := allocatedBytes(t, src), allocatedBytes(t, dst)
	t.Logf("source allocates %d bytes, copy %d (file length %d)", sa, da, dstSt.Size())
	if da > sa+sa/10+(1<<20) || da < sa*9/10 {
		t.Errorf("copy allocates %d bytes, source %d: holes were not kept", da, sa)
	}
	// Nothing but the copy is left in the directory.
	ents, _ := os.ReadDir(filepath.Dir(dst))
	if len(ents) != 1 {
		t.Errorf("directory holds %d entries, want only root.qcow2", len(ents))
	}
}

func TestCopyRefuses(t *testing.T) {
	needTool(t, "qemu-img")
	dir := t.TempDir()
	base := filepath.Join(dir, "base.qcow2")
	overlay := filepath.Join(dir, "overlay.qcow2")
	raw := filepath.Join(dir, "raw.img")
	if err := qcow2.Create(base, 1<<30); err != nil {
		t.Fatal(err)
	}
	run(t, "qemu-img", "create", "-q", "-f", "qcow2", "-b", base, "-F", "qcow2", overlay)
	if err := os.WriteFile(raw, make([]byte, 1<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	existing := filepath.Join(dir, "existing.qcow2")
	if err := os.WriteFile(existing, []byte("keep"), 0o600); err != nil {
		t.Fatal(err)
	}
	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	for _, tc := range []struct {
		name, src, dst string
		ctx            context.Context
		want           string
		is             error
	}{
		{"backing file", overlay, "out1", context.Background(), "backing file", nil},
		{"not qcow2", raw, "out2", context.Background(), "not a qcow2 image", qcow2.ErrNotQcow2},
		{"missing", filepath.Join(dir, "nope"), "out3", context.Background(), "no such file", fs.ErrNotExist},
		{"existing destination", base, "existing.qcow2", context.Background(), "exists", fs.ErrExist},
		{"cancelled", base, "out4", cancelled, "context canceled", context.Canceled},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dst := filepath.Join(dir, tc.dst)
			err := Copy(tc.ctx, tc.src, dst)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Copy = %v, want an error containing %q", err, tc.want)
			}
			if tc.is != nil && !errors.Is(err, tc.is) {
				t.Errorf("errors.Is(%v, %v) = false", err, tc.is)
			}
			if tc.dst != "existing.qcow2" {
				if _, err := os.Stat(dst); !errors.Is(err, fs.ErrNotExist) {
					t.Errorf("%s exists after a failed copy", dst)
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

// fsyncPath makes an external tool's output durable (the file and its
// directory entry, like `cp && sync`), so every method in BenchmarkCopy
// pays for the same flushes as Copy does.
func fsyncPath(b *testing.B, path string) {
	f, err := os.Open(path)
	if err != nil {
		b.Fatal(err)
	}
	if err := f.Sync(); err != nil {
		b.Fatal(err)
	}
	f.Close()
	if err := atomicfile.SyncDir(filepath.Dir(path)); err != nil {
		b.Fatal(err)
	}
}

// BenchmarkCopy compares Copy with the tools an operator would use on the
// same 2 GiB-virtual, 300 MiB-data image, each including the fsync.
// Compare medians with: go test -run XXX -bench Copy -count 5 ./disk
func BenchmarkCopy(b *testing.B) {
	src := sparseBase(b)
	dir := b.TempDir()
	bench := func(name string, copyFn func(dst string)) {
		b.Run(name, func(b *testing.B) {
			for i := 0; b.Loop(); i++ {
				dst := filepath.Join(dir, fmt.Sprintf("%s-%d.qcow2", strings.ReplaceAll(name, "/", "_"), i))
				copyFn(dst)
				b.StopTimer()
				os.Remove(dst)
				b.StartTimer()
			}
		})
	}
	bench("disk.Copy", func(dst string) {
		if err := Copy(context.Background(), src, dst); err != nil {
			b.Fatal(err)
		}
	})
	if cp, err := exec.LookPath("cp"); err == nil {
		bench("cp--sparse=always", func(dst string) {
			run(b, cp, "--sparse=always", src, dst)
			fsyncPath(b, dst)
		})
	}
	if qi, err := exec.LookPath("qemu-img"); err == nil {
		bench("qemu-img-convert", func(dst string) {
			run(b, qi, "convert", "-O", "qcow2", src, dst)
			fsyncPath(b, dst)
		})
	}
}

// TestCopyImage: a VM disk's copy is byte for byte the image, an overlay
// staying an overlay of the same build (where Copy refuses it); nothing is
// left at the destination of a refused copy, and an existing destination
// is never replaced.
func TestCopyImage(t *testing.T) {
	dir := t.TempDir()
	build := filepath.Join(dir, "build.qcow2")
	if err := qcow2.Create(build, 1<<30); err != nil {
		t.Fatal(err)
	}
	overlay := filepath.Join(dir, "root.qcow2")
	if err := qcow2.CreateOverlay(overlay, build, 2<<30); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := Copy(ctx, overlay, filepath.Join(dir, "refused.qcow2")); err == nil {
		t.Fatal("Copy took an overlay as a base image")
	}
	dst := filepath.Join(dir, "copy.qcow2")
	if err := CopyImage(ctx, overlay, dst); err != nil {
		t.Fatal(err)
	}
	a, _ := os.ReadFile(overlay)
	b, _ := os.ReadFile(dst)
	if string(a) != string(b) {
		t.Error("the copy differs from the image")
	}
	if h, err := qcow2.ReadHeaderFile(dst); err != nil || h.BackingFile != build {
		t.Errorf("copy's header: %+v %v, want an overlay of %s", h, err, build)
	}
	if err := CopyImage(ctx, overlay, dst); !errors.Is(err, fs.ErrExist) {
		t.Errorf("copy over an existing file: %v, want fs.ErrExist", err)
	}
	corrupt := filepath.Join(dir, "corrupt.qcow2")
	data := append([]byte(nil), a...)
	data[79] |= 2 // incompatible_features: corrupt
	if err := os.WriteFile(corrupt, data, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := CopyImage(ctx, corrupt, filepath.Join(dir, "c2.qcow2")); err == nil || !strings.Contains(err.Error(), "corrupt") {
		t.Errorf("copy of a corrupt image: %v", err)
	}
	if _, err := os.Stat(filepath.Join(dir, "c2.qcow2")); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("a refused copy left %v", err)
	}
	if err := CopyImage(ctx, filepath.Join(dir, "missing"), filepath.Join(dir, "c3.qcow2")); err == nil {
		t.Error("copy of a missing image succeeded")
	}
}
