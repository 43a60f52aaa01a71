package api

import (
	"errors"
	"io/fs"
	"net/http"

	"vmhost/appvm"
	"vmhost/openapi"
	"vmhost/store"
	"vmhost/vm"
)

// Suspend and snapshots (docs/api.md, Suspend and snapshots): suspend and
// start?cold= under each VM of either family, snapshots taken from and
// restored onto a VM there, and the snapshots themselves under
// /api/snapshots. The rules are vm.Service's; these handlers decode, call
// and answer.

// snapshotList is GET /api/snapshots's body.
type snapshotList struct {
	Snapshots []*vm.SnapshotView `json:"snapshots"`
}

// suspendVM returns the suspend handler of family mode: 204 once the VM's
// state is saved and its processes are gone.
func suspendVM(mode vm.Mode) func(*Server, http.ResponseWriter, *http.Request) {
	return func(s *Server, w http.ResponseWriter, r *http.Request) {
		if _, err := s.vms.Suspend(r.Context(), mode, r.PathValue("id")); err != nil {
			s.lifecycleFail(w, r, mode, err)
			return
		}
		w.WriteHeader(http.StatusNoContent)
	}
}

// startVM returns the start handler of family mode; ?cold=true discards
// a saved state and boots.
func startVM(mode vm.Mode) func(*Server, http.ResponseWriter, *http.Request) {
	return func(s *Server, w http.ResponseWriter, r *http.Request) {
		cold := false
		switch c := r.URL.Query().Get("cold"); c {
		case "", "false":
		case "true":
			cold = true
		default:
			writeError(w, http.StatusBadRequest, CodeBadRequest, "cold: must be true or false")
			return
		}
		if _, err := s.vms.Start(r.Context(), mode, r.PathValue("id"), cold); err != nil {
			s.lifecycleFail(w, r, mode, err)
			return
		}
		w.WriteHeader(http.StatusNoContent)
	}
}

// createSnapshot returns the snapshot handler of family mode: 201 with the
// Snapshot.
func createSnapshot(mode vm.Mode) func(*Server, http.ResponseWriter, *http.Request) {
	return func(s *Server, w http.ResponseWriter, r *http.Request) {
		var req vm.SnapshotRequest
		if _, ok := s.decodeBody(w, r, MaxBodyBytes, &req); !ok {
			return
		}
		sn, err := s.vms.CreateSnapshot(r.Context(), mode, r.PathValue("id"), req)
		if err != nil {
			s.lifecycleFail(w, r, mode, err)
			return
		}
		writeJSON(w, http.StatusCreated, sn)
	}
}

// restoreVM returns the restore handler of family mode: 200 with the VM's
// view as its GET answers it.
func restoreVM(mode vm.Mode) func(*Server, http.ResponseWriter, *http.Request) {
	return func(s *Server, w http.ResponseWriter, r *http.Request) {
		var req vm.RestoreRequest
		if _, ok := s.decodeBody(w, r, MaxBodyBytes, &req); !ok {
			return
		}
		id := r.PathValue("id")
		if _, err := s.vms.Get(mode, id); err != nil {
			s.lifecycleFail(w, r, mode, err)
			return
		}
		rec, err := s.vms.RestoreSnapshot(r.Context(), mode, id, req)
		// The VM was there: a missing thing now is the snapshot (or the VM
		// deleted meanwhile), named by the message.
		s.volumeChanged(w, r, mode, rec, err)
	}
}

// listSnapshots answers GET /api/snapshots, sorted by id; ?vm_id= keeps a
// VM's.
func (s *Server) listSnapshots(w http.ResponseWriter, r *http.Request) {
	vmID := r.URL.Query().Get("vm_id")
	if vmID != "" && !store.ValidID(vmID) {
		writeError(w, http.StatusBadRequest, CodeBadRequest, "vm_id: not a VM id")
		return
	}
	list, err := s.vms.ListSnapshots(vmID)
	if err != nil {
		s.fail(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, snapshotList{list})
}

// getSnapshot answers GET /api/snapshots/{id}.
func (s *Server) getSnapshot(w http.ResponseWriter, r *http.Request) {
	sn, err := s.vms.GetSnapshot(r.PathValue("id"))
	if err != nil {
		s.snapshotFail(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, sn)
}

// deleteSnapshot answers DELETE /api/snapshots/{id}: 204, or 409 while a
// create from it or a restore of it runs.
func (s *Server) deleteSnapshot(w http.ResponseWriter, r *http.Request) {
	if err := s.vms.DeleteSnapshot(r.PathValue("id")); err != nil {
		s.snapshotFail(w, r, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// snapshotFail answers a failed snapshot read or delete: 404 in the words
// of the snapshot routes, the common mapping otherwise.
func (s *Server) snapshotFail(w http.ResponseWriter, r *http.Request, err error) {
	var he *vm.HostError
	if !errors.As(err, &he) && errors.Is(err, fs.ErrNotExist) {
		writeError(w, http.StatusNotFound, CodeNotFound, "no snapshot has this id")
		return
	}
	s.fail(w, r, err)
}

// snapshotDocs are the snapshot routes' entries of the OpenAPI document.
var snapshotDocs = map[string]routeDoc{
	"POST /api/vms/{id}/suspend": {summary: "Suspend a classic VM: its memory and device state saved, its processes gone (a start resumes it)", tag: "vms",
		ok: []openapi.Response{noContent}},
	"POST /api/appvm/vms/{id}/suspend": {summary: "Suspend an AppVM: its memory and device state saved, its processes gone (a start resumes it)", tag: "appvms",
		ok: []openapi.Response{noContent}},
	"POST /api/vms/{id}/snapshots": {summary: "Snapshot a classic VM: copies of its own disks, and its memory when asked and it runs", tag: "snapshots",
		request: (*vm.SnapshotRequest)(nil), ok: []openapi.Response{jsonOK(201, vm.SnapshotView{})}},
	"POST /api/appvm/vms/{id}/snapshots": {summary: "Snapshot an AppVM: copies of its own disks, and its memory when asked and it runs", tag: "snapshots",
		request: (*vm.SnapshotRequest)(nil), ok: []openapi.Response{jsonOK(201, vm.SnapshotView{})}},
	"POST /api/vms/{id}/restore": {summary: "Restore a snapshot onto a classic VM that does not run (with memory, the next start resumes from it)", tag: "snapshots",
		request: (*vm.RestoreRequest)(nil), ok: []openapi.Response{jsonOK(200, vm.View{})}},
	"POST /api/appvm/vms/{id}/restore": {summary: "Restore a snapshot onto an AppVM that does not run (with memory, the next start resumes from it)", tag: "snapshots",
		request: (*vm.RestoreRequest)(nil), ok: []openapi.Response{jsonOK(200, appvm.View{})}},
	"GET /api/snapshots": {summary: "List snapshots (sorted by id)", tag: "snapshots", ok: []openapi.Response{jsonOK(200, snapshotList{})},
		query: []openapi.Param{{Name: "vm_id", Description: "only this VM's snapshots"}}},
	"GET /api/snapshots/{id}":    {summary: "Read a snapshot", tag: "snapshots", ok: []openapi.Response{jsonOK(200, vm.SnapshotView{})}},
	"DELETE /api/snapshots/{id}": {summary: "Delete a snapshot", tag: "snapshots", ok: []openapi.Response{noContent}},
}
