// Package e2e tests vmhost end to end: the real `vmhost serve` process,
// through its HTTP API on a unix socket, running the Cloud Hypervisor and
// qemu-storage-daemon simulators (and the real qemu-storage-daemon where
// installed) as real child processes.
//
// TestMain builds the vmhost binary once. Tests that need taps run the
// server in a network namespace of its own, with a bridge the test creates
// there, and skip when not root. The tests run on Linux only (taps, network
// namespaces, the simulators); elsewhere the package is empty.
package e2e
