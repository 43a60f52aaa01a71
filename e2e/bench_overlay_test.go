//go:build linux

package e2e

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"syscall"
	"testing"
	"time"

	"vmhost/appvm"
	"vmhost/config"
	"vmhost/internal/netnstest"
	"vmhost/qcow2"
	"vmhost/vm"
)

// denseBuild writes a build of size bytes of random data at path, every
// cluster allocated (as an imported root file system is, near enough).
func denseBuild(tb testing.TB, path string, size int64) {
	tb.Helper()
	raw, err := os.CreateTemp(filepath.Dir(path), "raw-*")
	if err != nil {
		tb.Fatal(err)
	}
	defer os.Remove(raw.Name())
	defer raw.Close()
	r := rand.New(rand.NewChaCha8([32]byte{7}))
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

// putImage adds image id with the build at build (hard-linked into the
// catalog) to the agent's catalog.
func putImage(tb testing.TB, s *server, id, build string, size int64) {
	tb.Helper()
	cat := appvm.Catalog{Dir: s.stateDir + "/appvm-images"}
	digest := "sha256:" + id
	if err := os.MkdirAll(filepath.Join(cat.Dir, id), 0o700); err != nil {
		tb.Fatal(err)
	}
	if err := os.Link(build, cat.BuildFile(id, digest)); err != nil {
		tb.Fatal(err)
	}
	if err := cat.Put(&appvm.Image{ID: id, Status: appvm.StatusReady, CreatedAt: time.Now().UTC(), Workload: vm.Workload{
		BuildDigest: digest, SizeBytes: uint64(size), Cmd: []string{"/bin/sh", "-c", "exec sleep 300"},
		Env: []string{"PATH=/usr/local/bin:/usr/bin:/bin"}}}); err != nil {
		tb.Fatal(err)
	}
}

// appvmAgent starts an agent with an AppVM kernel whose AppVMs get root
// disks of kind mode (appvm_root_disk).
func appvmAgent(tb testing.TB, kernel, mode string) *server {
	return startServer(tb, serverOpts{netns: true, edit: func(c *config.Config) {
		c.AppVMKernel = kernel
		c.AppVMRootDisk = mode
		c.HostCPUs, c.HostMemoryMB = 1024, 1<<20
	}})
}

// BenchmarkAppVMCreate times an AppVM's create, POST /api/appvm/vms with
// auto_boot until the view's display_state is running (the guest agent's
// first heartbeat; simulators, disk_gib 4), for images whose build holds
// 10 MiB, 200 MiB and 1 GiB of data (the order of the sizes rotating from
// round to round too), three ways side by side: vmhost
// making an overlay of the build (appvm_root_disk overlay, the default),
// vmhost making a copy (appvm_root_disk copy, two agents), and what a
// user would otherwise run for the disk alone, `qemu-img create -f qcow2
// -b BUILD -F qcow2` and an fsync. Each iteration is one round of every
// size and way, the order of the ways rotating from round to round; the
// medians are reported as ms/<way>-<size>, and overlay-1GiB/10MiB is the
// ratio of the overlay's 1 GiB and 10 MiB medians. The AppVMs are deleted
// outside the timer.
//
//	go test -run '^$' -bench '^BenchmarkAppVMCreate$' -benchtime 9x ./e2e
//
// bench/appvm-overlay.sh runs it with the other overlay benchmarks.
func BenchmarkAppVMCreate(b *testing.B) {
	netnstest.RequireRoot(b) // an AppVM always has an interface
	qemuImg, err := exec.LookPath("qemu-img")
	if err != nil {
		b.Skip("qemu-img not installed (apt-get install qemu-utils)")
	}
	f := newFixture(b)
	agents := map[string]*server{"overlay": appvmAgent(b, f.kernel, config.AppVMRootOverlay), "copy": appvmAgent(b, f.kernel, config.AppVMRootCopy)}
	dir := b.TempDir()
	sizes := []struct {
		name string
		size int64
	}{{"10MiB", 10 << 20}, {"200MiB", 200 << 20}, {"1GiB", 1 << 30}}
	for _, sz := range sizes {
		build := filepath.Join(dir, "build-"+sz.name+".qcow2")
		denseBuild(b, build, sz.size)
		for _, s := range agents {
			putImage(b, s, "img"+sz.name, build, sz.size)
		}
	}
	ways := []string{"overlay", "copy", "qemu-img-create-b"}
	ms := map[string][]float64{}
	n := 0
	create := func(s *server, img string) float64 {
		n++
		id := fmt.Sprintf("b%d", n)
		body := fmt.Sprintf(`{"vm_id":%q,"image_id":%q,"vcpus":1,"memory_mb":128,"disk_gib":4,"ip":"10.82.%d.%d","prefix":16,"gateway":"10.82.0.1"}`,
			id, img, n/200, n%200+2)
		t0 := time.Now()
		if st, out := s.do("POST", "/api/appvm/vms", body); st != http.StatusCreated {
			b.Fatalf("create = %d %s", st, out)
		}
		for {
			_, out := s.do("GET", "/api/appvm/vms/"+id, "")
			var v struct {
				DisplayState string `json:"display_state"`
			}
			json.Unmarshal(out, &v)
			if v.DisplayState == "running" {
				break
			}
			if time.Since(t0) > 60*time.Second {
				b.Fatalf("AppVM %s not running after 60s: %s", id, out)
			}
			time.Sleep(2 * time.Millisecond)
		}
		took := time.Since(t0)
		if st, out := s.do("DELETE", "/api/appvm/vms/"+id+"?force=true", ""); st != http.StatusNoContent {
			b.Fatalf("delete = %d %s", st, out)
		}
		return float64(took.Microseconds()) / 1000
	}
	qemuImgCreate := func(build string) float64 {
		dst := filepath.Join(dir, "overlay.qcow2")
		os.Remove(dst)
		t0 := time.Now()
		if out, err := exec.Command(qemuImg, "create", "-q", "-f", "qcow2", "-b", build, "-F", "qcow2", dst, fmt.Sprint(4<<30)).CombinedOutput(); err != nil {
			b.Fatalf("qemu-img create: %v: %s", err, out)
		}
		fd, err := syscall.Open(dst, syscall.O_RDONLY, 0)
		if err == nil {
			err = syscall.Fsync(fd)
			syscall.Close(fd)
		}
		if err != nil {
			b.Fatal(err)
		}
		return float64(time.Since(t0).Microseconds()) / 1000
	}
	b.ResetTimer()
	for i := range b.N {
		for j := range sizes {
			sz := sizes[(i+j)%len(sizes)]
			for k := range ways {
				way := ways[(i+k)%len(ways)]
				var v float64
				switch way {
				case "qemu-img-create-b":
					v = qemuImgCreate(filepath.Join(dir, "build-"+sz.name+".qcow2"))
				default:
					v = create(agents[way], "img"+sz.name)
				}
				ms[way+"-"+sz.name] = append(ms[way+"-"+sz.name], v)
			}
		}
	}
	b.StopTimer()
	med := map[string]float64{}
	for k, v := range ms {
		slices.Sort(v)
		med[k] = v[len(v)/2]
		b.ReportMetric(med[k], "ms/"+k)
	}
	b.ReportMetric(med["overlay-1GiB"]/med["overlay-10MiB"], "overlay-1GiB/10MiB")
}

// BenchmarkAppVMDiskUse creates 100 AppVMs of one image whose build holds
// 1 GiB of data (auto_boot false: the root disks are made, nothing writes
// them), and reports the blocks allocated (st_blocks) by the build and by
// the AppVMs' directories, with overlay root disks (the default) and, for
// comparison, what 100 copies take (one copy made by an agent with
// appvm_root_disk copy, times 100).
//
//	go test -run '^$' -bench '^BenchmarkAppVMDiskUse$' -benchtime 1x ./e2e
func BenchmarkAppVMDiskUse(b *testing.B) {
	netnstest.RequireRoot(b)
	f := newFixture(b)
	dir := b.TempDir()
	build := filepath.Join(dir, "build.qcow2")
	denseBuild(b, build, 1<<30)
	blocks := func(paths ...string) int64 {
		var sum int64
		for _, p := range paths {
			filepath.Walk(p, func(_ string, fi os.FileInfo, err error) error {
				if err == nil && fi.Mode().IsRegular() {
					sum += fi.Sys().(*syscall.Stat_t).Blocks * 512
				}
				return nil
			})
		}
		return sum
	}
	var overlays, copies int64
	for range b.N {
		s := appvmAgent(b, f.kernel, config.AppVMRootOverlay)
		putImage(b, s, "big", build, 1<<30)
		for i := range 100 {
			body := fmt.Sprintf(`{"vm_id":"u%d","image_id":"big","vcpus":1,"memory_mb":128,"disk_gib":4,"auto_boot":false}`, i)
			if st, out := s.do("POST", "/api/appvm/vms", body); st != http.StatusCreated {
				b.Fatalf("create = %d %s", st, out)
			}
		}
		overlays = blocks(s.stateDir + "/vms")
		c := appvmAgent(b, f.kernel, config.AppVMRootCopy)
		putImage(b, c, "big", build, 1<<30)
		if st, out := c.do("POST", "/api/appvm/vms", `{"vm_id":"c0","image_id":"big","vcpus":1,"memory_mb":128,"disk_gib":4,"auto_boot":false}`); st != http.StatusCreated {
			b.Fatalf("create = %d %s", st, out)
		}
		copies = 100 * blocks(c.stateDir+"/vms")
	}
	b.ReportMetric(float64(blocks(build))/(1<<20), "build-MiB")
	b.ReportMetric(float64(overlays)/(1<<20), "100-overlay-AppVMs-MiB")
	b.ReportMetric(float64(blocks(build)+overlays)/(1<<30), "overlays+build-GiB")
	b.ReportMetric(float64(copies)/(1<<30), "100-copy-AppVMs-GiB(computed)")
}
