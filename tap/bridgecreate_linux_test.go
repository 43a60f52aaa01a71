package tap

import (
	"context"
	"errors"
	"testing"
)

func TestIntegrationCreateBridge(t *testing.T) {
	ns := newTestNS(t)
	h := New(&Config{NetNS: ns.fd})
	ctx := context.Background()
	if err := h.CreateBridge(ctx, "vmhtest0"); err != nil {
		t.Fatalf("CreateBridge: %v", err)
	}
	l := ns.link("vmhtest0")
	if l.Kind != "bridge" {
		t.Errorf("kind = %q, want bridge", l.Kind)
	}
	if err := h.CreateBridge(ctx, "vmhtest0"); err != nil {
		t.Errorf("CreateBridge of an existing bridge = %v, want nil", err)
	}
	ns.createTap("vmhtap0", 0)
	if err := h.CreateBridge(ctx, "vmhtap0"); !errors.Is(err, ErrNotBridge) {
		t.Errorf("CreateBridge over a tap = %v, want ErrNotBridge", err)
	}
	if err := h.DeleteBridge(ctx, "vmhtap0"); !errors.Is(err, ErrNotBridge) {
		t.Errorf("DeleteBridge of a tap = %v, want ErrNotBridge", err)
	}
	if err := h.Attach(ctx, "vmhtap0", "vmhtest0", PortOptions{}); err != nil {
		t.Errorf("attaching a tap to the new bridge: %v", err)
	}
	if err := h.DeleteBridge(ctx, "vmhtest0"); err != nil {
		t.Fatalf("DeleteBridge: %v", err)
	}
	if err := h.DeleteBridge(ctx, "vmhtest0"); err != nil {
		t.Errorf("DeleteBridge of a missing bridge = %v, want nil", err)
	}
	if err := h.Attach(ctx, "vmhtap0", "vmhtest0", PortOptions{}); err == nil {
		t.Error("attaching to the deleted bridge succeeded")
	}
}
