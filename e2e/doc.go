// Package e2e tests vmhost end to end: the real `vmhost serve` process,
// through its HTTP API on a unix socket, running the Cloud Hypervisor and
// qemu-storage-daemon simulators (and the real qemu-storage-daemon where
// installed) as real child processes.
//
// TestMain builds the vmhost binary once. Tests that need taps run the
// server in a network namespace of its own, with a bridge the test creates
// there, and skip when not root. The tests run on Linux only (taps, network
// namespaces, the simulators); elsewhere the package is empty.
//
// The long crash loops (TestCrashDuringAppVMOperations and its variants,
// TestCrashAtEachSaveStep, TestCrashOverlayLoop, TestCrashDeleteCreateLoop,
// TestCrashSaveLoop) call t.Parallel: each spends most of its time waiting
// for an agent to restart and its VMs to settle, with the machine idle, so
// they run side by side (up to go test's -parallel, GOMAXPROCS by default)
// after every other test of the package has run alone. Each has its own
// agent, state and run directories, network namespace and cgroups, and
// checks only what is its own; none uses t.Setenv (which a parallel test
// cannot).
package e2e
