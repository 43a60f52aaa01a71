package server

import "golang.org/x/sys/unix"

// setNetNS moves the calling thread into the network namespace fd.
func setNetNS(fd int) error { return unix.Setns(fd, unix.CLONE_NEWNET) }
