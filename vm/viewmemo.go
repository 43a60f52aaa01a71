package vm

import (
	"bytes"
	"encoding/json"
	"slices"
	"sync"
	"time"

	"vmhost/vm/record"
)

// ViewJSON returns the JSON of rec's view as encoding/json gives it (HTML
// escaping off, no trailing newline). The caller must not modify it.
//
// Everything in the classic view but volumes[].disk_bytes is a pure
// function of the record, which is never modified (a change stores a new
// *Record), and of the service's fixed config and layout. So a list item
// (no disk_bytes) is encoded once per record version, and the single-VM
// read once per record version and disk_bytes sample (sampled at most
// once per diskUsageMaxAge). An AppVM view holds live session values and
// is not memoized (package appvm encodes it).
func (s *Service) ViewJSON(rec *Record, o ViewOptions) []byte {
	var disk []diskSample
	if o.DiskBytes {
		absent := disksAbsent(rec)
		for _, vol := range rec.Spec.Volumes {
			if vol.Pending == record.PendingAttach {
				continue // as View
			}
			var d diskSample
			if !absent || vol.VolumeID != "" {
				d.n, d.ok = s.usage.get(s.layout.VolumeFile(rec.ID, vol))
			}
			disk = append(disk, d)
		}
	}
	s.views.mu.Lock()
	e := s.views.m[rec.ID]
	s.views.mu.Unlock()
	if e != nil && e.rec == rec {
		if !o.DiskBytes && e.list != nil {
			return e.list
		}
		if o.DiskBytes && e.one != nil && slices.Equal(e.disk, disk) {
			return e.one
		}
	}
	v := s.View(rec, ViewOptions{})
	for i, d := range disk {
		if d.ok {
			v.Volumes[i].DiskBytes = &disk[i].n
		}
	}
	b := encodeView(v)
	s.views.mu.Lock()
	defer s.views.mu.Unlock()
	if s.recs.Get(rec.ID) != rec {
		return b // an old version, or a removed VM (forgotten after the removal): nothing to keep
	}
	if s.views.m == nil {
		s.views.m = map[string]*encodedView{}
	}
	cur := s.views.m[rec.ID]
	if cur == nil || cur.rec != rec {
		cur = &encodedView{rec: rec}
	} else {
		c := *cur // readers hold the old one
		cur = &c
	}
	if o.DiskBytes {
		cur.one, cur.disk = b, disk
	} else {
		cur.list = b
	}
	s.views.m[rec.ID] = cur
	return b
}

// forgetView drops the memo of a removed VM.
func (s *Service) forgetView(id string) {
	s.views.mu.Lock()
	delete(s.views.m, id)
	s.views.mu.Unlock()
}

func encodeView(v *View) []byte {
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		panic(err) // a View holds only strings, numbers, bools and times
	}
	return bytes.TrimSuffix(b.Bytes(), []byte("\n"))
}

// viewMemo holds the encoded view of each VM's current record version.
type viewMemo struct {
	mu sync.Mutex
	m  map[string]*encodedView
}

// encodedView is one record version's view, encoded; never modified once
// stored.
type encodedView struct {
	rec  *Record
	list []byte       // without disk_bytes
	one  []byte       // with disk as sampled
	disk []diskSample // each volume's disk_bytes in one
}

type diskSample struct {
	n  uint64
	ok bool
}

// diskUsageMaxAge bounds how stale a reported disk_bytes may be: the
// single-VM read stats each volume at most once per this interval, since
// a stat per volume per read dominated the read's cost.
const diskUsageMaxAge = time.Second

type usageEntry struct {
	bytes uint64
	ok    bool
	at    time.Time
}

// diskUsage caches allocatedBytes per path for diskUsageMaxAge.
type diskUsage struct {
	mu sync.Mutex
	m  map[string]usageEntry
}

func (d *diskUsage) get(path string) (uint64, bool) {
	now := time.Now()
	d.mu.Lock()
	e, hit := d.m[path]
	d.mu.Unlock()
	if !hit || now.Sub(e.at) > diskUsageMaxAge {
		p := allocatedBytes(path)
		if p == nil {
			return 0, false // not cached: the file may appear any moment
		}
		e = usageEntry{bytes: *p, ok: true, at: now}
		d.mu.Lock()
		if d.m == nil || len(d.m) > 1<<16 {
			d.m = map[string]usageEntry{} // bound the cache; VMs come and go
		}
		d.m[path] = e
		d.mu.Unlock()
	}
	return e.bytes, e.ok
}
