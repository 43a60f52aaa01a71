package engine

import (
	"context"
	"errors"
	"fmt"
	"os"
	"testing"

	"vmhost/qcow2"
	"vmhost/vm/record"
)

// The engine is package vm's Host: vm validates and admits a request,
// takes the VM's action lock, checks the state and calls the engine, which
// records its results. These helpers are that caller, cut to what the
// engine's tests need (no validation, no admission): they make the same
// calls in the same order, so the tests run on the real records without
// package vm.

// simService is a testService whose CH and QSD are the simulators (this
// test binary), edited by edit when given.
func simService(t *testing.T, edit func(*Options)) *testService {
	t.Helper()
	return newTestServiceWith(t, testOpts{sims: true, edit: edit})
}

// baseSpec is a VM without interfaces on a fresh base image in root, with
// one VM-owned data volume.
func baseSpec(t *testing.T, root, id string) *record.Spec {
	t.Helper()
	kernel, base := root+"/vmlinux", root+"/base.qcow2"
	if err := os.WriteFile(kernel, []byte("k"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(base); err != nil {
		if err := qcow2.Create(base, 1<<30); err != nil {
			t.Fatal(err)
		}
	}
	size := uint32(2)
	return &record.Spec{VMID: id, Vcpus: 1, MemoryMB: 128, KernelPath: &kernel,
		Disk: &record.DiskSpec{BasePath: base, SizeGiB: &size}, Volumes: []record.VolumeSpec{{ID: "data0", SizeGiB: 1}}}
}

// newRecord is the record of a create of sp, as vm makes it: created,
// display creating (downloading with an image), a MAC and tap per
// interface.
func newRecord(sp *record.Spec) *record.Record {
	rec := &record.Record{ID: sp.VMID, Mode: record.ModeVM, State: record.StateCreated, DisplayState: record.DisplayCreating, Spec: *sp}
	if sp.Image != nil {
		rec.DisplayState = record.DisplayDownloading
	}
	rec.Spec.NormalizeVolumes()
	if sp.Disk != nil && sp.Disk.BasePath != "" {
		rec.Base = &record.BaseImage{Path: sp.Disk.BasePath, VirtualSizeBytes: 1 << 30}
	}
	for i := range sp.Nets {
		rec.NICs = append(rec.NICs, record.NIC{MAC: fmt.Sprintf("02:00:00:00:00:%02x", i+1), Tap: record.TapName(sp.VMID, i)})
	}
	return rec
}

// create is a synchronous create: Preflight, the record stored (the
// create's intent), Provision (rolled back with the record when it
// fails), and with auto_boot the boot under the VM's lock. It returns the
// record after; a failed boot keeps the VM.
func (s *testService) create(ctx context.Context, sp *record.Spec) (*record.Record, error) {
	rec := newRecord(sp)
	if err := s.Preflight(ctx, rec); err != nil {
		return nil, err
	}
	if err := s.recs.Create(rec); err != nil {
		return nil, err
	}
	if err := s.Provision(ctx, rec); err != nil {
		if !errors.Is(err, record.ErrDeleted) {
			s.Rollback(context.Background(), rec)
			s.recs.Remove(rec.ID)
		}
		return nil, err
	}
	if sp.AutoBoot {
		return s.act(ctx, rec.ID, "start")
	}
	return s.recs.Get(rec.ID), nil
}

// mustCreate is create that fails the test on an error.
func (s *testService) mustCreate(t *testing.T, sp *record.Spec) *record.Record {
	t.Helper()
	rec, err := s.create(context.Background(), sp)
	if err != nil {
		t.Fatalf("create %s: %v", sp.VMID, err)
	}
	return rec
}

// act runs lifecycle action a ("start" is Boot) on VM id under its lock
// and returns the record after.
func (s *testService) act(ctx context.Context, id, a string) (*record.Record, error) {
	unlock := s.recs.Lock(id)
	defer unlock()
	rec := s.recs.Get(id)
	if rec == nil {
		return nil, fmt.Errorf("no VM %q", id)
	}
	var err error
	switch a {
	case "start":
		err = s.Boot(ctx, rec)
	case "shutdown":
		err = s.Shutdown(ctx, rec)
	case "stop":
		err = s.Stop(ctx, rec)
	case "pause":
		err = s.Pause(ctx, rec)
	case "resume":
		err = s.Resume(ctx, rec)
	case "reboot":
		err = s.Reboot(ctx, rec)
	default:
		return nil, fmt.Errorf("unknown action %q", a)
	}
	if err != nil {
		return nil, err
	}
	return s.recs.Get(id), nil
}

// remove deletes VM id: its intent recorded first, then Delete, then the
// record.
func (s *testService) remove(ctx context.Context, id string) error {
	unlock := s.recs.Lock(id)
	defer unlock()
	rec, err := s.recs.Update(id, func(r *record.Record) { r.Deleting = true })
	if err != nil {
		return err
	}
	if err := s.Delete(ctx, rec); err != nil {
		return err
	}
	return s.recs.Remove(id)
}

// hotAttach attaches v to running VM id: recorded pending, HotAttach, the
// mark cleared, or the volume dropped again when HotAttach fails.
func (s *testService) hotAttach(ctx context.Context, id string, v record.VolumeSpec) (*record.Record, error) {
	unlock := s.recs.Lock(id)
	defer unlock()
	v.Pending = record.PendingAttach
	rec, err := s.recs.Update(id, func(r *record.Record) { r.Spec.Volumes = append(r.Spec.Volumes, v) })
	if err != nil {
		return nil, err
	}
	setPending := func(r *record.Record, p string) {
		if i := r.Spec.VolumeIndex(v.ID); i >= 0 {
			r.Spec.Volumes[i].Pending = p
		}
	}
	if err := s.HotAttach(ctx, rec, v.ID); err != nil {
		s.recs.Update(id, func(r *record.Record) {
			if i := r.Spec.VolumeIndex(v.ID); i >= 0 {
				r.Spec.Volumes = append(r.Spec.Volumes[:i], r.Spec.Volumes[i+1:]...)
			}
		})
		return nil, err
	}
	return s.recs.Update(id, func(r *record.Record) { setPending(r, "") })
}

// hotDetach detaches volume key (a per-VM id or a first-class volume id)
// from running VM id: recorded pending, HotDetach of its per-VM id, the
// volume dropped, or the mark cleared again when HotDetach fails.
func (s *testService) hotDetach(ctx context.Context, id, key string) (*record.Record, error) {
	unlock := s.recs.Lock(id)
	defer unlock()
	i := s.recs.Get(id).Spec.VolumeIndex(key)
	if i < 0 {
		return nil, fmt.Errorf("VM %q has no volume %q", id, key)
	}
	key = s.recs.Get(id).Spec.Volumes[i].ID
	rec, err := s.recs.Update(id, func(r *record.Record) { r.Spec.Volumes[r.Spec.VolumeIndex(key)].Pending = record.PendingDetach })
	if err != nil {
		return nil, err
	}
	if err := s.HotDetach(ctx, rec, key); err != nil {
		s.recs.Update(id, func(r *record.Record) { r.Spec.Volumes[r.Spec.VolumeIndex(key)].Pending = "" })
		return nil, err
	}
	return s.recs.Update(id, func(r *record.Record) {
		i := r.Spec.VolumeIndex(key)
		r.Spec.Volumes = append(r.Spec.Volumes[:i], r.Spec.Volumes[i+1:]...)
	})
}

// coldChange changes the volumes of VM id, which runs nothing, in its
// record alone, as vm's cold attach and detach do.
func (s *testService) coldChange(id string, f func(*[]record.VolumeSpec)) error {
	unlock := s.recs.Lock(id)
	defer unlock()
	_, err := s.recs.Update(id, func(r *record.Record) { f(&r.Spec.Volumes) })
	return err
}
