package vm

import (
	"bufio"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"

	"vmhost/hostpci"
)

// HostFacts reads what validation and admission need to know about the host
// from a sysfs tree. Tests point Sysfs at a fake tree in a temp dir.
type HostFacts struct {
	// Sysfs is the root of the sysfs tree, normally /sys.
	Sysfs string
	// Nested, when set, overrides what kvm_intel/kvm_amd report.
	Nested *bool
	// Meminfo is the path of /proc/meminfo.
	Meminfo string
}

// IOMMU reports whether the host has an IOMMU in use: the kernel lists
// IOMMU groups, so devices bound to vfio-pci can be passed through.
func (h HostFacts) IOMMU() bool {
	d, err := os.Open(filepath.Join(h.Sysfs, "kernel/iommu_groups"))
	if err != nil {
		return false
	}
	defer d.Close()
	names, _ := d.Readdirnames(1)
	return len(names) > 0
}

// OnlineCPUs lists the host's online logical CPUs (devices/system/cpu/online).
func (h HostFacts) OnlineCPUs() ([]int, error) {
	b, err := os.ReadFile(filepath.Join(h.Sysfs, "devices/system/cpu/online"))
	if err != nil {
		return nil, fmt.Errorf("reading online CPUs: %w", err)
	}
	cpus, err := ParseCPUSet(strings.TrimSpace(string(b)))
	if err != nil {
		return nil, fmt.Errorf("reading online CPUs: %w", err)
	}
	return cpus, nil
}

// NestedSupported reports whether KVM on this host lets guests run KVM: the
// config override if set, else the nested parameter of kvm_intel or kvm_amd.
func (h HostFacts) NestedSupported() bool {
	if h.Nested != nil {
		return *h.Nested
	}
	for _, mod := range []string{"kvm_intel", "kvm_amd"} {
		b, err := os.ReadFile(filepath.Join(h.Sysfs, "module", mod, "parameters/nested"))
		if err != nil {
			continue
		}
		switch strings.TrimSpace(string(b)) {
		case "Y", "y", "1":
			return true
		}
	}
	return false
}

// MemoryMB is the host's MemTotal in MiB.
func (h HostFacts) MemoryMB() (uint64, error) {
	path := h.Meminfo
	if path == "" {
		path = "/proc/meminfo"
	}
	f, err := os.Open(path)
	if err != nil {
		return 0, fmt.Errorf("reading host memory: %w", err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		rest, ok := strings.CutPrefix(sc.Text(), "MemTotal:")
		if !ok {
			continue
		}
		kb, err := strconv.ParseUint(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 10, 64)
		if err != nil {
			return 0, fmt.Errorf("reading host memory: bad MemTotal line %q", sc.Text())
		}
		return kb / 1024, nil
	}
	return 0, fmt.Errorf("reading host memory: no MemTotal in %s", path)
}

// BridgeExists reports whether a bridge interface of that name exists.
func (h HostFacts) BridgeExists(name string) bool {
	if name == "" || strings.ContainsAny(name, "/\x00") || name == "." || name == ".." {
		return false
	}
	st, err := os.Stat(filepath.Join(h.Sysfs, "class/net", name, "bridge"))
	return err == nil && st.IsDir()
}

var bdfPattern = regexp.MustCompile(`^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$`)

// ValidBDF reports whether s is a full PCI address, domain:bus:device.function,
// in lower-case hex as sysfs spells it (0000:01:00.0).
func ValidBDF(s string) bool { return bdfPattern.MatchString(s) }

// PassthroughReady says why the PCI device bdf cannot be passed through
// (no IOMMU group, it or a member of its group not bound to vfio-pci), or
// nil when it can.
func (h HostFacts) PassthroughReady(bdf string) error { return hostpci.Check(h.Sysfs, bdf) }

// IOMMUGroup returns the IOMMU group of a PCI device and every device in
// that group, sorted. A device that does not exist gives an error satisfying
// errors.Is(err, fs.ErrNotExist).
func (h HostFacts) IOMMUGroup(bdf string) (group string, members []string, err error) {
	dev := filepath.Join(h.Sysfs, "bus/pci/devices", bdf)
	if _, err := os.Stat(dev); err != nil {
		return "", nil, fmt.Errorf("PCI device %s: %w", bdf, err)
	}
	link, err := os.Readlink(filepath.Join(dev, "iommu_group"))
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return "", nil, fmt.Errorf("PCI device %s has no IOMMU group (is the IOMMU enabled?)", bdf)
		}
		return "", nil, fmt.Errorf("reading IOMMU group of %s: %w", bdf, err)
	}
	group = filepath.Base(link)
	entries, err := os.ReadDir(filepath.Join(h.Sysfs, "kernel/iommu_groups", group, "devices"))
	if err != nil {
		return "", nil, fmt.Errorf("reading IOMMU group %s: %w", group, err)
	}
	for _, e := range entries {
		members = append(members, e.Name())
	}
	slices.Sort(members)
	return group, members, nil
}
