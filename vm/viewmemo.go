package vm

import "strconv"

// EncodedView is a classic VM's view encoded once per record version.
//
// Everything in the classic view but volumes[].disk_bytes is a pure function
// of the record, which is never modified (a change stores a new *Record),
// and of the service's fixed config and layout. So the JSON can be encoded
// once per record version and reused, as long as each read fills in the
// host-measured disk_bytes afresh: AppendView does exactly that, and gives
// the same bytes as ViewInto with DiskBytes set followed by AppendJSON.
type EncodedView struct {
	rec   *Record
	json  []byte   // the view with no disk_bytes
	holes []int    // where each volume's disk_bytes goes: its closing '}'
	paths []string // the file behind each hole
}

// Record returns the record version e was encoded from.
func (e *EncodedView) Record() *Record { return e.rec }

// EncodeView encodes rec's classic view, leaving out every disk_bytes but
// remembering where each belongs. The result is safe for concurrent use.
func (s *Service) EncodeView(rec *Record) *EncodedView {
	var v View
	s.ViewInto(&v, rec, ViewOptions{})
	e := &EncodedView{rec: rec}
	// As in ViewInto: disk_bytes only once provisioning made the files.
	if !rec.Provisioning() {
		v.holes = &e.holes
		for i := range v.Volumes {
			e.paths = append(e.paths, v.Volumes[i].Path)
		}
	}
	e.json = v.AppendJSON(make([]byte, 0, 2048))
	return e
}

// AppendView appends e's JSON to b with each volume's current disk_bytes
// (sampled at most once per diskUsageMaxAge, as for every read).
func (s *Service) AppendView(b []byte, e *EncodedView) []byte {
	prev := 0
	for i, h := range e.holes {
		b = append(b, e.json[prev:h]...)
		if n, ok := s.usage.get(e.paths[i]); ok {
			b = append(b, `,"disk_bytes":`...)
			b = strconv.AppendUint(b, n, 10)
		}
		prev = h
	}
	return append(b, e.json[prev:]...)
}
