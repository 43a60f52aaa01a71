package hostpci

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"
	"testing"
)

type fakeDev struct {
	bdf, vendor, device, class, driver, numa string
	group                                    int // -1: none
}

// fakeSysfs lays devices out as the kernel does: the device directories
// under devices/pci0000:00, linked from bus/pci/devices; driver and
// iommu_group links; kernel/iommu_groups/N/devices/BDF links back.
func fakeSysfs(t *testing.T, devs []fakeDev) string {
	t.Helper()
	root := t.TempDir()
	mk := func(p string) {
		if err := os.MkdirAll(filepath.Join(root, p), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	link := func(target, name string) {
		if err := os.Symlink(target, filepath.Join(root, name)); err != nil {
			t.Fatal(err)
		}
	}
	mk("bus/pci/devices")
	for _, d := range devs {
		real := "devices/pci0000:00/" + d.bdf
		mk(real)
		for name, v := range map[string]string{"vendor": d.vendor, "device": d.device, "class": d.class, "numa_node": d.numa} {
			if v != "" {
				os.WriteFile(filepath.Join(root, real, name), []byte(v+"\n"), 0o644)
			}
		}
		link("../../../"+real, "bus/pci/devices/"+d.bdf)
		if d.driver != "" {
			mk("bus/pci/drivers/" + d.driver)
			link("../../../bus/pci/drivers/"+d.driver, real+"/driver")
		}
		if d.group >= 0 {
			g := "kernel/iommu_groups/" + strconv.Itoa(d.group)
			mk(g + "/devices")
			link("../../../"+g, real+"/iommu_group")
			link("../../../../"+real, g+"/devices/"+d.bdf)
		}
	}
	return root
}

const pciIDs = `# pci.ids excerpt
10de  NVIDIA Corporation
	2204  GA102 [GeForce RTX 3090]
	1aef  GA102 High Definition Audio Controller
		10de 1454  some subsystem
8086  Intel Corporation
	1533  I210 Gigabit Network Connection
C 02  Network controller
	00  Ethernet controller
`

func TestList(t *testing.T) {
	sysfs := fakeSysfs(t, []fakeDev{
		// A GPU and its audio function in group 12: the audio function is
		// still on snd_hda_intel, so neither is ready.
		{bdf: "0000:41:00.1", vendor: "0x10de", device: "0x1aef", class: "0x040300", driver: "snd_hda_intel", numa: "0", group: 12},
		{bdf: "0000:41:00.0", vendor: "0x10de", device: "0x2204", class: "0x030000", driver: "vfio-pci", numa: "0", group: 12},
		// A NIC alone in its group, on vfio-pci: ready.
		{bdf: "0000:03:00.0", vendor: "0x8086", device: "0x1533", class: "0x020000", driver: "vfio-pci", numa: "-1", group: 7},
		// No IOMMU group, no driver, an id pci.ids does not know.
		{bdf: "0000:00:1f.3", vendor: "0x1af4", device: "0x1050", class: "0x030000", group: -1},
	})
	ids := filepath.Join(t.TempDir(), "pci.ids")
	os.WriteFile(ids, []byte(pciIDs), 0o644)

	devs, err := List(sysfs, []string{filepath.Join(t.TempDir(), "missing"), ids})
	if err != nil {
		t.Fatal(err)
	}
	zero, seven, twelve := 0, 7, 12
	want := []Device{
		{BDF: "0000:00:1f.3", VendorID: "0x1af4", DeviceID: "0x1050", Class: "0x030000", IOMMUGroupDevices: []string{}},
		{BDF: "0000:03:00.0", VendorID: "0x8086", DeviceID: "0x1533", Class: "0x020000", VendorName: "Intel Corporation",
			DeviceName: "I210 Gigabit Network Connection", Driver: "vfio-pci", IOMMUGroup: &seven,
			IOMMUGroupDevices: []string{"0000:03:00.0"}, PassthroughReady: true},
		{BDF: "0000:41:00.0", VendorID: "0x10de", DeviceID: "0x2204", Class: "0x030000", VendorName: "NVIDIA Corporation",
			DeviceName: "GA102 [GeForce RTX 3090]", Driver: "vfio-pci", IOMMUGroup: &twelve,
			IOMMUGroupDevices: []string{"0000:41:00.0", "0000:41:00.1"}, NUMANode: &zero},
		{BDF: "0000:41:00.1", VendorID: "0x10de", DeviceID: "0x1aef", Class: "0x040300", VendorName: "NVIDIA Corporation",
			DeviceName: "GA102 High Definition Audio Controller", Driver: "snd_hda_intel", IOMMUGroup: &twelve,
			IOMMUGroupDevices: []string{"0000:41:00.0", "0000:41:00.1"}, NUMANode: &zero},
	}
	if !reflect.DeepEqual(devs, want) {
		for i := range max(len(devs), len(want)) {
			var g, w Device
			if i < len(devs) {
				g = devs[i]
			}
			if i < len(want) {
				w = want[i]
			}
			if !reflect.DeepEqual(g, w) {
				t.Errorf("device %d:\n got %+v\nwant %+v", i, g, w)
			}
		}
	}

	for _, tc := range []struct{ bdf, want string }{
		{"0000:03:00.0", ""},
		{"0000:41:00.0", "0000:41:00.0 shares IOMMU group 12 with 0000:41:00.1, which is bound to snd_hda_intel, not vfio-pci"},
		{"0000:41:00.1", "0000:41:00.1 is bound to snd_hda_intel, not vfio-pci"},
		{"0000:00:1f.3", "0000:00:1f.3 has no IOMMU group"},
	} {
		err := Check(sysfs, tc.bdf)
		if (tc.want == "") != (err == nil) || (err != nil && !strings.Contains(err.Error(), tc.want)) {
			t.Errorf("Check(%s) = %v, want %q", tc.bdf, err, tc.want)
		}
	}
	if err := Check(sysfs, "0000:09:00.0"); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("Check(absent) = %v, want fs.ErrNotExist", err)
	}
	if err := Check(sysfs, "../../etc"); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("Check(path) = %v, want fs.ErrNotExist", err)
	}
}

func TestListWithoutPCIOrNames(t *testing.T) {
	devs, err := List(t.TempDir(), nil)
	if err != nil || devs == nil || len(devs) != 0 {
		t.Errorf("no bus/pci: %v, %v; want an empty list", devs, err)
	}
	sysfs := fakeSysfs(t, []fakeDev{{bdf: "0000:00:02.0", vendor: "0x8086", device: "0x1533", class: "0x020000", driver: "vfio-pci", group: 3}})
	devs, err = List(sysfs, []string{filepath.Join(t.TempDir(), "none")})
	if err != nil || len(devs) != 1 || devs[0].VendorName != "" || !devs[0].PassthroughReady {
		t.Errorf("without pci.ids: %+v, %v", devs, err)
	}
}
