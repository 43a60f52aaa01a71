package vm

// HostRecords is the records as the host sees them (engine.Records): every
// family, creates still in flight included, and the per-VM action lock the
// Service's actions take.
type HostRecords struct{ s *Service }

// HostRecords returns the records for the host (engine.Engine.Start).
func (s *Service) HostRecords() HostRecords { return HostRecords{s} }

// Get returns the newest version of the record of id, stored or still
// being created, or nil.
func (h HostRecords) Get(id string) *Record {
	g := h.s.reg
	g.mu.RLock()
	defer g.mu.RUnlock()
	if r := g.recs[id]; r != nil {
		return r
	}
	return g.pending[id]
}

// List returns every stored record: the classic VMs, then the AppVMs,
// each sorted by id.
func (h HostRecords) List() []*Record {
	return append(h.s.reg.list(ModeVM), h.s.reg.list(ModeAppVM)...)
}

// Update stores f applied to a copy of the record of id (stored or still
// being created) and returns it; errors.Is(err, fs.ErrNotExist) when there
// is none.
func (h HostRecords) Update(id string, f func(*Record)) (*Record, error) {
	return h.s.reg.update(id, f)
}

// Stage applies f to a copy of the record of id in memory only: readers
// see it at once, and the record's next Update, or Save, stores it.
func (h HostRecords) Stage(id string, f func(*Record)) (*Record, error) {
	return h.s.reg.stage(id, f)
}

// Save stores the record of id if it has staged changes not stored yet.
func (h HostRecords) Save(id string) error { return h.s.reg.save(id) }

// Remove deletes the record of id (recovery finishing a delete the agent
// did not finish).
func (h HostRecords) Remove(id string) error {
	if err := h.s.reg.remove(id); err != nil {
		return err
	}
	h.s.forgetView(id)
	return nil
}

// Lock takes the action lock of VM id (the one Act and Delete hold) and
// returns its unlock.
func (h HostRecords) Lock(id string) (unlock func()) { return h.s.lockVM(id) }

// Host is the host the service works on (package appvm's redeploy
// rebuilds a root disk through it).
func (s *Service) Host() Host { return s.o.Host }
