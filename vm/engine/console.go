package engine

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"

	"vmhost/chclient"
	"vmhost/console"
	"vmhost/vm/record"
)

// consoleTailLines is how many of the console's last lines a boot_timeout
// summary quotes.
const consoleTailLines = 5

// consoles are the console keepers of the VMs whose CH runs, by VM id, and
// the agent's one attach socket (<run>/console.attach), which hands an
// operator's `vmhost console` to the keeper it names: a VM costs no
// socket of its own for attaching, so adopting many running VMs binds
// nothing per VM.
type consoles struct {
	mu      sync.Mutex
	keepers map[string]*console.Keeper
	attach  *console.AttachServer
	wg      sync.WaitGroup
	// closed: the engine is closing; a boot that ends meanwhile keeps
	// no console (wg is waited on).
	closed bool
}

// serveConsoleAttach opens the agent's attach socket; without it the
// consoles are still kept, and `vmhost console` says no agent keeps them.
func (e *Engine) serveConsoleAttach() {
	if err := os.MkdirAll(e.layout().RunDir, 0o700); err != nil {
		e.log.Warn("vmhost console cannot attach to VMs", "err", err)
		return
	}
	s, err := console.ServeAttach(filepath.Join(e.layout().RunDir, console.AttachName), e.findConsole)
	if err != nil {
		e.log.Warn("vmhost console cannot attach to VMs", "err", err)
		return
	}
	e.cons.mu.Lock()
	e.cons.attach = s
	e.cons.mu.Unlock()
}

// findConsole is the keeper of VM id's console, or why there is none, in
// the words `vmhost console` shows.
func (e *Engine) findConsole(id string) (*console.Keeper, error) {
	e.cons.mu.Lock()
	k := e.cons.keepers[id]
	e.cons.mu.Unlock()
	if k != nil {
		return k, nil
	}
	rec := e.recs.Get(id)
	switch {
	case rec == nil:
		return nil, fmt.Errorf("no VM %q on this host", id)
	case rec.State != record.StateRunning && rec.State != record.StatePaused:
		return nil, errors.New("the VM is not running")
	}
	return nil, errors.New("the agent keeps no console for this VM (see its log)")
}

// keepConsole keeps the serial console of the VM rec, whose Cloud
// Hypervisor is p, in <run>/vms/<id>/console.log until p exits or the
// engine closes, with rec's secrets replaced (docs/api.md, Secrets), and
// lets operators attach to it. It must start before vm.boot: what the
// guest prints while nobody reads the socket is not kept. A console that
// cannot be kept is logged and the VM runs without it.
func (e *Engine) keepConsole(rec *record.Record, socket string, p *chclient.Process) {
	id := rec.ID
	// An agent before the shared attach socket bound one per VM here.
	os.Remove(filepath.Join(e.layout().RunVMDir(id), console.AttachName))
	k, err := console.Start(e.consoleCtx, console.Config{Socket: socket, Path: e.layout().ConsoleLog(id), Redact: rec.Secrets.Redactor()})
	if err != nil {
		e.log.Warn("keeping the serial console", "id", id, "err", err)
		return
	}
	c := &e.cons
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		k.Stop()
		return
	}
	if c.keepers == nil {
		c.keepers = map[string]*console.Keeper{}
	}
	c.keepers[id] = k
	c.wg.Add(1) // under mu: never beside closeConsoles' Wait
	c.mu.Unlock()
	go func() {
		defer c.wg.Done()
		select {
		case <-p.Done():
		case <-k.Done(): // the engine closed
		}
		k.Stop()
		c.mu.Lock()
		if c.keepers[id] == k {
			delete(c.keepers, id)
		}
		c.mu.Unlock()
	}()
}

// closeConsoles stops the attach socket and every keeper (at Close).
func (e *Engine) closeConsoles() {
	e.cons.mu.Lock()
	s := e.cons.attach
	e.cons.attach = nil
	e.cons.closed = true
	e.cons.mu.Unlock()
	if s != nil {
		s.Close()
	}
	e.consoleStop()
	e.cons.wg.Wait()
}

// consoleTail returns the last lines of the VM's console log of this boot,
// "" when it has none.
func (e *Engine) consoleTail(id string) string {
	s, err := console.Tail(e.layout().ConsoleLog(id), consoleTailLines)
	if err != nil {
		e.log.Warn("reading the console log", "id", id, "err", err)
	}
	return s
}
