package api

import (
	"errors"
	"io/fs"
	"net/http"

	"vmhost/vm"
)

// Lifecycle routes (docs/design.md §5): POST /api/vms/{id}/{action} and DELETE
// /api/vms/{id}, the same under /api/appvm/vms. 204 on success, 409
// INVALID_STATE when the VM's state does not allow the action, 404 for an
// id of the other family.

// actVM returns the handler of one lifecycle action on family mode.
func actVM(mode vm.Mode, a vm.Action) func(*Server, http.ResponseWriter, *http.Request) {
	return func(s *Server, w http.ResponseWriter, r *http.Request) {
		if _, err := s.vms.Act(r.Context(), mode, r.PathValue("id"), a); err != nil {
			s.lifecycleFail(w, r, mode, err)
			return
		}
		w.WriteHeader(http.StatusNoContent)
	}
}

// deleteVM returns the DELETE handler of family mode; ?force=true deletes
// a running or paused VM.
func deleteVM(mode vm.Mode) func(*Server, http.ResponseWriter, *http.Request) {
	return func(s *Server, w http.ResponseWriter, r *http.Request) {
		force := false
		switch f := r.URL.Query().Get("force"); f {
		case "", "false":
		case "true":
			force = true
		default:
			writeError(w, http.StatusBadRequest, CodeBadRequest, "force: must be true or false")
			return
		}
		id := r.PathValue("id")
		if err := s.vms.Delete(r.Context(), mode, id, force); err != nil {
			s.lifecycleFail(w, r, mode, err)
			return
		}
		w.WriteHeader(http.StatusNoContent)
	}
}

// lifecycleFail answers a failed action: 404 in the words of the family's
// reads, and the common mapping (409 INVALID_STATE among it) otherwise.
func (s *Server) lifecycleFail(w http.ResponseWriter, r *http.Request, mode vm.Mode, err error) {
	var he *vm.HostError
	switch {
	case !errors.As(err, &he) && errors.Is(err, fs.ErrNotExist):
		msg := "no classic VM has this id"
		if mode == vm.ModeAppVM {
			msg = "no AppVM has this id"
		}
		writeError(w, http.StatusNotFound, CodeNotFound, msg)
	default:
		s.fail(w, r, err)
	}
}
