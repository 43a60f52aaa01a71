package seed

import (
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"syscall"
	"testing"
	"time"

	"vmhost/seed/fat"
)

// benchFiles are the reference's three validated documents, the same ones
// TestMatchesMkfsMcopy in seed/fat uses.
func benchFiles(b *testing.B) (Files, []string) {
	var f Files
	var paths []string
	for _, p := range []struct {
		name string
		dst  *[]byte
	}{{MetaDataName, &f.MetaData}, {UserDataName, &f.UserData}, {NetworkConfigName, &f.NetworkConfig}} {
		path := filepath.Join("testdata", "fat", p.name)
		data, err := os.ReadFile(path)
		if err != nil {
			b.Fatal(err)
		}
		*p.dst = data
		paths = append(paths, path)
	}
	return f, paths
}

// medians remembers each sub-benchmark's median so the reference pipeline
// can report how much slower it is than the writer on the same target.
var medians = map[string]time.Duration{}

// timed runs op b.N times, timing each call, and reports the median next to
// the mean that ns/op shows (the mean suffers from scheduling outliers on a
// busy machine). The reference pipeline also reports its median divided by
// the writer's on the same target, as x-writer-median.
func timed(b *testing.B, target, name string, op func() error) {
	b.Helper()
	var d []time.Duration
	for b.Loop() {
		start := time.Now()
		if err := op(); err != nil {
			b.Fatal(err)
		}
		d = append(d, time.Since(start))
	}
	slices.Sort(d)
	med := d[len(d)/2]
	medians[target+"/"+name] = med
	b.ReportMetric(float64(med.Nanoseconds()), "median-ns/op")
	if w, ok := medians[target+"/writer"]; ok && name != "writer" {
		b.ReportMetric(float64(med)/float64(w), "x-writer-median")
	}
}

// BenchmarkSeedImage builds a 1 MiB CIDATA image holding the same three
// files with this package and with the pipeline a user would otherwise run
// (mkfs.vfat + mcopy, exec'd directly), side by side, on the same target
// directory: "disk" is the test's temporary directory, "tmpfs" is /dev/shm
// (skipped where it is not tmpfs), which leaves out the file system costs
// both sides share. Both sides remove the old image and create a new one
// each time, without fsync; WriteFile-atomic-fsync is the production path
// (temporary file, fsync, rename, directory fsync). Run:
//
//	go test -run '^$' -bench SeedImage -benchtime 300x ./seed/
//
// The target is a writer median at least 10 times below the pipeline's.
// Building the image in memory takes about 20 µs; on a busy ext4 the
// writer's disk median is dominated by creating the file (a few hundred µs),
// a cost the pipeline pays as well.
func BenchmarkSeedImage(b *testing.B) {
	files, paths := benchFiles(b)
	for _, target := range []string{"disk", "tmpfs"} {
		b.Run(target, func(b *testing.B) {
			dir := b.TempDir()
			if target == "tmpfs" {
				var st syscall.Statfs_t
				if err := syscall.Statfs("/dev/shm", &st); err != nil || st.Type != tmpfsMagic {
					b.Skip("/dev/shm is not a tmpfs")
				}
				d, err := os.MkdirTemp("/dev/shm", "seedbench")
				if err != nil {
					b.Skip(err)
				}
				b.Cleanup(func() { os.RemoveAll(d) })
				dir = d
			}
			img := filepath.Join(dir, "seed.img")
			benchTarget(b, target, img, files, paths)
		})
	}
}

// tmpfsMagic is TMPFS_MAGIC from linux/magic.h.
const tmpfsMagic = 0x01021994

func benchTarget(b *testing.B, target, img string, files Files, paths []string) {
	removeOld := func() error {
		if err := os.Remove(img); err != nil && !os.IsNotExist(err) {
			return err
		}
		return nil
	}
	b.Run("writer", func(b *testing.B) {
		timed(b, target, "writer", func() error {
			if err := removeOld(); err != nil {
				return err
			}
			out, err := os.OpenFile(img, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
			if err != nil {
				return err
			}
			if _, err := fat.WriteSparse(out, files.fatFiles(), fat.Options{Label: Label}); err != nil {
				out.Close()
				return err
			}
			return out.Close()
		})
	})
	b.Run("mkfs.vfat+mcopy", func(b *testing.B) {
		mkfs, err1 := exec.LookPath("mkfs.vfat")
		mcopy, err2 := exec.LookPath("mcopy")
		if err1 != nil || err2 != nil {
			b.Skip("mkfs.vfat or mcopy not installed (apt-get install dosfstools mtools)")
		}
		env := append(os.Environ(), "MTOOLSRC=/dev/null")
		timed(b, target, "mkfs.vfat+mcopy", func() error {
			if err := removeOld(); err != nil { // mkfs.vfat -C refuses an existing file
				return err
			}
			if out, err := exec.Command(mkfs, "-n", "CIDATA", "-C", img, "1024").CombinedOutput(); err != nil {
				b.Fatalf("mkfs.vfat: %v\n%s", err, out)
			}
			cmd := exec.Command(mcopy, append(append([]string{"-i", img}, paths...), "::")...)
			cmd.Env = env
			if out, err := cmd.CombinedOutput(); err != nil {
				b.Fatalf("mcopy: %v\n%s", err, out)
			}
			return nil
		})
	})
	if target == "disk" {
		b.Run("WriteFile-atomic-fsync", func(b *testing.B) {
			timed(b, target, "WriteFile-atomic-fsync", func() error {
				_, err := WriteFile(img, files)
				return err
			})
		})
	}
}
