package api

import (
	"net/http"

	"vmhost/labels"
	"vmhost/vm"
)

// LabelsEdit is the body of PATCH /api/{family}/{id}/labels (docs/api.md,
// Labels): a JSON merge patch (RFC 7396) of the VM's labels object. A key
// with a string sets that label, a key with null deletes it, a key left
// out stays.
type LabelsEdit map[string]*string

// editLabels returns the PATCH .../labels handler of family mode: 200
// with the VM's view after the edit.
func editLabels(mode vm.Mode) func(*Server, http.ResponseWriter, *http.Request) {
	return func(s *Server, w http.ResponseWriter, r *http.Request) {
		var edit LabelsEdit
		if _, ok := s.decodeBody(w, r, MaxBodyBytes, &edit); !ok {
			return
		}
		rec, err := s.vms.EditLabels(mode, r.PathValue("id"), edit)
		if err != nil {
			s.lifecycleFail(w, r, mode, err)
			return
		}
		if mode == vm.ModeAppVM {
			writeJSON(w, http.StatusOK, s.apps.View(rec, vm.ViewOptions{DiskBytes: true}))
			return
		}
		writeView(w, http.StatusOK, s.vms.ViewJSON(rec, vm.ViewOptions{DiskBytes: true}))
	}
}

// labelSelector reads the ?label= filters of a list or the event stream
// ("key=value", or "key" for present; all must match). It answers 400 and
// returns false for a malformed one.
func labelSelector(w http.ResponseWriter, r *http.Request) (labels.Selector, bool) {
	sel, err := labels.ParseSelector(r.URL.Query()["label"])
	if err != nil {
		writeError(w, http.StatusBadRequest, CodeBadRequest, "label: "+err.Error())
		return nil, false
	}
	return sel, true
}

// filterLabels keeps the records whose labels sel matches, in order.
func filterLabels(recs []*vm.Record, sel labels.Selector) []*vm.Record {
	if len(sel) == 0 {
		return recs
	}
	out := recs[:0]
	for _, rec := range recs {
		if sel.Matches(rec.Spec.Labels) {
			out = append(out, rec)
		}
	}
	return out
}
