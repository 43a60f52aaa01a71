package api

import (
	"net/http"
	"os"
	"slices"
	"strings"

	"vmhost/doctor"
	"vmhost/vm"
)

// HostView is GET /api/host (docs/api.md, The host): who this agent is and
// what the host can still take, in the numbers admission decides with
// (vm.Service.Capacity): a create fits when its vcpus are at most
// cpus.allocatable − cpus.used, its memory_mb at most memory_mb.allocatable
// − memory_mb.used, and its new disks at most disk_bytes.state_free −
// disk_bytes.committed; one more is 409 CAPACITY_CONFLICT.
type HostView struct {
	Hostname  string         `json:"hostname"`
	AgentID   string         `json:"agent_id"`
	Version   string         `json:"version"`
	BootID    string         `json:"boot_id"`
	KVM       bool           `json:"kvm"`
	CPUs      HostCPUs       `json:"cpus"`
	MemoryMB  HostMemory     `json:"memory_mb"`
	DiskBytes HostDisk       `json:"disk_bytes"`
	VMs       map[string]int `json:"vms"`
	Features  []string       `json:"features"`
}

// HostCPUs counts CPUs: online is the host's (or the config's host_cpus),
// allocatable the vCPUs VMs may hold (online × the CPU overcommit), used
// the vCPUs of VMs neither stopped nor failed, creates in flight included.
type HostCPUs struct {
	Online      uint64 `json:"online"`
	Allocatable uint64 `json:"allocatable"`
	Used        uint64 `json:"used"`
}

// HostMemory counts MiB as HostCPUs counts CPUs: total is MemTotal (or the
// config's host_memory_mb).
type HostMemory struct {
	Total       uint64 `json:"total"`
	Allocatable uint64 `json:"allocatable"`
	Used        uint64 `json:"used"`
}

// HostDisk is the state directory's file system: its size, the space
// available to the agent, and what provisions in flight will still write
// there.
type HostDisk struct {
	StateTotal uint64 `json:"state_total"`
	StateFree  uint64 `json:"state_free"`
	Committed  uint64 `json:"committed"`
}

// Feature is an optional capability GET /api/host lists while On reports
// that this agent has it now. The API's own are in hostFeatures; the
// wiring adds those of the packages below it (Config.Features).
type Feature struct {
	Name string
	On   func() bool
}

// hostFeatures are the features the API itself can tell: a package that
// adds a capability visible from here adds its entry; one visible only
// below (the engine's) is passed in Config.Features by main_wire.go.
var hostFeatures = []struct {
	name string
	on   func(*Server) bool
}{
	// AppVMs can boot: the configured AppVM kernel is a file.
	{"appvm", func(s *Server) bool {
		k := s.vms.Config().AppVMKernel
		fi, err := os.Stat(k)
		return k != "" && err == nil && fi.Mode().IsRegular()
	}},
	// Labels, their filters and PATCH .../labels (this API).
	{"labels", func(*Server) bool { return true }},
	// Guests may run KVM themselves (nested: true at create).
	{"nested", func(s *Server) bool { return s.vms.Facts().NestedSupported() }},
	// The IOMMU is on: devices bound to vfio-pci can be passed through
	// (GET /api/host/pci says which are ready).
	{"pci_passthrough", func(s *Server) bool { return s.vms.Facts().IOMMU() }},
}

// bootIDPath is where Linux gives the id of the running boot.
const bootIDPath = "/proc/sys/kernel/random/boot_id"

// getHost answers GET /api/host.
func (s *Server) getHost(w http.ResponseWriter, r *http.Request) {
	c, err := s.vms.Capacity()
	if err != nil {
		s.log.Error("reading the host's capacity", "err", err)
		writeError(w, http.StatusInternalServerError, CodeInternal, "reading the host's capacity: "+err.Error())
		return
	}
	v := HostView{
		AgentID:   s.agentID,
		Version:   s.version,
		KVM:       doctor.KVMReady(s.kvmDevice),
		CPUs:      HostCPUs{Online: c.HostCPUs, Allocatable: c.VCPUs, Used: c.VCPUsUsed},
		MemoryMB:  HostMemory{Total: c.HostMemoryMB, Allocatable: c.MemoryMB, Used: c.MemoryMBUsed},
		DiskBytes: HostDisk{StateTotal: c.DiskTotal, StateFree: c.DiskFree, Committed: c.DiskCommitted},
		VMs:       map[string]int{},
		Features:  []string{},
	}
	v.Hostname, _ = os.Hostname()
	if b, err := os.ReadFile(bootIDPath); err == nil {
		v.BootID = strings.TrimSpace(string(b))
	}
	for _, st := range []vm.State{vm.StateCreated, vm.StateRunning, vm.StatePaused, vm.StateStopped, vm.StateFailed} {
		v.VMs[string(st)] = 0
	}
	for _, mode := range []vm.Mode{vm.ModeVM, vm.ModeAppVM} {
		for _, rec := range s.vms.List(mode) {
			v.VMs[string(rec.State)]++
		}
	}
	for _, f := range hostFeatures {
		if f.on(s) {
			v.Features = append(v.Features, f.name)
		}
	}
	for _, f := range s.features {
		if f.On() {
			v.Features = append(v.Features, f.Name)
		}
	}
	slices.Sort(v.Features)
	writeJSON(w, http.StatusOK, v)
}
