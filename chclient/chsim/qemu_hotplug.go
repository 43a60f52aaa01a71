package chsim

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"time"
)

// Hot-plug in the qemu backend. q35's root bus (pcie.0) cannot hot-plug, so every VM boots
// with hotplugPorts spare pcie-root-ports, the functions of one slot (hotplugSlot) above
// the CH-style slots of the cold devices. vm.add-disk puts a vhost-user disk on a free port
// (chardev-add, device_add) and answers the address the guest's kernel sees: the port's
// secondary bus as the guest firmware numbered it, slot 0, function 0, read back from
// query-pci. vm.remove-device asks qemu to unplug (device_del: an ACPI eject request to the
// guest); qemu's DEVICE_DELETED, once the guest has ejected it, drops the disk from the
// config, removes its chardev (closing the vhost-user connection) and is CH's vm
// device-removed.

const (
	hotplugPorts = 4    // spare pcie-root-ports per VM
	hotplugSlot  = 0x1e // their slot on pcie.0 (0x1f is the ICH9 LPC, SATA and SMBus)
)

// rootPortID is the qemu id of spare root port i. It cannot clash with a device's qemuID,
// which starts with "ch".
func rootPortID(i int) string { return fmt.Sprintf("rp%d", i) }

// hotDisk is a disk hot-plugged into the running qemu.
type hotDisk struct {
	port       int // index of its root port
	qemuID     string
	chardev    string
	unplugging bool // device_del sent; DEVICE_DELETED not seen yet
}

// hotAddDiskQemuLocked is vm.add-disk on the running or paused qemu VM.
func (s *sim) hotAddDiskQemuLocked(d diskConfig) response {
	const op = "The disk could not be added to the VM"
	q := s.qemu
	if q == nil || q.client == nil {
		return apiError(http.StatusInternalServerError, op, "qemu is not running")
	}
	switch {
	case !d.VhostUser:
		return notInQemu(op, "hot-plugging a disk image (vhost-user disks only)")
	case d.RateLimiterConfig != nil || d.RateLimitGroup != nil:
		return notInQemu(op, "rate limits")
	case d.Serial != nil:
		return notInQemu(op, "a serial on a vhost-user disk (the backend gives the disk its identity)")
	}
	if d.VhostSocket == nil {
		return apiError(http.StatusInternalServerError, op, "Error validating configuration", "No socket provided when using vhost-user")
	}
	id := deref(d.ID)
	if d.ID == nil {
		id = fmt.Sprintf("_disk%d", s.nextID)
	}
	port := q.freePortLocked()
	if port < 0 {
		return notInQemu(op, fmt.Sprintf("more than %d hot-plugged devices at once", hotplugPorts))
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	portInfo, err := q.findPCI(ctx, rootPortID(port))
	if err != nil {
		return apiError(http.StatusInternalServerError, op, "Error hot-plugging in qemu", err.Error())
	}
	if portInfo.PciBridge == nil || portInfo.PciBridge.Bus.Secondary == 0 {
		// Before the guest's firmware has numbered the buses, no address can be told.
		return apiError(http.StatusInternalServerError, op, "Error hot-plugging in qemu",
			fmt.Sprintf("the guest has not numbered the bus behind root port %s yet (its firmware has not run); retry", rootPortID(port)))
	}
	h := &hotDisk{port: port, qemuID: qemuID(id), chardev: "vhost-" + qemuID(id)}
	err = q.client.Execute(ctx, "chardev-add", map[string]any{"id": h.chardev, "backend": map[string]any{
		"type": "socket",
		"data": map[string]any{
			"addr":   map[string]any{"type": "unix", "data": map[string]any{"path": *d.VhostSocket}},
			"server": false,
		},
	}}, nil)
	if err != nil {
		return apiError(http.StatusInternalServerError, op, "Failed to connect to vhost-user backend", err.Error())
	}
	// device_add takes JSON types: numbers for the integer properties, a string for OnOffAuto.
	err = q.client.Execute(ctx, "device_add", map[string]any{
		"driver": "vhost-user-blk-pci", "id": h.qemuID, "bus": rootPortID(port), "chardev": h.chardev,
		"num-queues": d.NumQueues, "queue-size": d.QueueSize, "disable-legacy": "on",
	}, nil)
	if err != nil {
		if rerr := q.removeChardev(h.chardev); rerr != nil {
			s.logf(0, "Error: removing chardev %s after a failed device_add: %v", h.chardev, rerr)
		}
		return apiError(http.StatusInternalServerError, op, "Error hot-plugging in qemu", err.Error())
	}
	bdf := fmt.Sprintf("0000:%02x:00.0", portInfo.PciBridge.Bus.Secondary)
	if dev, err := q.findPCI(ctx, h.qemuID); err == nil {
		bdf = fmt.Sprintf("0000:%02x:%02x.%d", dev.Bus, dev.Slot, dev.Function)
	} else {
		s.logf(0, "Error: reading back the address of %s: %v; assuming %s", id, err, bdf)
	}

	if d.ID == nil {
		d.ID = strp(id)
		s.nextID++
	}
	q.hot[id] = h
	q.addDevice(qemuDevice{chID: id, qemuID: h.qemuID, virtio: true, vhostUser: true, hot: true})
	s.bdfs[id] = bdf
	s.order = append(s.order, id)
	s.counters[id] = blockCounters()
	s.vm.Disks = append(s.vm.Disks, d)
	s.logf(1, "hot-plugged %s (%s) on %s at %s", id, h.qemuID, rootPortID(port), bdf)
	// The activation poll watches it, but a vhost-user disk's activation is not announced
	// (its reset is).
	return jsonResponse(http.StatusOK, map[string]string{"id": id, "bdf": bdf})
}

// hotRemoveQemuLocked is vm.remove-device of device id, which the config has, on the
// running or paused qemu VM: an unplug request the guest acts on, or not.
func (s *sim) hotRemoveQemuLocked(id string) response {
	const op = "The device could not be removed from the VM"
	q := s.qemu
	if q == nil || q.client == nil {
		return apiError(http.StatusInternalServerError, op, "qemu is not running")
	}
	h := q.hot[id]
	if h == nil {
		return notInQemu(op, "hot-unplug of a device plugged at boot (q35's root bus cannot unplug)")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := q.client.Execute(ctx, "device_del", map[string]string{"id": h.qemuID}, nil); err != nil {
		if !h.unplugging {
			return apiError(http.StatusInternalServerError, op, "Error hot-unplugging in qemu", err.Error())
		}
		// A repeated request while the first is pending, as CH answers it.
		s.logf(1, "device_del %s again: %v", h.qemuID, err)
	}
	h.unplugging = true
	s.logf(1, "unplug of %s (%s) requested", id, h.qemuID)
	return noContent()
}

// qemuDeviceDeleted handles qemu's DEVICE_DELETED for device qemu id qid: a hot-plugged disk
// the guest ejected goes from the config, its chardev goes (the backend sees the vhost-user
// connection close), then vm device-removed, as in CH.
func (s *sim) qemuDeviceDeleted(q *qemuVM, qid string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.qemu != q {
		return
	}
	var id string
	var h *hotDisk
	for k, v := range q.hot {
		if v.qemuID == qid {
			id, h = k, v
		}
	}
	if h == nil {
		return
	}
	delete(q.hot, id)
	q.dropDevice(id)
	if err := q.removeChardev(h.chardev); err != nil {
		s.logf(0, "Error: removing chardev %s of %s: %v", h.chardev, id, err)
	}
	bdf := s.dropDeviceLocked(id)
	s.logf(1, "the guest ejected %s (%s)", id, qid)
	s.emit("vm", "device-removed", map[string]string{"id": id, "bdf": bdf})
}

// freePortLocked returns the index of a root port with nothing plugged into it, or -1.
func (q *qemuVM) freePortLocked() int {
	used := map[int]bool{}
	for _, h := range q.hot {
		used[h.port] = true
	}
	for i := range hotplugPorts {
		if !used[i] {
			return i
		}
	}
	return -1
}

// removeChardev removes a hot-plugged disk's chardev. qemu may still hold it for a moment
// after the device is gone ("busy"), so it retries briefly.
func (q *qemuVM) removeChardev(id string) error {
	var err error
	for range 20 {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		err = q.client.Execute(ctx, "chardev-remove", map[string]string{"id": id}, nil)
		cancel()
		if err == nil || !strings.Contains(err.Error(), "busy") {
			return err
		}
		time.Sleep(50 * time.Millisecond)
	}
	return err
}

// pciDevice is one device of qemu's query-pci answer.
type pciDevice struct {
	Bus       int    `json:"bus"`
	Slot      int    `json:"slot"`
	Function  int    `json:"function"`
	QdevID    string `json:"qdev_id"`
	PciBridge *struct {
		Bus struct {
			Number    int `json:"number"`
			Secondary int `json:"secondary"`
		} `json:"bus"`
		Devices []pciDevice `json:"devices"`
	} `json:"pci_bridge"`
}

// findPCI returns the device with qemu id qid as qemu's query-pci shows it: its address as
// the guest programmed the buses.
func (q *qemuVM) findPCI(ctx context.Context, qid string) (*pciDevice, error) {
	var buses []struct {
		Devices []pciDevice `json:"devices"`
	}
	if err := q.client.Execute(ctx, "query-pci", nil, &buses); err != nil {
		return nil, err
	}
	var find func([]pciDevice) *pciDevice
	find = func(devs []pciDevice) *pciDevice {
		for i := range devs {
			if devs[i].QdevID == qid {
				return &devs[i]
			}
			if b := devs[i].PciBridge; b != nil {
				if d := find(b.Devices); d != nil {
					return d
				}
			}
		}
		return nil
	}
	for _, b := range buses {
		if d := find(b.Devices); d != nil {
			return d, nil
		}
	}
	return nil, fmt.Errorf("query-pci lists no device %s", qid)
}
