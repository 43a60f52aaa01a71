package engine

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"vmhost/chclient"
	"vmhost/jail"
	"vmhost/qmp"
	"vmhost/vm/record"
)

// Hot-plug of data volumes (docs/api.md, Attach and detach). Attach: the storage
// daemon opens and exports the image (blockdev-add, block-export-add; the
// root disk's nodes and throttle group are not touched), then CH adds the
// vhost-user disk with the volume's per-VM id as its device id, then a
// running AppVM's guest mounts it. Detach, the other way round: the guest
// unmounts, CH is asked to remove the device and the guest acks the eject
// (CH's device-removed event), then the export and nodes go. Each step
// that fails undoes the ones before it.
//
// The caller records the change (VolumeSpec.Pending) before either runs,
// and both can run again over what a run cut short left: each step looks
// at what CH (vm.info) and the storage daemon (query-block-exports,
// query-named-block-nodes) have of the volume and does only what is
// missing. Recovery finishes an interrupted change so (vm.RecoverVolumes).

// DetachTimeout bounds the wait for a guest to release a hot-detached
// disk. A variable so tests can shorten it.
var DetachTimeout = 10 * time.Second

// HotAttach plugs volume key of rec into the running or paused VM
// (vm.Host); rec is the record as the caller, holding the VM's lock, has
// just stored it. What an earlier attach of key did is kept: a disk CH
// presents is only mounted (a running AppVM); otherwise what the storage
// daemon has of key is cleared and the volume exported and added anew.
func (e *Engine) HotAttach(ctx context.Context, rec *record.Record, key string) (err error) {
	i := rec.Spec.VolumeIndex(key)
	if i < 0 {
		return &record.HostError{Kind: record.HostInternal, Op: "hot-plugging volume " + key, Err: errors.New("not in the VM's record")}
	}
	v := rec.Spec.Volumes[i]
	chMayUseIt := false
	defer func() {
		// A failed attach takes the volume out of the VM's record: a
		// first-class volume's link, made by this run or one cut short,
		// goes, and the volume is root's again, unless CH may still
		// have the disk.
		if err != nil && !chMayUseIt {
			e.unlinkHotVolume(rec, v)
		}
	}()
	q, err := e.heldQSD(rec)
	if err != nil {
		return err
	}
	c, err := e.client(rec)
	if err != nil {
		return err
	}
	defer c.Close()
	testStopAt(HookAttachStart)
	// Nothing can be mounted into a running jail: a first-class volume
	// reaches a confined storage daemon through a link in its VM directory
	// (made again, as the volume given again, by an attach run anew).
	if jv := e.vmJail(rec); jv != nil {
		err := e.linkVolume(rec, v, jv)
		if v.VolumeID == "" { // made for the VM just now, by the agent
			err = jail.Own(jv.UID, jv.GID, e.layout().DataVolume(rec.ID, v.ID))
		}
		if err != nil {
			return &record.HostError{Kind: record.HostStorage, Op: fmt.Sprintf("giving volume %s to VM %s", key, rec.ID), Err: err}
		}
	}
	d := e.dataDisk(rec, v)
	undoExport := func() {
		if err := q.RemoveDataExport(context.WithoutCancel(ctx), key); err != nil {
			e.log.Error("removing the export of a failed hot-plug", "id", rec.ID, "volume", key, "err", err)
		}
	}
	have, bdf, err := diskOf(ctx, c, rec.ID, key)
	if err != nil {
		return err
	}
	if have != nil && (!have.VhostUser || have.VhostSocket != d.Socket) {
		return &record.HostError{Kind: record.HostHypervisor, Op: fmt.Sprintf("hot-plugging volume %s into VM %s", key, rec.ID), Err: errors.New("the VM has another device of that id")}
	}
	if have == nil {
		if err := q.RemoveDataExport(ctx, key); err != nil { // what a cut-short attach left
			return &record.HostError{Kind: record.HostStorage, Op: fmt.Sprintf("clearing the storage daemon's leftovers of volume %s of VM %s", key, rec.ID), Err: err}
		}
		if err := q.AddDataExport(ctx, d); err != nil {
			return &record.HostError{Kind: record.HostStorage, Op: fmt.Sprintf("exporting volume %s of VM %s", key, rec.ID), Err: err}
		}
		testStopAt(HookAttachExported)
		info, err := c.AddDisk(ctx, &chclient.DiskConfig{ID: key, VhostUser: true, VhostSocket: d.Socket, Readonly: v.Readonly})
		if err != nil {
			undoExport()
			return &record.HostError{Kind: record.HostHypervisor, Op: fmt.Sprintf("vm.add-disk of volume %s to VM %s", key, rec.ID), Err: err}
		}
		if info != nil {
			bdf = info.Bdf
		}
	}
	if g := e.guest(rec); g != nil && rec.State == record.StateRunning {
		testStopAt(HookAttachDiskAdded)
		if err := g.Mount(ctx, rec, v, bdf); err != nil {
			if rerr := e.removeDisk(context.WithoutCancel(ctx), c, rec.ID, key); rerr != nil {
				e.log.Error("unplugging a volume its guest did not mount", "id", rec.ID, "volume", key, "err", rerr)
				chMayUseIt = true
				return err // the export stays: CH may still use it
			}
			undoExport()
			return err
		}
	}
	testStopAt(HookAttachAdded)
	e.setDataSocket(rec.ID, d.Socket, true)
	e.log.Info("volume hot-plugged", "id", rec.ID, "volume", key)
	return nil
}

// HotDetach unplugs volume key from the running VM (vm.Host); rec is the
// record as the caller, holding the VM's lock, has just stored it. What
// an earlier detach of key did is kept: the guest's unmount is asked
// again (a volume not mounted is success), the disk is removed only if CH
// still presents it, and whatever the storage daemon still has of key
// goes.
func (e *Engine) HotDetach(ctx context.Context, rec *record.Record, key string) error {
	i := rec.Spec.VolumeIndex(key)
	if i < 0 {
		return &record.HostError{Kind: record.HostInternal, Op: "hot-unplugging volume " + key, Err: errors.New("not in the VM's record")}
	}
	v := rec.Spec.Volumes[i]
	q, err := e.heldQSD(rec)
	if err != nil {
		return err
	}
	c, err := e.client(rec)
	if err != nil {
		return err
	}
	defer c.Close()
	testStopAt(HookDetachStart)
	g := e.guest(rec)
	if g != nil {
		if err := g.Unmount(ctx, rec, v); err != nil {
			return err
		}
	}
	testStopAt(HookDetachUnmounted)
	have, _, err := diskOf(ctx, c, rec.ID, key)
	if err != nil {
		return err
	}
	if have != nil {
		if err := e.removeDisk(ctx, c, rec.ID, key); err != nil {
			if g != nil {
				if bdf, ok := diskBDF(ctx, c, key); ok {
					if merr := g.Mount(context.WithoutCancel(ctx), rec, v, bdf); merr != nil {
						e.log.Error("mounting a volume again after a failed detach", "id", rec.ID, "volume", key, "err", merr)
					}
				}
			}
			return err
		}
	}
	testStopAt(HookDetachRemoved)
	if err := q.RemoveDataExport(ctx, key); err != nil {
		// CH no longer uses the disk, so the detach stands; the export
		// goes with the daemon at the VM's next stop.
		e.log.Error("removing the export of a detached volume", "id", rec.ID, "volume", key, "err", err)
	}
	testStopAt(HookDetachUnexported)
	e.unlinkHotVolume(rec, v)
	e.setDataSocket(rec.ID, e.layout().DataSocket(rec.ID, key), false)
	e.log.Info("volume hot-unplugged", "id", rec.ID, "volume", key)
	return nil
}

// diskOf returns the disk key of VM id as CH presents it now (nil when it
// does not), and its PCI address.
func diskOf(ctx context.Context, c *chclient.Client, id, key string) (*chclient.DiskConfig, string, error) {
	info, err := c.VMInfo(ctx)
	if err != nil {
		return nil, "", &record.HostError{Kind: record.HostHypervisor, Op: "vm.info of VM " + id, Err: err}
	}
	i := slices.IndexFunc(info.Config.Disks, func(d chclient.DiskConfig) bool { return d.ID == key })
	if i < 0 {
		return nil, "", nil
	}
	return &info.Config.Disks[i], deviceBDF(info, key), nil
}

// deviceBDF is the PCI address of device id in CH's device tree: on the
// device's node, or (CH's shape for virtio devices) on its parent, the
// "_virtio-pci-<id>" node.
func deviceBDF(info *chclient.VmInfo, id string) string {
	n := info.DeviceTree[id]
	if n.PciBdf == "" && n.Parent != "" {
		return info.DeviceTree[n.Parent].PciBdf
	}
	return n.PciBdf
}

// removeDisk asks CH to remove device key and waits, at most
// DetachTimeout, for the guest to release it: CH's device-removed event,
// confirmed by vm.info. A guest that does not release it is *StateError,
// and the disk stays.
func (e *Engine) removeDisk(ctx context.Context, c *chclient.Client, id, key string) error {
	removed, stop := e.awaitRemoved(id, key)
	defer stop()
	if err := c.RemoveDevice(ctx, key); err != nil {
		return &record.HostError{Kind: record.HostHypervisor, Op: fmt.Sprintf("vm.remove-device of volume %s of VM %s", key, id), Err: err}
	}
	t := time.NewTimer(DetachTimeout)
	defer t.Stop()
	select {
	case <-removed:
	case <-t.C:
	case <-ctx.Done():
		return ctx.Err()
	}
	// The event, or its absence, is confirmed by CH's config: an event
	// missed (a monitor restarting) must not leave a disk behind.
	info, err := c.VMInfo(ctx)
	if err != nil {
		return &record.HostError{Kind: record.HostHypervisor, Op: "vm.info of VM " + id, Err: err}
	}
	if hasDisk(info, key) {
		return &record.StateError{Msg: fmt.Sprintf("the guest of VM %q did not release volume %s within %s; it stays attached (retry the detach, or stop the VM and detach it then)", id, key, DetachTimeout)}
	}
	return nil
}

func hasDisk(info *chclient.VmInfo, key string) bool {
	return slices.ContainsFunc(info.Config.Disks, func(d chclient.DiskConfig) bool { return d.ID == key })
}

// diskBDF is the PCI address CH gave disk key.
func diskBDF(ctx context.Context, c *chclient.Client, key string) (string, bool) {
	info, err := c.VMInfo(ctx)
	if err != nil {
		return "", false
	}
	bdf := deviceBDF(info, key)
	return bdf, bdf != ""
}

// heldQSD is rec's storage daemon as its monitor holds it.
func (e *Engine) heldQSD(rec *record.Record) (*qmp.QSD, error) {
	e.mon.mu.Lock()
	m := e.mon.m[rec.ID]
	e.mon.mu.Unlock()
	if m == nil || m.qsd == nil {
		return nil, &record.HostError{Kind: record.HostStorage, Op: "reaching the storage daemon of VM " + rec.ID, Err: errors.New("its QMP monitor is not held (restart the VM to hot-plug volumes)")}
	}
	return m.qsd, nil
}

func (e *Engine) dataDisk(rec *record.Record, v record.VolumeSpec) qmp.DataDisk {
	return qmp.DataDisk{ID: v.ID, Path: e.volumePath(rec, v), Socket: e.layout().DataSocket(rec.ID, v.ID), Readonly: v.Readonly}
}

// unlinkHotVolume removes the link through which a confined VM's storage
// daemon reached first-class volume v and gives the volume back to root
// (a detach, or an attach undone); the next boot would do it otherwise.
func (e *Engine) unlinkHotVolume(rec *record.Record, v record.VolumeSpec) {
	if v.VolumeID == "" || e.vmJail(rec) == nil {
		return
	}
	if err := e.unlinkVolume(rec.ID, v.VolumeID); err != nil {
		e.log.Warn("taking volume back from VM", "id", rec.ID, "volume", v.VolumeID, "err", err)
	}
}

// setDataSocket keeps the recorded storage daemon's socket list true.
func (e *Engine) setDataSocket(id, socket string, add bool) {
	_, err := e.recs.Update(id, func(r *record.Record) {
		if r.Runtime == nil || r.Runtime.QSD == nil {
			return
		}
		q := r.Runtime.QSD
		q.DataSockets = slices.DeleteFunc(q.DataSockets, func(s string) bool { return s == socket })
		if add {
			q.DataSockets = append(q.DataSockets, socket)
		}
	})
	if err != nil {
		e.log.Warn("recording the storage daemon's sockets", "id", id, "err", err)
	}
}

// removals are the waiters for CH's device-removed events.
type removals struct {
	mu sync.Mutex
	m  map[string][]chan struct{} // "<vm id>/<device id>"
}

// awaitRemoved returns a channel closed when VM id's CH reports that
// device dev was removed, and the function that stops waiting.
func (e *Engine) awaitRemoved(id, dev string) (<-chan struct{}, func()) {
	r := &e.removals
	k := id + "/" + dev
	ch := make(chan struct{})
	r.mu.Lock()
	if r.m == nil {
		r.m = map[string][]chan struct{}{}
	}
	r.m[k] = append(r.m[k], ch)
	r.mu.Unlock()
	return ch, func() {
		r.mu.Lock()
		defer r.mu.Unlock()
		if r.m[k] = slices.DeleteFunc(r.m[k], func(c chan struct{}) bool { return c == ch }); len(r.m[k]) == 0 {
			delete(r.m, k)
		}
	}
}

// deviceRemoved wakes the waiters for VM id's device dev.
func (e *Engine) deviceRemoved(id, dev string) {
	r := &e.removals
	k := id + "/" + dev
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, ch := range r.m[k] {
		close(ch)
	}
	delete(r.m, k)
}

// syncExports makes the data exports of q, a storage daemon kept from
// provisioning, those of rec's volumes: volumes attached or detached while
// the VM did not run changed only the record.
func (e *Engine) syncExports(ctx context.Context, q *qmp.QSD, rec *record.Record) error {
	exports, err := q.DataExports(ctx)
	if err != nil {
		return err
	}
	want := map[string]bool{}
	for _, v := range rec.Spec.Volumes {
		want[v.ID] = true
		if !slices.ContainsFunc(exports, func(x qmp.BlockExport) bool { return x.ID == v.ID }) {
			if err := q.AddDataExport(ctx, e.dataDisk(rec, v)); err != nil {
				return err
			}
		}
	}
	for _, x := range exports {
		if x.ID != qmp.RootExportID && !want[x.ID] {
			if err := q.RemoveDataExport(ctx, x.ID); err != nil {
				return err
			}
		}
	}
	return nil
}
