package appvm

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"vmhost/initramfs"
	"vmhost/kmod/kmodtest"
)

const testRelease = "6.1.0-99-test"

// moduleTree writes a Debian-shaped module tree (no modules.dep, ext4 built
// in) for release with every module of AgentModules and their
// dependencies, and returns the package root.
func moduleTree(t *testing.T, release string) string {
	t.Helper()
	root := t.TempDir()
	dir := filepath.Join(root, "lib", "modules", release)
	mods := map[string]string{
		"kernel/drivers/virtio/virtio_ring.ko":                      "",
		"kernel/drivers/virtio/virtio.ko":                           "virtio_ring",
		"kernel/drivers/virtio/virtio_pci.ko":                       "virtio_ring,virtio",
		"kernel/drivers/block/virtio_blk.ko":                        "virtio,virtio_ring",
		"kernel/net/core/failover.ko":                               "",
		"kernel/drivers/net/net_failover.ko":                        "failover",
		"kernel/drivers/net/virtio_net.ko":                          "virtio_ring,virtio,net_failover",
		"kernel/net/vmw_vsock/vsock.ko":                             "",
		"kernel/net/vmw_vsock/vmw_vsock_virtio_transport_common.ko": "vsock",
		"kernel/net/vmw_vsock/vmw_vsock_virtio_transport.ko":        "virtio,vmw_vsock_virtio_transport_common,virtio_ring,vsock",
		"kernel/crypto/crc32c_generic.ko":                           "",
	}
	for p, deps := range mods {
		full := filepath.Join(dir, p)
		os.MkdirAll(filepath.Dir(full), 0o755)
		data := kmodtest.Module("depends="+deps, "vermagic="+release+" SMP preempt mod_unload modversions ")
		if err := os.WriteFile(full, data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(dir, "modules.builtin"), []byte("kernel/fs/ext4/ext4.ko\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	return root
}

func writeKernel(t *testing.T, release string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "vmlinuz")
	if err := os.WriteFile(p, kmodtest.BzImage(release+" (test@host) #1 SMP"), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

// archiveFile extracts name from the cpio archive at img.
func archiveFile(t *testing.T, img, name string) string {
	t.Helper()
	cpio, err := exec.LookPath("cpio")
	if err != nil {
		t.Skip("cpio not installed (apt-get install cpio)")
	}
	in, err := os.Open(img)
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	cmd := exec.Command(cpio, "-i", "--quiet", "--to-stdout", name)
	cmd.Stdin = in
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("cpio -i %s: %v", name, err)
	}
	return string(out)
}

func TestInitramfsCarriesAgentModulesInOrder(t *testing.T) {
	run := t.TempDir()
	bin := filepath.Join(t.TempDir(), "vmhost")
	os.WriteFile(bin, []byte("binary v1"), 0o755)
	var b initramfsBuild
	p, err := b.get(run, bin, writeKernel(t, testRelease), moduleTree(t, testRelease))
	if err != nil {
		t.Fatal(err)
	}
	got := archiveFile(t, p, initramfs.ModuleList)
	want := "virtio_ring\nvirtio\nvirtio_pci\nvirtio_blk\nfailover\nnet_failover\nvirtio_net\nvsock\nvmw_vsock_virtio_transport_common\nvmw_vsock_virtio_transport\ncrc32c_generic\n"
	if got != want {
		t.Errorf("module list:\n%s\nwant:\n%s", got, want)
	}
	if ko := archiveFile(t, p, "lib/modules/virtio_blk.ko"); !strings.HasPrefix(ko, "\x7fELF") {
		t.Errorf("virtio_blk.ko in the archive is not the module: %q", ko[:min(len(ko), 8)])
	}
	if init := archiveFile(t, p, "init"); init != "binary v1" {
		t.Errorf("/init = %q", init)
	}
}

func TestInitramfsKeyCoversBinaryAndModules(t *testing.T) {
	run := t.TempDir()
	bin := filepath.Join(t.TempDir(), "vmhost")
	os.WriteFile(bin, []byte("binary v1"), 0o755)
	kernel := writeKernel(t, testRelease)
	tree := moduleTree(t, testRelease)
	var b initramfsBuild

	plain, err := b.get(run, bin, kernel, "")
	if err != nil {
		t.Fatal(err)
	}
	withMods, err := b.get(run, bin, kernel, tree)
	if err != nil {
		t.Fatal(err)
	}
	again, err := b.get(run, bin, kernel, tree)
	if err != nil {
		t.Fatal(err)
	}
	if plain == withMods || again != withMods {
		t.Errorf("paths: no modules %s, modules %s, again %s: want two distinct, the second reused", plain, withMods, again)
	}

	// A changed module is a new archive.
	ko := filepath.Join(tree, "lib", "modules", testRelease, "kernel/drivers/block/virtio_blk.ko")
	os.WriteFile(ko, kmodtest.Module("depends=virtio", "vermagic="+testRelease+" SMP rebuilt"), 0o644)
	changedMod, err := b.get(run, bin, kernel, tree)
	if err != nil {
		t.Fatal(err)
	}
	// A rebuilt binary (the same size, another mtime) too.
	os.WriteFile(bin, []byte("binary v2"), 0o755)
	future := time.Now().Add(time.Hour)
	os.Chtimes(bin, future, future)
	changedBin, err := b.get(run, bin, kernel, tree)
	if err != nil {
		t.Fatal(err)
	}
	if changedMod == withMods || changedBin == changedMod {
		t.Errorf("paths: %s, changed module %s, changed binary %s: want all distinct", withMods, changedMod, changedBin)
	}
	if init := archiveFile(t, changedBin, "init"); init != "binary v2" {
		t.Errorf("/init after the rebuild = %q", init)
	}
}

func TestInitramfsRefusesModulesOfAnotherKernel(t *testing.T) {
	bin := filepath.Join(t.TempDir(), "vmhost")
	os.WriteFile(bin, []byte("binary"), 0o755)
	var b initramfsBuild
	run := t.TempDir()
	_, err := b.get(run, bin, writeKernel(t, "6.1.0-98-other"), moduleTree(t, testRelease))
	if err == nil || !strings.Contains(err.Error(), "does not fit the kernel") || !strings.Contains(err.Error(), "the kernel is release 6.1.0-98-other; modules built for \""+testRelease+"\": virtio_ring, virtio, virtio_pci, virtio_blk,") {
		t.Errorf("mismatched vermagic: %v", err)
	}
	// A tree without virtio_blk (and not built in) names the module.
	tree := moduleTree(t, testRelease)
	os.Remove(filepath.Join(tree, "lib", "modules", testRelease, "kernel/drivers/block/virtio_blk.ko"))
	_, err = b.get(run, bin, writeKernel(t, testRelease), tree)
	if err == nil || !strings.Contains(err.Error(), "appvm_modules: module virtio_blk is not in") {
		t.Errorf("missing virtio_blk: %v", err)
	}
	if left, _ := filepath.Glob(filepath.Join(run, "*")); len(left) != 0 {
		t.Errorf("refused builds left %q", left)
	}
}
