package main

import (
	"os"

	"vmhost/appvm/guest"
)

// Inside an AppVM the kernel starts the initramfs's /init (this binary) as
// PID 1 with no subcommand, so PID 1 always means the guest agent.

// runAsInit reports whether this process is the init of a guest, and if
// so runs the guest agent with the kernel-given arguments.
func runAsInit() (int, bool) {
	if os.Getpid() != 1 {
		return 0, false
	}
	return guest.Main(os.Args[1:]), true
}
