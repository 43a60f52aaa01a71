package engine

import (
	"fmt"
	"os"
)

// Crash-test hook. With VMHOST_TEST_STOP_AT_STEP=<step> in its
// environment, the agent stops dead when it reaches that provisioning or
// boot step: the goroutine doing the work blocks forever, after creating
// the file named by VMHOST_TEST_STOP_MARKER (if set), so a test can
// SIGKILL the agent right there and check what a restart makes of it.
// Steps are the Step* constants, "data<N>", "tap<N>" (each done but not
// recorded, except "image", which is recorded), and the hooks below.
// Unset, as in production, it does nothing.
const (
	testStopAtEnv     = "VMHOST_TEST_STOP_AT_STEP"
	testStopMarkerEnv = "VMHOST_TEST_STOP_MARKER"
)

// Hooks besides the provisioning steps.
const (
	HookQSD         = "qsd"         // qemu-storage-daemon launched, not recorded
	HookProvisioned = "provisioned" // the provision's result recorded (staged, with auto_boot)
	HookCH          = "ch"          // cloud-hypervisor launched, not recorded
	HookBooted      = "booted"      // vm.boot done, not recorded
	HookRunning     = "running"     // the boot recorded: processes, state running

	// Hot attach and detach of a volume (the record says Pending).
	HookAttachStart      = "attach:start"      // nothing done yet
	HookAttachExported   = "attach:exported"   // the storage daemon exports it
	HookAttachDiskAdded  = "attach:disk"       // CH has the disk; an AppVM's guest has not mounted it
	HookAttachAdded      = "attach:added"      // CH has the disk (and the guest mounted it)
	HookDetachStart      = "detach:start"      // nothing done yet
	HookDetachUnmounted  = "detach:unmounted"  // an AppVM's guest unmounted it; CH still has it
	HookDetachRemoved    = "detach:removed"    // CH removed the disk; still exported
	HookDetachUnexported = "detach:unexported" // the export is gone too
)

var testStopAtStep = os.Getenv(testStopAtEnv)

// testStopAt blocks forever when step is the one the environment names.
func testStopAt(step string) {
	if testStopAtStep == "" || step != testStopAtStep {
		return
	}
	fmt.Fprintf(os.Stderr, "vmhost: %s=%s reached; blocking until killed\n", testStopAtEnv, step)
	if p := os.Getenv(testStopMarkerEnv); p != "" {
		os.WriteFile(p, []byte(step+"\n"), 0o600)
	}
	select {}
}
