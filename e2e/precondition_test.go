//go:build linux

package e2e

import (
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"vmhost/config"
)

// wantRefused posts body to path and wants 400 BAD_REQUEST whose message
// says each of says, with nothing made for id.
func wantRefused(t *testing.T, s *server, path, body, id string, says ...string) {
	t.Helper()
	st, b := s.do("POST", path, body)
	if st != http.StatusBadRequest || !strings.Contains(string(b), `"code":"BAD_REQUEST"`) {
		t.Fatalf("POST %s = %d %s, want 400 BAD_REQUEST", path, st, b)
	}
	for _, w := range says {
		if !strings.Contains(string(b), w) {
			t.Errorf("the refusal %s does not say %q", b, w)
		}
	}
	checkGone(t, s, id)
}

// TestAppVMWithoutKernel: on a host whose configuration names no AppVM
// kernel, or one that is not there, an AppVM create is refused before
// anything is made (400 naming appvm_kernel), and a retry once the kernel
// is in place creates it (the retry does not meet ALREADY_EXISTS).
func TestAppVMWithoutKernel(t *testing.T) {
	s := startServer(t, serverOpts{netns: true})
	addImages(t, s, map[string]string{"img": "sleep 300"})
	body := `{"vm_id":"app","image_id":"img","vcpus":1,"memory_mb":128,"disk_gib":1,"ip":"10.80.0.7","prefix":24,"gateway":"10.80.0.1"}`
	wantRefused(t, s, "/api/appvm/vms", body, "app", "appvm_kernel: this host's configuration sets none, so AppVMs cannot boot here")

	kernel := filepath.Join(t.TempDir(), "appvm-vmlinux")
	s = startServer(t, serverOpts{netns: true, edit: func(c *config.Config) { c.AppVMKernel = kernel }})
	addImages(t, s, map[string]string{"img": "sleep 300"})
	wantRefused(t, s, "/api/appvm/vms", body, "app", "appvm_kernel: "+kernel+" cannot be read")
	if err := os.WriteFile(kernel, []byte("not really a kernel"), 0o644); err != nil {
		t.Fatal(err)
	}
	if st, b := s.do("POST", "/api/appvm/vms", body); st != http.StatusCreated {
		t.Fatalf("the retry once the kernel is there = %d %s", st, b)
	}
}

// TestMissingPrograms: a host without the cloud-hypervisor or the
// qemu-storage-daemon its configuration names refuses a create before
// anything is made (400 naming the binaries key and the program); once the
// program is installed there, the same create succeeds.
func TestMissingPrograms(t *testing.T) {
	for _, p := range []struct{ key, sim, real string }{
		{"binaries.cloud_hypervisor", "qsd", "ch"},
		{"binaries.qemu_storage_daemon", "ch", "qsd"},
	} {
		t.Run(p.key, func(t *testing.T) {
			prog := filepath.Join(t.TempDir(), "bin", "vmhost-"+p.real)
			s := startServer(t, serverOpts{simulate: p.sim, edit: func(c *config.Config) {
				// The program installed below is a shell wrapper, and the
				// jail runs ELF programs only: this test is about the check.
				c.Jail.Enabled = new(false)
				if p.real == "ch" {
					c.Binaries.CloudHypervisor = prog
				} else {
					c.Binaries.QemuStorageDaemon = prog
				}
			}})
			f := newFixture(t)
			body := f.body("vm", true, "")
			wantRefused(t, s, "/api/vms", body, "vm", p.key+": ", `(\"`+prog+`\") is not on this host`)
			if err := os.MkdirAll(filepath.Dir(prog), 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(prog, []byte("#!/bin/sh\nexec "+simBin+" sim-"+p.real+" \"$@\"\n"), 0o755); err != nil {
				t.Fatal(err)
			}
			s.create(body, http.StatusCreated)
			s.waitDisplay("vm", "running", "running")
		})
	}
}
