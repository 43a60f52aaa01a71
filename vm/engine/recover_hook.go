package engine

import "vmhost/internal/crashhook"

// Crash-test hook (package internal/crashhook): with
// VMHOST_TEST_STOP_AT_STEP=<step> in its environment, the agent stops dead
// when it reaches that provisioning or boot step, so a test can SIGKILL it
// right there. Steps are the Step* constants, "data<N>", "tap<N>" (each
// done but not recorded, except "image", which is recorded), and the hooks
// below.
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

	// Suspend (the record says Saving suspend).
	HookSuspendStart   = "suspend:start"   // nothing done yet
	HookSuspendPaused  = "suspend:paused"  // the VM is paused
	HookSuspendSaved   = "suspend:saved"   // its state is written and synced, not in place
	HookSuspendPlaced  = "suspend:placed"  // the suspend directory is in place
	HookSuspendStopped = "suspend:stopped" // its processes are gone, not recorded

	// A start from the saved state.
	HookResumeCH       = "resume:ch"       // cloud-hypervisor launched, not recorded
	HookResumeRestored = "resume:restored" // vm.restore done (paused), not recorded
	HookResumeRecorded = "resume:recorded" // recorded running (Saving resume), not resumed
	HookResumeResumed  = "resume:resumed"  // vm.resume done, Saving not cleared

	// A snapshot's copies (the record says Saving snapshot).
	HookSnapshotStart  = "snapshot:start"  // nothing done yet
	HookSnapshotPaused = "snapshot:paused" // the VM is paused
	HookSnapshotMemory = "snapshot:memory" // its state is in the staging directory
	HookSnapshotDisks  = "snapshot:disks"  // its disks are copied
	HookSnapshotResume = "snapshot:resume" // the VM runs again, Saving not cleared

	// A restore of a snapshot (the record says Saving restore).
	HookRestoreStart   = "restore:start"   // nothing done yet
	HookRestoreStaged  = "restore:staged"  // the copies are complete beside the VM's own
	HookRestoreCommit  = "restore:commit"  // recorded staged (the commit point)
	HookRestoreSwapped = "restore:swapped" // the copies in place, Saving not cleared
)

// testStopAt blocks forever when step is the one the environment names.
func testStopAt(step string) { crashhook.StopAt(step) }
