package main

import (
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// TestLimitListener: with a cap of 2, five clients whose requests block in
// the handler get two handlers running and the rest waiting; closing
// connections lets the others in, and all five are answered. Closing the
// listener ends an Accept that waits for a slot.
func TestLimitListener(t *testing.T) {
	raw, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ln := limitListener(raw, 2)
	var inside, most atomic.Int32
	release := make(chan struct{})
	entered := make(chan struct{}, 5)
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := inside.Add(1)
		for m := most.Load(); n > m && !most.CompareAndSwap(m, n); m = most.Load() {
		}
		entered <- struct{}{}
		<-release
		inside.Add(-1)
		w.Header().Set("Connection", "close") // the slot frees when the answer is sent
		fmt.Fprint(w, "ok")
	})}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()

	var wg sync.WaitGroup
	errs := make(chan error, 5)
	for range 5 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c := &http.Client{Timeout: 20 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
			resp, err := c.Get("http://" + raw.Addr().String() + "/")
			if err != nil {
				errs <- err
				return
			}
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if string(b) != "ok" {
				errs <- fmt.Errorf("body %q", b)
			}
		}()
	}
	<-entered
	<-entered
	// The other three have connected (the kernel's backlog took them) but
	// are not accepted while two connections are open.
	time.Sleep(300 * time.Millisecond)
	if n := inside.Load(); n != 2 {
		t.Errorf("%d handlers running with a cap of 2 connections", n)
	}
	close(release)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Errorf("request: %v", err)
	}
	if m := most.Load(); m > 2 {
		t.Errorf("up to %d handlers ran at once, want at most 2", m)
	}

	srv.Close()
	if err := <-served; err != http.ErrServerClosed {
		t.Errorf("Serve = %v, want ErrServerClosed", err)
	}

	// A full listener's waiting Accept ends when the listener closes.
	raw2, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	full := limitListener(raw2, 1)
	dialed, err := net.Dial("tcp", raw2.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer dialed.Close()
	first, err := full.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer first.Close()
	waiting := make(chan error, 1)
	go func() {
		c, err := full.Accept()
		if c != nil {
			c.Close()
		}
		waiting <- err
	}()
	full.Close()
	select {
	case err := <-waiting:
		if !errors.Is(err, net.ErrClosed) {
			t.Errorf("Accept after Close = %v, want net.ErrClosed", err)
		}
	case <-time.After(20 * time.Second):
		t.Error("Accept waiting for a slot did not end when the listener closed")
	}
}

// TestNoTapsReason: the advice to an agent that is not root names what it
// can still create, and says that it is no way for an AppVM.
func TestNoTapsReason(t *testing.T) {
	got := noTapsReason(1000)
	for _, want := range []string{"uid 1000", "run vmhost serve as root", "classic VMs without nets and without cloud_init", "an AppVM always has an interface"} {
		if !strings.Contains(got, want) {
			t.Errorf("noTapsReason = %q, want it to say %q", got, want)
		}
	}
}
