package realguest

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"vmhost/ociimage/ocitest"
	"vmhost/qcow2"
)

// checkOverlay asserts that AppVM id's root disk is a qcow2 overlay of its
// image's build: the view says so (disk.mode overlay, disk.base_path the
// build) and the root disk's header names that build.
func (l *lane) checkOverlay(id string) {
	l.t.Helper()
	v, _ := l.view("/api/appvm/vms", id)
	if v.Disk == nil || v.Disk.Mode != "overlay" || !strings.HasPrefix(v.Disk.BasePath, l.stateDir+"/appvm-images/") {
		l.t.Fatalf("%s: disk %+v, want an overlay of a build in the catalog", id, v.Disk)
	}
	h, err := qcow2.ReadHeaderFile(l.stateDir + "/vms/" + id + "/root.qcow2")
	if err != nil {
		l.t.Fatal(err)
	}
	if err := h.CheckOverlay(v.Disk.BasePath); err != nil {
		l.t.Errorf("%s: root disk: %v", id, err)
	}
}

// ioPayload is the size of the file the IO image holds and of the file its
// workload writes.
const ioPayload = 256 << 20

// ioWorkload measures the guest's root disk: three rounds of reading the
// image's /payload (all of it from the build, for an overlay) with cold
// caches, and writing as much to a new file with an fsync. /proc/uptime
// gives the times (centiseconds).
const ioWorkload = `#!/bin/sh
now() { read up idle </proc/uptime; echo "$up"; }
for r in 1 2 3; do
	sync; echo 3 >/proc/sys/vm/drop_caches
	a=$(now); dd if=/payload of=/dev/null bs=1M 2>/dev/null; b=$(now)
	echo "lane-io read $r $a $b"
	a=$(now); dd if=/dev/zero of=/written bs=1M count=256 conv=fsync 2>/dev/null; b=$(now)
	echo "lane-io write $r $a $b"
	rm -f /written; sync
done
echo "lane-io done"
exec sleep 100000
`

// importIOImage imports "busybox-io": busybox, ioWorkload and a payload of
// random data.
func importIOImage(l *lane) {
	t := l.t
	busybox, err := os.ReadFile("/bin/busybox")
	if err != nil {
		t.Fatalf("reading the static busybox (busybox-static): %v", err)
	}
	payload := make([]byte, ioPayload)
	r := rand.New(rand.NewChaCha8([32]byte{9}))
	for i := 0; i < len(payload); i += 8 {
		v := r.Uint64()
		for j := range 8 {
			payload[i+j] = byte(v >> (8 * j))
		}
	}
	entries := []ocitest.Entry{
		ocitest.Dir("bin/", 0o755), ocitest.Dir("proc/", 0o555), ocitest.Dir("sys/", 0o555),
		ocitest.Dir("dev/", 0o755), ocitest.Dir("tmp/", 0o1777), ocitest.Dir("etc/", 0o755),
		ocitest.File("bin/busybox", string(busybox), 0o755, 0, 0),
		ocitest.File("workload.sh", ioWorkload, 0o755, 0, 0),
		ocitest.File("payload", string(payload), 0o644, 0, 0),
	}
	for _, applet := range []string{"sh", "dd", "echo", "sync", "sleep", "rm"} {
		entries = append(entries, ocitest.Symlink("bin/"+applet, "busybox"))
	}
	img := ocitest.Image{
		Layers: [][]byte{ocitest.Layer(t, entries...)},
		Config: ocitest.Config{Entrypoint: []string{"/bin/sh", "/workload.sh"}, Env: []string{"PATH=/bin"}},
	}
	layout := l.dir + "/busybox-io-oci"
	img.WriteDir(t, layout)
	l.must("POST", "/api/appvm/images", fmt.Sprintf(`{"id":"busybox-io","path":%q}`, layout), http.StatusAccepted)
	l.poll("IO image import", 5*time.Minute, func() bool {
		var got struct{ Status, Failure string }
		json.Unmarshal(l.must("GET", "/api/appvm/images/busybox-io", "", http.StatusOK), &got)
		if got.Status == "failed" {
			t.Fatalf("IO image import failed: %s", got.Failure)
		}
		return got.Status == "ready"
	})
	os.RemoveAll(layout)
}

// appVMIO measures guest IO through an overlay root disk beside a copied
// one: two AppVMs of the IO image, io-ovl made with appvm_root_disk
// overlay and io-copy with copy (the agent restarted in between), booted
// together so they share the host alike, each reading its 256 MiB payload
// and writing 256 MiB three times (dd in the guest). It reports the
// medians and the overlay/copy ratios. main is the lane whose agent is
// restarted (l is its copy for this test).
func appVMIO(l, main *lane) {
	t := l.t
	start := time.Now()
	importIOImage(l)
	phase(t, "appvm-io: image import", start)
	create := func(id string) {
		body := fmt.Sprintf(`{"vm_id":%q,"image_id":"busybox-io","vcpus":1,"memory_mb":256,"disk_gib":2,"network_id":"lane","auto_boot":false}`, id)
		l.must("POST", "/api/appvm/vms", body, http.StatusCreated)
	}
	create("io-ovl")
	main.restartServe("appvm_root_disk", "copy")
	create("io-copy")
	main.restartServe("appvm_root_disk", "overlay")
	l.checkOverlay("io-ovl")
	if v, _ := l.view("/api/appvm/vms", "io-copy"); v.Disk == nil || v.Disk.Mode != "copy" {
		t.Fatalf("io-copy: disk %+v, want a copy", v.Disk)
	}
	for _, id := range []string{"io-ovl", "io-copy"} {
		l.must("POST", "/api/appvm/vms/"+id+"/start", "", http.StatusNoContent)
	}
	logOf := func(id string) string {
		b, _ := os.ReadFile(l.stateDir + "/vms/" + id + "/workload.log")
		return string(b)
	}
	l.poll("both IO workloads done", 20*time.Minute, func() bool {
		return strings.Contains(logOf("io-ovl"), "lane-io done") && strings.Contains(logOf("io-copy"), "lane-io done")
	})
	phase(t, "appvm-io: boots and dd", start)
	med := map[string]float64{}
	for _, id := range []string{"io-ovl", "io-copy"} {
		secs := map[string][]float64{}
		for _, line := range strings.Split(logOf(id), "\n") {
			_, rest, ok := strings.Cut(line, "lane-io ")
			f := strings.Fields(rest)
			if !ok || len(f) != 4 {
				continue
			}
			a, err1 := strconv.ParseFloat(f[2], 64)
			b, err2 := strconv.ParseFloat(f[3], 64)
			if err1 != nil || err2 != nil {
				t.Fatalf("%s: bad line %q", id, line)
			}
			secs[f[0]] = append(secs[f[0]], b-a)
		}
		for _, kind := range []string{"read", "write"} {
			v := secs[kind]
			if len(v) != 3 {
				t.Fatalf("%s: %d %s rounds in the workload log, want 3:\n%s", id, len(v), kind, logOf(id))
			}
			slices.Sort(v)
			med[id+" "+kind] = v[1]
			t.Logf("%s %s 256 MiB: %.2f, %.2f, %.2f s (median %.2f s, %.1f MiB/s)", id, kind, v[0], v[1], v[2], v[1], 256/v[1])
		}
	}
	t.Logf("guest dd of 256 MiB, overlay / copy time: read %.2f, write %.2f",
		med["io-ovl read"]/med["io-copy read"], med["io-ovl write"]/med["io-copy write"])
	for _, id := range []string{"io-ovl", "io-copy"} {
		l.deleteVM("/api/appvm/vms", id)
	}
}
