package main

import (
	"strings"
	"testing"
)

// TestNoTapsReason: the advice to an agent that is not root names what it
// can still create: classic VMs without interfaces, AppVMs in dev mode.
func TestNoTapsReason(t *testing.T) {
	got := noTapsReason(1000)
	for _, want := range []string{"uid 1000", "run vmhost serve as root", "classic VMs without nets and without cloud_init", "AppVMs in dev mode without network_id"} {
		if !strings.Contains(got, want) {
			t.Errorf("noTapsReason = %q, want it to say %q", got, want)
		}
	}
}
