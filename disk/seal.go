package disk

import "errors"

// A build (an AppVM image's root file system, rootfs-<digest>.qcow2) is
// the backing file of every overlay made on it, so once imported it must
// never change: SealBuild makes it read-only and, where it can, immutable;
// UnsealBuild undoes that so the build can be deleted.

// Seal is what SealBuild achieved. The mode is always 0444 after a
// successful SealBuild; the immutable flag only where the file system
// supports FS_IMMUTABLE_FL and the agent holds CAP_LINUX_IMMUTABLE.
type Seal struct {
	Immutable bool // FS_IMMUTABLE_FL is set: not even root can write, rename or unlink it
	// NotImmutable says why Immutable is false: an error wrapping
	// ErrImmutableUnsupported or ErrNoImmutableCapability.
	NotImmutable error
}

var (
	// ErrImmutableUnsupported: the file system (or the OS) has no
	// immutable flag, e.g. ramfs, vfat, some FUSE file systems.
	ErrImmutableUnsupported = errors.New("the file system does not support the immutable flag")
	// ErrNoImmutableCapability: setting or clearing the flag needs
	// CAP_LINUX_IMMUTABLE, which the agent lacks (it runs without root).
	ErrNoImmutableCapability = errors.New("the agent lacks CAP_LINUX_IMMUTABLE")
)

// Modes of a sealed build and of one made deletable again.
const (
	sealedMode   = 0o444
	unsealedMode = 0o600
)
