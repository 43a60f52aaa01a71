//go:build !linux

package tap

import "context"

// CreateBridge is not supported off Linux.
func (h *Handle) CreateBridge(ctx context.Context, name string) error { return ErrNotSupported }

// DeleteBridge is not supported off Linux.
func (h *Handle) DeleteBridge(ctx context.Context, name string) error { return ErrNotSupported }

// RemoveBridge is not supported off Linux.
func (h *Handle) RemoveBridge(ctx context.Context, name string) (bool, error) {
	return false, ErrNotSupported
}
