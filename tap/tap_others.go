//go:build !linux

package tap

import (
	"context"
	"errors"
	"net"
	"net/netip"
)

// ErrNotSupported is returned by every operation on systems other than
// Linux, where taps, bridges and nftables do not exist.
var ErrNotSupported = errors.New("tap: not supported on this system")

// A Handle creates and configures taps; on this system every method fails
// with ErrNotSupported.
type Handle struct{}

// New returns a Handle whose methods fail with ErrNotSupported.
func New(cfg *Config) *Handle { return &Handle{} }

// Create fails with ErrNotSupported.
func (h *Handle) Create(ctx context.Context, cfg TapConfig) error { return ErrNotSupported }

// SetOwner fails with ErrNotSupported.
func (h *Handle) SetOwner(ctx context.Context, name string, uid int) error { return ErrNotSupported }

// Delete fails with ErrNotSupported.
func (h *Handle) Delete(ctx context.Context, name string) error { return ErrNotSupported }

// ListOwned fails with ErrNotSupported.
func (h *Handle) ListOwned(ctx context.Context) ([]Owned, error) { return nil, ErrNotSupported }

// ListMarked fails with ErrNotSupported.
func (h *Handle) ListMarked(ctx context.Context) ([]Owned, error) { return nil, ErrNotSupported }

// Adopt fails with ErrNotSupported.
func (h *Handle) Adopt(ctx context.Context, name, vmID string, index int) error {
	return ErrNotSupported
}

// Attach fails with ErrNotSupported.
func (h *Handle) Attach(ctx context.Context, tap, bridge string, opts PortOptions) error {
	return ErrNotSupported
}

// AttachIndex fails with ErrNotSupported.
func (h *Handle) AttachIndex(ctx context.Context, tap string, bridgeIndex int, opts PortOptions) error {
	return ErrNotSupported
}

// CheckBridge fails with ErrNotSupported.
func (h *Handle) CheckBridge(ctx context.Context, name string) error { return ErrNotSupported }

// Port fails with ErrNotSupported.
func (h *Handle) Port(ctx context.Context, tap string) (Port, error) { return Port{}, ErrNotSupported }

// Guard fails with ErrNotSupported.
func (h *Handle) Guard(ctx context.Context, r GuardRule) error { return ErrNotSupported }

// Unguard fails with ErrNotSupported.
func (h *Handle) Unguard(ctx context.Context, tap string) error { return ErrNotSupported }

// LastIPv4 fails with ErrNotSupported.
func (h *Handle) LastIPv4(ctx context.Context, mac net.HardwareAddr) (netip.Addr, error) {
	return netip.Addr{}, ErrNotSupported
}

// A Snooper cannot exist on this system.
type Snooper struct{}

// Snoop fails with ErrNotSupported.
func (h *Handle) Snoop(tap string, mac net.HardwareAddr) (*Snooper, error) {
	return nil, ErrNotSupported
}

// Next fails with ErrNotSupported.
func (s *Snooper) Next(ctx context.Context) (Binding, error) { return Binding{}, ErrNotSupported }

// Close does nothing.
func (s *Snooper) Close() error { return nil }

// FollowDHCP fails with ErrNotSupported.
func (h *Handle) FollowDHCP(ctx context.Context, tap string, mac net.HardwareAddr, guard *GuardRule, found func(Binding)) error {
	return ErrNotSupported
}
