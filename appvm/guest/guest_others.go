//go:build !linux

package guest

import (
	"fmt"
	"os"
)

// Main refuses: the guest agent runs only as init inside a Linux AppVM.
func Main(args []string) int {
	fmt.Fprintln(os.Stderr, "vmhost guest: the guest agent runs only inside a Linux AppVM")
	return 1
}
