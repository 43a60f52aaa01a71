package records

import "sync"

// vmLocks are the per-VM action locks. A VM's entry lives while someone
// holds or waits for its lock, so deleted VMs leave none behind.
type vmLocks struct {
	mu sync.Mutex
	m  map[string]*vmLock
}

type vmLock struct {
	sync.Mutex
	users int // holders and waiters
}

// Lock takes the action lock of VM id, the one the lifecycle actions,
// volume changes, spec edits and redeploys hold, and returns its unlock.
// The lock is not reentrant.
func (g *Registry) Lock(id string) (unlock func()) {
	l := &g.locks
	l.mu.Lock()
	if l.m == nil {
		l.m = map[string]*vmLock{}
	}
	m := l.m[id]
	if m == nil {
		m = new(vmLock)
		l.m[id] = m
	}
	m.users++
	l.mu.Unlock()
	m.Lock()
	return func() {
		m.Unlock()
		l.mu.Lock()
		if m.users--; m.users == 0 {
			delete(l.m, id)
		}
		l.mu.Unlock()
	}
}
