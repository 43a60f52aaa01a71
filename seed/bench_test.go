package seed

import (
	"os"
	"os/exec"
	"path/filepath"
	"slices"
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
// can report how much slower it is than the writer.
var medians = map[string]time.Duration{}

// timed runs op b.N times, timing each call, and reports the median next to
// the mean that ns/op shows.
func timed(b *testing.B, name string, op func() error) {
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
	medians[name] = med
	b.ReportMetric(float64(med.Nanoseconds()), "median-ns/op")
	if w, ok := medians["writer"]; ok && name != "writer" {
		b.ReportMetric(float64(med)/float64(w), "x-writer-median")
	}
}

// BenchmarkSeedImage builds a 1 MiB CIDATA image holding the same three
// files with this package and with the pipeline a user would otherwise run
// (mkfs.vfat + mcopy, exec'd directly), side by side. Run:
//
//	go test -run '^$' -bench SeedImage -benchtime 200x ./seed/
//
// The target is a writer median at least 10 times below the pipeline's.
func BenchmarkSeedImage(b *testing.B) {
	files, paths := benchFiles(b)
	dir := b.TempDir()
	img := filepath.Join(dir, "seed.img")

	// writer does what the reference pipeline does: create the file and
	// fill it, sparse (mkfs.vfat -C also leaves the unused area a hole),
	// without fsync.
	b.Run("writer", func(b *testing.B) {
		timed(b, "writer", func() error {
			out, err := os.Create(img)
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
	// writer-stream writes all 1 MiB through Write.
	b.Run("writer-stream", func(b *testing.B) {
		timed(b, "writer-stream", func() error {
			out, err := os.Create(img)
			if err != nil {
				return err
			}
			if _, err := Write(out, files); err != nil {
				out.Close()
				return err
			}
			return out.Close()
		})
	})
	// WriteFile is the production path: temp file, fsync, rename, fsync of
	// the directory. The fsyncs dominate; the reference pipeline has none.
	b.Run("WriteFile-atomic-fsync", func(b *testing.B) {
		timed(b, "WriteFile-atomic-fsync", func() error {
			_, err := WriteFile(img, files)
			return err
		})
	})
	b.Run("mkfs.vfat+mcopy", func(b *testing.B) {
		mkfs, err1 := exec.LookPath("mkfs.vfat")
		mcopy, err2 := exec.LookPath("mcopy")
		if err1 != nil || err2 != nil {
			b.Skip("mkfs.vfat or mcopy not installed (apt-get install dosfstools mtools)")
		}
		env := append(os.Environ(), "MTOOLSRC=/dev/null")
		timed(b, "mkfs.vfat+mcopy", func() error {
			// mkfs.vfat -C refuses an existing file.
			if err := os.Remove(img); err != nil && !os.IsNotExist(err) {
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
}
