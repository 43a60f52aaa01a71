package vm

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/google/uuid"

	"vmhost/qcow2"
	"vmhost/store"
	"vmhost/vm/record"
	"vmhost/volume"
)

// Volumes (docs/api.md, Volumes): first-class volumes live in package volume;
// which VM uses one is said only by that VM's record (VolumeSpec.VolumeID),
// so the two cannot disagree. volMu serializes what reads that across all
// records and then changes it: an attach's check and its reservation, and
// a volume's delete. (A VM's delete needs no part in it: removing the
// record is what frees its first-class volumes.)

// Limits of attach (docs/api.md, Attach and detach).
const (
	// MaxAppVMVolumes is how many data volumes an AppVM may have, as at
	// create.
	MaxAppVMVolumes = 8
	// DetachTimeout bounds the wait for the guest to release a hot-detached
	// disk; the engine uses it.
	DetachTimeout = 10 * time.Second
)

// VolumeRequest is the body of POST /api/volumes.
type VolumeRequest struct {
	VolumeID string `json:"volume_id,omitempty"`
	SizeGiB  uint32 `json:"size_gib" decode:"required"`
	Format   string `json:"format,omitempty"`
}

// VolumeInfo is the Volume view of a first-class volume.
type VolumeInfo struct {
	ID               string            `json:"id"`
	Path             string            `json:"path"`
	VirtualSizeBytes uint64            `json:"virtual_size_bytes"`
	Fmt              string            `json:"fmt"`
	Format           string            `json:"format"`
	CreatedAt        time.Time         `json:"created_at"`
	AttachedTo       *VolumeAttachment `json:"attached_to,omitempty"`
	DiskBytes        *uint64           `json:"disk_bytes,omitempty"`
}

// VolumeAttachment says which VM uses a volume, and as which device.
type VolumeAttachment struct {
	VMID   string `json:"vm_id"`
	Mode   Mode   `json:"mode"`
	Device string `json:"device"`
}

// AttachRequest is the body of POST /api/vms/{id}/volumes and of the AppVM
// route: exactly one of VolumeID and SizeGiB.
type AttachRequest struct {
	VolumeID string  `json:"volume_id,omitempty"`
	SizeGiB  *uint32 `json:"size_gib,omitempty"`
	Readonly bool    `json:"readonly,omitempty"`
	// Mountpoint is where an AppVM's guest mounts the volume (required
	// there, CheckMountpoint's rule; refused on a classic VM).
	Mountpoint string `json:"mountpoint,omitempty"`
}

// Volumes is the first-class volume store.
func (s *Service) Volumes() *volume.Store { return s.vols }

// CreateVolume makes a first-class volume. A taken id is *ExistsError; a
// size the state directory cannot hold is *CapacityError; a failed write
// is a storage *HostError and leaves nothing.
func (s *Service) CreateVolume(ctx context.Context, req VolumeRequest) (*VolumeInfo, error) {
	if req.VolumeID != "" && !store.ValidID(req.VolumeID) {
		return nil, bad("volume_id", "must match ^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
	}
	if req.SizeGiB < 1 || req.SizeGiB > MaxSizeGiB {
		return nil, bad("size_gib", "must be 1..%d, got %d", MaxSizeGiB, req.SizeGiB)
	}
	switch req.Format {
	case "":
		req.Format = volume.FormatRaw
	case volume.FormatRaw, volume.FormatExt4:
	default:
		return nil, bad("format", "must be raw or ext4, got %q", req.Format)
	}
	if req.VolumeID == "" {
		s.randMu.Lock()
		u, err := uuid.NewRandomFromReader(s.o.Rand)
		s.randMu.Unlock()
		if err != nil {
			return nil, fmt.Errorf("generating volume id: %w", err)
		}
		req.VolumeID = u.String()
	}
	if err := s.admitVolume(req.SizeGiB); err != nil {
		return nil, err
	}
	v := volume.Volume{ID: req.VolumeID, Format: req.Format, SizeGiB: req.SizeGiB, CreatedAt: s.o.Now().UTC().Truncate(time.Second)}
	if err := s.vols.Create(ctx, v); err != nil {
		if errors.Is(err, volume.ErrExists) {
			return nil, &ExistsError{ID: v.ID, What: "volume"}
		}
		return nil, &HostError{Kind: HostStorage, Op: "creating volume " + v.ID, Err: err}
	}
	s.log.Info("volume created", "volume_id", v.ID, "format", v.Format, "size_gib", v.SizeGiB)
	return s.volumeInfo(v, nil, false), nil
}

// admitVolume refuses a new volume of size GiB that the state directory's
// free space, less the disk copies in flight, cannot hold (as a create's
// admission counts its disks).
func (s *Service) admitVolume(size uint32) error {
	free, err := s.o.DiskFree()
	if err != nil {
		return &CapacityError{Resource: "disk", Msg: err.Error()}
	}
	need := uint64(size) << 30
	for _, r := range s.recs.All() {
		if r.Provisioning() {
			need += diskBytes(r)
		}
	}
	if need > free {
		return &CapacityError{Resource: "disk", Msg: fmt.Sprintf("a %d GiB volume (and the disk copies in flight) need %d bytes, %d free in the state directory", size, need, free)}
	}
	return nil
}

// ListVolumes is every first-class volume, sorted by id, without
// disk_bytes.
func (s *Service) ListVolumes() ([]VolumeInfo, error) {
	vols, err := s.vols.List()
	if err != nil {
		return nil, &HostError{Kind: HostStorage, Op: "listing volumes", Err: err}
	}
	users := s.volumeUsers()
	out := make([]VolumeInfo, 0, len(vols))
	for _, v := range vols {
		out = append(out, *s.volumeInfo(v, users[v.ID], false))
	}
	return out, nil
}

// GetVolume is volume id's view with disk_bytes; a missing one satisfies
// errors.Is(err, fs.ErrNotExist).
func (s *Service) GetVolume(id string) (*VolumeInfo, error) {
	v, err := s.getVolume(id)
	if err != nil {
		return nil, err
	}
	return s.volumeInfo(v, s.volumeUsers()[id], true), nil
}

func (s *Service) getVolume(id string) (volume.Volume, error) {
	v, err := s.vols.Get(id)
	if errors.Is(err, volume.ErrNotFound) {
		return v, notFound(fmt.Sprintf("no volume has id %q", id))
	}
	if err != nil {
		return v, &HostError{Kind: HostStorage, Op: "reading volume " + id, Err: err}
	}
	return v, nil
}

// DeleteVolume erases volume id; one attached to a VM is *StateError.
func (s *Service) DeleteVolume(id string) error {
	s.volMu.Lock()
	defer s.volMu.Unlock()
	if _, err := s.getVolume(id); err != nil {
		return err
	}
	if u := s.volumeUsers()[id]; u != nil {
		return &StateError{Msg: fmt.Sprintf("volume %q is attached to VM %q as %s; detach it first", id, u.VMID, u.Device)}
	}
	if err := s.vols.Delete(id); err != nil {
		return &HostError{Kind: HostStorage, Op: "deleting volume " + id, Err: err}
	}
	s.log.Info("volume deleted", "volume_id", id)
	return nil
}

func (s *Service) volumeInfo(v volume.Volume, at *VolumeAttachment, diskBytes bool) *VolumeInfo {
	vi := &VolumeInfo{ID: v.ID, Path: s.vols.Path(v.ID), VirtualSizeBytes: uint64(v.SizeGiB) << 30, Fmt: "qcow2",
		Format: v.Format, CreatedAt: v.CreatedAt, AttachedTo: at}
	if diskBytes {
		if n, ok := s.usage.get(vi.Path); ok {
			vi.DiskBytes = &n
		}
	}
	return vi
}

// volumeUsers maps each attached first-class volume to its VM (a hot
// attach in progress included: it has the volume reserved).
func (s *Service) volumeUsers() map[string]*VolumeAttachment {
	out := map[string]*VolumeAttachment{}
	for _, r := range s.recs.All() {
		for i, v := range r.Spec.Volumes {
			if v.VolumeID != "" {
				out[v.VolumeID] = &VolumeAttachment{VMID: r.ID, Mode: r.Mode, Device: VolumeDevice(r, i)}
			}
		}
	}
	return out
}

// VolumeDevice is the guest device of rec's volume i as the next boot
// presents it (record.VolumeDevice).
func VolumeDevice(rec *Record, i int) string { return record.VolumeDevice(rec, i) }

// AttachVolume attaches a volume to the VM id of family mode (docs/api.md
// §1.2): a first-class one (req.VolumeID) or a new blank VM-owned one
// (req.SizeGiB). An AppVM's volume has a mountpoint, so it holds ext4 (a
// new one is made so; a first-class one must be). A VM that is not
// running only changes its record; a running or paused one gets the disk
// hot-plugged (Host.HotAttach), and a running AppVM's guest mounts it. An
// attach that changes the host (a new volume's file, a hot-plug) is
// recorded as pending before it changes anything, so that recovery
// finishes (or, failing, rolls back) an interrupted one. It returns the
// record after.
func (s *Service) AttachVolume(ctx context.Context, mode Mode, id string, req AttachRequest) (*Record, error) {
	unlock := s.lockVM(id)
	defer unlock()
	rec, err := s.Get(mode, id)
	if err != nil {
		return nil, err
	}
	if err := checkAttach(rec, req); err != nil {
		return nil, err
	}
	hot := rec.State == StateRunning || rec.State == StatePaused
	if hot && mode == ModeAppVM && rec.State == StatePaused {
		return nil, &StateError{ID: id, Action: "attach a volume to", State: rec.DisplayState, Hint: "resume it first: its guest agent mounts the volume"}
	}
	spec := VolumeSpec{ID: rec.Spec.FreeVolumeID(), Readonly: req.Readonly, Mountpoint: req.Mountpoint}
	if req.VolumeID != "" {
		v, err := s.getVolume(req.VolumeID)
		if err != nil {
			return nil, err
		}
		if spec.Mounted() && v.Format != volume.FormatExt4 {
			return nil, bad("volume_id", "volume %q holds no file system (format %s); an AppVM mounts ext4 volumes", v.ID, v.Format)
		}
		spec.VolumeID, spec.SizeGiB = v.ID, v.SizeGiB
	} else {
		spec.SizeGiB = *req.SizeGiB
		if err := s.admitVolume(spec.SizeGiB); err != nil {
			return nil, err
		}
		os.Remove(s.layout.DataVolume(id, spec.ID)) // a leftover no record names
	}
	if hot || spec.VolumeID == "" {
		spec.Pending = record.PendingAttach
	}
	if rec, err = s.reserveVolume(rec, spec); err != nil {
		return nil, err
	}
	if spec.Pending != "" {
		if rec, err = s.attachPending(ctx, id, spec.ID); err != nil {
			return nil, err
		}
	}
	i := rec.Spec.VolumeIndex(spec.ID)
	s.log.Info("volume attached", "id", id, "volume", spec.ID, "volume_id", spec.VolumeID, "device", VolumeDevice(rec, i), "hot", hot)
	return rec, nil
}

// attachPending carries out the recorded attach of volume key of VM id
// (its record says Pending attach; the VM's lock is held): a VM-owned
// volume's file is made unless it is there, a running or paused VM gets
// the disk (Host.HotAttach, which resumes what an interrupted run did),
// then the attach is recorded done. On failure the attach is rolled back:
// the volume leaves the record and a VM-owned volume's file goes. It
// returns the record after.
func (s *Service) attachPending(ctx context.Context, id, key string) (*Record, error) {
	rec := s.recs.Get(id)
	i := rec.Spec.VolumeIndex(key)
	if i < 0 {
		return nil, &HostError{Kind: HostInternal, Op: "attaching volume " + key + " to VM " + id, Err: errors.New("not in the VM's record")}
	}
	v := rec.Spec.Volumes[i]
	owned := v.VolumeID == ""
	err := func() error {
		if owned {
			if _, err := os.Stat(s.layout.DataVolume(id, v.ID)); err != nil {
				if err := s.makeOwnedVolume(ctx, rec, v); err != nil {
					return err
				}
			}
		}
		if rec.State == StateRunning || rec.State == StatePaused {
			return s.o.Host.HotAttach(ctx, rec, key)
		}
		return nil
	}()
	if err != nil {
		if _, uerr := s.recs.Update(id, func(r *Record) { dropVolume(r, key) }); uerr != nil {
			s.log.Error("rolling back a failed attach", "id", id, "volume", key, "err", uerr)
		} else if owned {
			os.Remove(s.layout.DataVolume(id, key))
		}
		return nil, err
	}
	out, err := s.recs.Update(id, func(r *Record) {
		if i := r.Spec.VolumeIndex(key); i >= 0 {
			r.Spec.Volumes[i].Pending = ""
		}
	})
	if err != nil {
		return nil, &HostError{Kind: HostStorage, Op: "recording the attach of " + key + " to VM " + id, Err: err}
	}
	return out, nil
}

// checkAttach applies the request rules that need only the record. An
// AppVM's volume needs a mountpoint of its own (its form checked first); a
// classic VM's may have none.
func checkAttach(rec *Record, req AttachRequest) error {
	if rec.Mode == ModeAppVM {
		if req.Mountpoint == "" {
			return bad("mountpoint", "required on an AppVM")
		}
		if err := CheckMountpoint(req.Mountpoint); err != nil {
			return bad("mountpoint", "%s", err)
		}
	}
	if (req.VolumeID == "") == (req.SizeGiB == nil) {
		return bad("volume_id", "give exactly one of volume_id (attach a volume) and size_gib (make a new one)")
	}
	if req.SizeGiB != nil && (*req.SizeGiB < 1 || *req.SizeGiB > MaxSizeGiB) {
		return bad("size_gib", "must be 1..%d, got %d", MaxSizeGiB, *req.SizeGiB)
	}
	max := MaxVolumes
	if rec.Mode == ModeAppVM {
		max = MaxAppVMVolumes
		if slices.ContainsFunc(rec.Spec.Volumes, func(v VolumeSpec) bool { return v.Mountpoint == req.Mountpoint }) {
			return bad("mountpoint", "%s is already a data volume's mountpoint", req.Mountpoint)
		}
	} else if req.Mountpoint != "" {
		return bad("mountpoint", "only an AppVM mounts its volumes")
	}
	if len(rec.Spec.Volumes) >= max {
		return bad("volumes", "VM %q has %d volumes, the most it may have", rec.ID, max)
	}
	if n := pciDevices(&rec.Spec); n >= PCISlots {
		return bad("volumes", "VM %q has %d PCI devices, all that Cloud Hypervisor's PCI segment holds (%d); detach a volume first", rec.ID, n, PCISlots)
	}
	switch {
	case rec.Deleting:
		return &StateError{ID: rec.ID, Action: "attach a volume to", State: "being deleted"}
	case disksAbsent(rec):
		return &StateError{ID: rec.ID, Action: "attach a volume to", State: rec.DisplayState, Hint: "its disks are not made"}
	case slices.ContainsFunc(rec.Spec.Volumes, func(v VolumeSpec) bool { return v.Pending != "" }):
		return &StateError{ID: rec.ID, Action: "attach a volume to", State: rec.DisplayState, Hint: "a volume change is in progress"}
	case rec.Suspended != nil:
		return &StateError{ID: rec.ID, Action: "attach a volume to", State: "suspended", Hint: suspendedHint}
	}
	return nil
}

// makeOwnedVolume writes the image of a new VM-owned volume (an ext4 file
// system for one its guest mounts), atomically: the file appears complete
// or not at all (its temp files carry names the startup sweep removes).
func (s *Service) makeOwnedVolume(ctx context.Context, rec *Record, v VolumeSpec) error {
	path := s.layout.DataVolume(rec.ID, v.ID)
	var err error
	if v.Mounted() {
		err = qcow2.CreateExt4(ctx, path, uint64(v.SizeGiB)<<30, v.ID)
	} else {
		err = qcow2.Create(path, uint64(v.SizeGiB)<<30)
	}
	if err != nil {
		os.Remove(path)
		return &HostError{Kind: HostStorage, Op: fmt.Sprintf("creating volume %s of VM %s", v.ID, rec.ID), Err: err}
	}
	return nil
}

// reserveVolume records v on rec's VM, unless v's first-class volume is
// attached anywhere (*StateError): the check and the record are one step
// under volMu.
func (s *Service) reserveVolume(rec *Record, v VolumeSpec) (*Record, error) {
	s.volMu.Lock()
	defer s.volMu.Unlock()
	if v.VolumeID != "" {
		if u := s.volumeUsers()[v.VolumeID]; u != nil {
			return nil, &StateError{Msg: fmt.Sprintf("volume %q is already attached to VM %q as %s", v.VolumeID, u.VMID, u.Device)}
		}
	}
	rec, err := s.recs.Update(rec.ID, func(r *Record) { r.Spec.Volumes = append(r.Spec.Volumes, v) })
	if err != nil {
		return nil, &HostError{Kind: HostStorage, Op: "recording a volume of VM " + rec.ID, Err: err}
	}
	return rec, nil
}

// dropVolume removes volume key from r's spec.
func dropVolume(r *Record, key string) {
	if i := r.Spec.VolumeIndex(key); i >= 0 {
		r.Spec.Volumes = slices.Delete(r.Spec.Volumes, i, i+1)
	}
}

// DetachVolume detaches volume key (a per-VM id such as "data1", or a
// first-class volume id) from the VM id of family mode. A running or
// paused VM has the disk hot-unplugged first (Host.HotDetach; a running
// AppVM's guest unmounts it, and a busy mount is *StateError naming the
// mountpoint). A VM-owned volume is kept as a first-class volume named
// "<vm id>-<data id>" (with a suffix when taken): detaching never loses
// data. It returns the record after.
func (s *Service) DetachVolume(ctx context.Context, mode Mode, id, key string) (*Record, error) {
	unlock := s.lockVM(id)
	defer unlock()
	rec, err := s.Get(mode, id)
	if err != nil {
		return nil, err
	}
	i := rec.Spec.VolumeIndex(key)
	if i < 0 {
		return nil, notFound(fmt.Sprintf("VM %q has no volume %q", id, key))
	}
	v := rec.Spec.Volumes[i]
	switch {
	case rec.Deleting:
		return nil, &StateError{ID: id, Action: "detach a volume from", State: "being deleted"}
	case disksAbsent(rec):
		return nil, &StateError{ID: id, Action: "detach a volume from", State: rec.DisplayState, Hint: "its disks are not made"}
	case v.Pending != "" || slices.ContainsFunc(rec.Spec.Volumes, func(v VolumeSpec) bool { return v.Pending != "" }):
		return nil, &StateError{ID: id, Action: "detach a volume from", State: rec.DisplayState, Hint: "a volume change is in progress"}
	case rec.State == StatePaused:
		return nil, &StateError{ID: id, Action: "detach a volume from", State: rec.DisplayState, Hint: "resume it first: a paused guest cannot release the disk"}
	case rec.Suspended != nil:
		return nil, &StateError{ID: id, Action: "detach a volume from", State: "suspended", Hint: suspendedHint}
	}
	device := VolumeDevice(rec, i)
	if rec.State == StateRunning {
		if rec, err = s.recs.Update(id, func(r *Record) { r.Spec.Volumes[i].Pending = record.PendingDetach }); err != nil {
			return nil, &HostError{Kind: HostStorage, Op: "recording the detach of " + v.ID + " from VM " + id, Err: err}
		}
		if err := s.o.Host.HotDetach(ctx, rec, v.ID); err != nil {
			if _, uerr := s.recs.Update(id, func(r *Record) {
				if j := r.Spec.VolumeIndex(v.ID); j >= 0 {
					r.Spec.Volumes[j].Pending = ""
				}
			}); uerr != nil {
				s.log.Error("rolling back a failed detach", "id", id, "volume", v.ID, "err", uerr)
			}
			return nil, err
		}
	}
	rec, kept, err := s.finishDetach(rec, v)
	if err != nil {
		return nil, err
	}
	s.log.Info("volume detached", "id", id, "volume", v.ID, "volume_id", kept, "device", device)
	return rec, nil
}

// finishDetach drops v from its VM's record after the host let go of it
// (or the VM does not run): a VM-owned volume is first kept as a
// first-class one, then its old name goes. It returns the record after
// and the first-class volume's id. Recovery calls it for a detach the
// agent did not finish.
func (s *Service) finishDetach(rec *Record, v VolumeSpec) (*Record, string, error) {
	kept := v.VolumeID
	if kept == "" {
		var err error
		if kept, err = s.keepOwned(rec, v); err != nil {
			return nil, "", err
		}
	}
	if v.VolumeID == "" {
		// First recorded as the first-class volume it now is, so the
		// detach (the next write) names it, and a crash in between
		// leaves a record that points at the kept file.
		if _, err := s.recs.Update(rec.ID, func(r *Record) {
			if i := r.Spec.VolumeIndex(v.ID); i >= 0 {
				r.Spec.Volumes[i].VolumeID = kept
			}
		}); err != nil {
			return nil, "", &HostError{Kind: HostStorage, Op: "recording the detach of " + v.ID + " from VM " + rec.ID, Err: err}
		}
	}
	out, err := s.recs.Update(rec.ID, func(r *Record) { dropVolume(r, v.ID) })
	if err != nil {
		return nil, "", &HostError{Kind: HostStorage, Op: "recording the detach of " + v.ID + " from VM " + rec.ID, Err: err}
	}
	if v.VolumeID == "" {
		if err := os.Remove(s.layout.DataVolume(rec.ID, v.ID)); err != nil && !errors.Is(err, fs.ErrNotExist) {
			s.log.Warn("removing the old name of a kept volume", "id", rec.ID, "volume", v.ID, "err", err)
		}
	}
	return out, kept, nil
}

// keepOwned makes VM-owned volume v of rec a first-class volume, named
// "<vm id>-<data id>", or with "-2", "-3", … appended when taken. A
// volume already kept under one of those names from this very file (an
// interrupted detach) is reused.
func (s *Service) keepOwned(rec *Record, v VolumeSpec) (string, error) {
	src := s.layout.DataVolume(rec.ID, v.ID)
	format := volume.FormatRaw
	if v.Mounted() {
		format = volume.FormatExt4
	}
	for n := 1; n <= 100; n++ {
		suffix := "-" + v.ID
		if n > 1 {
			suffix += fmt.Sprintf("-%d", n)
		}
		// Ids are at most 64 bytes: a long VM id is cut, deterministically,
		// so a retry after a crash finds the same name.
		id := rec.ID[:min(len(rec.ID), 64-len(suffix))] + suffix
		if sameFile(src, s.vols.Path(id)) {
			if _, err := s.vols.Get(id); err == nil {
				return id, nil // kept before a crash
			}
		}
		err := s.vols.Adopt(volume.Volume{ID: id, Format: format, SizeGiB: v.SizeGiB, CreatedAt: s.o.Now().UTC().Truncate(time.Second)}, src)
		if err == nil {
			s.log.Info("detached volume kept as a first-class volume", "id", rec.ID, "volume", v.ID, "volume_id", id)
			return id, nil
		}
		if !errors.Is(err, volume.ErrExists) {
			return "", &HostError{Kind: HostStorage, Op: "keeping detached volume " + v.ID + " of VM " + rec.ID, Err: err}
		}
	}
	return "", &HostError{Kind: HostStorage, Op: "keeping detached volume " + v.ID + " of VM " + rec.ID, Err: errors.New("no free volume id")}
}

// notFound is a missing volume: errors.Is(err, fs.ErrNotExist) holds (the
// API's 404), and the message is only what it says.
type notFound string

func (e notFound) Error() string        { return string(e) }
func (e notFound) Is(target error) bool { return target == fs.ErrNotExist }

func sameFile(a, b string) bool {
	fa, err := os.Stat(a)
	if err != nil {
		return false
	}
	fb, err := os.Stat(b)
	return err == nil && os.SameFile(fa, fb)
}

// RecoverVolumes finishes the attaches and detaches an agent stop cut
// short (a record with a Pending volume), once the host has adopted the
// running VMs, in the background (Wait waits for it): each is carried out
// again from where it stopped, as the operation meant, the host's steps
// resuming over what the cut-short run did (an attach: the volume's file
// made unless there, then Host.HotAttach on a VM that runs; a detach:
// Host.HotDetach on a VM that runs, then the record). One that fails now
// ends as the same failure would have: an attach rolled back, a detach
// called off (the volume stays attached). Each VM's run holds its lock,
// so a request meanwhile waits, then finds the change done.
func (s *Service) RecoverVolumes(ctx context.Context) {
	s.removeKeptLinks()
	for _, rec := range s.recs.All() {
		var keys []string
		for _, v := range rec.Spec.Volumes {
			if v.Pending != "" {
				keys = append(keys, v.ID)
			}
		}
		if len(keys) == 0 {
			continue
		}
		s.bg.Add(1)
		go func() {
			defer s.bg.Done()
			for _, key := range keys {
				s.recoverVolume(ctx, rec.ID, key)
			}
		}()
	}
}

// removeKeptLinks removes, from each VM's directory, the volume files its
// record no longer names that are a first-class volume's file under its
// old name: what a detach that kept a VM-owned volume (finishDetach) left
// when the agent died before its last step. Any other such file is left
// and logged.
func (s *Service) removeKeptLinks() {
	vols, err := s.vols.List()
	if err != nil {
		s.log.Error("listing volumes; old names of kept volumes are not removed", "err", err)
		return
	}
	for _, rec := range s.recs.All() {
		dir := s.layout.VMDir(rec.ID)
		ents, err := os.ReadDir(dir)
		if err != nil {
			continue
		}
		for _, ent := range ents {
			key, ok := strings.CutSuffix(ent.Name(), ".qcow2")
			if !ok || !ent.Type().IsRegular() || key == "root" {
				continue
			}
			if i := rec.Spec.VolumeIndex(key); i >= 0 && rec.Spec.Volumes[i].VolumeID == "" {
				continue // the VM's own volume
			}
			p := filepath.Join(dir, ent.Name())
			if !slices.ContainsFunc(vols, func(v volume.Volume) bool { return sameFile(p, s.vols.Path(v.ID)) }) {
				s.log.Warn("a volume file in a VM's directory that its record does not name; left in place", "id", rec.ID, "file", p)
				continue
			}
			if err := os.Remove(p); err != nil {
				s.log.Error("removing the old name of a kept volume", "id", rec.ID, "file", p, "err", err)
				continue
			}
			s.log.Info("removed the old name of a kept volume, left by a detach the agent did not finish", "id", rec.ID, "file", p)
		}
	}
}

// recoverTimeout bounds the recovery of one volume change: the wait for a
// running AppVM's guest agent to reconnect, and for the guest to release a
// detached disk.
const recoverTimeout = time.Minute

func (s *Service) recoverVolume(ctx context.Context, id, key string) {
	ctx, cancel := context.WithTimeout(ctx, recoverTimeout)
	defer cancel()
	unlock := s.lockVM(id)
	defer unlock()
	rec := s.recs.Get(id)
	if rec == nil {
		return
	}
	i := rec.Spec.VolumeIndex(key)
	if i < 0 || rec.Spec.Volumes[i].Pending == "" {
		return
	}
	v := rec.Spec.Volumes[i]
	log := s.log.With("id", id, "volume", key)
	if v.Pending == PendingAttach {
		if _, err := s.attachPending(ctx, id, key); err != nil {
			log.Error("an attach interrupted by an agent restart failed when finished; rolled back", "err", err)
			return
		}
		log.Info("finished an attach interrupted by an agent restart")
		return
	}
	if rec.State == StateRunning || rec.State == StatePaused {
		if err := s.o.Host.HotDetach(ctx, rec, key); err != nil {
			if _, uerr := s.recs.Update(id, func(r *Record) {
				if j := r.Spec.VolumeIndex(key); j >= 0 {
					r.Spec.Volumes[j].Pending = ""
				}
			}); uerr != nil {
				log.Error("recording a detach called off", "err", uerr)
			}
			log.Error("a detach interrupted by an agent restart failed when finished; called off, the volume stays attached", "err", err)
			return
		}
	}
	_, kept, err := s.finishDetach(rec, v)
	if err != nil {
		log.Error("finishing a detach interrupted by an agent restart", "err", err)
		return
	}
	log.Info("finished a detach interrupted by an agent restart", "volume_id", kept)
}
