//go:build !linux

package ociimage

import (
	"context"
	"fmt"
)

// applyLayers needs Linux's *at system calls.
func applyLayers(ctx context.Context, src source, layers []descriptor, rootfs string, opts Options) (int, error) {
	return 0, fmt.Errorf("applying layers: %w on this operating system", ErrUnsupported)
}
