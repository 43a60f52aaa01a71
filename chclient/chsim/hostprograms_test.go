package chsim

import (
	"os"
	"path/filepath"
	"slices"
	"testing"
)

// HostPrograms names what the qemu backend runs, as it finds it, and
// nothing for the simulated guest.
func TestHostPrograms(t *testing.T) {
	if got, err := HostPrograms(nil); err != nil || got != nil {
		t.Errorf("sim backend: %v, %v; want none", got, err)
	}
	dir := t.TempDir()
	qemu, vsock := filepath.Join(dir, "qemu"), filepath.Join(dir, "vhost-device-vsock")
	for _, p := range []string{qemu, vsock} {
		if err := os.WriteFile(p, []byte("#!/bin/sh\n"), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	got, err := HostPrograms([]string{"--sim-backend", "qemu", "--sim-qemu", qemu, "--sim-vsock-backend=" + vsock})
	if err != nil || !slices.Equal(got, []string{qemu, vsock}) {
		t.Errorf("qemu backend: %v, %v; want %v", got, err, []string{qemu, vsock})
	}
	got, err = HostPrograms([]string{"--sim-backend", "qemu", "--sim-qemu", filepath.Join(dir, "missing"), "--sim-vsock-backend", vsock})
	if err != nil || !slices.Equal(got, []string{vsock}) {
		t.Errorf("a missing qemu is left out: %v, %v", got, err)
	}
	if _, err := HostPrograms([]string{"--sim-qemu", qemu}); err == nil {
		t.Error("qemu flags without the qemu backend were accepted")
	}
}
