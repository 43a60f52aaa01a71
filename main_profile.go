package main

import (
	"fmt"
	"io"
	"os"
	"runtime/pprof"
)

// startProfileEnv names a file that `vmhost serve` writes a CPU profile of
// its start to: from the start of serve until the service is built (the
// records loaded and every VM reconciled with the host), which is what an
// agent restart costs per VM (bench/restart.sh; docs/testing.md). Read it
// with `go tool pprof`.
const startProfileEnv = "VMHOST_START_CPUPROFILE"

// startProfile starts the CPU profile startProfileEnv asks for and returns
// the function that ends it; without the variable both do nothing. A
// profile that cannot be written is reported and the agent starts anyway.
func startProfile(stderr io.Writer) (stop func()) {
	path := os.Getenv(startProfileEnv)
	if path == "" {
		return func() {}
	}
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err == nil {
		if err = pprof.StartCPUProfile(f); err != nil {
			f.Close()
		}
	}
	if err != nil {
		fmt.Fprintf(stderr, "vmhost serve: %s: %v (starting without a profile)\n", startProfileEnv, err)
		return func() {}
	}
	done := false
	return func() {
		if done {
			return
		}
		done = true
		pprof.StopCPUProfile()
		if err := f.Close(); err != nil {
			fmt.Fprintf(stderr, "vmhost serve: %s: %v\n", startProfileEnv, err)
		}
	}
}
