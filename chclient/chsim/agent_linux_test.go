package chsim_test

import "vmhost/appvm/guest"

// guestAgentMain runs the AppVM guest agent the simulator starts by re-executing the test
// binary.
func guestAgentMain(args []string) int { return guest.Main(args) }
