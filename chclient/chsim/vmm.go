package chsim

import (
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"slices"
	"strings"
	"time"
)

type endpoint struct {
	method  string
	hasBody bool // false: a body is 400 Bad Request
	handle  func(s *sim, r *request) (response, func())
}

// endpoints are the v53 routes under /api/v1/. Routes the simulator does not model answer
// 500 with a chain that says so.
var endpoints = map[string]endpoint{
	"vmm.ping":         {http.MethodGet, false, (*sim).ping},
	"vmm.shutdown":     {http.MethodPut, false, (*sim).vmmShutdown},
	"vm.create":        {http.MethodPut, true, (*sim).create},
	"vm.boot":          {http.MethodPut, false, (*sim).boot},
	"vm.info":          {http.MethodGet, false, (*sim).info},
	"vm.shutdown":      {http.MethodPut, false, (*sim).shutdown},
	"vm.power-button":  {http.MethodPut, false, (*sim).powerButton},
	"vm.reboot":        {http.MethodPut, false, (*sim).reboot},
	"vm.pause":         {http.MethodPut, false, (*sim).pause},
	"vm.resume":        {http.MethodPut, false, (*sim).resume},
	"vm.delete":        {http.MethodPut, false, (*sim).delete},
	"vm.counters":      {http.MethodGet, false, (*sim).countersHandler},
	"vm.resize":        {http.MethodPut, true, (*sim).resize},
	"vm.add-disk":      {http.MethodPut, true, (*sim).addDisk},
	"vm.remove-device": {http.MethodPut, true, (*sim).removeDevice},
	"vm.snapshot":      {http.MethodPut, true, (*sim).snapshot},
	"vm.restore":       {http.MethodPut, true, (*sim).restore},
	"vm.nmi":           {http.MethodPut, false, unsupported},

	"vm.add-device": {http.MethodPut, true, unsupported}, "vm.add-net": {http.MethodPut, true, unsupported},
	"vm.add-vsock": {http.MethodPut, true, unsupported}, "vm.add-fs": {http.MethodPut, true, unsupported},
	"vm.add-pmem": {http.MethodPut, true, unsupported}, "vm.add-vdpa": {http.MethodPut, true, unsupported},
	"vm.add-user-device": {http.MethodPut, true, unsupported}, "vm.add-generic-vhost-user": {http.MethodPut, true, unsupported},
	"vm.resize-disk": {http.MethodPut, true, unsupported}, "vm.resize-zone": {http.MethodPut, true, unsupported},
	"vm.send-migration": {http.MethodPut, true, unsupported}, "vm.receive-migration": {http.MethodPut, true, unsupported},
}

func unsupported(s *sim, r *request) (response, func()) {
	return apiError(http.StatusInternalServerError, "chsim does not simulate "+strings.TrimPrefix(r.path, "/api/v1/")), nil
}

// route dispatches one request. The returned func runs after the response is written
// (process exit, guest actions).
func (s *sim) route(r *request) (response, func()) {
	if strings.HasPrefix(r.path, "/sim/v1/") {
		if s.qemuMode() {
			// A real guest does what it does; nothing drives it from outside.
			return controlError(http.StatusNotFound, "the qemu backend runs a real guest: /sim/v1/ is not available"), nil
		}
		return s.control(r)
	}
	if s.hung.Load() {
		// A hung VMM accepts connections but never answers.
		select {}
	}
	name, ok := strings.CutPrefix(r.path, "/api/v1/")
	ep, known := endpoints[name]
	if !ok || !known {
		return jsonResponse(http.StatusNotFound, []string{"Not Found"}), nil
	}
	if r.method != ep.method {
		return jsonResponse(http.StatusBadRequest, []string{"Bad Request"}), nil
	}
	if !ep.hasBody && r.body != nil {
		return jsonResponse(http.StatusBadRequest, []string{"Bad Request"}), nil
	}
	if ep.hasBody && r.body == nil {
		if name == "vm.create" {
			// vm.create's own handler answers a missing body with no error body.
			return response{status: http.StatusBadRequest}, nil
		}
		return jsonResponse(http.StatusBadRequest, []string{"Bad Request"}), nil
	}
	s.logf(2, "API request %s %s", r.method, r.path)
	return ep.handle(s, r)
}

func deserialize(data []byte, into any) *response {
	err := json.Unmarshal(data, into)
	if err == nil {
		return nil
	}
	msg := serdeMessage(err).Error()
	resp := jsonResponse(http.StatusBadRequest, []string{"Failed to deserialize JSON", msg})
	return &resp
}

func noContent() response { return response{status: http.StatusNoContent} }

func (s *sim) ping(*request) (response, func()) {
	return jsonResponse(http.StatusOK, map[string]any{
		"build_version": s.buildVersion(),
		"version":       "53.0.0",
		"pid":           os.Getpid(),
		"features":      []string{"io_uring", "kvm"},
	}), nil
}

func (s *sim) vmmShutdown(*request) (response, func()) {
	return response{status: http.StatusOK}, func() { s.terminate(0) }
}

func (s *sim) create(r *request) (response, func()) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.state != stateNone {
		return apiError(http.StatusInternalServerError, "The VM could not be created", "VM is already created"), nil
	}
	var cfg vmConfig
	if resp := deserialize(r.body, &cfg); resp != nil {
		return *resp, nil
	}
	s.vm = &cfg
	s.state = stateCreated
	// Console back-ends are created at vm.create; a failure answers 500 but keeps the config.
	if err := s.openConsolesLocked(); err != nil {
		return apiError(http.StatusInternalServerError, "The VM could not be created", "Error creating console devices", err.Error()), nil
	}
	s.logf(1, "VM created")
	return noContent(), nil
}

func (s *sim) openConsolesLocked() error {
	if s.vm.Console.Mode == "Socket" {
		return errors.New("No socket option support for console device")
	}
	if s.vm.Serial.Mode == "Socket" && s.serial == nil {
		if s.vm.Serial.Socket == nil {
			return errors.New("Path missing when using socket console mode")
		}
		sp, err := openSerial(*s.vm.Serial.Socket)
		if err != nil {
			return err
		}
		s.serial = sp
	}
	return nil
}

func (s *sim) boot(*request) (response, func()) {
	s.mu.Lock()
	defer s.mu.Unlock()
	switch s.state {
	case stateNone:
		return apiError(http.StatusNotFound, "The VM could not boot", "VM config is missing"), nil
	case stateRunning, statePaused:
		return apiError(http.StatusInternalServerError, "The VM could not boot", "VM is already created"), nil
	}
	s.emit("vm", "booting", nil)
	if chain := s.bootLocked(); chain != nil {
		return apiError(http.StatusInternalServerError, append([]string{"The VM could not boot"}, chain...)...), nil
	}
	s.emit("vm", "booted", nil)
	if s.cfg.PoweroffAtBoot {
		// The guest powers off as soon as it is up: after the answer, as
		// with a real guest, whose boot takes longer than the API call.
		gen := s.bootGen
		return noContent(), func() { s.guestPoweroff(gen) }
	}
	return noContent(), nil
}

// bootLocked validates the config the way VmConfig::validate does, acquires what CH would
// (files, vhost-user sockets, taps, the vsock socket) and starts the VM. It returns the
// error chain after "The VM could not boot", or nil.
func (s *sim) bootLocked() []string {
	if err := validate(s.vm); err != nil {
		return []string{"Error validating configuration", err.Error()}
	}
	for _, p := range []*string{s.vm.Payload.Kernel, s.vm.Payload.Firmware, s.vm.Payload.Initramfs} {
		if p == nil {
			continue
		}
		f, err := os.Open(*p)
		if err != nil {
			return []string{"Cannot open the kernel image", osErrText(err)}
		}
		f.Close()
	}
	if err := s.openConsolesLocked(); err != nil {
		return []string{"Error creating console devices", err.Error()}
	}
	if s.qemuMode() {
		// qemu opens the disks, vhost-user sockets and taps itself; the simulator
		// holding them would take them from it.
		s.assignDevicesLocked()
		return s.bootQemuLocked()
	}
	held, chain := s.acquireDevicesLocked()
	if chain != nil {
		return chain
	}
	s.assignDevicesLocked()
	s.holdDevicesLocked(held)
	s.state = stateRunning
	s.guestDownLocked()
	s.bootGen++
	s.serialWrite("chsim: Linux version 6.1.0-chsim booting\r\n")
	s.scheduleActivateLocked()
	if err := s.startGuestAgentLocked(); err != nil {
		// A guest without its init panics; the VM itself is up.
		s.logf(0, "Error: %v", err)
	}
	return nil
}

// heldDevices is what the device manager opened for a boot or a restore.
type heldDevices struct {
	taps  []*os.File
	vhost []net.Conn // one per vhost-user disk, in config order
	vsock *vsockMux
}

func (h *heldDevices) release() {
	for _, f := range h.taps {
		f.Close()
	}
	for _, c := range h.vhost {
		c.Close()
	}
	if h.vsock != nil {
		h.vsock.close()
	}
}

// acquireDevicesLocked opens what CH's device manager opens for the config, at a boot as
// at a restore: disk images, vhost-user sockets, taps by name, VFIO paths and the vsock
// socket. It returns the error chain below "The VM could not boot" (or be restored), with
// nothing left held.
func (s *sim) acquireDevicesLocked() (*heldDevices, []string) {
	h := &heldDevices{}
	fail := func(chain ...string) (*heldDevices, []string) {
		h.release()
		return nil, chain
	}
	for _, d := range s.vm.Disks {
		if d.VhostUser {
			c, err := net.Dial("unix", deref(d.VhostSocket))
			if err != nil {
				return fail("Error creating device manager", "Cannot create virtio-block device",
					"Failed to connect to vhost-user backend", osErrText(err))
			}
			h.vhost = append(h.vhost, c)
			continue
		}
		f, err := os.Open(deref(d.Path))
		if err != nil {
			return fail("Error creating device manager", "Cannot create virtio-block device",
				"Failed to open disk file", osErrText(err))
		}
		f.Close()
	}
	for _, n := range s.vm.Net {
		if n.Tap == nil {
			s.logf(0, "net without tap: chsim does not create taps; device %s has no backend", deref(n.ID))
			continue
		}
		f, err := attachTap(*n.Tap, n.NumQueues > 2)
		if err != nil {
			return fail("Error creating device manager", "Cannot create virtio-net device",
				"Open tap device failed", err.Error())
		}
		h.taps = append(h.taps, f)
	}
	for _, d := range s.vm.Devices {
		if _, err := os.Stat(deref(d.Path)); err != nil {
			return fail("Error creating device manager", "Cannot create VFIO device", osErrText(err))
		}
	}
	if v := s.vm.Vsock; v != nil {
		mux, err := s.openVsock(v.Socket)
		if err != nil {
			return fail("Error creating device manager", "Cannot create virtio-vsock device",
				"Failed to create vsock backend", err.Error())
		}
		h.vsock = mux
	}
	return h, nil
}

// holdDevicesLocked keeps what acquireDevicesLocked opened for the running VM, each
// vhost-user connection under its disk's id (the ids are assigned by now), so an unplug
// closes it.
func (s *sim) holdDevicesLocked(h *heldDevices) {
	s.taps = h.taps
	s.vsock = h.vsock
	s.vhost = map[string]net.Conn{}
	j := 0
	for _, d := range s.vm.Disks {
		if d.VhostUser {
			s.vhost[*d.ID] = h.vhost[j]
			j++
		}
	}
}

func osErrText(err error) string {
	var pe *os.PathError
	if errors.As(err, &pe) {
		err = pe.Err
	}
	var ope *net.OpError
	if errors.As(err, &ope) {
		err = ope.Err
		var se *os.SyscallError
		if errors.As(err, &se) {
			err = se.Err
		}
	}
	return fmt.Sprintf("%s", err)
}

// validate reproduces the VmConfig::validate checks vmhost can trip over.
func validate(c *vmConfig) error {
	if c.Payload == nil || (c.Payload.Kernel == nil) == (c.Payload.Firmware == nil) {
		return errors.New("Payload configuration is not bootable")
	}
	if c.Cpus.MaxVcpus < c.Cpus.BootVcpus {
		return errors.New("Max CPUs lower than boot CPUs")
	}
	if t := c.Cpus.Topology; t != nil {
		if t.ThreadsPerCore == 0 || t.CoresPerDie == 0 || t.DiesPerPackage == 0 || t.Packages == 0 {
			return errors.New("No part of the CPU topology can be zero")
		}
		if uint32(t.ThreadsPerCore)*uint32(t.CoresPerDie)*uint32(t.DiesPerPackage)*uint32(t.Packages) != c.Cpus.MaxVcpus {
			return errors.New("Product of CPU topology parts does not match maximum vCPU")
		}
	}
	if c.Memory.HugepageSize != nil && !c.Memory.Hugepages {
		return errors.New("Huge page size specified but huge pages not enabled")
	}
	shared := c.Memory.Shared || c.Memory.Hugepages
	ids := map[string]bool{}
	checkID := func(id *string) error {
		if id == nil {
			return nil
		}
		if strings.HasPrefix(*id, "__") {
			return fmt.Errorf("Identifier %s is not invalid", *id)
		}
		if ids[*id] {
			return fmt.Errorf("Identifier %s is not unique", *id)
		}
		ids[*id] = true
		return nil
	}
	for _, d := range c.Disks {
		if d.Path != nil && d.VhostSocket != nil {
			return errors.New("Disk path and vhost socket both provided")
		}
		if d.VhostUser {
			if !shared {
				return errors.New("Using vhost-user requires using shared memory or huge pages")
			}
			if d.VhostSocket == nil {
				return errors.New("No socket provided when using vhost-user")
			}
		} else if d.Path == nil {
			return errors.New("Disk path missing")
		}
		if uint32(d.NumQueues) > c.Cpus.BootVcpus {
			return errors.New("Number of vCPUs is insufficient for number of queues")
		}
		if d.Serial != nil && len(*d.Serial) > 20 {
			return fmt.Errorf("Block device serial length (%d) exceeds maximum allowed length (20)", len(*d.Serial))
		}
		if err := checkID(d.ID); err != nil {
			return err
		}
	}
	for _, n := range c.Net {
		if n.NumQueues < 2 {
			return errors.New("Number of queues to virtio_net less than 2")
		}
		if uint32(n.NumQueues/2) > c.Cpus.BootVcpus {
			return errors.New("Number of vCPUs is insufficient for number of queues")
		}
		if n.VhostUser && !shared {
			return errors.New("Using vhost-user requires using shared memory or huge pages")
		}
		if n.Mtu != nil && *n.Mtu < 1280 {
			return fmt.Errorf("Provided MTU %d is lower than 1280 (expected by VIRTIO specification)", *n.Mtu)
		}
		if (n.IP == nil) != (n.Mask == nil) {
			return errors.New("Both ip and mask must be given")
		}
		if err := checkID(n.ID); err != nil {
			return err
		}
	}
	if v := c.Vsock; v != nil {
		if v.Cid <= 2 || v.Cid == 0xFFFFFFFF {
			return fmt.Errorf("%d is a special VSOCK CID", v.Cid)
		}
		if err := checkID(v.ID); err != nil {
			return err
		}
	}
	if b := c.Balloon; b != nil && b.Size >= c.Memory.Size {
		return fmt.Errorf("Ballon size (%d) greater than RAM (%d)", b.Size, c.Memory.Size)
	}
	if c.Serial.Mode == "File" && c.Serial.File == nil || c.Console.Mode == "File" && c.Console.File == nil {
		return errors.New("Path missing when using file console mode")
	}
	paths := map[string]bool{}
	for _, d := range c.Devices {
		if paths[deref(d.Path)] {
			return fmt.Errorf("Duplicated device path: %s", deref(d.Path))
		}
		paths[deref(d.Path)] = true
		if err := checkID(d.ID); err != nil {
			return err
		}
	}
	return nil
}

// assignDevicesLocked gives unnamed devices CH's generated ids (one shared counter) and
// every PCI device a slot, in the order CH's device manager creates them.
func (s *sim) assignDevicesLocked() {
	s.bdfs = map[string]string{}
	s.order = nil
	s.counters = map[string]map[string]uint64{}
	slot := 1
	add := func(id string, virtio bool) {
		s.bdfs[id] = fmt.Sprintf("0000:00:%02x.0", slot)
		slot++
		if virtio {
			s.order = append(s.order, id)
		}
	}
	gen := func(id **string, prefix string) string {
		if *id == nil {
			*id = strp(fmt.Sprintf("_%s%d", prefix, s.nextID))
			s.nextID++
		}
		return **id
	}
	if s.vm.Console.Mode != "Off" {
		add("__console", true)
	}
	for i := range s.vm.Disks {
		id := gen(&s.vm.Disks[i].ID, "disk")
		add(id, true)
		s.counters[id] = blockCounters()
	}
	for i := range s.vm.Net {
		id := gen(&s.vm.Net[i].ID, "net")
		add(id, true)
		s.counters[id] = map[string]uint64{"rx_bytes": 0, "rx_frames": 0, "tx_bytes": 0, "tx_frames": 0}
	}
	add("__rng", true)
	if s.vm.Balloon != nil {
		if s.vm.Balloon.ID == nil {
			s.vm.Balloon.ID = strp("__balloon")
		}
		add(*s.vm.Balloon.ID, true)
	}
	if s.vm.Vsock != nil {
		add(gen(&s.vm.Vsock.ID, "vsock"), true)
	}
	if s.vm.Watchdog {
		add(watchdogID, true)
	}
	if s.vm.Pvpanic {
		add("__pvpanic", false)
	}
	for i := range s.vm.Devices {
		add(gen(&s.vm.Devices[i].ID, "vfio"), false)
	}
}

func blockCounters() map[string]uint64 {
	m := map[string]uint64{}
	for _, k := range []string{"read_bytes", "write_bytes", "read_ops", "write_ops",
		"read_latency_min", "read_latency_max", "read_latency_avg",
		"write_latency_min", "write_latency_max", "write_latency_avg"} {
		m[k] = 0
	}
	return m
}

func (s *sim) nextSlotLocked() string {
	used := map[string]bool{}
	for _, b := range s.bdfs {
		used[b] = true
	}
	for slot := 1; slot < 32; slot++ {
		b := fmt.Sprintf("0000:00:%02x.0", slot)
		if !used[b] {
			return b
		}
	}
	return ""
}

func (s *sim) scheduleActivateLocked() {
	if s.cfg.NoActivate {
		return
	}
	gen := s.bootGen
	time.AfterFunc(s.cfg.ActivateDelay, func() {
		s.mu.Lock()
		defer s.mu.Unlock()
		if s.bootGen == gen {
			s.activateLocked()
		}
	})
}

// activateLocked is the guest's drivers coming up: they take the virtio devices they have
// a driver for (of ids only, when given: a guest whose kernel lacks the others' drivers,
// or loads them later), in the order the devices were created, and CH announces each one
// it implements itself with "virtio-device activated". It reports whether a device was
// taken.
func (s *sim) activateLocked(ids ...string) bool {
	if s.state != stateRunning && s.state != statePaused {
		return false
	}
	took := false
	for _, id := range s.order {
		if s.taken[id] || !guestDriverTakes(id) || len(ids) > 0 && !slices.Contains(ids, id) {
			continue
		}
		s.takeLocked(id)
		took = true
	}
	if took && !s.activated {
		s.activated = true
		s.serialWrite("chsim login: ")
	}
	return took
}

// takeLocked is the guest's driver taking device id: CH announces it unless it is
// vhost-user.
func (s *sim) takeLocked(id string) {
	if s.taken == nil {
		s.taken = map[string]bool{}
	}
	s.taken[id] = true
	if s.announcesActivationLocked(id) {
		s.emit("virtio-device", "activated", map[string]string{"id": id})
	}
}

// resetDevicesLocked is the guest's drivers going down before a guest reboot or poweroff:
// CH reports the reset of every device the guest had taken, vhost-user ones included
// (their common reset path emits it, although their activation emitted nothing).
func (s *sim) resetDevicesLocked() {
	for _, id := range s.order {
		if s.taken[id] {
			s.emit("virtio-device", "reset", map[string]string{"id": id})
		}
	}
	s.guestDownLocked()
}

// guestDownLocked forgets the guest's drivers: its OS is not up and has no device.
func (s *sim) guestDownLocked() {
	s.activated = false
	s.taken = nil
}

// watchdogID is the id CH gives its virtio-watchdog device.
const watchdogID = "__watchdog"

// guestDriverTakes reports whether the simulated guest, a stock Linux kernel, has a
// driver for virtio device id: every one CH offers but the virtio-watchdog, whose driver
// only CH's kernel fork carries.
func guestDriverTakes(id string) bool { return id != watchdogID }

// announcesActivationLocked reports whether CH v53 emits "virtio-device activated" when a
// guest's driver takes device id: it does for the devices it implements itself (block on
// a file, net on a tap, console, rng, balloon, vsock, …), not for vhost-user-blk and
// vhost-user-net, whose activate has no event (docs/ref/cloud-hypervisor.md §11).
func (s *sim) announcesActivationLocked(id string) bool {
	for _, d := range s.vm.Disks {
		if deref(d.ID) == id {
			return !d.VhostUser
		}
	}
	for _, n := range s.vm.Net {
		if deref(n.ID) == id {
			return !n.VhostUser
		}
	}
	return true
}

// stopLocked stops a running or paused VM: the config stays and the state is Created.
func (s *sim) stopLocked() {
	s.emit("vm", "shutdown", nil)
	s.releaseLocked()
	s.state = stateCreated
}

func (s *sim) releaseLocked() {
	s.bootGen++
	s.guestDownLocked()
	s.agentOnResume = false
	for _, f := range s.taps {
		f.Close()
	}
	for _, c := range s.vhost {
		c.Close()
	}
	s.taps, s.vhost = nil, nil
	if s.qemu != nil {
		s.qemu.stop()
		s.qemu = nil
	}
	s.stopGuestAgentLocked()
	s.dropSavedLocked()
	if s.vsock != nil {
		s.vsock.close()
		s.vsock = nil
	}
	if s.serial != nil {
		s.serial.close()
		s.serial = nil
	}
	s.bdfs = nil
}

func (s *sim) dropConfigLocked() {
	if s.serial != nil {
		s.serial.close()
		s.serial = nil
	}
	s.vm = nil
	s.state = stateNone
	s.emit("vm", "deleted", nil)
}

func (s *sim) info(*request) (response, func()) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.state == stateNone {
		return apiError(http.StatusNotFound, "The VM info is not available", "VM is not created"), nil
	}
	info := map[string]any{
		"config":             s.vm,
		"state":              s.state.String(),
		"memory_actual_size": s.vm.Memory.Size,
	}
	if s.state == stateRunning || s.state == statePaused {
		// Once booted: less what the balloon holds, plus hotplugged memory
		// (docs/ref/cloud-hypervisor.md §5). The simulated guest gives the
		// balloon all it asks for at once.
		actual := s.vm.Memory.Size
		if h := s.vm.Memory.HotpluggedSize; h != nil {
			actual += *h
		}
		if b := s.vm.Balloon; b != nil {
			actual -= min(b.Size, actual)
		}
		if s.qemuMode() && s.vm.Balloon != nil {
			// What the real guest's balloon driver has given back so far.
			var bal struct {
				Actual uint64 `json:"actual"`
			}
			if err := s.qmpArgsLocked("query-balloon", nil, &bal); err == nil {
				actual = bal.Actual
			}
		}
		info["memory_actual_size"] = actual
		info["device_tree"] = s.deviceTreeLocked()
	}
	return jsonResponse(http.StatusOK, info), nil
}

// deviceNode is one entry of CH's device tree (vm.info, and the device manager's part of a
// snapshot's state.json).
type deviceNode struct {
	ID        string   `json:"id"`
	Resources []any    `json:"resources"`
	Parent    string   `json:"parent,omitempty"`
	Children  []string `json:"children"`
	PciBdf    string   `json:"pci_bdf,omitempty"`
}

// deviceTreeLocked is the running VM's device tree: each PCI device under its virtio-pci
// transport node, which carries the address.
func (s *sim) deviceTreeLocked() map[string]deviceNode {
	tree := map[string]deviceNode{}
	for id, bdf := range s.bdfs {
		wrapper := transportID(id)
		tree[id] = deviceNode{ID: id, Resources: []any{}, Parent: wrapper, Children: []string{}}
		tree[wrapper] = deviceNode{ID: wrapper, Resources: []any{}, Children: []string{id}, PciBdf: bdf}
	}
	return tree
}

// transportID is the id CH gives the virtio-pci transport of device id.
func transportID(id string) string { return "_virtio-pci-" + id }

func (s *sim) notRunning(op string) response {
	return apiError(http.StatusInternalServerError, op, "VM is not running")
}

func (s *sim) shutdown(*request) (response, func()) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.state != stateRunning && s.state != statePaused {
		return s.notRunning("The VM could not shutdown"), nil
	}
	s.stopLocked()
	return noContent(), nil
}

// powerButton presses the ACPI button. A classic guest whose OS is up (devices activated)
// powers off shortly after, as systemd does on the button, unless /sim/v1/power-button
// made it ignore the button; one that has not booted yet ignores it. An AppVM's guest
// agent gets SIGPWR and does what it does with the button.
func (s *sim) powerButton(*request) (response, func()) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.state != stateRunning && s.state != statePaused {
		return s.notRunning("Error triggering power button"), nil
	}
	if s.qemuMode() {
		// The ACPI button press; what follows is up to the guest.
		if err := s.qmpLocked("system_powerdown"); err != nil {
			return apiError(http.StatusInternalServerError, "Error triggering power button", err.Error()), nil
		}
		return noContent(), nil
	}
	if pid := s.agentPidLocked(); pid != 0 {
		// An AppVM's guest agent watches the button: SIGPWR stands for
		// the press; it stops the workload and powers off (its exit).
		if err := pressAgentPowerButton(pid); err != nil {
			return apiError(http.StatusInternalServerError, "Error triggering power button", err.Error()), nil
		}
		return noContent(), nil
	}
	if !s.activated {
		s.logf(1, "power button pressed; the guest is not up and ignores it")
		return noContent(), nil
	}
	if s.ignorePowerButton {
		s.logf(1, "power button pressed; the guest ignores it (/sim/v1/power-button)")
		return noContent(), nil
	}
	gen := s.bootGen
	return noContent(), func() {
		time.AfterFunc(powerButtonDelay, func() { s.guestPoweroff(gen) })
	}
}

// powerButtonDelay is how long the simulated classic guest takes from the ACPI power
// button to its poweroff (its init stopping its services).
const powerButtonDelay = 50 * time.Millisecond

// guestPoweroff is an ACPI S5 from the guest (gen 0 means whatever is running now).
func (s *sim) guestPoweroff(gen int) bool {
	s.mu.Lock()
	if s.state != stateRunning || gen != 0 && gen != s.bootGen {
		s.mu.Unlock()
		return false
	}
	s.resetDevicesLocked()
	if s.cfg.NoShutdown {
		s.stopLocked()
		s.mu.Unlock()
		return true
	}
	s.mu.Unlock()
	s.terminate(0)
	return true
}

func (s *sim) reboot(*request) (response, func()) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.state != stateRunning && s.state != statePaused {
		return apiError(http.StatusNotFound, "The VM could not reboot", "VM is not created"), nil
	}
	if chain := s.rebootLocked(); chain != nil {
		return apiError(http.StatusInternalServerError, append([]string{"The VM could not reboot"}, chain...)...), nil
	}
	return noContent(), nil
}

// rebootLocked re-creates the VM in the same process: the vsock socket is unlinked and
// bound again (open connections drop) and the guest comes up again.
func (s *sim) rebootLocked() []string {
	if s.qemuMode() {
		return s.rebootQemuLocked()
	}
	s.emit("vm", "rebooting", nil)
	s.bootGen++
	s.guestDownLocked()
	s.stopGuestAgentLocked()
	s.agentOnResume = false
	if s.vsock != nil {
		s.vsock.close()
		mux, err := s.openVsock(s.vm.Vsock.Socket)
		if err != nil {
			s.vsock = nil
			return []string{"Cannot create virtio-vsock device", err.Error()}
		}
		s.vsock = mux
	}
	s.state = stateRunning
	s.emit("vm", "rebooted", nil)
	s.scheduleActivateLocked()
	// The guest's init runs again.
	if err := s.startGuestAgentLocked(); err != nil {
		s.logf(0, "Error: %v", err)
	}
	return nil
}

func (s *sim) pause(*request) (response, func()) {
	s.mu.Lock()
	defer s.mu.Unlock()
	switch s.state {
	case stateRunning:
		s.emit("vm", "pausing", nil)
		if s.qemuMode() {
			if err := s.qmpLocked("stop"); err != nil {
				return apiError(http.StatusInternalServerError, "The VM could not be paused", "Cannot pause VM", err.Error()), nil
			}
		}
		s.state = statePaused
		s.pauseGuestAgentLocked(true)
		s.emit("vm", "paused", nil)
		return noContent(), nil
	case statePaused:
		return apiError(http.StatusInternalServerError, "The VM could not be paused", "Cannot pause VM",
			"Failed to pause migratable component", "Invalid transition: InvalidStateTransition(Paused, Paused)"), nil
	}
	return s.notRunning("The VM could not be paused"), nil
}

func (s *sim) resume(*request) (response, func()) {
	s.mu.Lock()
	defer s.mu.Unlock()
	switch s.state {
	case statePaused:
		if chain := s.resumeLocked(); chain != nil {
			return apiError(http.StatusInternalServerError, append([]string{"The VM could not resume", "Cannot resume VM"}, chain...)...), nil
		}
		return noContent(), nil
	case stateRunning:
		return apiError(http.StatusInternalServerError, "The VM could not resume", "Cannot resume VM",
			"Failed to resume migratable component", "Invalid transition: InvalidStateTransition(Running, Running)"), nil
	}
	return s.notRunning("The VM could not resume"), nil
}

// resumeLocked runs the paused VM; it returns the chain below "Cannot resume VM" when qemu
// refuses.
func (s *sim) resumeLocked() []string {
	s.emit("vm", "resuming", nil)
	if s.qemuMode() {
		if err := s.qemuPlugVsockLocked(); err != nil {
			return []string{err.Error()}
		}
		if err := s.qmpLocked("cont"); err != nil {
			return []string{err.Error()}
		}
	}
	s.state = stateRunning
	s.dropSavedLocked() // the guest runs on: it is no longer the state it was saved as
	if s.agentOnResume {
		// Restored without its agent process: the guest's init runs it again.
		s.agentOnResume = false
		if err := s.startGuestAgentLocked(); err != nil {
			s.logf(0, "Error: %v", err)
		}
	} else {
		s.pauseGuestAgentLocked(false)
	}
	s.emit("vm", "resumed", nil)
	return nil
}

func (s *sim) delete(*request) (response, func()) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.state == stateRunning || s.state == statePaused {
		s.stopLocked()
	}
	if s.state == stateCreated {
		s.dropConfigLocked()
	}
	return noContent(), nil
}

func (s *sim) countersHandler(*request) (response, func()) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.state != stateRunning && s.state != statePaused {
		return s.notRunning("The VM info is not available"), nil
	}
	if s.qemuMode() {
		return notInQemu("The VM info is not available", "vm.counters"), nil
	}
	return jsonResponse(http.StatusOK, s.counters), nil
}

func (s *sim) resize(r *request) (response, func()) {
	var req resizeRequest
	if resp := deserialize(r.body, &req); resp != nil {
		return *resp, nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	const op = "The VM could not be resized"
	switch s.state {
	case stateNone:
		return apiError(http.StatusNotFound, op, "VM is not created"), nil
	case stateCreated:
		if req.DesiredVcpus != nil {
			s.vm.Cpus.BootVcpus = *req.DesiredVcpus
		}
		if req.DesiredRAM != nil {
			s.vm.Memory.Size = *req.DesiredRAM
		}
		if req.DesiredBalloon != nil && s.vm.Balloon != nil {
			s.vm.Balloon.Size = *req.DesiredBalloon
		}
		return noContent(), nil
	}
	if s.qemuMode() {
		// The balloon alone: qemu's balloon command takes the memory the
		// guest should keep; the guest's driver inflates toward it.
		if req.DesiredVcpus != nil || req.DesiredRAM != nil || req.DesiredBalloon == nil || s.vm.Balloon == nil {
			return notInQemu(op, "resizing a booted VM, except its balloon"), nil
		}
		keep := s.vm.Memory.Size - min(*req.DesiredBalloon, s.vm.Memory.Size)
		if err := s.qmpArgsLocked("balloon", map[string]uint64{"value": keep}, nil); err != nil {
			return apiError(http.StatusInternalServerError, op, "Error resizing VM", "Cannot resize balloon", err.Error()), nil
		}
		s.vm.Balloon.Size = *req.DesiredBalloon
		return noContent(), nil
	}
	if req.DesiredVcpus != nil && (*req.DesiredVcpus == 0 || *req.DesiredVcpus > s.vm.Cpus.MaxVcpus) {
		return apiError(http.StatusInternalServerError, op, "Error resizing VM", "Cannot resize vCPUs",
			fmt.Sprintf("Desired vCPUs %d exceeds maximum %d", *req.DesiredVcpus, s.vm.Cpus.MaxVcpus)), nil
	}
	if req.DesiredRAM != nil {
		limit := s.vm.Memory.Size
		if s.vm.Memory.HotplugSize != nil {
			limit += *s.vm.Memory.HotplugSize
		}
		if *req.DesiredRAM > limit || *req.DesiredRAM < s.vm.Memory.Size {
			return apiError(http.StatusInternalServerError, op, "Error resizing VM", "Cannot resize memory",
				"Invalid memory size for hotplug"), nil
		}
	}
	s.emit("vm", "resizing", nil)
	if req.DesiredVcpus != nil {
		s.vm.Cpus.BootVcpus = *req.DesiredVcpus
	}
	if req.DesiredRAM != nil && *req.DesiredRAM > s.vm.Memory.Size {
		plugged := *req.DesiredRAM - s.vm.Memory.Size
		s.vm.Memory.HotpluggedSize = &plugged
	}
	if req.DesiredBalloon != nil && s.vm.Balloon != nil {
		s.vm.Balloon.Size = *req.DesiredBalloon
	}
	s.emit("vm", "resized", nil)
	return noContent(), nil
}

func (s *sim) addDisk(r *request) (response, func()) {
	var d diskConfig
	if resp := deserialize(r.body, &d); resp != nil {
		return *resp, nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	const op = "The disk could not be added to the VM"
	if s.state == stateNone {
		return apiError(http.StatusNotFound, op, "VM is not created"), nil
	}
	if d.ID != nil {
		for _, e := range s.vm.Disks {
			if e.ID != nil && *e.ID == *d.ID {
				return apiError(http.StatusInternalServerError, op, "Error validating configuration",
					fmt.Sprintf("Identifier %s is not unique", *d.ID)), nil
			}
		}
	}
	if s.state == stateCreated {
		s.vm.Disks = append(s.vm.Disks, d)
		return noContent(), nil
	}
	if s.qemuMode() {
		return s.hotAddDiskQemuLocked(d), nil
	}
	var vhostConn net.Conn
	if d.VhostUser {
		c, err := net.Dial("unix", deref(d.VhostSocket))
		if err != nil {
			return apiError(http.StatusInternalServerError, op, "Failed to connect to vhost-user backend", osErrText(err)), nil
		}
		vhostConn = c
	} else {
		f, err := os.Open(deref(d.Path))
		if err != nil {
			return apiError(http.StatusInternalServerError, op, "Failed to open disk file", osErrText(err)), nil
		}
		f.Close()
	}
	if d.ID == nil {
		d.ID = strp(fmt.Sprintf("_disk%d", s.nextID))
		s.nextID++
	}
	if vhostConn != nil {
		s.vhost[*d.ID] = vhostConn
	}
	bdf := s.nextSlotLocked()
	s.bdfs[*d.ID] = bdf
	s.order = append(s.order, *d.ID)
	s.counters[*d.ID] = blockCounters()
	s.vm.Disks = append(s.vm.Disks, d)
	if s.activated {
		// The guest's driver takes the new disk (after the answer, as CH's event follows it).
		id := *d.ID
		defer s.takeLocked(id)
	}
	return jsonResponse(http.StatusOK, map[string]string{"id": *d.ID, "bdf": bdf}), nil
}

func (s *sim) removeDevice(r *request) (response, func()) {
	var req removeRequest
	if resp := deserialize(r.body, &req); resp != nil {
		return *resp, nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	const op = "The device could not be removed from the VM"
	if s.state == stateNone {
		return apiError(http.StatusNotFound, op, "VM is not created"), nil
	}
	if !s.removeFromConfigLocked(req.ID, s.state == stateCreated) {
		return apiError(http.StatusInternalServerError, op, fmt.Sprintf("No device with id %s to remove", req.ID)), nil
	}
	if s.state == stateCreated {
		return noContent(), nil
	}
	if s.qemuMode() {
		return s.hotRemoveQemuLocked(req.ID), nil
	}
	if s.refuseEject {
		// The guest ignores this eject request: the device stays, no event.
		s.logf(1, "the guest refuses to eject %s", req.ID)
		return noContent(), nil
	}
	gen := s.bootGen
	id := req.ID
	return noContent(), func() {
		// The guest acks the eject shortly after; only then is the device gone.
		time.AfterFunc(50*time.Millisecond, func() {
			s.mu.Lock()
			defer s.mu.Unlock()
			if s.bootGen != gen {
				return
			}
			if c, ok := s.vhost[id]; ok {
				c.Close()
				delete(s.vhost, id)
			}
			if v := s.vm.Vsock; v != nil && deref(v.ID) == id && s.vsock != nil {
				s.vsock.close()
				s.vsock = nil
			}
			bdf := s.dropDeviceLocked(id)
			s.emit("vm", "device-removed", map[string]string{"id": id, "bdf": bdf})
		})
	}
}

// dropDeviceLocked removes device id, which the guest ejected, from the config and the
// running VM's bookkeeping, and returns the PCI address it had.
func (s *sim) dropDeviceLocked(id string) string {
	bdf := s.bdfs[id]
	s.removeFromConfigLocked(id, true)
	delete(s.bdfs, id)
	delete(s.counters, id)
	delete(s.taken, id)
	s.order = slices.DeleteFunc(s.order, func(x string) bool { return x == id })
	return bdf
}

// removeFromConfigLocked reports whether a removable device with id exists, removing it
// from the config when commit is set.
func (s *sim) removeFromConfigLocked(id string, commit bool) bool {
	match := func(p *string) bool { return p != nil && *p == id }
	for i, d := range s.vm.Disks {
		if match(d.ID) {
			if commit {
				s.vm.Disks = slices.Delete(s.vm.Disks, i, i+1)
			}
			return true
		}
	}
	for i, n := range s.vm.Net {
		if match(n.ID) {
			if commit {
				s.vm.Net = slices.Delete(s.vm.Net, i, i+1)
			}
			return true
		}
	}
	if v := s.vm.Vsock; v != nil && match(v.ID) {
		if commit {
			s.vm.Vsock = nil
		}
		return true
	}
	for i, d := range s.vm.Devices {
		if match(d.ID) {
			if commit {
				s.vm.Devices = slices.Delete(s.vm.Devices, i, i+1)
			}
			return true
		}
	}
	return false
}
