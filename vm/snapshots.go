package vm

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/google/uuid"

	"vmhost/events"
	"vmhost/internal/crashhook"
	"vmhost/snapshot"
	"vmhost/store"
	"vmhost/vm/record"
)

// Suspend and snapshots (docs/api.md, Suspend and snapshots): the rules
// and the snapshot store; the host work is Host's (Suspend, Snapshot,
// RestoreSnapshot, DiscardSaved, and Boot, which resumes a VM with a saved
// state).

// suspendedHint is what an operator can do about a suspended VM.
const suspendedHint = "its saved state holds its devices as they were: start it (it resumes), or start it with ?cold=true, which discards the state"

// SnapshotRequest is the body of POST /api/{family}/{id}/snapshots.
type SnapshotRequest struct {
	SnapshotID string `json:"snapshot_id,omitempty"`
	Memory     bool   `json:"memory,omitempty"`
}

// RestoreRequest is the body of POST /api/{family}/{id}/restore.
type RestoreRequest struct {
	SnapshotID string `json:"snapshot_id" decode:"required"`
}

// SnapshotView is the Snapshot of docs/api.md.
type SnapshotView struct {
	ID        string         `json:"id"`
	VMID      string         `json:"vm_id"`
	Mode      Mode           `json:"mode"`
	CreatedAt time.Time      `json:"created_at"`
	Memory    bool           `json:"memory"`
	Disks     []SnapshotDisk `json:"disks"`
	// Volumes are the first-class volumes the VM had attached: named, not
	// copied.
	Volumes   []SnapshotVolume `json:"volumes,omitempty"`
	SizeBytes uint64           `json:"size_bytes"`
}

// SnapshotDisk is the copy of one disk the VM owned.
type SnapshotDisk struct {
	ID               string `json:"id"`
	Path             string `json:"path"`
	VirtualSizeBytes uint64 `json:"virtual_size_bytes"`
}

// SnapshotVolume is a first-class volume a snapshot names.
type SnapshotVolume struct {
	ID       string `json:"id"`
	VolumeID string `json:"volume_id"`
}

func snapshotView(sn *snapshot.Snapshot) *SnapshotView {
	v := &SnapshotView{ID: sn.ID, VMID: sn.VMID, Mode: Mode(sn.Mode), CreatedAt: sn.CreatedAt, Memory: sn.Memory,
		Disks: []SnapshotDisk{}, SizeBytes: sn.SizeBytes}
	for _, d := range sn.Disks {
		v.Disks = append(v.Disks, SnapshotDisk{ID: d.ID, Path: d.Path, VirtualSizeBytes: d.VirtualSizeBytes})
	}
	for _, n := range sn.Volumes {
		v.Volumes = append(v.Volumes, SnapshotVolume{ID: n.ID, VolumeID: n.VolumeID})
	}
	return v
}

// Snapshots is the snapshot store.
func (s *Service) Snapshots() *snapshot.Store { return s.snaps }

func (s *Service) publish(e events.Event) {
	if s.o.Events != nil {
		s.o.Events.Publish(e)
	}
}

// Suspend saves the memory and device state of the running or paused VM
// id of family mode and stops its processes (Host.Suspend): it is then
// stopped, with suspended_at, and holds no memory; a start resumes it.
// Any other state is *StateError; a state directory without room for its
// memory is *CapacityError.
func (s *Service) Suspend(ctx context.Context, mode Mode, id string) (*Record, error) {
	unlock := s.lockVM(id)
	defer unlock()
	rec, err := s.Get(mode, id)
	if err != nil {
		return nil, err
	}
	if rec.Deleting || (rec.State != StateRunning && rec.State != StatePaused) {
		return nil, &StateError{ID: id, Action: "suspend", State: rec.DisplayState}
	}
	if err := s.admitSave(rec.Spec.MemoryMB<<20, "suspending VM "+id); err != nil {
		return nil, err
	}
	if err := s.o.Host.Suspend(ctx, rec); err != nil {
		return nil, err
	}
	s.log.Info("VM suspended", "id", id)
	return s.recs.Get(id), nil
}

// Start is the start action (Act); cold first discards a saved state
// (Host.DiscardSaved), so the VM boots instead of resuming.
func (s *Service) Start(ctx context.Context, mode Mode, id string, cold bool) (*Record, error) {
	if !cold {
		return s.Act(ctx, mode, id, ActionStart)
	}
	unlock := s.lockVM(id)
	defer unlock()
	rec, err := s.Get(mode, id)
	if err != nil {
		return nil, err
	}
	if !allowed(ActionStart, rec) {
		return nil, &StateError{ID: id, Action: string(ActionStart), State: rec.DisplayState}
	}
	if rec.Suspended != nil {
		if err := s.o.Host.DiscardSaved(ctx, rec); err != nil {
			return nil, err
		}
		rec = s.recs.Get(id)
	}
	if _, _, err := s.boot(ctx, rec); err != nil {
		return nil, err
	}
	s.log.Info("VM lifecycle action", "id", id, "action", ActionStart, "cold", true)
	return s.recs.Get(id), nil
}

// admitSave refuses a save of need bytes (a VM's memory, disk copies)
// that the state directory's free space, less the disk copies in flight,
// cannot hold (*CapacityError, resource disk).
func (s *Service) admitSave(need uint64, what string) error {
	free, err := s.o.DiskFree()
	if err != nil {
		return &CapacityError{Resource: "disk", Msg: err.Error()}
	}
	inflight := uint64(0)
	for _, r := range s.recs.All() {
		if r.Provisioning() {
			inflight += diskBytes(r)
		}
	}
	if need+inflight > free {
		return &CapacityError{Resource: "disk", Msg: fmt.Sprintf("%s needs %d bytes (and the disk copies in flight %d), %d free in the state directory", what, need, inflight, free)}
	}
	return nil
}

// CreateSnapshot takes a snapshot of the VM id of family mode (Host
// .Snapshot): copies of the disks it owns, and its memory when req.Memory
// and the VM runs, is paused or is suspended. A running VM is paused for
// the copies and runs again after. A taken id is *ExistsError; a VM whose
// disks are not made, or that is being deleted, *StateError; too little
// room, *CapacityError.
func (s *Service) CreateSnapshot(ctx context.Context, mode Mode, id string, req SnapshotRequest) (*SnapshotView, error) {
	if req.SnapshotID != "" && !store.ValidID(req.SnapshotID) {
		return nil, bad("snapshot_id", "must match ^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
	}
	unlock := s.lockVM(id)
	defer unlock()
	rec, err := s.Get(mode, id)
	if err != nil {
		return nil, err
	}
	switch {
	case rec.Deleting:
		return nil, &StateError{ID: id, Action: "snapshot", State: "being deleted"}
	case disksAbsent(rec):
		return nil, &StateError{ID: id, Action: "snapshot", State: rec.DisplayState, Hint: "its disks are not made"}
	case slices.ContainsFunc(rec.Spec.Volumes, func(v VolumeSpec) bool { return v.Pending != "" }):
		return nil, &StateError{ID: id, Action: "snapshot", State: rec.DisplayState, Hint: "a volume change is in progress"}
	}
	sid := req.SnapshotID
	if sid == "" {
		s.randMu.Lock()
		u, err := uuid.NewRandomFromReader(s.o.Rand)
		s.randMu.Unlock()
		if err != nil {
			return nil, fmt.Errorf("generating snapshot id: %w", err)
		}
		sid = u.String()
	}
	live := rec.State == StateRunning || rec.State == StatePaused
	memory := req.Memory && (live || rec.Suspended != nil)
	need := s.ownedDiskBytes(rec)
	if memory && live {
		need += rec.Spec.MemoryMB << 20
	}
	if err := s.admitSave(need, "snapshot "+sid+" of VM "+id); err != nil {
		return nil, err
	}
	release, err := s.snaps.Reserve(sid)
	if errors.Is(err, snapshot.ErrExists) {
		return nil, &ExistsError{ID: sid, What: "snapshot"}
	}
	if err != nil {
		return nil, &HostError{Kind: HostStorage, Op: "snapshot of VM " + id, Err: err}
	}
	defer release()
	at := s.o.Now().UTC().Truncate(time.Millisecond)
	disks, saved, err := s.o.Host.Snapshot(ctx, rec, sid, s.snaps.Staging(sid), memory)
	if err != nil {
		return nil, err
	}
	rec = s.recs.Get(id)
	sn := &snapshot.Snapshot{ID: sid, VMID: id, Mode: string(mode), CreatedAt: at, Memory: saved, Disks: disks,
		Source: snapshotSource(rec)}
	for _, v := range rec.Spec.Volumes {
		if v.VolumeID != "" {
			sn.Volumes = append(sn.Volumes, snapshot.NamedVolume{ID: v.ID, VolumeID: v.VolumeID})
		}
	}
	if err := s.snaps.Commit(sn); err != nil {
		return nil, &HostError{Kind: HostStorage, Op: "snapshot of VM " + id, Err: err}
	}
	crashhook.StopAt("snapshot:committed") // crash tests: the snapshot whole, not answered
	s.log.Info("snapshot taken", "id", id, "snapshot", sid, "memory", saved, "disks", len(disks))
	got, err := s.snaps.Get(sid)
	if err != nil {
		return nil, &HostError{Kind: HostStorage, Op: "reading snapshot " + sid, Err: err}
	}
	s.publish(events.Event{Type: events.SnapshotCreated, VMID: id, Mode: string(rec.Mode), State: string(rec.State),
		DisplayState: rec.DisplayState, SnapshotID: sid})
	return snapshotView(got), nil
}

// snapshotSource is what a snapshot keeps of rec for a new VM from it and
// a restore onto it.
func snapshotSource(rec *Record) snapshot.Source {
	var src snapshot.Source
	src.Volumes, _ = json.Marshal(rec.Spec.Volumes)
	if rec.Base != nil {
		src.Base, _ = json.Marshal(rec.Base)
	}
	if a := rec.AppVM; a != nil {
		src.ImageID = a.ImageID
		src.Workload, _ = json.Marshal(a.Image)
	}
	src.VMCreatedAt = rec.CreatedAt
	return src
}

// ownedDiskBytes is the space rec's own disks take now (what copies of
// them take at most).
func (s *Service) ownedDiskBytes(rec *Record) uint64 {
	files := []string{s.layout.RootDisk(rec.ID)}
	for _, v := range rec.Spec.Volumes {
		if v.VolumeID == "" {
			files = append(files, s.layout.DataVolume(rec.ID, v.ID))
		}
	}
	var n uint64
	for _, f := range files {
		if fi, err := os.Stat(f); err == nil {
			if st, ok := fi.Sys().(*syscall.Stat_t); ok {
				n += uint64(st.Blocks) * 512
			}
		}
	}
	return n
}

// ListSnapshots is every snapshot, sorted by id; vmID, when set, keeps
// only that VM's.
func (s *Service) ListSnapshots(vmID string) ([]*SnapshotView, error) {
	all, err := s.snaps.List()
	if err != nil {
		return nil, &HostError{Kind: HostStorage, Op: "listing snapshots", Err: err}
	}
	out := []*SnapshotView{}
	for _, sn := range all {
		if vmID == "" || sn.VMID == vmID {
			out = append(out, snapshotView(sn))
		}
	}
	return out, nil
}

// GetSnapshot is snapshot sid; a missing one satisfies
// errors.Is(err, fs.ErrNotExist).
func (s *Service) GetSnapshot(sid string) (*SnapshotView, error) {
	sn, err := s.getSnapshot(sid)
	if err != nil {
		return nil, err
	}
	return snapshotView(sn), nil
}

func (s *Service) getSnapshot(sid string) (*snapshot.Snapshot, error) {
	sn, err := s.snaps.Get(sid)
	if errors.Is(err, snapshot.ErrNotFound) {
		return nil, notFound(fmt.Sprintf("no snapshot has id %q", sid))
	}
	if err != nil {
		return nil, &HostError{Kind: HostStorage, Op: "reading snapshot " + sid, Err: err}
	}
	return sn, nil
}

// DeleteSnapshot removes snapshot sid; one a create or restore is reading
// is *StateError.
func (s *Service) DeleteSnapshot(sid string) error {
	sn, err := s.getSnapshot(sid)
	if err != nil {
		return err
	}
	if err := s.snaps.Delete(sid); err != nil {
		switch {
		case errors.Is(err, snapshot.ErrNotFound):
			return notFound(fmt.Sprintf("no snapshot has id %q", sid))
		case errors.Is(err, snapshot.ErrInUse):
			return &StateError{Msg: err.Error()}
		}
		return &HostError{Kind: HostStorage, Op: "deleting snapshot " + sid, Err: err}
	}
	s.log.Info("snapshot deleted", "snapshot", sid, "vm", sn.VMID)
	s.publish(events.Event{Type: events.SnapshotDeleted, VMID: sn.VMID, Mode: sn.Mode, SnapshotID: sid})
	for _, fn := range s.snapDeleted {
		fn(sn)
	}
	return nil
}

// OnSnapshotDeleted has fn told of each snapshot deleted, after its
// delete (appvm: the builds its disks were overlays of may be unused).
// Call it while wiring, before the service is used.
func (s *Service) OnSnapshotDeleted(fn func(*snapshot.Snapshot)) {
	s.snapDeleted = append(s.snapDeleted, fn)
}

// RestoreSnapshot makes the disks of the VM id of family mode, which must
// not run (*StateError), copies of snapshot req.SnapshotID's, and its
// saved state the snapshot's (or none): with memory, the next start
// resumes from it. A snapshot of another VM is *FieldError; a VM whose
// own disks (or, for a snapshot with memory, attached volumes) are not
// those of the snapshot, *StateError.
func (s *Service) RestoreSnapshot(ctx context.Context, mode Mode, id string, req RestoreRequest) (*Record, error) {
	unlock := s.lockVM(id)
	defer unlock()
	rec, err := s.Get(mode, id)
	if err != nil {
		return nil, err
	}
	switch {
	case rec.Deleting:
		return nil, &StateError{ID: id, Action: "restore a snapshot onto", State: "being deleted"}
	case rec.State == StateRunning || rec.State == StatePaused:
		return nil, &StateError{ID: id, Action: "restore a snapshot onto", State: rec.DisplayState, Hint: "stop or suspend it first"}
	case disksAbsent(rec):
		return nil, &StateError{ID: id, Action: "restore a snapshot onto", State: rec.DisplayState, Hint: "its disks are not made"}
	}
	if !store.ValidID(req.SnapshotID) {
		return nil, bad("snapshot_id", "must match ^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
	}
	unpin, err := s.snaps.Pin(req.SnapshotID)
	if err != nil {
		return nil, notFound(fmt.Sprintf("no snapshot has id %q", req.SnapshotID))
	}
	defer unpin()
	sn, err := s.getSnapshot(req.SnapshotID)
	if err != nil {
		return nil, err
	}
	if sn.VMID != id || sn.Mode != string(mode) || !sn.Source.VMCreatedAt.Equal(rec.CreatedAt) {
		return nil, bad("snapshot_id", "snapshot %q is of another VM (%s %q created %s)", sn.ID, sn.Mode, sn.VMID, sn.Source.VMCreatedAt.Format(time.RFC3339))
	}
	if err := sameDisks(rec, sn); err != nil {
		return nil, err
	}
	apply, err := restoreApply(sn)
	if err != nil {
		return nil, &HostError{Kind: HostStorage, Op: "reading snapshot " + sn.ID, Err: err}
	}
	if err := s.o.Host.RestoreSnapshot(ctx, rec, sn, apply); err != nil {
		return nil, err
	}
	s.log.Info("snapshot restored", "id", id, "snapshot", sn.ID, "memory", sn.Memory)
	return s.recs.Get(id), nil
}

// sameDisks refuses a restore onto a VM whose own disks are not the
// snapshot's (a volume attached or detached since), or, for a snapshot
// with memory, whose attached volumes are not: the saved state names
// every device.
func sameDisks(rec *Record, sn *snapshot.Snapshot) error {
	own := []string{record.RootDiskID}
	var named []string
	for _, v := range rec.Spec.Volumes {
		if v.VolumeID == "" {
			own = append(own, v.ID)
		} else {
			named = append(named, v.ID+"="+v.VolumeID)
		}
	}
	var snapOwn, snapNamed []string
	for _, d := range sn.Disks {
		snapOwn = append(snapOwn, d.ID)
	}
	for _, n := range sn.Volumes {
		snapNamed = append(snapNamed, n.ID+"="+n.VolumeID)
	}
	if !slices.Equal(own, snapOwn) {
		return &StateError{Msg: fmt.Sprintf("VM %q owns the disks %s, snapshot %q has copies of %s: attach or detach volumes to match first",
			rec.ID, strings.Join(own, ", "), sn.ID, strings.Join(snapOwn, ", "))}
	}
	if sn.Memory && !slices.Equal(named, snapNamed) {
		return &StateError{Msg: fmt.Sprintf("VM %q has the volumes %v attached, snapshot %q (with memory) had %v: its saved state names every device",
			rec.ID, named, sn.ID, snapNamed)}
	}
	return nil
}

// restoreApply is what a restore of sn changes in its VM's record: the
// base image and an AppVM's image and workload, as they were.
func restoreApply(sn *snapshot.Snapshot) (func(*Record), error) {
	var base *BaseImage
	if len(sn.Source.Base) > 0 {
		base = new(BaseImage)
		if err := json.Unmarshal(sn.Source.Base, base); err != nil {
			return nil, err
		}
	}
	var wl *Workload
	if len(sn.Source.Workload) > 0 {
		wl = new(Workload)
		if err := json.Unmarshal(sn.Source.Workload, wl); err != nil {
			return nil, err
		}
	}
	return func(r *Record) {
		if base != nil {
			r.Base = base
		}
		if r.AppVM != nil && wl != nil {
			r.AppVM.ImageID, r.AppVM.Image = sn.Source.ImageID, *wl
		}
	}, nil
}

// FromSnapshot is the snapshot a new VM of family mode is made from (its
// from_snapshot), pinned until release is called, with the volumes the
// VM gets copies of (the snapshot's own ones, as they were) and its root
// disk. A missing snapshot, or one of the other family, is *FieldError.
func (s *Service) FromSnapshot(sid string, mode Mode) (sn *snapshot.Snapshot, vols []VolumeSpec, release func(), err error) {
	if !store.ValidID(sid) {
		return nil, nil, nil, bad("from_snapshot", "must match ^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
	}
	release, err = s.snaps.Pin(sid)
	if err != nil {
		return nil, nil, nil, bad("from_snapshot", "no snapshot has id %q", sid)
	}
	fail := func(err error) (*snapshot.Snapshot, []VolumeSpec, func(), error) {
		release()
		return nil, nil, nil, err
	}
	if sn, err = s.getSnapshot(sid); err != nil {
		return fail(bad("from_snapshot", "no snapshot has id %q", sid))
	}
	if sn.Mode != string(mode) {
		return fail(bad("from_snapshot", "snapshot %q is of a VM of family %s, not %s", sid, sn.Mode, mode))
	}
	if len(sn.Disks) == 0 || sn.Disks[0].ID != record.RootDiskID {
		return fail(&HostError{Kind: HostStorage, Op: "reading snapshot " + sid, Err: errors.New("it has no root disk")})
	}
	var all []VolumeSpec
	if len(sn.Source.Volumes) > 0 {
		if err := json.Unmarshal(sn.Source.Volumes, &all); err != nil {
			return fail(&HostError{Kind: HostStorage, Op: "reading snapshot " + sid, Err: err})
		}
	}
	for _, v := range all {
		if v.VolumeID == "" && slices.ContainsFunc(sn.Disks, func(d snapshot.Disk) bool { return d.ID == v.ID }) {
			v.Pending = ""
			vols = append(vols, v)
		}
	}
	return sn, vols, release, nil
}
