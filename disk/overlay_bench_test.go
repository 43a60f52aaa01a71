package disk

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"vmhost/internal/atomicfile"
	"vmhost/qcow2"
)

// makeDenseBuild writes a build of size bytes of random data at path, every
// cluster allocated (as a freshly imported root file system is, near
// enough): a raw file converted with qcow2.ConvertRaw.
func makeDenseBuild(tb testing.TB, path string, size int64) {
	tb.Helper()
	raw, err := os.CreateTemp(filepath.Dir(path), "raw-*")
	if err != nil {
		tb.Fatal(err)
	}
	defer os.Remove(raw.Name())
	defer raw.Close()
	r := rand.New(rand.NewChaCha8([32]byte{1}))
	buf := make([]byte, 4<<20)
	for off := int64(0); off < size; off += int64(len(buf)) {
		for i := 0; i < len(buf); i += 8 {
			v := r.Uint64()
			for j := range 8 {
				buf[i+j] = byte(v >> (8 * j))
			}
		}
		if _, err := raw.WriteAt(buf[:min(int64(len(buf)), size-off)], off); err != nil {
			tb.Fatal(err)
		}
	}
	if err := qcow2.ConvertRaw(path, raw); err != nil {
		tb.Fatal(err)
	}
}

// BenchmarkRootDisk times the three ways to give a VM its root disk from a
// build, for builds of 10 MiB, 200 MiB and 1 GiB of data: `qemu-img create
// -f qcow2 -b BUILD -F qcow2` (then fsync of the file and its directory, as
// the other two do), qcow2.CreateOverlay, and Copy. Each iteration is one
// round of all three, in an order that rotates from round to round; the
// medians of each are reported (ms/<method>), the default ns/op is the
// round. Disk use is reported by BenchmarkOverlayDiskUse.
//
//	go test -run '^$' -bench '^BenchmarkRootDisk$' -benchtime 9x ./disk
//
// bench/appvm-overlay.sh runs it and prints a table.
func BenchmarkRootDisk(b *testing.B) {
	qemuImg, err := exec.LookPath("qemu-img")
	if err != nil {
		b.Skip("qemu-img not installed (apt-get install qemu-utils)")
	}
	dir := b.TempDir()
	for _, sz := range []struct {
		name string
		size int64
	}{{"10MiB", 10 << 20}, {"200MiB", 200 << 20}, {"1GiB", 1 << 30}} {
		build := filepath.Join(dir, "rootfs-"+sz.name+".qcow2")
		makeDenseBuild(b, build, sz.size)
		// The size an AppVM's disk_gib asks for: 4 GiB.
		const virtual = 4 << 30
		methods := []struct {
			name string
			make func(dst string) error
		}{
			{"qemu-img-create-b", func(dst string) error {
				if out, err := exec.Command(qemuImg, "create", "-q", "-f", "qcow2", "-b", build, "-F", "qcow2", dst, fmt.Sprint(virtual)).CombinedOutput(); err != nil {
					return fmt.Errorf("%v: %s", err, out)
				}
				return syncFileAndDir(dst)
			}},
			{"CreateOverlay", func(dst string) error { return qcow2.CreateOverlay(dst, build, virtual) }},
			{"Copy", func(dst string) error { return Copy(context.Background(), build, dst) }},
		}
		b.Run(sz.name, func(b *testing.B) {
			times := make([][]time.Duration, len(methods))
			for round := 0; b.Loop(); round++ {
				for k := range methods {
					i := (round + k) % len(methods)
					dst := filepath.Join(dir, fmt.Sprintf("root-%s-%d.qcow2", methods[i].name, round))
					start := time.Now()
					if err := methods[i].make(dst); err != nil {
						b.Fatal(err)
					}
					times[i] = append(times[i], time.Since(start))
					b.StopTimer()
					os.Remove(dst)
					b.StartTimer()
				}
			}
			for i, m := range methods {
				b.ReportMetric(median(times[i]).Seconds()*1000, "ms/"+m.name)
			}
		})
		os.Remove(build)
	}
}

// syncFileAndDir fsyncs path and its directory, what Copy and
// CreateOverlay pay for and qemu-img does not do.
func syncFileAndDir(path string) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	if err := f.Sync(); err != nil {
		return err
	}
	return atomicfile.SyncDir(filepath.Dir(path))
}

func median(ds []time.Duration) time.Duration {
	s := slices.Clone(ds)
	slices.Sort(s)
	if len(s) == 0 {
		return 0
	}
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// BenchmarkOverlayDiskUse makes 100 overlays of one 1 GiB build (4 GiB
// virtual each) and reports the blocks they allocate (st_blocks), beside
// the build's and one Copy's; 100 copies would allocate 100 times the
// latter, which is computed, not made.
//
//	go test -run '^$' -bench '^BenchmarkOverlayDiskUse$' -benchtime 1x ./disk
func BenchmarkOverlayDiskUse(b *testing.B) {
	dir := b.TempDir()
	build := filepath.Join(dir, "rootfs.qcow2")
	makeDenseBuild(b, build, 1<<30)
	for round := 0; b.Loop(); round++ {
		var overlays int64
		for i := range 100 {
			p := filepath.Join(dir, fmt.Sprintf("root-%d-%d.qcow2", round, i))
			if err := qcow2.CreateOverlay(p, build, 4<<30); err != nil {
				b.Fatal(err)
			}
			overlays += allocatedBytes(b, p)
		}
		cp := filepath.Join(dir, fmt.Sprintf("copy-%d.qcow2", round))
		if err := Copy(context.Background(), build, cp); err != nil {
			b.Fatal(err)
		}
		b.ReportMetric(float64(allocatedBytes(b, build)), "build-bytes")
		b.ReportMetric(float64(overlays), "100-overlays-bytes")
		b.ReportMetric(float64(100*allocatedBytes(b, cp)), "100-copies-bytes(computed)")
		b.StopTimer()
		ents, _ := os.ReadDir(dir)
		for _, e := range ents {
			if e.Name() != filepath.Base(build) {
				os.Remove(filepath.Join(dir, e.Name()))
			}
		}
		b.StartTimer()
	}
}
