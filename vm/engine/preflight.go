package engine

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"

	"vmhost/tap"
	"vmhost/vm/record"
)

// Preflight checks, before anything is stored or made, what the host must
// have for rec: the VM's socket paths fit a unix socket address; an AppVM
// has a kernel to boot (appvm_kernel, a readable file); the programs the
// engine runs are there (cloud-hypervisor, qemu-storage-daemon, or what
// stands in for them); each interface can have a tap (the agent may create
// taps) on a bridge that exists. A refusal is a *record.FieldError (400)
// naming the request field or the configuration key and what this host
// lacks, so that a retry once it is fixed succeeds.
func (e *Engine) Preflight(ctx context.Context, rec *record.Record) error {
	if err := e.layout().CheckSocketPaths(rec.ID); err != nil {
		return &record.FieldError{Field: "vm_id", Msg: err.Error()}
	}
	cfg := e.o.Config
	if rec.Mode == record.ModeAppVM && rec.Spec.KernelPath == nil && rec.Spec.FirmwarePath == nil {
		if cfg.AppVMKernel == "" {
			return &record.FieldError{Field: "appvm_kernel", Msg: "this host's configuration sets none, so AppVMs cannot boot here: " +
				"set appvm_kernel (and appvm_modules) to a kernel for AppVMs (docs/appvm.md, Kernels)"}
		}
		if fi, err := os.Stat(cfg.AppVMKernel); err != nil || !fi.Mode().IsRegular() {
			what := "is not a regular file"
			if err != nil {
				what = "cannot be read: " + errors.Unwrap(err).Error()
			}
			return &record.FieldError{Field: "appvm_kernel", Msg: fmt.Sprintf("%s %s on this host (vmhost doctor checks the AppVM kernel)", cfg.AppVMKernel, what)}
		}
	}
	for _, p := range []struct {
		prog      Program
		name, key string
	}{{e.o.CH, "cloud-hypervisor", "binaries.cloud_hypervisor"}, {e.o.QSD, "qemu-storage-daemon", "binaries.qemu_storage_daemon"}} {
		if _, err := exec.LookPath(p.prog.Binary); err != nil {
			return &record.FieldError{Field: p.key, Msg: fmt.Sprintf("%s (%q) is not on this host: install it, or point %s at it (vmhost doctor checks the host)",
				p.name, p.prog.Binary, p.key)}
		}
	}
	for i, nic := range rec.NICs {
		field := nicField(rec, i)
		if e.o.Taps == nil {
			return &record.FieldError{Field: field, Msg: e.o.NoTapsReason}
		}
		var np *record.NetSpec
		if i < len(rec.Spec.Nets) {
			np = &rec.Spec.Nets[i]
		}
		nv := record.ResolveNet(cfg, np, nic)
		err := e.o.Taps.CheckBridge(ctx, nv.Bridge)
		network := "bridge " + nv.Bridge
		if nv.NetworkID != "" {
			network = fmt.Sprintf("network %q's bridge %s", nv.NetworkID, nv.Bridge)
		}
		switch {
		case errors.Is(err, fs.ErrNotExist):
			return &record.FieldError{Field: field, Msg: fmt.Sprintf("%s does not exist on this host: create it (ip link add %s type bridge && ip link set %s up; docs/operating.md, Networks)",
				network, nv.Bridge, nv.Bridge)}
		case errors.Is(err, tap.ErrNotBridge):
			return &record.FieldError{Field: field, Msg: fmt.Sprintf("%s is not a bridge on this host: %v", network, err)}
		case err != nil:
			return &record.HostError{Kind: record.HostNetwork, Op: "checking the bridge of VM " + rec.ID, Err: err}
		}
	}
	return nil
}

// nicField is the request field that asked for interface i of rec: an
// AppVM's network_id, a classic VM's nets[i], or cloud_init for the
// default interface of a cloud-init VM without nets.
func nicField(rec *record.Record, i int) string {
	switch {
	case rec.Mode == record.ModeAppVM:
		return "network_id"
	case i < len(rec.Spec.Nets):
		return fmt.Sprintf("nets[%d]", i)
	}
	return "cloud_init"
}
