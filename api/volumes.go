package api

import (
	"errors"
	"io/fs"
	"net/http"

	"vmhost/store"
	"vmhost/vm"
)

// Volumes (docs/api.md, Volumes): first-class volumes under /api/volumes, and
// attach and detach under each VM of either family. The work is
// vm.Service's, an AppVM's mountpoint included; these handlers decode,
// call and answer.

// volumeList is GET /api/volumes's body.
type volumeList struct {
	Volumes []vm.VolumeInfo `json:"volumes"`
}

// createVolume answers POST /api/volumes: 201 with the Volume.
func (s *Server) createVolume(w http.ResponseWriter, r *http.Request) {
	var req vm.VolumeRequest
	if _, ok := s.decodeBody(w, r, MaxBodyBytes, &req); !ok {
		return
	}
	v, err := s.vms.CreateVolume(r.Context(), req)
	if err != nil {
		s.fail(w, r, err)
		return
	}
	writeJSON(w, http.StatusCreated, v)
}

// listVolumes answers GET /api/volumes: sorted by id, without disk_bytes.
func (s *Server) listVolumes(w http.ResponseWriter, r *http.Request) {
	vols, err := s.vms.ListVolumes()
	if err != nil {
		s.fail(w, r, err)
		return
	}
	if vols == nil {
		vols = []vm.VolumeInfo{}
	}
	writeJSON(w, http.StatusOK, volumeList{vols})
}

// getVolume answers GET /api/volumes/{id}, with disk_bytes.
func (s *Server) getVolume(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	if !store.ValidID(id) { // no volume can have it: never a file name
		writeError(w, http.StatusNotFound, CodeNotFound, "no volume has this id")
		return
	}
	v, err := s.vms.GetVolume(id)
	if err != nil {
		s.volumeFail(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, v)
}

// deleteVolume answers DELETE /api/volumes/{id}: 204, or 409
// INVALID_STATE while a VM has it attached.
func (s *Server) deleteVolume(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	if !store.ValidID(id) {
		writeError(w, http.StatusNotFound, CodeNotFound, "no volume has this id")
		return
	}
	if err := s.vms.DeleteVolume(id); err != nil {
		s.volumeFail(w, r, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// volumeFail answers a failed volume read or delete: 404 in the words of
// the volume routes, the common mapping otherwise.
func (s *Server) volumeFail(w http.ResponseWriter, r *http.Request, err error) {
	var he *vm.HostError
	if !errors.As(err, &he) && errors.Is(err, fs.ErrNotExist) {
		writeError(w, http.StatusNotFound, CodeNotFound, "no volume has this id")
		return
	}
	s.fail(w, r, err)
}

// attachVolume returns the attach handler of family mode: 200 with the
// VM's view as its GET answers it.
func attachVolume(mode vm.Mode) func(*Server, http.ResponseWriter, *http.Request) {
	return func(s *Server, w http.ResponseWriter, r *http.Request) {
		var req vm.AttachRequest
		if _, ok := s.decodeBody(w, r, MaxBodyBytes, &req); !ok {
			return
		}
		id := r.PathValue("id")
		s.changeVolume(w, r, mode, id, func() (*vm.Record, error) {
			return s.vms.AttachVolume(r.Context(), mode, id, req)
		})
	}
}

// detachVolume returns the detach handler of family mode; {vol} is the
// per-VM id (data0, …) or the first-class volume id.
func detachVolume(mode vm.Mode) func(*Server, http.ResponseWriter, *http.Request) {
	return func(s *Server, w http.ResponseWriter, r *http.Request) {
		id, key := r.PathValue("id"), r.PathValue("vol")
		s.changeVolume(w, r, mode, id, func() (*vm.Record, error) {
			return s.vms.DetachVolume(r.Context(), mode, id, key)
		})
	}
}

// changeVolume runs an attach or detach on VM id of family mode and
// answers it. An id of neither family (or of the other) is a 404 in the
// words of the family's reads, before any rule of the body.
func (s *Server) changeVolume(w http.ResponseWriter, r *http.Request, mode vm.Mode, id string, change func() (*vm.Record, error)) {
	if _, err := s.vms.Get(mode, id); err != nil {
		s.lifecycleFail(w, r, mode, err)
		return
	}
	rec, err := change()
	s.volumeChanged(w, r, mode, rec, err)
}

// volumeChanged answers an attach or detach: the VM's view, or err (a
// missing VM or volume is 404, both named by the service's message).
func (s *Server) volumeChanged(w http.ResponseWriter, r *http.Request, mode vm.Mode, rec *vm.Record, err error) {
	var he *vm.HostError
	switch {
	case err == nil:
	case !errors.As(err, &he) && errors.Is(err, fs.ErrNotExist):
		writeError(w, http.StatusNotFound, CodeNotFound, err.Error())
		return
	default:
		s.fail(w, r, err)
		return
	}
	if mode == vm.ModeAppVM {
		writeJSON(w, http.StatusOK, s.apps.View(rec, vm.ViewOptions{DiskBytes: true}))
		return
	}
	writeView(w, http.StatusOK, s.vms.ViewJSON(rec, vm.ViewOptions{DiskBytes: true}))
}
