package chsim_test

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"
)

// qcow2Image writes a qcow2 image of size bytes whose first bytes are marker.
func qcow2Image(t testing.TB, path, marker string, size int64) {
	t.Helper()
	qemuImg, err := exec.LookPath("qemu-img")
	if err != nil {
		t.Skip("qemu-img is not installed")
	}
	raw := path + ".raw"
	rawImage(t, raw, size)
	f, err := os.OpenFile(raw, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	f.WriteString(marker)
	f.Close()
	if out, err := exec.Command(qemuImg, "convert", "-f", "raw", "-O", "qcow2", raw, path).CombinedOutput(); err != nil {
		t.Fatalf("qemu-img convert: %v\n%s", err, out)
	}
	os.Remove(raw)
}

// pciDisks is what vm.info says of the disks: the config's ids and the device tree's
// addresses.
func pciDisks(t testing.TB, p *simProc) (ids []string, bdfs map[string]string) {
	t.Helper()
	var info struct {
		Config struct {
			Disks []struct{ ID string }
		}
		DeviceTree map[string]struct {
			PciBdf string `json:"pci_bdf"`
		} `json:"device_tree"`
	}
	if err := json.Unmarshal(p.wantStatus("GET", "/api/v1/vm.info", "", 200), &info); err != nil {
		t.Fatal(err)
	}
	bdfs = map[string]string{}
	for _, d := range info.Config.Disks {
		ids = append(ids, d.ID)
		bdfs[d.ID] = info.DeviceTree["_virtio-pci-"+d.ID].PciBdf
	}
	return ids, bdfs
}

// TestQemuBackendHotplug hot-plugs vhost-user disks (qcow2 images exported by a real
// qemu-storage-daemon) into the running tiny guest and unplugs them: vm.add-disk answers the
// address the guest's kernel sees the disk at (behind a spare root port, one per disk),
// vm.info and the events agree, vm.remove-device answers at once and the disk goes when the
// guest has ejected it, with vm device-removed. The second round plugs the first export
// again, which shows its vhost-user connection was released. A disk still plugged at
// vm.shutdown is a cold one at the next boot, on a CH-style slot. Devices plugged at boot
// cannot be unplugged.
func TestQemuBackendHotplug(t *testing.T) {
	t.Parallel()
	start := time.Now()
	g := bootTinyGuest(t, tinyGuestOpts{mode: "hotplug"})
	p := g.p
	var socks []string
	for i, marker := range []string{"HOTDISK1", "HOTDISK2"} {
		image, sock := filepath.Join(p.dir, fmt.Sprintf("hot%d.qcow2", i)), filepath.Join(p.dir, fmt.Sprintf("hot%d.vhost", i))
		qcow2Image(t, image, marker, 16<<20)
		startQSDFormat(t, image, "qcow2", sock)
		socks = append(socks, sock)
	}
	const coldDisks = "tinyguest: disks now vda:4096:0000:00:01.0: vdb:2048:0000:00:02.0:"
	g.serial.wait(t, coldDisks+".", 60*time.Second)
	t.Logf("the guest was up after %v", time.Since(start))

	p.wantStatus("PUT", "/api/v1/vm.remove-device", `{"id":"nope"}`, 500)
	chain := errorChain(t, p.wantStatus("PUT", "/api/v1/vm.remove-device", `{"id":"_disk1"}`, 500))
	if !strings.Contains(lastOf(chain), "plugged at boot") {
		t.Errorf("remove-device of a cold disk = %q", chain)
	}
	chain = errorChain(t, p.wantStatus("PUT", "/api/v1/vm.add-disk", fmt.Sprintf(`{"path":%q}`, filepath.Join(p.dir, "disk0.img")), 500))
	if !strings.Contains(lastOf(chain), "vhost-user disks only") {
		t.Errorf("add-disk of an image = %q", chain)
	}

	bdfRE := regexp.MustCompile(`^0000:[0-9a-f]{2}:00\.0$`)
	// plug adds the disk of export i and waits for the guest to show what it expects.
	plug := func(i int, wantID, guestSees string) string {
		t.Helper()
		plugged, mark := time.Now(), len(g.serial.String())
		data := p.wantStatus("PUT", "/api/v1/vm.add-disk", fmt.Sprintf(`{"vhost_user":true,"vhost_socket":%q}`, socks[i]), 200)
		var dev struct{ ID, Bdf string }
		json.Unmarshal(data, &dev)
		if dev.ID != wantID || !bdfRE.MatchString(dev.Bdf) || strings.HasPrefix(dev.Bdf, "0000:00:") {
			t.Fatalf("add-disk = %s, want id %s on a root port's bus", data, wantID)
		}
		// The guest sees it where the answer says: 16 MiB, the image's first bytes. A
		// line of an earlier round (the same export at the same address) does not count:
		// a disk plugged before the guest saw this one could take its name.
		g.serial.waitSince(t, mark, fmt.Sprintf(guestSees, dev.Bdf), 30*time.Second)
		t.Logf("%s at %s seen by the guest after %v", wantID, dev.Bdf, time.Since(plugged))
		return dev.Bdf
	}
	unplug := func(bdfs map[string]string) {
		t.Helper()
		unplugged := time.Now()
		for id := range bdfs {
			p.wantStatus("PUT", "/api/v1/vm.remove-device", fmt.Sprintf(`{"id":%q}`, id), 204)
		}
		for id, bdf := range bdfs {
			p.waitEventsFor(30*time.Second, fmt.Sprintf("vm/device-removed map[bdf:%s id:%s]", bdf, id))
		}
		t.Logf("%d disk(s) ejected after %v", len(bdfs), time.Since(unplugged))
	}
	checkInfo := func(step, want string, bdfs map[string]string) {
		t.Helper()
		ids, got := pciDisks(t, p)
		if strings.Join(ids, " ") != want {
			t.Errorf("%s: vm.info disks %v, want %s", step, ids, want)
		}
		for id, bdf := range bdfs {
			if got[id] != bdf {
				t.Errorf("%s: vm.info has %s at %q, want %s", step, id, got[id], bdf)
			}
		}
	}

	// Round 1: one disk in and out.
	b2 := plug(0, "_disk2", coldDisks+" vdc:32768:%s:HOTDISK1.")
	checkInfo("plugged _disk2", "_disk0 _disk1 _disk2", map[string]string{"_disk2": b2})
	unplug(map[string]string{"_disk2": b2})
	g.serial.waitCount(t, coldDisks+".", 2, 30*time.Second)
	checkInfo("unplugged _disk2", "_disk0 _disk1", nil)

	// Round 2: the same export again, and a second one on another port.
	b3 := plug(0, "_disk3", coldDisks+" vdc:32768:%s:HOTDISK1.")
	b4 := plug(1, "_disk4", " vdd:32768:%s:HOTDISK2.")
	if b3 == b4 {
		t.Fatalf("_disk3 and _disk4 both at %s", b3)
	}
	checkInfo("plugged _disk3 and _disk4", "_disk0 _disk1 _disk3 _disk4", map[string]string{"_disk3": b3, "_disk4": b4})
	unplug(map[string]string{"_disk3": b3})
	g.serial.wait(t, fmt.Sprintf("%s vdd:32768:%s:HOTDISK2.", coldDisks, b4), 30*time.Second)
	checkInfo("unplugged _disk3", "_disk0 _disk1 _disk4", map[string]string{"_disk4": b4})

	// One device-removed per unplugged disk, and nothing about it after that.
	evs := p.eventsSoFar()
	gone := map[string]bool{}
	for _, e := range evs {
		id := e.Properties["id"]
		if gone[id] {
			t.Errorf("event %s after %s was removed: %v", e, id, evs)
		}
		if e.Source+"/"+e.Event == "vm/device-removed" {
			gone[id] = true
		}
	}
	if !gone["_disk2"] || !gone["_disk3"] || len(gone) != 2 {
		t.Errorf("device-removed for %v, want _disk2 and _disk3: %v", gone, evs)
	}
	// The guest's driver took each hot-plugged disk (it read them), but CH announces no
	// vhost-user activation.
	for _, id := range []string{"_disk2", "_disk3", "_disk4"} {
		if hasEvent(evs, "virtio-device/activated", id) {
			t.Errorf("activation of the hot-plugged vhost-user disk %s announced: %v", id, evs)
		}
	}

	// _disk4 stays in the config: the next boot has it on the root bus, after the others.
	p.wantStatus("PUT", "/api/v1/vm.shutdown", "", 204)
	p.wantStatus("PUT", "/api/v1/vm.boot", "", 204)
	g.serial = readSerial(t, filepath.Join(p.dir, "console.sock"))
	g.serial.wait(t, coldDisks+" vdc:32768:0000:00:03.0:HOTDISK2.", 60*time.Second)
	checkInfo("booted again", "_disk0 _disk1 _disk4", map[string]string{"_disk4": "0000:00:03.0"})
	p.wantStatus("PUT", "/api/v1/vmm.shutdown", "", 200)
	if st := p.wait(t); !st.Success() {
		t.Fatalf("exit after vmm.shutdown = %v", st)
	}
	t.Logf("total %v", time.Since(start))
}
