// Package crashhook is the crash tests' stopping point. With
// VMHOST_TEST_STOP_AT_STEP=<step> in its environment, the agent stops dead
// when it reaches that step: the goroutine doing the work blocks forever,
// after creating the file named by VMHOST_TEST_STOP_MARKER (if set), so a
// test can SIGKILL the agent right there and check what a restart makes
// of it. Unset, as in production, StopAt does nothing.
package crashhook

import (
	"fmt"
	"os"
)

const (
	stopAtEnv     = "VMHOST_TEST_STOP_AT_STEP"
	stopMarkerEnv = "VMHOST_TEST_STOP_MARKER"
)

var stopAtStep = os.Getenv(stopAtEnv)

// StopAt blocks forever when step is the one the environment names.
func StopAt(step string) {
	if stopAtStep == "" || step != stopAtStep {
		return
	}
	fmt.Fprintf(os.Stderr, "vmhost: %s=%s reached; blocking until killed\n", stopAtEnv, step)
	if p := os.Getenv(stopMarkerEnv); p != "" {
		os.WriteFile(p, []byte(step+"\n"), 0o600)
	}
	select {}
}
