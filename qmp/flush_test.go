package qmp_test

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"vmhost/qcow2"
	"vmhost/qmp"
)

// TestQSDFlush proves with the real qemu-storage-daemon what Flush is for:
// a write QSD has completed (through an NBD export here, by a client with
// a writeback cache that sends no flush) sits in qcow2's metadata cache,
// so a copy of the image file taken now misses it; after Flush the file
// has it, while the client stays connected and nothing else changed.
// Against the simulator, Flush is accepted and changes nothing.
func TestQSDFlush(t *testing.T) {
	for _, b := range backends(t) {
		t.Run(b.name, func(t *testing.T) {
			dir := socketDir(t)
			cfg := config(b, dir)
			for _, p := range []string{cfg.Root.Path, cfg.Data[0].Path} {
				if err := qcow2.Create(p, 64<<20); err != nil {
					t.Fatal(err)
				}
			}
			real := b.name != "qsdsim"
			if real {
				for _, tool := range []string{"qemu-io", "qemu-img"} {
					if _, err := exec.LookPath(tool); err != nil {
						t.Skipf("%s not installed (qemu-utils)", tool)
					}
				}
				// Cluster 0 written first: the L2 table then exists, and
				// the writes below only update it (in QSD's cache).
				qemuIO(t, cfg.Root.Path, "write -P 1 0 64k")
			}
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			q, err := qmp.LaunchQSD(ctx, cfg)
			if err != nil {
				t.Fatal(err)
			}
			defer q.Quit(context.Background())
			if !real {
				if err := q.Flush(ctx); err != nil {
					t.Fatalf("Flush: %v", err)
				}
				return
			}
			nbd := filepath.Join(dir, "nbd.sock")
			c, err := q.Client(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if err := c.Execute(ctx, "nbd-server-start", map[string]any{"addr": map[string]any{"type": "unix", "data": map[string]any{"path": nbd}}}, nil); err != nil {
				t.Fatal(err)
			}
			if err := c.Execute(ctx, "block-export-add", map[string]any{"type": "nbd", "id": "n", "node-name": qmp.RootNode, "name": "n", "writable": true}, nil); err != nil {
				t.Fatal(err)
			}
			// The client writes, then sleeps with its connection open (a
			// flush at its exit would prove nothing).
			client := exec.Command("qemu-io", "-t", "writeback", "-f", "raw", "-c", "write -P 0xab 1M 64k",
				"-c", "write -P 0xcd 3M 64k", "-c", "sleep 30000", "nbd+unix:///n?socket="+nbd)
			if err := client.Start(); err != nil {
				t.Fatal(err)
			}
			defer func() { client.Process.Kill(); client.Wait() }()
			// The data clusters reach the file as the writes complete;
			// only their L2 entries wait in QSD's cache.
			deadline := time.Now().Add(20 * time.Second)
			for {
				data, err := os.ReadFile(cfg.Root.Path)
				if err != nil {
					t.Fatal(err)
				}
				if bytes.Contains(data, bytes.Repeat([]byte{0xab}, 64<<10)) && bytes.Contains(data, bytes.Repeat([]byte{0xcd}, 64<<10)) {
					break
				}
				if time.Now().After(deadline) {
					t.Fatal("the client's writes never reached the image file")
				}
				time.Sleep(20 * time.Millisecond)
			}
			want := []uint64{0, 1 << 20, 3 << 20}
			if got := mapped(t, cfg.Root.Path); slices.Equal(got, want) {
				t.Fatalf("the image file maps %v before any flush: the test shows nothing", got)
			}
			if err := q.Flush(ctx); err != nil {
				t.Fatalf("Flush: %v", err)
			}
			if got := mapped(t, cfg.Root.Path); !slices.Equal(got, want) {
				t.Errorf("after Flush the image file maps data at %v, want %v", got, want)
			}
			exports, err := c.QueryBlockExports(ctx)
			if err != nil || len(exports) != 3 {
				t.Errorf("exports after Flush: %+v %v", exports, err)
			}
		})
	}
}

func qemuIO(t *testing.T, image, cmd string) {
	t.Helper()
	if out, err := exec.Command("qemu-io", "-f", "qcow2", "-c", cmd, image).CombinedOutput(); err != nil {
		t.Fatalf("qemu-io %s: %v\n%s", cmd, err, out)
	}
}

// mapped lists the guest offsets of the image file's data extents, as
// qemu-img reads the file (sharing it with the running QSD).
func mapped(t *testing.T, image string) []uint64 {
	t.Helper()
	out, err := exec.Command("qemu-img", "map", "-U", "--output=json", image).Output()
	if err != nil {
		t.Fatalf("qemu-img map: %v", err)
	}
	var ext []struct {
		Start uint64 `json:"start"`
		Data  bool   `json:"data"`
	}
	if err := json.Unmarshal(out, &ext); err != nil {
		t.Fatal(err)
	}
	var got []uint64
	for _, e := range ext {
		if e.Data {
			got = append(got, e.Start)
		}
	}
	return got
}
