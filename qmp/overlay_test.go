package qmp_test

import (
	"bytes"
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"vmhost/disk"
	"vmhost/proc"
	"vmhost/qcow2"
	"vmhost/qmp"
)

// sealedBuild makes a 64 MiB build at dir/build.qcow2, with data written
// by qemu-io when it is installed (0xab in the first MiB, 0xcd in the
// last), and seals it as an import does (0444, immutable where possible).
func sealedBuild(t *testing.T, dir string) (path string, immutable bool) {
	t.Helper()
	path = filepath.Join(dir, "build.qcow2")
	if err := qcow2.Create(path, 64<<20); err != nil {
		t.Fatal(err)
	}
	if _, err := exec.LookPath("qemu-io"); err == nil {
		if out, err := exec.Command("qemu-io", "-f", "qcow2", "-c", "write -q -P 0xab 0 1M", "-c", "write -q -P 0xcd 63M 1M", path).CombinedOutput(); err != nil || len(out) > 0 {
			t.Fatalf("qemu-io: %v %s", err, out)
		}
	}
	s, err := disk.SealBuild(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { disk.UnsealBuild(path) })
	return path, s.Immutable
}

func nodeMap(t *testing.T, ctx context.Context, c *qmp.Client) map[string]qmp.BlockNode {
	t.Helper()
	nodes, err := c.QueryNamedBlockNodes(ctx)
	if err != nil {
		t.Fatal(err)
	}
	m := map[string]qmp.BlockNode{}
	for _, n := range nodes {
		m[n.NodeName] = n
	}
	return m
}

// TestQSDOverlayChain launches QSD on a root disk that is an overlay of a
// sealed build, on both backends: the chain is root (throttle) →
// root-qcow2 → root-base (read-only, the build) with no node QSD opened on
// its own, the grow goes through the chain, the throttle group is the
// root's, and the build node cannot be removed under the overlay. With the
// real QSD, the build's data reads through the throttle node, the guest's
// writes land in the overlay, and the build is unchanged.
func TestQSDOverlayChain(t *testing.T) {
	for _, b := range backends(t) {
		t.Run(b.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			dir := socketDir(t)
			build, immutable := sealedBuild(t, dir)
			before, err := os.ReadFile(build)
			if err != nil {
				t.Fatal(err)
			}
			cfg := config(b, dir)
			cfg.Data = nil
			if err := qcow2.CreateOverlay(cfg.Root.Path, build, 1<<30); err != nil {
				t.Fatal(err)
			}
			cfg.Root.Backing = build
			cfg.Root.Size = 2 << 30
			cfg.Root.Limits = qmp.ThrottleLimits{IopsTotal: 500}
			q, err := qmp.LaunchQSD(ctx, cfg)
			if err != nil {
				t.Fatalf("%v\nlog:\n%s", err, proc.LogTail(cfg.LogFile, 20))
			}
			defer func() {
				select {
				case <-q.Done():
				default:
					syscallKill(q.Pid)
				}
			}()
			c, err := q.Client(ctx)
			if err != nil {
				t.Fatal(err)
			}
			nodes := nodeMap(t, ctx, c)
			for name, want := range map[string]struct {
				drv  string
				ro   bool
				file string
			}{
				"root":           {"throttle", false, ""},
				"root-qcow2":     {"qcow2", false, cfg.Root.Path},
				"root-file":      {"file", false, cfg.Root.Path},
				"root-base":      {"qcow2", true, build},
				"root-base-file": {"file", true, build},
			} {
				n, ok := nodes[name]
				if !ok || n.Drv != want.drv || n.RO != want.ro || want.file != "" && n.File != want.file {
					t.Errorf("node %s = %+v, want %s, read-only %v, file %s", name, n, want.drv, want.ro, want.file)
				}
			}
			if len(nodes) != 5 {
				t.Errorf("nodes = %v, want exactly the five of the chain (none opened by QSD on its own)", keys(nodes))
			}
			if n := nodes["root-qcow2"]; n.BackingFile != build || n.Image.BackingFilename != build || n.Image.BackingFilenameFormat != "qcow2" {
				t.Errorf("root-qcow2 backing = %q (header %q, %q), want %s (qcow2)", n.BackingFile, n.Image.BackingFilename, n.Image.BackingFilenameFormat, build)
			}
			if nodes["root"].Image.VirtualSize != 2<<30 || nodes["root-base"].Image.VirtualSize != 64<<20 {
				t.Errorf("sizes: root %d, root-base %d; want 2 GiB over 64 MiB", nodes["root"].Image.VirtualSize, nodes["root-base"].Image.VirtualSize)
			}
			if p := vhostProbe(t, cfg.Root.Socket); p.capacity != (2<<30)/512 || p.features&(1<<5) != 0 {
				t.Errorf("root export probe = %+v, want 2 GiB, writable", p)
			}
			if l, err := q.RootLimits(ctx); err != nil || l != (qmp.ThrottleLimits{IopsTotal: 500}) {
				t.Errorf("root limits = %+v (%v), want iops 500", l, err)
			}
			// A second VM's daemon on another overlay of the same build:
			// read-only opens share the build (QEMU's locks allow it).
			cfg2 := config(b, socketDir(t))
			cfg2.Data = nil
			if err := qcow2.CreateOverlay(cfg2.Root.Path, build, 1<<30); err != nil {
				t.Fatal(err)
			}
			cfg2.Root.Backing = build
			q2, err := qmp.LaunchQSD(ctx, cfg2)
			if err != nil {
				t.Fatalf("a second QSD on the same build: %v\nlog:\n%s", err, proc.LogTail(cfg2.LogFile, 20))
			}
			if err := q2.Quit(ctx); err != nil {
				t.Error(err)
			}
			wantQMPError(t, c.BlockdevDel(ctx, qmp.RootBaseNode), "GenericError", "Node 'root-base' is busy: node is used as backing hd of 'root-qcow2'")
			if immutable {
				// The build opens only read-only: QSD's plain file node
				// (read-write) is refused.
				wantQMPError(t, c.BlockdevAdd(ctx, qmp.FileNode("w", build)), "GenericError", "Could not open '"+build+"': Operation not permitted")
			}
			if b.name == "qemu" {
				readThroughNBD(t, ctx, c, dir)
			}
			if err := q.Quit(ctx); err != nil {
				t.Fatal(err)
			}
			qemuImgCheck(t, cfg.Root.Path)
			if got := qemuImgSize(t, cfg.Root.Path); got != 2<<30 {
				t.Errorf("overlay size after quit = %d, want 2 GiB", got)
			}
			if h, err := qcow2.ReadHeaderFile(cfg.Root.Path); err != nil || h.CheckOverlay(build) != nil {
				t.Errorf("overlay after QSD: %v / %v", err, h.CheckOverlay(build))
			}
			if b.name == "qemu" {
				// What the guest wrote is in the overlay only.
				out, err := exec.Command("qemu-io", "-f", "qcow2", "-c", "read -q -P 0x11 1M 64K", "-c", "read -q -P 0x22 1536M 64K", "-c", "read -q -P 0xab 0 1M", cfg.Root.Path).CombinedOutput()
				if err != nil || len(out) > 0 {
					t.Errorf("reading the overlay back: %v %s", err, out)
				}
			}
			after, err := os.ReadFile(build)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(before, after) {
				t.Error("the build changed")
			}
		})
	}
}

func keys(m map[string]qmp.BlockNode) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	return out
}

// readThroughNBD exports the root's throttle node over NBD (a second
// export beside the vhost-user one) and has qemu-io read the build's
// patterns and zeros through it, and write two patterns.
func readThroughNBD(t *testing.T, ctx context.Context, c *qmp.Client, dir string) {
	t.Helper()
	if _, err := exec.LookPath("qemu-io"); err != nil {
		t.Log("qemu-io not installed: the data path is not checked")
		return
	}
	sock := filepath.Join(dir, "nbd.sock")
	if err := c.Execute(ctx, "nbd-server-start", map[string]any{"addr": map[string]any{"type": "unix", "data": map[string]any{"path": sock}}}, nil); err != nil {
		t.Fatal(err)
	}
	if err := c.Execute(ctx, "block-export-add", map[string]any{"type": "nbd", "id": "nbd", "node-name": qmp.RootNode, "writable": true}, nil); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command("qemu-io", "-f", "raw",
		"-c", "read -q -P 0xab 0 1M", "-c", "read -q -P 0 1M 62M", "-c", "read -q -P 0xcd 63M 1M", "-c", "read -q -P 0 64M 1M", "-c", "read -q -P 0 2047M 1M",
		"-c", "write -q -P 0x11 1M 64K", "-c", "write -q -P 0x22 1536M 64K", "-c", "read -q -P 0x11 1M 64K",
		"nbd+unix:///"+qmp.RootNode+"?socket="+sock).CombinedOutput()
	if err != nil || len(bytes.TrimSpace(out)) > 0 {
		t.Errorf("qemu-io through QSD: %v\n%s", err, out)
	}
	if err := c.BlockExportDel(ctx, "nbd"); err != nil {
		t.Fatal(err)
	}
	if err := c.Execute(ctx, "nbd-server-stop", nil, nil); err != nil {
		t.Fatal(err)
	}
}

// TestQSDOverlayRefusals: LaunchQSD refuses, before spawning anything, a
// root disk whose header disagrees with Root.Backing (an overlay given no
// backing would show the guest zeros; one given another build, another
// image's data), and a relative Backing; a missing build fails in QSD's
// words on both backends.
func TestQSDOverlayRefusals(t *testing.T) {
	for _, b := range backends(t) {
		t.Run(b.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			dir := socketDir(t)
			build := filepath.Join(dir, "build.qcow2")
			other := filepath.Join(dir, "other.qcow2")
			alone := filepath.Join(dir, "alone.qcow2")
			for _, p := range []string{build, other, alone} {
				if err := qcow2.Create(p, 64<<20); err != nil {
					t.Fatal(err)
				}
			}
			overlay := filepath.Join(dir, "root.qcow2")
			if err := qcow2.CreateOverlay(overlay, build, 1<<30); err != nil {
				t.Fatal(err)
			}
			for _, tc := range []struct {
				name, path, backing, want string
			}{
				{"overlay without backing", overlay, "", "is an overlay of " + build + ", but no backing file was given"},
				{"overlay of another build", overlay, other, "is an overlay of " + build + ", not of " + other},
				{"standalone with backing", alone, build, "has no backing file, but " + build + " was given"},
				{"relative backing", overlay, "build.qcow2", "not a clean absolute path"},
			} {
				t.Run(tc.name, func(t *testing.T) {
					cfg := config(b, dir)
					cfg.Data = nil
					cfg.Root.Path, cfg.Root.Backing = tc.path, tc.backing
					_, err := qmp.LaunchQSD(ctx, cfg)
					if err == nil || !strings.Contains(err.Error(), tc.want) {
						t.Fatalf("LaunchQSD = %v, want %q", err, tc.want)
					}
					if _, err := os.Stat(cfg.QMPSocket); !errors.Is(err, os.ErrNotExist) {
						t.Error("a QSD was started")
					}
				})
			}
			// The build gone: QSD's own message, from the build's file node.
			if err := os.Rename(build, build+".gone"); err != nil {
				t.Fatal(err)
			}
			cfg := config(b, dir)
			cfg.Data = nil
			cfg.Root.Path, cfg.Root.Backing = overlay, build
			_, err := qmp.LaunchQSD(ctx, cfg)
			var early *proc.EarlyExitError
			want := "Could not open '" + build + "': No such file or directory"
			if !errors.As(err, &early) || !strings.Contains(early.LogTail, want) {
				t.Errorf("LaunchQSD with the build gone = %v, want QSD's %q", err, want)
			}
		})
	}
}

// TestQSDImplicitBacking: a qcow2 node opened without a "backing" key
// follows its header's backing file as QSD 7.2 does, on both backends:
// extra read-only nodes, busy while used, not the monitor's to delete,
// gone with the node; and a missing backing file, a missing one further
// down the chain or a missing backing node fail with QSD's text.
func TestQSDImplicitBacking(t *testing.T) {
	for _, b := range backends(t) {
		t.Run(b.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			dir := socketDir(t)
			build := filepath.Join(dir, "build.qcow2")
			if err := qcow2.Create(build, 64<<20); err != nil {
				t.Fatal(err)
			}
			overlay := filepath.Join(dir, "root.qcow2")
			if err := qcow2.CreateOverlay(overlay, build, 1<<30); err != nil {
				t.Fatal(err)
			}
			cfg := config(b, dir)
			cfg.Data = nil
			cfg.Root.Path = filepath.Join(dir, "alone.qcow2")
			if err := qcow2.Create(cfg.Root.Path, 1<<30); err != nil {
				t.Fatal(err)
			}
			q, err := qmp.LaunchQSD(ctx, cfg)
			if err != nil {
				t.Fatalf("%v\nlog:\n%s", err, proc.LogTail(cfg.LogFile, 20))
			}
			defer q.Quit(ctx)
			c, err := q.Client(ctx)
			if err != nil {
				t.Fatal(err)
			}
			base := len(nodeMap(t, ctx, c))
			if err := c.BlockdevAdd(ctx, qmp.FileNode("f", overlay)); err != nil {
				t.Fatal(err)
			}
			if err := c.BlockdevAdd(ctx, map[string]any{"driver": "qcow2", "node-name": "q", "file": "f"}); err != nil {
				t.Fatal(err)
			}
			nodes, err := c.QueryNamedBlockNodes(ctx)
			if err != nil {
				t.Fatal(err)
			}
			// Newest first: the build's qcow2 node, its file node, then q.
			if len(nodes) != base+4 || nodes[2].NodeName != "q" {
				t.Fatalf("nodes = %+v, want the build's two nodes before q", nodes)
			}
			impQ, impF := nodes[0], nodes[1]
			if !strings.HasPrefix(impQ.NodeName, "#block") || impQ.Drv != "qcow2" || !impQ.RO || impQ.File != build ||
				!strings.HasPrefix(impF.NodeName, "#block") || impF.Drv != "file" || !impF.RO || impF.File != build {
				t.Errorf("implicit nodes = %+v / %+v, want read-only #block qcow2 and file nodes on %s", impQ, impF, build)
			}
			if nodes[2].BackingFile != build {
				t.Errorf("q backing_file = %q, want %s", nodes[2].BackingFile, build)
			}
			wantQMPError(t, c.BlockdevDel(ctx, impQ.NodeName), "GenericError", "Node '"+impQ.NodeName+"' is busy: node is used as backing hd of 'q'")
			wantQMPError(t, c.BlockdevDel(ctx, impF.NodeName), "GenericError", "Node "+impF.NodeName+" is not owned by the monitor")
			wantQMPError(t, c.BlockdevDel(ctx, "f"), "GenericError", "Block device f is in use")
			if err := c.BlockdevDel(ctx, "q"); err != nil {
				t.Fatal(err)
			}
			if n := len(nodeMap(t, ctx, c)); n != base+1 {
				t.Errorf("%d nodes after deleting q, want %d (the build's went with it)", n, base+1)
			}
			// "backing": null opens the overlay alone.
			if err := c.BlockdevAdd(ctx, qmp.Qcow2Node("q", "f")); err != nil {
				t.Fatal(err)
			}
			if n := nodeMap(t, ctx, c)["q"]; n.BackingFile != "" || n.Image.BackingFilename != build {
				t.Errorf("q with backing null: backing_file %q, header's %q; want none attached, %s named", n.BackingFile, n.Image.BackingFilename, build)
			}
			if err := c.BlockdevDel(ctx, "q"); err != nil {
				t.Fatal(err)
			}
			// A writable qcow2 node over a read-only file node.
			if err := c.BlockdevAdd(ctx, qmp.ReadOnly(qmp.FileNode("bro", build))); err != nil {
				t.Fatal(err)
			}
			wantQMPError(t, c.BlockdevAdd(ctx, qmp.Qcow2Node("bq", "bro")), "GenericError", "Block node is read-only")

			wantQMPError(t, c.BlockdevAdd(ctx, qmp.Qcow2OverlayNode("q", "f", "nope")), "GenericError",
				"Could not open backing file: Cannot find device='nope' nor node-name='nope'")
			if err := os.Rename(build, build+".gone"); err != nil {
				t.Fatal(err)
			}
			wantQMPError(t, c.BlockdevAdd(ctx, map[string]any{"driver": "qcow2", "node-name": "q", "file": "f"}), "GenericError",
				"Could not open backing file: Could not open '"+build+"': No such file or directory")
			if n := len(nodeMap(t, ctx, c)); n != base+2 {
				t.Errorf("%d nodes after failed adds, want %d", n, base+2)
			}
		})
	}
}
