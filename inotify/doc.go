// Package inotify is a small wrapper of Linux inotify(7): one instance,
// watches added and removed by path, and events read through the Go
// runtime's poller (the descriptor is non-blocking), so a reader blocks
// without a thread and Close wakes it.
package inotify
