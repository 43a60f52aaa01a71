package ociimage

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
)

// benchImage is a ~200 MiB image: 3 gzip layers of a few hundred files,
// half random bytes and half compressible text.
type benchImage struct {
	layout    string   // OCI layout directory
	layers    []string // the layer blobs, for tar -xzf
	plainSize int64    // uncompressed file bytes
}

func makeBenchImage(b *testing.B) *benchImage {
	b.Helper()
	dir := b.TempDir()
	rng := rand.New(rand.NewPCG(1, 2))
	words := []string{"alpha", "beta", "gamma", "delta", "vmhost", "layer", "image", "ext4", "\n"}
	const (
		layers        = 3
		filesPerLayer = 100
		totalBytes    = 200 << 20
		fileSize      = totalBytes / (layers * filesPerLayer)
	)
	bi := &benchImage{}
	var plain [][]byte
	var blobs [][]byte
	for l := range layers {
		var raw bytes.Buffer
		tw := tar.NewWriter(&raw)
		dirName := fmt.Sprintf("layer%d/", l)
		tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: dirName, Mode: 0o755, ModTime: testTime})
		for f := range filesPerLayer {
			data := make([]byte, fileSize)
			if f%2 == 0 {
				for i := 0; i < len(data); i += 8 {
					v := rng.Uint64()
					for j := 0; j < 8 && i+j < len(data); j++ {
						data[i+j] = byte(v >> (8 * j))
					}
				}
			} else {
				var text bytes.Buffer
				for text.Len() < len(data) {
					text.WriteString(words[rng.IntN(len(words))])
					text.WriteByte(' ')
				}
				copy(data, text.Bytes())
			}
			hdr := &tar.Header{Typeflag: tar.TypeReg, Name: fmt.Sprintf("%sf%03d", dirName, f), Mode: 0o644, Uid: 1000, Gid: 1000, Size: int64(len(data)), ModTime: testTime}
			if err := tw.WriteHeader(hdr); err != nil {
				b.Fatal(err)
			}
			tw.Write(data)
			bi.plainSize += int64(len(data))
		}
		if err := tw.Close(); err != nil {
			b.Fatal(err)
		}
		var gz bytes.Buffer
		zw, _ := gzip.NewWriterLevel(&gz, gzip.BestSpeed)
		zw.Write(raw.Bytes())
		zw.Close()
		plain = append(plain, raw.Bytes())
		blobs = append(blobs, gz.Bytes())
		p := filepath.Join(dir, fmt.Sprintf("layer%d.tar.gz", l))
		if err := os.WriteFile(p, gz.Bytes(), 0o644); err != nil {
			b.Fatal(err)
		}
		bi.layers = append(bi.layers, p)
	}
	l := &ociLayout{layers: blobs, plain: plain, config: testConfig(b, plain), ref: "bench"}
	files, _ := l.files(b)
	bi.layout = filepath.Join(dir, "layout")
	writeDir(b, bi.layout, files)
	return bi
}

// BenchmarkImport200MiB imports a ~200 MiB, 3-layer gzip image, next to
// what an operator would do by hand: tar -xzf each layer, then
// mkfs.ext4 -d (that path neither verifies digests, nor handles
// whiteouts, nor writes qcow2).
func BenchmarkImport200MiB(b *testing.B) {
	requireTools(b)
	bi := makeBenchImage(b)
	work := b.TempDir()
	ctx := context.Background()

	b.Run("ociimage.Import", func(b *testing.B) {
		b.SetBytes(bi.plainSize)
		for i := 0; b.Loop(); i++ {
			dst := filepath.Join(work, "import"+strconv.Itoa(i))
			if _, err := Import(ctx, bi.layout, dst, asTestUser(Options{})); err != nil {
				b.Fatal(err)
			}
			b.StopTimer()
			os.RemoveAll(dst)
			b.StartTimer()
		}
	})

	b.Run("tar-x+mkfs.ext4", func(b *testing.B) {
		if _, err := exec.LookPath("tar"); err != nil {
			b.Skip("tar not installed")
		}
		b.SetBytes(bi.plainSize)
		// The same size Import would choose, decided by hand.
		size, _ := ext4Geometry(treeUsage{bytes: bi.plainSize, entries: 400})
		for i := 0; b.Loop(); i++ {
			root := filepath.Join(work, "tar"+strconv.Itoa(i))
			img := root + ".ext4"
			if err := os.Mkdir(root, 0o755); err != nil {
				b.Fatal(err)
			}
			for _, l := range bi.layers {
				if out, err := exec.Command("tar", "-xzf", l, "-C", root).CombinedOutput(); err != nil {
					b.Fatalf("tar -x: %v: %s", err, out)
				}
			}
			if out, err := exec.Command("mkfs.ext4", "-q", "-F", "-d", root, img, strconv.FormatInt(size>>10, 10)+"k").CombinedOutput(); err != nil {
				b.Fatalf("mkfs.ext4: %v: %s", err, out)
			}
			b.StopTimer()
			os.RemoveAll(root)
			os.Remove(img)
			b.StartTimer()
		}
	})
}
