package chsim

import (
	"context"
	"fmt"
	"slices"
	"time"
)

// The vsock device across a snapshot in the qemu backend. QEMU cannot migrate
// vhost-user-vsock at all: the device's VMState is marked unmigratable
// (hw/virtio/vhost-user-vsock.c), whatever its backend offers, so a migration of a VM that
// has it is refused ("non-migratable device: …/vhost-user-vsock";
// docs/ref/qemu-vhost-user-migration.md). The backend therefore keeps the device on a
// root port of its own and unplugs it before it saves the guest: vm.snapshot lets the
// paused guest run until its kernel has ejected the device (an ACPI eject, tens of
// milliseconds under TCG), pauses it again, ends vhost-device-vsock, and migrates the
// guest without the device. A restore's qemu starts without it. Whenever the guest runs
// again (vm.resume, a restore with resume, vm.reboot of a paused VM) a new
// vhost-device-vsock with the same CID and sockets is started and the device plugged
// back. The guest sees its vsock device go and come back, which resets its vsock
// connections (CH's restore drops them too: the host ends of the old process are gone);
// the AppVM guest agent connects again.

const (
	vsockPortID  = "rpvsock"     // the vsock device's root port; no CH-derived id starts so
	vsockChardev = "vhost-vsock" // qemu's chardev to vhost-device-vsock
	// vsockEjectTimeout bounds the wait for the guest to eject its vsock device.
	vsockEjectTimeout = 30 * time.Second
)

// vsockDevice is the VM's vsock device as the activation poll watches it.
func vsockDevice(v *vsockConfig) qemuDevice {
	return qemuDevice{chID: deref(v.ID), qemuID: qemuID(deref(v.ID)), virtio: true}
}

// qemuUnplugVsockLocked takes the vsock device out of the paused VM's qemu so that qemu
// can save it: the guest runs until it has ejected the device, then is paused again, and
// vhost-device-vsock is ended. Without a vsock device plugged in, it does nothing.
func (s *sim) qemuUnplugVsockLocked() error {
	q := s.qemu
	if s.vm.Vsock == nil || !q.vsockIn {
		return nil
	}
	d := vsockDevice(s.vm.Vsock)
	ctx, cancel := context.WithTimeout(context.Background(), vsockEjectTimeout+10*time.Second)
	defer cancel()
	if err := q.client.Execute(ctx, "device_del", map[string]string{"id": d.qemuID}, nil); err != nil {
		return fmt.Errorf("unplugging the vsock device, which qemu cannot save: %w", err)
	}
	// The poll must not take the device's going for a driver reset.
	q.dropDevice(d.chID)
	q.vsockIn = false
	start := time.Now()
	if err := q.client.Execute(ctx, "cont", nil, nil); err != nil {
		return err
	}
	var gone bool
	for !gone && time.Since(start) < vsockEjectTimeout {
		time.Sleep(10 * time.Millisecond)
		present, err := q.hasVirtio(ctx, d)
		if err != nil {
			q.client.Execute(ctx, "stop", nil, nil)
			return err
		}
		gone = !present
	}
	if err := q.client.Execute(ctx, "stop", nil, nil); err != nil {
		return err
	}
	if !gone {
		// The request stays pending; the next resume finds the device still there (or
		// gone by then) and acts on what it finds.
		return fmt.Errorf("the guest did not eject its vsock device within %v (qemu cannot save vhost-user-vsock, so the device goes before a snapshot)", vsockEjectTimeout)
	}
	s.logf(1, "the guest ejected its vsock device in %v; saving it without", time.Since(start).Round(time.Millisecond))
	if err := q.removeChardev(vsockChardev); err != nil {
		s.logf(0, "Error: removing the vsock chardev: %v", err)
	}
	q.stopVsockBackend()
	return nil
}

// qemuPlugVsockLocked plugs the VM's vsock device back into its qemu (after a snapshot or
// a restore), with a new vhost-device-vsock, before the guest runs. With the device in
// place, or no vsock in the config, it does nothing.
func (s *sim) qemuPlugVsockLocked() error {
	q := s.qemu
	v := s.vm.Vsock
	if v == nil || q.vsockIn {
		return nil
	}
	d := vsockDevice(v)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if present, err := q.hasVirtio(ctx, d); err != nil {
		return err
	} else if present {
		// An unplug the guest had not finished: still in place, and its backend with it.
		q.addDevice(d)
		q.vsockIn = true
		return nil
	}
	q.removeChardev(vsockChardev) // left by an unplug that timed out; absent otherwise
	q.stopVsockBackend()
	vu, err := q.startVsockBackend(v)
	if err != nil {
		return err
	}
	err = q.client.Execute(ctx, "chardev-add", map[string]any{"id": vsockChardev, "backend": map[string]any{
		"type": "socket",
		"data": map[string]any{
			"addr":   map[string]any{"type": "unix", "data": map[string]any{"path": vu}},
			"server": false,
		},
	}}, nil)
	if err != nil {
		q.stopVsockBackend()
		return fmt.Errorf("connecting qemu to vhost-device-vsock again: %w", err)
	}
	err = q.client.Execute(ctx, "device_add", map[string]any{
		"driver": "vhost-user-vsock-pci", "id": d.qemuID, "bus": vsockPortID, "chardev": vsockChardev, "disable-legacy": "on",
	}, nil)
	if err != nil {
		q.removeChardev(vsockChardev)
		q.stopVsockBackend()
		return fmt.Errorf("plugging the vsock device back: %w", err)
	}
	q.addDevice(d)
	q.vsockIn = true
	s.logf(1, "vsock device plugged back (CID %d)", v.Cid)
	return nil
}

// hasVirtio reports whether qemu has virtio device d.
func (q *qemuVM) hasVirtio(ctx context.Context, d qemuDevice) (bool, error) {
	var list []struct {
		Path string `json:"path"`
	}
	if err := q.client.Execute(ctx, "x-query-virtio", nil, &list); err != nil {
		return false, err
	}
	return slices.ContainsFunc(list, func(e struct {
		Path string `json:"path"`
	}) bool {
		return e.Path == d.qomPath()
	}), nil
}
