package vm

import (
	"errors"
	"io/fs"
	"maps"

	"vmhost/labels"
)

// CheckLabels applies the label rules (package labels) to the labels of a
// create of either family: a *FieldError naming the rule and the key.
func CheckLabels(l map[string]string) error {
	if err := labels.Check(l); err != nil {
		return &FieldError{Field: "labels", Msg: err.Error()}
	}
	return nil
}

// EditLabels applies a labels edit (docs/api.md, PATCH .../labels) to the
// VM id of family mode under its action lock: a key with a value sets it,
// a key with nil deletes it, a key left out stays. The labels are part of
// the record (Spec.Labels), written with it through the records' owner, so
// the event log and the views follow. It returns the record after the
// edit; an edit that changes nothing writes nothing. Not found satisfies
// errors.Is(err, fs.ErrNotExist); a broken rule is a *FieldError.
func (s *Service) EditLabels(mode Mode, id string, patch map[string]*string) (*Record, error) {
	unlock := s.lockVM(id)
	defer unlock()
	rec, err := s.Get(mode, id)
	if err != nil {
		return nil, err
	}
	// Labels change only under the VM's lock, so the merge of the labels
	// read here is the merge of the labels the write below replaces.
	merged, err := labels.Merge(rec.Spec.Labels, patch)
	if err != nil {
		return nil, &FieldError{Field: "labels", Msg: err.Error()}
	}
	if maps.Equal(merged, rec.Spec.Labels) {
		return rec, nil
	}
	rec, err = s.recs.Update(id, func(r *Record) { r.Spec.Labels = merged })
	if errors.Is(err, fs.ErrNotExist) {
		return nil, err
	}
	if err != nil {
		return nil, &HostError{Kind: HostStorage, Op: "recording the labels of VM " + id, Err: err}
	}
	s.log.Info("VM labels edited", "id", id, "labels", len(merged))
	return rec, nil
}
