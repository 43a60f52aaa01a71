//go:build !linux

package chsim_test

import (
	"fmt"
	"os"
)

// guestAgentMain stands in for the AppVM guest agent, which builds on Linux only.
func guestAgentMain(args []string) int {
	fmt.Fprintln(os.Stderr, "the AppVM guest agent runs only on Linux")
	return 1
}
