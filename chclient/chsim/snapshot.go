package chsim

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
)

// vm.snapshot and vm.restore as CH v53 does them (vmm/src/lib.rs vm_snapshot, vm_restore;
// vmm/src/vm.rs Snapshottable and Transportable for Vm; vmm/src/migration/mod.rs): the
// same state rules, the same files with the same names and tree shape, the same error
// chains. What the files hold below CH's structure is the simulator's own state.

// The files of a snapshot directory. qemuStreamFile is the qemu backend's: its guest memory
// and device state are qemu's migration stream, written in place of memory-ranges.
const (
	snapshotConfigFile = "config.json"
	snapshotStateFile  = "state.json"
	snapshotMemoryFile = "memory-ranges"
	qemuStreamFile     = "qemu-migration"
)

// The component ids of CH's snapshot tree (vmm/src/lib.rs).
const (
	cpuManagerID    = "cpu-manager"
	memoryManagerID = "memory-manager"
	deviceManagerID = "device-manager"
)

// snapshotRequest is the body of vm.snapshot (VmSnapshotConfig).
type snapshotRequest struct {
	DestinationURL string `json:"destination_url"`
}

func (r *snapshotRequest) UnmarshalJSON(data []byte) error {
	type plain snapshotRequest
	var p plain
	if err := decodeStrict(data, &p, "destination_url"); err != nil {
		return err
	}
	*r = snapshotRequest(p)
	return nil
}

// restoreRequest is the body of vm.restore (RestoreConfig). net_fds names file descriptors
// sent with the request (SCM_RIGHTS) for nets built from fds; the simulator's nets never
// are, so like CH for such configs it ignores the field.
type restoreRequest struct {
	SourceURL         string `json:"source_url"`
	Prefault          bool   `json:"prefault"`
	MemoryRestoreMode string `json:"memory_restore_mode"`
	Resume            bool   `json:"resume"`
}

func (r *restoreRequest) UnmarshalJSON(data []byte) error {
	type plain restoreRequest
	p := plain{MemoryRestoreMode: "Copy"}
	if err := decodeStrict(data, &p, "source_url"); err != nil {
		return err
	}
	if err := checkEnum("memory_restore_mode", p.MemoryRestoreMode, "Copy", "OnDemand"); err != nil {
		return err
	}
	*r = restoreRequest(p)
	return nil
}

// snapshotTree is CH's vm_migration::Snapshot: components keyed by id, each with its state
// as a JSON document inside a string.
type snapshotTree struct {
	Snapshots    map[string]*snapshotTree `json:"snapshots"`
	SnapshotData *snapshotData            `json:"snapshot_data"`
}

type snapshotData struct {
	State string `json:"state"`
}

// newSnapshot makes a component with state (nil: none).
func newSnapshot(state any) *snapshotTree {
	t := &snapshotTree{Snapshots: map[string]*snapshotTree{}}
	if state != nil {
		data, _ := json.Marshal(state)
		t.SnapshotData = &snapshotData{State: string(data)}
	}
	return t
}

// decode reads the component's state as CH's Snapshot::to_state does, with its messages.
func (t *snapshotTree) decode(into any) error {
	if t == nil || t.SnapshotData == nil {
		return errors.New("Missing snapshot data")
	}
	if err := json.Unmarshal([]byte(t.SnapshotData.State), into); err != nil {
		return fmt.Errorf("Error deserialising: %s", strings.TrimPrefix(err.Error(), "json: "))
	}
	return nil
}

func (t *snapshotTree) child(id string) *snapshotTree {
	if t == nil {
		return nil
	}
	return t.Snapshots[id]
}

// vmSnapshotState is the root component (CH's VmSnapshot); chsim is the simulator's part.
type vmSnapshotState struct {
	CommonCpuid []any          `json:"common_cpuid"`
	Chsim       *simGuestState `json:"chsim,omitempty"`
}

// simGuestState is what the simulated guest keeps in its memory, and which backend wrote
// the snapshot (a snapshot restores only where it was taken).
type simGuestState struct {
	Backend     string   `json:"backend"`
	Activated   bool     `json:"activated"`              // the guest's drivers have their devices
	GuestPorts  []uint32 `json:"guest_ports,omitempty"`  // vsock ports the guest listens on
	RefuseEject bool     `json:"refuse_eject,omitempty"` // /sim/v1/eject
	DeviceOrder []string `json:"device_order"`           // virtio devices in creation order
	// Stream is the qemu backend's migration stream, a file of the snapshot directory.
	Stream string `json:"stream,omitempty"`
	// GuestAgent names the AppVM guest agent of a process-mode guest (keep_linux.go:
	// keptAgent), which a restore adopts if it was kept.
	GuestAgent json.RawMessage `json:"guest_agent,omitempty"`
	// GuestRoot names the copy of the process-mode guest's root directory
	// (guestroot.go), which a restore that cannot adopt the agent puts back.
	GuestRoot string `json:"guest_root,omitempty"`
	// IgnorePowerButton: the guest ignores the ACPI power button (/sim/v1/power-button).
	IgnorePowerButton bool `json:"ignore_power_button,omitempty"`
}

type memoryRange struct {
	Gpa    uint64 `json:"gpa"`
	Length uint64 `json:"length"`
}

// memoryManagerState is the part of CH's MemoryManagerSnapshotData that places
// memory-ranges: the ranges, stored back to back in the file, and the RAM sizes.
type memoryManagerState struct {
	MemoryRanges struct {
		Data []memoryRange `json:"data"`
	} `json:"memory_ranges"`
	BootRAM    uint64 `json:"boot_ram"`
	CurrentRAM uint64 `json:"current_ram"`
}

// deviceManagerState is CH's DeviceManagerState: the device tree (PCI addresses) and the
// counter of generated ids.
type deviceManagerState struct {
	DeviceTree  map[string]deviceNode `json:"device_tree"`
	DeviceIDCnt int                   `json:"device_id_cnt"`
}

// transportState is the part of CH's VirtioPciDeviceState that says whether the guest's
// driver had the device.
type transportState struct {
	DeviceActivated bool `json:"device_activated"`
}

// deviceState is a device's own component: the simulator keeps its counters.
type deviceState struct {
	Counters map[string]uint64 `json:"counters,omitempty"`
}

// x86_64 RAM layout (arch/src/x86_64/layout.rs): RAM up to the 32-bit device hole at 3 GiB,
// the rest from 4 GiB.
const (
	mem32BitReservedStart = 0xc000_0000
	ram64BitStart         = 0x1_0000_0000
)

// ramRanges are the guest RAM ranges CH's memory manager lists for a VM of size bytes.
func ramRanges(size uint64) []memoryRange {
	if size <= mem32BitReservedStart {
		return []memoryRange{{Gpa: 0, Length: size}}
	}
	return []memoryRange{{Gpa: 0, Length: mem32BitReservedStart}, {Gpa: ram64BitStart, Length: size - mem32BitReservedStart}}
}

// osError formats an OS error as Rust's io::Error displays it: "File exists (os error 17)".
func osError(err error) string {
	var errno syscall.Errno
	if !errors.As(err, &errno) {
		return osErrText(err)
	}
	msg := errno.Error()
	if msg != "" {
		msg = strings.ToUpper(msg[:1]) + msg[1:]
	}
	return fmt.Sprintf("%s (os error %d)", msg, int(errno))
}

// urlToPath is CH's url_to_path: a file:// URL naming an existing directory. CH reports
// its failures as send errors, for a restore too.
func urlToPath(url string) (string, error) {
	path, ok := strings.CutPrefix(url, "file://")
	if !ok {
		return "", fmt.Errorf("Could not extract path from URL: %s", url)
	}
	if fi, err := os.Stat(path); err != nil || !fi.IsDir() {
		return "", fmt.Errorf("Destination is not a directory: %s", strconv.Quote(path))
	}
	return path, nil
}

func (s *sim) snapshot(r *request) (response, func()) {
	var req snapshotRequest
	if resp := deserialize(r.body, &req); resp != nil {
		return *resp, nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	const op = "The VM could not be snapshotted"
	if s.state != stateRunning && s.state != statePaused {
		return apiError(http.StatusInternalServerError, op, "VM is not running"), nil
	}
	// CH announces the snapshot before it checks the state.
	s.emit("vm", "snapshotting", nil)
	if s.state != statePaused {
		return apiError(http.StatusInternalServerError, op, "Cannot snapshot VM", "Failed to snapshot migratable component",
			"Trying to snapshot while VM is running"), nil
	}
	if s.qemuMode() {
		if why := s.qemuSnapshotBlockedLocked(); why != "" {
			return apiError(http.StatusInternalServerError, op, "Cannot snapshot VM", "Failed to snapshot migratable component", why), nil
		}
	}
	tree := s.snapshotTreeLocked()
	s.emit("vm", "snapshotted", nil)
	if chain := s.sendSnapshotLocked(tree, req.DestinationURL); chain != nil {
		return apiError(http.StatusInternalServerError, append([]string{op, "Cannot send VM snapshot",
			"Failed to send migratable component snapshot"}, chain...)...), nil
	}
	if dir, err := urlToPath(req.DestinationURL); err == nil {
		s.noteSavedLocked(dir) // the paused guest is the state just saved
	}
	s.logf(1, "VM snapshotted to %s", req.DestinationURL)
	return noContent(), nil
}

// snapshotTreeLocked collects the paused VM's state in CH's tree: the root (the simulated
// guest), one component per vCPU, the memory layout, and the device manager with one
// component per device and per virtio-pci transport.
func (s *sim) snapshotTreeLocked() *snapshotTree {
	guest := &simGuestState{Backend: s.backendName(), Activated: s.activated, RefuseEject: s.refuseEject,
		DeviceOrder: slices.Clone(s.order), GuestAgent: s.saveGuestAgentLocked(), IgnorePowerButton: s.ignorePowerButton}
	if s.wantsGuestAgentLocked() {
		guest.GuestRoot = guestRootFile
	}
	for p := range s.guestPorts {
		guest.GuestPorts = append(guest.GuestPorts, p)
	}
	slices.Sort(guest.GuestPorts)
	mem := memoryManagerState{BootRAM: s.vm.Memory.Size, CurrentRAM: s.vm.Memory.Size}
	mem.MemoryRanges.Data = ramRanges(s.vm.Memory.Size)
	if s.qemuMode() {
		// qemu's stream carries the memory: CH lists no range it does not copy itself.
		guest.Stream = qemuStreamFile
		mem.MemoryRanges.Data = []memoryRange{}
	}
	root := newSnapshot(vmSnapshotState{CommonCpuid: []any{}, Chsim: guest})
	cpus := newSnapshot(nil)
	for i := range s.vm.Cpus.BootVcpus {
		cpus.Snapshots[strconv.Itoa(int(i))] = newSnapshot(struct{}{})
	}
	root.Snapshots[cpuManagerID] = cpus
	root.Snapshots[memoryManagerID] = newSnapshot(mem)
	dev := newSnapshot(deviceManagerState{DeviceTree: s.deviceTreeLocked(), DeviceIDCnt: s.nextID})
	for id := range s.bdfs {
		dev.Snapshots[id] = newSnapshot(deviceState{Counters: s.counters[id]})
		dev.Snapshots[transportID(id)] = newSnapshot(transportState{DeviceActivated: s.taken[id]})
	}
	root.Snapshots[deviceManagerID] = dev
	return root
}

func (s *sim) backendName() string {
	if s.qemuMode() {
		return BackendQemu
	}
	return BackendSim
}

// createNew creates a file that must not exist yet, as CH's OpenOptions::create_new.
func createNew(path string) (*os.File, error) {
	return os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o666)
}

// sendSnapshotLocked writes the snapshot as CH's Vm::send does: config.json, state.json,
// then the memory (memory-ranges, or the qemu backend's stream), each created anew, none
// synced. It returns the chain below "Failed to send migratable component snapshot".
func (s *sim) sendSnapshotLocked(tree *snapshotTree, url string) []string {
	dir, err := urlToPath(url)
	if err != nil {
		return []string{err.Error()}
	}
	write := func(name, what string, data []byte) []string {
		f, err := createNew(filepath.Join(dir, name))
		if err != nil {
			return []string{"Error creating VM " + what + " snapshot file", osError(err)}
		}
		defer f.Close()
		if _, err := f.Write(data); err != nil {
			return []string{"Error writing VM " + what + " snapshot", osError(err)}
		}
		return nil
	}
	config, _ := json.Marshal(s.vm)
	if chain := write(snapshotConfigFile, "config", config); chain != nil {
		return chain
	}
	if s.wantsGuestAgentLocked() {
		if err := saveGuestRoot(GuestRoot(s.vm.Vsock.Socket), filepath.Join(dir, guestRootFile)); err != nil {
			return []string{"Error writing the guest root", err.Error()}
		}
	}
	state, _ := json.Marshal(tree)
	if chain := write(snapshotStateFile, "state", state); chain != nil {
		return chain
	}
	name := snapshotMemoryFile
	if s.qemuMode() {
		name = qemuStreamFile
	}
	path := filepath.Join(dir, name)
	f, err := createNew(path)
	if err != nil {
		return []string{"Error creating memory snapshot file " + strconv.Quote(path), osError(err)}
	}
	defer f.Close()
	if s.qemuMode() {
		if err := s.qemuSaveLocked(f); err != nil {
			return []string{"Error writing the qemu migration stream", err.Error()}
		}
		return nil
	}
	// The simulated guest never touched its RAM: the ranges are holes, as CH leaves the
	// pages of shared memory the guest never wrote.
	var total uint64
	for _, r := range ramRanges(s.vm.Memory.Size) {
		total += r.Length
	}
	if err := f.Truncate(int64(total)); err != nil {
		return []string{"Error writing dense memory snapshot region", osError(err)}
	}
	return nil
}

func (s *sim) restore(r *request) (response, func()) {
	var req restoreRequest
	if resp := deserialize(r.body, &req); resp != nil {
		return *resp, nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	const op = "The VM could not be restored"
	fail := func(chain ...string) (response, func()) {
		return apiError(http.StatusInternalServerError, append([]string{op}, chain...)...), nil
	}
	if s.state != stateNone {
		return fail("VM is already created")
	}
	dir, err := urlToPath(req.SourceURL)
	if err != nil {
		return fail("Cannot restore VM", "Failed to send migratable component snapshot", err.Error())
	}
	cfg, chain := readSnapshotConfig(dir)
	if chain != nil {
		return fail(append([]string{"Cannot restore VM", "Failed to receive migratable component snapshot"}, chain...)...)
	}
	if req.Prefault && req.MemoryRestoreMode == "OnDemand" {
		return fail("Failed to validate config", "'prefault' cannot be combined with 'memory_restore_mode=ondemand'")
	}
	tree, chain := readSnapshotState(dir)
	if chain != nil {
		return fail(append([]string{"Cannot restore VM", "Failed to receive migratable component snapshot"}, chain...)...)
	}
	var root vmSnapshotState
	if tree.SnapshotData == nil {
		return fail("Cannot restore VM", "Failed to restore migratable component", "Could not find VM config snapshot section")
	}
	if err := tree.decode(&root); err != nil {
		return fail("Cannot restore VM", "Failed to restore migratable component", err.Error())
	}
	guest := root.Chsim
	if guest == nil || guest.Backend != s.backendName() {
		taken := "Cloud Hypervisor"
		if guest != nil {
			taken = "the chsim " + guest.Backend + " backend"
		}
		return fail("Cannot restore VM", "Failed to restore migratable component",
			fmt.Sprintf("the snapshot was taken by %s; this simulator runs the %s backend", taken, s.backendName()))
	}

	// From here on CH holds the config; a failure drops it again (vm deleted).
	s.vm = cfg
	s.state = stateCreated
	undo := func(chain ...string) (response, func()) {
		s.releaseLocked()
		s.dropConfigLocked()
		return fail(chain...)
	}
	if err := s.openConsolesLocked(); err != nil {
		return undo("Error creating console devices", err.Error())
	}
	var mem memoryManagerState
	if c := tree.child(memoryManagerID); c != nil {
		if err := c.decode(&mem); err != nil {
			return undo("Memory manager error", "Cannot restore VM", "Failed to restore migratable component", err.Error())
		}
	}
	stream := ""
	if len(mem.MemoryRanges.Data) > 0 || guest.Stream != "" {
		name := snapshotMemoryFile
		if guest.Stream != "" {
			name = guest.Stream
		}
		f, err := os.Open(filepath.Join(dir, name))
		if err != nil {
			return undo("Memory manager error", "Error opening snapshot file", osError(err))
		}
		f.Close()
		stream = filepath.Join(dir, name)
	}
	var devState deviceManagerState
	if err := tree.child(deviceManagerID).decode(&devState); err != nil {
		return undo("Error from device manager", "Failed retrieving device state from snapshot", err.Error())
	}
	s.bdfs = map[string]string{}
	for _, n := range devState.DeviceTree {
		if n.PciBdf != "" && len(n.Children) == 1 {
			s.bdfs[n.Children[0]] = n.PciBdf
		}
	}
	s.order = slices.Clone(guest.DeviceOrder)
	s.nextID = devState.DeviceIDCnt
	s.counters = map[string]map[string]uint64{}
	for id := range s.bdfs {
		var d deviceState
		if c := tree.child(deviceManagerID).child(id); c != nil && c.decode(&d) == nil && d.Counters != nil {
			s.counters[id] = d.Counters
		}
	}
	if s.qemuMode() {
		if chain := s.restoreQemuLocked(stream); chain != nil {
			return undo(chain...)
		}
	} else {
		held, chain := s.acquireDevicesLocked()
		if chain != nil {
			return undo(chain...)
		}
		s.holdDevicesLocked(held)
	}
	if p := s.vm.Payload; p != nil && p.Initramfs != nil {
		// v53's Vm::new opens the initramfs on a restore too.
		f, err := os.Open(*p.Initramfs)
		if err != nil {
			return undo("Cannot open initramfs file", osError(err))
		}
		f.Close()
	}
	s.guestPorts = map[uint32]bool{}
	for _, p := range guest.GuestPorts {
		s.guestPorts[p] = true
	}
	s.refuseEject = guest.RefuseEject
	s.ignorePowerButton = guest.IgnorePowerButton
	s.activated = guest.Activated
	s.state = statePaused
	s.bootGen++
	if !s.qemuMode() {
		// The devices the guest's drivers had are activated again as they are created;
		// CH announces those it implements itself (a vhost-user disk's activate is silent).
		for _, id := range s.order {
			var ts transportState
			if c := tree.child(deviceManagerID).child(transportID(id)); c != nil && c.decode(&ts) == nil && ts.DeviceActivated {
				s.takeLocked(id)
			}
		}
		if !s.activated {
			// Snapshotted before its drivers came up: the guest goes on booting.
			s.scheduleActivateLocked()
		}
	}
	s.emit("vm", "restoring", nil)
	s.emit("vm", "restored", nil)
	s.restoreGuestAgentLocked(guest, dir)
	s.logf(1, "VM restored from %s", req.SourceURL)
	if req.Resume {
		if chain := s.resumeLocked(); chain != nil {
			// CH deletes the VM when the resume after a restore fails.
			s.stopLocked()
			return undo(append([]string{"Cannot resume VM"}, chain...)...)
		}
	}
	return noContent(), nil
}

// readSnapshotConfig is CH's recv_vm_config: config.json decoded as vm.create decodes its
// body. It returns the chain below "Failed to receive migratable component snapshot".
func readSnapshotConfig(dir string) (*vmConfig, []string) {
	path := filepath.Join(dir, snapshotConfigFile)
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, []string{"Error opening VM config snapshot file " + strconv.Quote(path), osError(err)}
	}
	var cfg vmConfig
	if err := json.Unmarshal(data, &cfg); err != nil {
		return nil, []string{"Error deserialising VM config snapshot", serdeMessage(err).Error()}
	}
	return &cfg, nil
}

// readSnapshotState is CH's recv_vm_state: state.json as a snapshot tree.
func readSnapshotState(dir string) (*snapshotTree, []string) {
	path := filepath.Join(dir, snapshotStateFile)
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, []string{"Error opening VM state snapshot file " + strconv.Quote(path), osError(err)}
	}
	var tree snapshotTree
	if err := json.Unmarshal(data, &tree); err != nil {
		return nil, []string{"Error deserialising VM state snapshot", serdeMessage(err).Error()}
	}
	return &tree, nil
}

// restoreGuestAgentLocked brings back the AppVM guest agent after a restore. A real guest's
// agent is in the guest's memory and simply goes on (its vsock connections to the host are
// reset: CH v53 queues a RST for each connection the snapshot recorded). Here the agent is
// a host process: one kept with the saved state is adopted (keep_linux.go) and continues
// with the VM's resume, its host connection found closed, as a reset one; otherwise (the
// VM ran on after the snapshot, or the agent is gone) the guest root is put back as saved
// and the agent starts afresh with the guest's next resume, its workload again.
func (s *sim) restoreGuestAgentLocked(guest *simGuestState, dir string) {
	if !s.wantsGuestAgentLocked() {
		return
	}
	if len(guest.GuestAgent) > 0 {
		var k keptAgent
		if err := json.Unmarshal(guest.GuestAgent, &k); err == nil {
			g, err := s.adoptGuestAgentLocked(k)
			if err == nil {
				s.agent = g
				s.noteSavedLocked(dir) // paused, the guest is the state restored
				return
			}
			s.logf(1, "the saved guest agent is not kept (%v): it starts afresh at the resume", err)
		}
	}
	if guest.GuestRoot != "" {
		if err := restoreGuestRoot(filepath.Join(dir, guest.GuestRoot), GuestRoot(s.vm.Vsock.Socket)); err != nil {
			s.logf(0, "Error: restoring the guest root: %v", err)
		}
	}
	s.agentOnResume = true
}
