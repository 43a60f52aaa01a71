package appvm

import (
	"fmt"
	"os"
)

// Crash-test hooks, as the engine's (vm/engine/recover_hook.go): with
// VMHOST_TEST_STOP_AT_STEP=<step> in its environment, the agent stops dead
// when one of these steps is reached: the goroutine doing the work blocks
// forever, after creating the file named by VMHOST_TEST_STOP_MARKER (if
// set), so a test can SIGKILL the agent right there. Unset, as in
// production, they do nothing.
const (
	// HookImageDeleteRenamed: the image's directory is renamed out of the
	// catalog (the delete's commit point), its files not yet removed.
	HookImageDeleteRenamed = "image-delete:renamed"
	// HookRedeployStaged: the new root disk is staged and recorded so,
	// not yet swapped in.
	HookRedeployStaged = "redeploy:staged"
	// HookRedeploySwapped: the new root disk is swapped in, the new build
	// not yet recorded.
	HookRedeploySwapped = "redeploy:swapped"
)

var testStopAtStep = os.Getenv("VMHOST_TEST_STOP_AT_STEP")

// testStopAt blocks forever when step is the one the environment names.
func testStopAt(step string) {
	if testStopAtStep == "" || step != testStopAtStep {
		return
	}
	fmt.Fprintf(os.Stderr, "vmhost: VMHOST_TEST_STOP_AT_STEP=%s reached; blocking until killed\n", step)
	if p := os.Getenv("VMHOST_TEST_STOP_MARKER"); p != "" {
		os.WriteFile(p, []byte(step+"\n"), 0o600)
	}
	select {}
}
