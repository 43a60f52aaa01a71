//go:build !linux

package disk

import (
	"fmt"
	"os"
)

// SealBuild sets mode 0444 only: the immutable flag is Linux's.
func SealBuild(path string) (Seal, error) {
	if err := chmodRegular(path, sealedMode); err != nil {
		return Seal{}, fmt.Errorf("sealing build: %w", err)
	}
	return Seal{NotImmutable: fmt.Errorf("immutable flag on %s: %w", path, ErrImmutableUnsupported)}, nil
}

// UnsealBuild sets mode 0600.
func UnsealBuild(path string) error {
	if err := chmodRegular(path, unsealedMode); err != nil {
		return fmt.Errorf("unsealing build: %w", err)
	}
	return nil
}

func chmodRegular(path string, mode os.FileMode) error {
	st, err := os.Lstat(path)
	if err != nil {
		return err
	}
	if !st.Mode().IsRegular() {
		return fmt.Errorf("%s is not a regular file (%v)", path, st.Mode().Type())
	}
	return os.Chmod(path, mode)
}
