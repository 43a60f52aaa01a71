package engine

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"vmhost/config"
	"vmhost/tap"
	"vmhost/vm/record"
)

// preflightRefuses creates sp (as rec would be made of it) and wants a
// 400 on field naming what the host lacks, with no record and no file;
// after fix, the same create succeeds.
func preflightRefuses(t *testing.T, s *testService, rec *record.Record, field string, says []string, fix func()) {
	t.Helper()
	ctx := context.Background()
	err := s.Preflight(ctx, rec)
	var fe *record.FieldError
	if !errors.As(err, &fe) || fe.Field != field {
		t.Fatalf("Preflight = %v, want a FieldError on %s", err, field)
	}
	for _, w := range says {
		if !strings.Contains(err.Error(), w) {
			t.Errorf("Preflight = %q, want it to say %q", err, w)
		}
	}
	for _, p := range []string{s.lay.VMDir(rec.ID), s.lay.RunVMDir(rec.ID)} {
		if _, err := os.Lstat(p); err == nil {
			t.Errorf("%s exists after the refusal", p)
		}
	}
	if s.recs.Get(rec.ID) != nil {
		t.Error("a record exists after the refusal")
	}
	fix()
	if err := s.Preflight(ctx, rec); err != nil {
		t.Fatalf("Preflight once fixed = %v", err)
	}
}

// TestPreflightHostPreconditions: each host precondition a create can
// check before it makes anything is a 400 naming the field or the
// configuration key and what the host lacks; fixed, the same create
// passes.
func TestPreflightHostPreconditions(t *testing.T) {
	t.Run("appvm_kernel unset", func(t *testing.T) {
		s := simService(t, nil)
		sp := baseSpec(t, s.root, "app")
		sp.KernelPath = nil
		rec := newRecord(sp)
		rec.Mode = record.ModeAppVM
		preflightRefuses(t, s, rec, "appvm_kernel", []string{"sets none", "AppVMs cannot boot"}, func() {
			s.o.Config.AppVMKernel = filepath.Join(s.root, "vmlinux") // baseSpec wrote it
		})
	})
	t.Run("appvm_kernel missing", func(t *testing.T) {
		s := simService(t, nil)
		sp := baseSpec(t, s.root, "app")
		sp.KernelPath = nil
		rec := newRecord(sp)
		rec.Mode = record.ModeAppVM
		kernel := filepath.Join(s.root, "appvm-vmlinux")
		s.o.Config.AppVMKernel = kernel
		preflightRefuses(t, s, rec, "appvm_kernel", []string{kernel, "cannot be read"}, func() {
			if err := os.WriteFile(kernel, []byte("k"), 0o644); err != nil {
				t.Fatal(err)
			}
		})
	})
	for _, p := range []struct{ key, name string }{{"binaries.cloud_hypervisor", "cloud-hypervisor"}, {"binaries.qemu_storage_daemon", "qemu-storage-daemon"}} {
		t.Run(p.key, func(t *testing.T) {
			s := simService(t, nil)
			prog := &s.o.CH
			if p.name == "qemu-storage-daemon" {
				prog = &s.o.QSD
			}
			good := prog.Binary
			prog.Binary = p.name + "-not-installed"
			rec := newRecord(baseSpec(t, s.root, "vm"))
			preflightRefuses(t, s, rec, p.key, []string{p.name + "-not-installed", "is not on this host"}, func() { prog.Binary = good })
		})
	}
	t.Run("bridge", func(t *testing.T) {
		fd, _ := testNetNS(t)
		h := tap.New(&tap.Config{NetNS: fd})
		s := simService(t, func(o *Options) {
			o.Taps = h
			o.Config.Networks = []config.Network{{ID: "lan", Bridge: "brpre"}}
			o.Config.DefaultNetwork = "lan"
		})
		sp := baseSpec(t, s.root, "vm")
		sp.Nets = []record.NetSpec{{NetworkID: "lan"}}
		preflightRefuses(t, s, newRecord(sp), "nets[0]", []string{`network "lan"'s bridge brpre does not exist`, "ip link add brpre type bridge"}, func() {
			if err := h.CreateBridge(context.Background(), "brpre"); err != nil {
				t.Fatal(err)
			}
		})
	})
}
