package vm

import (
	"testing"
	"time"
)

// TestVMLocksFreed: a VM's action lock serializes its holders, and its
// entry is gone once nobody holds or waits for it, so VMs that come and go
// leave nothing behind.
func TestVMLocksFreed(t *testing.T) {
	s := newNoHostService(t)
	unlock := s.lockVM("a")
	got := make(chan struct{})
	go func() {
		u := s.lockVM("a")
		close(got)
		u()
	}()
	select {
	case <-got:
		t.Fatal("a second holder got the lock while the first held it")
	case <-time.After(50 * time.Millisecond):
	}
	s.lockVM("b")()
	unlock()
	<-got
	deadline := time.Now().Add(5 * time.Second)
	for {
		s.locks.mu.Lock()
		n := len(s.locks.m)
		s.locks.mu.Unlock()
		if n == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d lock entries left after every holder released", n)
		}
		time.Sleep(time.Millisecond)
	}
}
