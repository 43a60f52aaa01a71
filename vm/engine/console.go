package engine

import (
	"path/filepath"

	"vmhost/chclient"
	"vmhost/console"
	"vmhost/vm/record"
)

// consoleTailLines is how many of the console's last lines a boot_timeout
// summary quotes.
const consoleTailLines = 5

// keepConsole keeps the serial console of the VM rec, whose Cloud
// Hypervisor is p, in <run>/vms/<id>/console.log until p exits or the
// engine closes, with rec's secrets replaced (docs/api.md, Secrets). It
// must start before vm.boot: what the guest prints while nobody reads the
// socket is not kept. A console that cannot be kept is logged and the VM
// runs without it.
func (e *Engine) keepConsole(rec *record.Record, socket string, p *chclient.Process) {
	id := rec.ID
	log := e.layout().ConsoleLog(id)
	// The attach socket (vmhost console) sits beside the log.
	attach := filepath.Join(filepath.Dir(log), console.AttachName)
	k, err := console.Start(e.consoleCtx, console.Config{Socket: socket, Path: log, Attach: attach, Redact: rec.Secrets.Redactor()})
	if err != nil {
		e.log.Warn("keeping the serial console", "id", id, "err", err)
		return
	}
	if err := k.AttachErr(); err != nil {
		e.log.Warn("vmhost console cannot attach to this VM", "id", id, "err", err)
	}
	e.consoles.Add(1)
	go func() {
		defer e.consoles.Done()
		select {
		case <-p.Done():
		case <-k.Done(): // the engine closed
		}
		k.Stop()
	}()
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
