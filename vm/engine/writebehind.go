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
// writeBehindPeriod, so the sync that must follow before the state counts
// as saved finds most of it on the disk already instead of starting it
// then. It only starts the write-out, in a goroutine of its own (a busy
// disk can hold a call there, and stop waits for that one call); the sync
// after still makes every file durable. The function returned stops it
// and waits until it stopped.
func writeBehind(dir string) (stop func()) {
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		open := map[string]*os.File{}
		defer func() {
			for _, f := range open {
				f.Close()
			}
		}()
		t := time.NewTicker(writeBehindPeriod)
		defer t.Stop()
		for {
			select {
			case <-done:
				return
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
		}
	}()
	return func() {
		close(done)
		wg.Wait()
	}
}
