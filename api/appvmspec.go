package api

import (
	"bytes"
	"encoding/json"
	"net/http"

	"vmhost/appvm"
	"vmhost/vm"
)

// editAppVMSpec answers PATCH /api/appvm/vms/{id}/spec (docs/api.md, AppVMs):
// a field absent stays, null resets it to the image's default, a value
// replaces it; 200 with the AppVM's view. ?restart=true applies the edit
// to a running AppVM now (graceful stop, then boot).
func (s *Server) editAppVMSpec(w http.ResponseWriter, r *http.Request) {
	restart := false
	switch r.URL.Query().Get("restart") {
	case "", "false":
	case "true":
		restart = true
	default:
		writeError(w, http.StatusBadRequest, CodeBadRequest, "restart: must be true or false")
		return
	}
	var edit appvm.SpecEdit
	body, ok := s.decodeBody(w, r, MaxWorkloadBodyBytes, &edit)
	if !ok {
		return
	}
	// Which fields were given, and which as null: decodeStrict has checked
	// the body, so this decoding of its top level cannot fail.
	var given map[string]json.RawMessage
	json.Unmarshal(body, &given)
	p := appvm.SpecPatch{Values: edit, Given: map[string]bool{}, Reset: map[string]bool{}}
	for k, raw := range given {
		if bytes.Equal(bytes.TrimSpace(raw), []byte("null")) {
			p.Reset[k] = true
		} else {
			p.Given[k] = true
		}
	}
	rec, err := s.apps.EditSpec(r.Context(), r.PathValue("id"), p, restart)
	if err != nil {
		s.lifecycleFail(w, r, vm.ModeAppVM, err)
		return
	}
	writeJSON(w, http.StatusOK, s.apps.View(rec, vm.ViewOptions{DiskBytes: true}))
}

// redeployAppVM answers POST /api/appvm/vms/{id}/redeploy: 202 with the
// AppVM's view (redeploying) while the redeploy runs in the background.
func (s *Server) redeployAppVM(w http.ResponseWriter, r *http.Request) {
	rec, err := s.apps.Redeploy(r.Context(), r.PathValue("id"))
	if err != nil {
		s.lifecycleFail(w, r, vm.ModeAppVM, err)
		return
	}
	writeJSON(w, http.StatusAccepted, s.apps.View(rec, vm.ViewOptions{DiskBytes: true}))
}
