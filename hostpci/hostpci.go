// Package hostpci reads the host's PCI devices from sysfs
// (<sysfs>/bus/pci/devices/*: vendor, device, class, the driver and
// iommu_group links, numa_node) and names them from the host's pci.ids,
// and says whether a device can be passed through to a VM: it has an IOMMU
// group and every device of the group is bound to vfio-pci.
//
// The package imports none of vmhost's packages.
package hostpci

import (
	"bufio"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
)

// VFIODriver is the driver a device must be bound to for passthrough.
const VFIODriver = "vfio-pci"

// PCIIDsPaths are where distributions put pci.ids, in the order tried.
var PCIIDsPaths = []string{"/usr/share/misc/pci.ids", "/usr/share/hwdata/pci.ids"}

// Device is one PCI function as sysfs shows it.
type Device struct {
	BDF        string `json:"bdf"`
	VendorID   string `json:"vendor_id"`
	DeviceID   string `json:"device_id"`
	Class      string `json:"class"`
	VendorName string `json:"vendor_name,omitempty"`
	DeviceName string `json:"device_name,omitempty"`
	Driver     string `json:"driver,omitempty"`
	// IOMMUGroup is nil without an IOMMU (or with the device outside one).
	IOMMUGroup *int `json:"iommu_group,omitempty"`
	// IOMMUGroupDevices are the BDFs of the group, this one included,
	// sorted; empty without a group.
	IOMMUGroupDevices []string `json:"iommu_group_devices"`
	NUMANode          *int     `json:"numa_node,omitempty"`
	// PassthroughReady: the group exists and every member is on vfio-pci.
	PassthroughReady bool `json:"passthrough_ready"`
}

// List returns every PCI device under sysfs in BDF order, named from the
// first pci.ids of idsPaths that can be read (none: no names). A host
// without PCI (no bus/pci/devices) has no devices, not an error.
func List(sysfs string, idsPaths []string) ([]Device, error) {
	dir := filepath.Join(sysfs, "bus/pci/devices")
	ents, err := os.ReadDir(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return []Device{}, nil
	}
	if err != nil {
		return nil, fmt.Errorf("reading PCI devices: %w", err)
	}
	names := loadNames(idsPaths)
	devs := make([]Device, 0, len(ents))
	drivers := map[string]string{}
	for _, e := range ents {
		d, err := read(sysfs, e.Name())
		if err != nil {
			return nil, err
		}
		d.VendorName, d.DeviceName = names.lookup(d.VendorID, d.DeviceID)
		drivers[d.BDF] = d.Driver
		devs = append(devs, d)
	}
	for i := range devs {
		devs[i].PassthroughReady = ready(devs[i], func(bdf string) string {
			if drv, ok := drivers[bdf]; ok {
				return drv
			}
			return driverOf(sysfs, bdf)
		})
	}
	slices.SortFunc(devs, func(a, b Device) int { return strings.Compare(a.BDF, b.BDF) })
	return devs, nil
}

// Check says why the device bdf cannot be passed through, or nil when it
// can. A device that does not exist gives an error satisfying
// errors.Is(err, fs.ErrNotExist).
func Check(sysfs, bdf string) error {
	d, err := read(sysfs, bdf)
	if err != nil {
		return err
	}
	if d.IOMMUGroup == nil {
		return fmt.Errorf("%s has no IOMMU group (is the IOMMU enabled: intel_iommu=on or amd_iommu=on?)", bdf)
	}
	for _, m := range d.IOMMUGroupDevices {
		switch drv := driverOf(sysfs, m); {
		case drv == VFIODriver:
		case m == bdf && drv == "":
			return fmt.Errorf("%s is bound to no driver, not %s", bdf, VFIODriver)
		case m == bdf:
			return fmt.Errorf("%s is bound to %s, not %s", bdf, drv, VFIODriver)
		case drv == "":
			return fmt.Errorf("%s shares IOMMU group %d with %s, which is bound to no driver, not %s", bdf, *d.IOMMUGroup, m, VFIODriver)
		default:
			return fmt.Errorf("%s shares IOMMU group %d with %s, which is bound to %s, not %s", bdf, *d.IOMMUGroup, m, drv, VFIODriver)
		}
	}
	return nil
}

func ready(d Device, driver func(bdf string) string) bool {
	if d.IOMMUGroup == nil {
		return false
	}
	for _, m := range d.IOMMUGroupDevices {
		if driver(m) != VFIODriver {
			return false
		}
	}
	return true
}

// read reads one device's directory.
func read(sysfs, bdf string) (Device, error) {
	if bdf == "" || strings.ContainsAny(bdf, "/\x00") || bdf == "." || bdf == ".." {
		return Device{}, fmt.Errorf("PCI device %q: %w", bdf, fs.ErrNotExist)
	}
	dir := filepath.Join(sysfs, "bus/pci/devices", bdf)
	if _, err := os.Stat(dir); err != nil {
		return Device{}, fmt.Errorf("PCI device %s: %w", bdf, err)
	}
	d := Device{BDF: bdf, IOMMUGroupDevices: []string{}}
	for _, f := range []struct {
		name string
		dst  *string
	}{{"vendor", &d.VendorID}, {"device", &d.DeviceID}, {"class", &d.Class}} {
		data, err := os.ReadFile(filepath.Join(dir, f.name))
		if err != nil {
			return Device{}, fmt.Errorf("reading PCI device %s: %w", bdf, err)
		}
		*f.dst = strings.TrimSpace(string(data))
	}
	d.Driver = driverOf(sysfs, bdf)
	if data, err := os.ReadFile(filepath.Join(dir, "numa_node")); err == nil {
		if n, err := strconv.Atoi(strings.TrimSpace(string(data))); err == nil && n >= 0 {
			d.NUMANode = &n
		}
	}
	link, err := os.Readlink(filepath.Join(dir, "iommu_group"))
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return d, nil
		}
		return Device{}, fmt.Errorf("reading the IOMMU group of %s: %w", bdf, err)
	}
	g, err := strconv.Atoi(filepath.Base(link))
	if err != nil {
		return Device{}, fmt.Errorf("IOMMU group of %s: %q is not a group number", bdf, filepath.Base(link))
	}
	d.IOMMUGroup = &g
	members, err := os.ReadDir(filepath.Join(sysfs, "kernel/iommu_groups", strconv.Itoa(g), "devices"))
	if err != nil {
		return Device{}, fmt.Errorf("reading IOMMU group %d: %w", g, err)
	}
	for _, m := range members {
		d.IOMMUGroupDevices = append(d.IOMMUGroupDevices, m.Name())
	}
	slices.Sort(d.IOMMUGroupDevices)
	return d, nil
}

// driverOf is the name of the driver bdf is bound to ("" for none).
func driverOf(sysfs, bdf string) string {
	link, err := os.Readlink(filepath.Join(sysfs, "bus/pci/devices", bdf, "driver"))
	if err != nil {
		return ""
	}
	return filepath.Base(link)
}

// names are the vendor and device names of pci.ids, keyed by lower-case
// hex ids without 0x ("10de", "10de:2204").
type names map[string]string

func (n names) lookup(vendorID, deviceID string) (vendor, device string) {
	v := strings.ToLower(strings.TrimPrefix(vendorID, "0x"))
	d := strings.ToLower(strings.TrimPrefix(deviceID, "0x"))
	return n[v], n[v+":"+d]
}

// loadNames reads the first readable pci.ids of paths. Its format: a
// vendor line "vvvv  Name", its devices "\tdddd  Name", subsystems
// "\t\t…" (skipped), and after the vendors the class lists, from the
// first "C " line on (skipped).
func loadNames(paths []string) names {
	n := names{}
	for _, p := range paths {
		f, err := os.Open(p)
		if err != nil {
			continue
		}
		defer f.Close()
		sc := bufio.NewScanner(f)
		vendor := ""
		for sc.Scan() {
			line := sc.Text()
			switch {
			case line == "" || line[0] == '#':
			case strings.HasPrefix(line, "C "):
				return n
			case strings.HasPrefix(line, "\t\t"):
			case line[0] == '\t':
				if id, name, ok := idLine(line[1:]); ok && vendor != "" {
					n[vendor+":"+id] = name
				}
			default:
				vendor = ""
				if id, name, ok := idLine(line); ok {
					vendor = id
					n[id] = name
				}
			}
		}
		return n
	}
	return n
}

func idLine(s string) (id, name string, ok bool) {
	id, name, ok = strings.Cut(s, "  ")
	if !ok || len(id) != 4 || strings.Trim(id, "0123456789abcdef") != "" {
		return "", "", false
	}
	return id, strings.TrimSpace(name), true
}
