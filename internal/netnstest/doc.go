// Package netnstest gives a test a Linux network namespace of its own, so
// that privileged tests (taps, bridges, netlink, nftables, packet sockets)
// never touch the host's network. A namespace belongs to one locked OS
// thread; New keeps that thread for the test so processes started from it
// live in the namespace, Enter moves the test's own goroutine, and RunIn
// runs a function in a namespace that already exists. Tests that are not
// root are skipped with a message saying how to run them.
//
// The package is for tests only and builds on Linux only.
package netnstest
