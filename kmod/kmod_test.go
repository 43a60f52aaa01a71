package kmod

import (
	"bytes"
	"compress/gzip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"vmhost/kmod/kmodtest"
)

const testRelease = "6.1.0-99-test"

// mod is one module file of a test tree.
type mod struct {
	path    string // relative to lib/modules/<release>
	depends string
	release string // vermagic release; testRelease when empty
}

func (m mod) data() []byte {
	rel := m.release
	if rel == "" {
		rel = testRelease
	}
	return kmodtest.Module("license=GPL", "depends="+m.depends, "name="+Name(m.path), "vermagic="+rel+" SMP preempt mod_unload modversions ")
}

// tree writes a module tree under a temp root as a kernel package would
// (root/lib/modules/<release>) and returns the root and the module dir.
func tree(t *testing.T, mods []mod, files map[string]string) (root, dir string) {
	t.Helper()
	root = t.TempDir()
	dir = filepath.Join(root, "lib", "modules", testRelease)
	write := func(rel string, data []byte) {
		p := filepath.Join(dir, rel)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	var order []string
	for _, m := range mods {
		write(m.path, m.data())
		order = append(order, m.path)
	}
	write("modules.order", []byte(strings.Join(order, "\n")+"\n"))
	for name, content := range files {
		write(name, []byte(content))
	}
	return root, dir
}

func names(mods []Module) string {
	var n []string
	for _, m := range mods {
		n = append(n, m.Name)
	}
	return strings.Join(n, " ")
}

// virtioTree mirrors the shape of Debian 6.1's virtio and vsock modules.
var virtioTree = []mod{
	{path: "kernel/drivers/virtio/virtio_ring.ko"},
	{path: "kernel/drivers/virtio/virtio.ko", depends: "virtio_ring"},
	{path: "kernel/drivers/virtio/virtio_pci_modern_dev.ko"},
	{path: "kernel/drivers/virtio/virtio_pci_legacy_dev.ko"},
	{path: "kernel/drivers/virtio/virtio_pci.ko", depends: "virtio_ring,virtio_pci_modern_dev,virtio_pci_legacy_dev,virtio"},
	{path: "kernel/drivers/block/virtio_blk.ko", depends: "virtio,virtio_ring"},
	{path: "kernel/net/vmw_vsock/vsock.ko"},
	{path: "kernel/net/vmw_vsock/vmw_vsock_virtio_transport_common.ko", depends: "vsock"},
	{path: "kernel/net/vmw_vsock/vmw_vsock_virtio_transport.ko", depends: "virtio,vmw_vsock_virtio_transport_common,virtio_ring,vsock"},
	{path: "kernel/arch/x86/crypto/crc32c-intel.ko"},
}

func TestResolveFromModinfoInDependencyOrder(t *testing.T) {
	root, dir := tree(t, virtioTree, map[string]string{"modules.builtin": "kernel/fs/ext4/ext4.ko\n"})
	tr, err := Open(root)
	if err != nil {
		t.Fatal(err)
	}
	if tr.Dir != dir || tr.Release() != testRelease {
		t.Errorf("Open(root) = %s (release %s), want %s", tr.Dir, tr.Release(), dir)
	}
	got, err := tr.Resolve([]string{"virtio_pci", "virtio_blk", "ext4", "vmw_vsock_virtio_transport"}, []string{"crc32c-intel", "absent_optional"})
	if err != nil {
		t.Fatal(err)
	}
	want := "virtio_ring virtio_pci_modern_dev virtio_pci_legacy_dev virtio virtio_pci virtio_blk vsock vmw_vsock_virtio_transport_common vmw_vsock_virtio_transport crc32c_intel"
	if names(got) != want {
		t.Errorf("Resolve = %s\nwant     %s", names(got), want)
	}
	// Every module comes after all it depends on.
	pos := map[string]int{}
	for i, m := range got {
		pos[m.Name] = i
	}
	for i, m := range got {
		for _, d := range m.Depends {
			if p, ok := pos[d]; !ok || p > i {
				t.Errorf("%s at %d depends on %s at %d", m.Name, i, d, p)
			}
		}
		if m.Release() != testRelease || len(m.Data) == 0 {
			t.Errorf("%s: release %q, %d bytes", m.Name, m.Release(), len(m.Data))
		}
	}
}

func TestModulesDepWinsOverModinfo(t *testing.T) {
	mods := []mod{
		{path: "kernel/a.ko", depends: "b"},
		{path: "kernel/b.ko"},
		{path: "kernel/c.ko"},
	}
	// modules.dep says a needs c (and not b): it is what depmod computed
	// for this kernel, so it wins.
	root, _ := tree(t, mods, map[string]string{"modules.dep": "kernel/a.ko: kernel/c.ko\nkernel/b.ko:\nkernel/c.ko:\n"})
	tr, err := Open(root)
	if err != nil {
		t.Fatal(err)
	}
	got, err := tr.Resolve([]string{"a"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if names(got) != "c a" {
		t.Errorf("with modules.dep: %s, want c a", names(got))
	}
	// The same tree without modules.dep follows .modinfo.
	os.Remove(filepath.Join(tr.Dir, "modules.dep"))
	tr, err = Open(tr.Dir)
	if err != nil {
		t.Fatal(err)
	}
	if got, err = tr.Resolve([]string{"a"}, nil); err != nil || names(got) != "b a" {
		t.Errorf("without modules.dep: %s, %v; want b a", names(got), err)
	}
}

func TestResolveMissingModule(t *testing.T) {
	root, _ := tree(t, []mod{{path: "kernel/drivers/net/virtio_net.ko", depends: "net_failover"}}, nil)
	tr, err := Open(root)
	if err != nil {
		t.Fatal(err)
	}
	_, err = tr.Resolve([]string{"virtio_blk"}, nil)
	if err == nil || !strings.Contains(err.Error(), "module virtio_blk is not in") {
		t.Errorf("missing required module: %v", err)
	}
	_, err = tr.Resolve([]string{"virtio_net"}, nil)
	if err == nil || !strings.Contains(err.Error(), "module net_failover (needed by virtio_net) is not in") {
		t.Errorf("missing dependency: %v", err)
	}
}

func TestResolveSkipsBuiltin(t *testing.T) {
	mods := []mod{{path: "kernel/drivers/block/virtio_blk.ko", depends: "virtio,virtio_ring"}}
	root, _ := tree(t, mods, map[string]string{"modules.builtin": "kernel/drivers/virtio/virtio.ko\nkernel/drivers/virtio/virtio_ring.ko\nkernel/fs/ext4/ext4.ko\n"})
	tr, err := Open(root)
	if err != nil {
		t.Fatal(err)
	}
	got, err := tr.Resolve([]string{"ext4", "virtio_blk"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if names(got) != "virtio_blk" {
		t.Errorf("Resolve = %s, want only virtio_blk (ext4, virtio, virtio_ring built in)", names(got))
	}
	if !tr.Builtin("ext4") || tr.Builtin("virtio_blk") {
		t.Error("Builtin disagrees with modules.builtin")
	}
}

func TestResolveCycle(t *testing.T) {
	root, _ := tree(t, []mod{{path: "kernel/a.ko", depends: "b"}, {path: "kernel/b.ko", depends: "a"}}, nil)
	tr, err := Open(root)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tr.Resolve([]string{"a"}, nil); err == nil || !strings.Contains(err.Error(), "cycle: a -> b -> a") {
		t.Errorf("cycle: %v", err)
	}
}

func TestOpenFindsTheReleaseDirectory(t *testing.T) {
	root, dir := tree(t, []mod{{path: "kernel/a.ko"}}, nil)
	for _, p := range []string{root, dir} {
		tr, err := Open(p)
		if err != nil || tr.Dir != dir {
			t.Errorf("Open(%s) = %v, %v; want %s", p, tr, err, dir)
		}
	}
	if err := os.MkdirAll(filepath.Join(root, "lib", "modules", "6.2.0-other"), 0o755); err != nil {
		t.Fatal(err)
	}
	if _, err := Open(root); err == nil || !strings.Contains(err.Error(), "several kernel releases") {
		t.Errorf("two releases: %v", err)
	}
	if _, err := Open(t.TempDir()); err == nil || !strings.Contains(err.Error(), "neither a lib/modules/<release> directory") {
		t.Errorf("empty directory: %v", err)
	}
}

func TestCompressedModules(t *testing.T) {
	want := mod{path: "x.ko", depends: "virtio"}.data()
	root := t.TempDir()
	dir := filepath.Join(root, "lib", "modules", testRelease, "kernel")
	os.MkdirAll(dir, 0o755)
	os.WriteFile(filepath.Join(dir, "virtio.ko"), mod{path: "virtio.ko"}.data(), 0o644)

	var gz bytes.Buffer
	zw := gzip.NewWriter(&gz)
	zw.Write(want)
	zw.Close()
	os.WriteFile(filepath.Join(dir, "virtio_gz.ko.gz"), gz.Bytes(), 0o644)

	compressed := []string{"virtio_gz"}
	for _, c := range []struct{ prog, ext, pkg string }{{"xz", ".ko.xz", "xz-utils"}, {"zstd", ".ko.zst", "zstd"}} {
		bin, err := exec.LookPath(c.prog)
		if err != nil {
			t.Logf("%s not installed (apt-get install %s): %s modules not checked", c.prog, c.pkg, c.ext)
			continue
		}
		cmd := exec.Command(bin, "-c")
		cmd.Stdin = bytes.NewReader(want)
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("%s -c: %v", c.prog, err)
		}
		name := "virtio_" + c.prog
		os.WriteFile(filepath.Join(dir, name+c.ext), out, 0o644)
		compressed = append(compressed, name)
	}
	tr, err := Open(root)
	if err != nil {
		t.Fatal(err)
	}
	got, err := tr.Resolve(compressed, nil)
	if err != nil {
		t.Fatal(err)
	}
	if names(got) != "virtio "+strings.Join(compressed, " ") {
		t.Errorf("Resolve = %s", names(got))
	}
	for _, m := range got[1:] {
		if !bytes.Equal(m.Data, want) {
			t.Errorf("%s (%s): decompressed data differs from the module", m.Name, m.Path)
		}
	}

	// Without the program, the error names it and its package.
	os.WriteFile(filepath.Join(dir, "needs_xz.ko.xz"), []byte("not read"), 0o644)
	t.Setenv("PATH", t.TempDir())
	tr, err = Open(root)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tr.Resolve([]string{"needs_xz"}, nil); err == nil || !strings.Contains(err.Error(), "the xz program is not installed (package xz-utils)") {
		t.Errorf("without xz: %v", err)
	}
}

func TestVermagicMismatch(t *testing.T) {
	mods := []mod{{path: "kernel/virtio.ko"}, {path: "kernel/virtio_blk.ko", depends: "virtio", release: "6.1.0-98-other"}}
	root, _ := tree(t, mods, nil)
	tr, err := Open(root)
	if err != nil {
		t.Fatal(err)
	}
	got, err := tr.Resolve([]string{"virtio_blk"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	err = CheckVermagic(got, testRelease)
	if err == nil || err.Error() != `the kernel is release `+testRelease+`; modules built for "6.1.0-98-other": virtio_blk` {
		t.Errorf("CheckVermagic = %v, want virtio_blk named alone", err)
	}
	if err := CheckVermagic(got[:1], testRelease); err != nil {
		t.Errorf("matching module: %v", err)
	}
}

func TestReadModuleRejects(t *testing.T) {
	dir := t.TempDir()
	for name, data := range map[string][]byte{
		"notelf.ko":   []byte("hello"),
		"novermag.ko": kmodtest.Module("depends="),
	} {
		p := filepath.Join(dir, name)
		os.WriteFile(p, data, 0o644)
		if _, err := ReadModule(p); err == nil {
			t.Errorf("ReadModule(%s) accepted it", name)
		}
	}
}

func TestKernelRelease(t *testing.T) {
	dir := t.TempDir()
	bz := filepath.Join(dir, "vmlinuz")
	os.WriteFile(bz, kmodtest.BzImage(testRelease+" (debian-kernel@lists.debian.org) #1 SMP PREEMPT_DYNAMIC Debian"), 0o644)
	// An ELF vmlinux: the format string first, the real banner past a
	// chunk boundary.
	elfImg := append([]byte("\x7fELF....Linux version %s (%s)\x00"), make([]byte, 1<<20)...)
	elfImg = append(elfImg, "Linux version "+testRelease+" (builder@host) (gcc 12) #1 SMP\x00"...)
	vmlinux := filepath.Join(dir, "vmlinux")
	os.WriteFile(vmlinux, elfImg, 0o644)
	for _, p := range []string{bz, vmlinux} {
		if got, err := KernelRelease(p); err != nil || got != testRelease {
			t.Errorf("KernelRelease(%s) = %q, %v; want %s", filepath.Base(p), got, err, testRelease)
		}
	}
	junk := filepath.Join(dir, "junk")
	os.WriteFile(junk, []byte("no kernel here"), 0o644)
	if _, err := KernelRelease(junk); err == nil {
		t.Error("KernelRelease of a file without a release succeeded")
	}
}

// agentModules are the modules vmhost's guest agent asks for (appvm's
// list), repeated here because kmod must not import appvm.
var agentModules = []string{"virtio_pci", "virtio_blk", "virtio_net", "ext4", "vsock", "vmw_vsock_virtio_transport"}

// TestRealKernelTree resolves the guest agent's modules in an extracted
// Debian kernel package (linux-image-6.1.*-cloud-amd64 through dpkg-deb -x)
// named by VMHOST_TEST_KERNEL_TREE.
func TestRealKernelTree(t *testing.T) {
	root := os.Getenv("VMHOST_TEST_KERNEL_TREE")
	if root == "" {
		t.Skip("VMHOST_TEST_KERNEL_TREE is not set (an extracted linux-image-6.1.*-cloud-amd64 package, see the README)")
	}
	tr, err := Open(root)
	if err != nil {
		t.Fatal(err)
	}
	got, err := tr.Resolve(agentModules, []string{"crc32c_generic"})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("release %s: %d modules: %s", tr.Release(), len(got), names(got))
	pos := map[string]int{}
	for i, m := range got {
		pos[m.Name] = i
		for _, d := range m.Depends {
			if _, ok := pos[d]; !ok && !tr.Builtin(d) {
				t.Errorf("%s loads before its dependency %s", m.Name, d)
			}
		}
	}
	// What Debian 6.1 builds as modules: virtio core, the PCI transport,
	// block, net with its failover, vsock with the virtio transport.
	for _, n := range []string{"virtio", "virtio_ring", "virtio_pci", "virtio_pci_modern_dev", "virtio_blk", "failover", "net_failover", "virtio_net", "vsock", "vmw_vsock_virtio_transport_common", "vmw_vsock_virtio_transport"} {
		if _, ok := pos[n]; !ok {
			t.Errorf("%s missing from the resolved set", n)
		}
	}
	if _, loaded := pos["ext4"]; loaded == tr.Builtin("ext4") {
		t.Errorf("ext4: built in %v, in the resolved set %v", tr.Builtin("ext4"), loaded)
	}
	matches, _ := filepath.Glob(filepath.Join(root, "boot", "vmlinuz-*"))
	if len(matches) != 1 {
		t.Fatalf("want one boot/vmlinuz-* in %s, found %q", root, matches)
	}
	rel, err := KernelRelease(matches[0])
	if err != nil {
		t.Fatal(err)
	}
	if rel != tr.Release() {
		t.Errorf("vmlinuz release %s, module directory %s", rel, tr.Release())
	}
	if err := CheckVermagic(got, rel); err != nil {
		t.Error(err)
	}
}
