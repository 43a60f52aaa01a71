package engine

import (
	"os"
	"path/filepath"
	"sync"
	"time"

	"vmhost/internal/nofollow"
)

// writeBehindPeriod is how often writeBehind looks for what CH wrote.
const writeBehindPeriod = 20 * time.Millisecond

// writeBehind starts the kernel's write-out of the files appearing in dir
// while Cloud Hypervisor writes them (vm.snapshot writes the guest's
// memory through the page cache and syncs nothing), every
// writeBehindPeriod, and once more when stopped (CH is done then): so the
// sync that must follow before the state counts as saved finds most of it
// on the disk already, and every file's write-out started, instead of
// starting them one by one then. It only starts the write-out, in a
// goroutine of its own (a busy disk can hold a call there, and stop waits
// for that one call); the sync after still makes every file durable. The
// function returned stops it, waits until it stopped, and returns how many
// files it wrote out.
func writeBehind(dir string) (stop func() (files int)) {
	done := make(chan struct{})
	var wg sync.WaitGroup
	open := map[string]*os.File{}
	wg.Add(1)
	go func() {
		defer wg.Done()
		t := time.NewTicker(writeBehindPeriod)
		defer t.Stop()
		for {
			stopped := false
			select {
			case <-done:
				stopped = true
			case <-t.C:
			}
			ents, err := os.ReadDir(dir)
			if err != nil {
				return
			}
			for _, ent := range ents {
				if !ent.Type().IsRegular() {
					continue
				}
				f := open[ent.Name()]
				if f == nil {
					// The directory is the VM's to write: a name that
					// became a link or a FIFO is not opened.
					if f, err = nofollow.Open(filepath.Join(dir, ent.Name())); err != nil {
						continue
					}
					open[ent.Name()] = f
				}
				startWriteOut(f)
			}
			if stopped {
				return
			}
		}
	}()
	return func() int {
		close(done)
		wg.Wait()
		for _, f := range open {
			f.Close()
		}
		return len(open)
	}
}
