package engine

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"time"

	"vmhost/chclient"
	"vmhost/jail"
	"vmhost/vm/record"
)

// Guest is the host end of the AppVMs' guest agents, as the engine drives
// it at the edges of an AppVM's boot: package appvm implements it
// (appvm.Guests), and Options.Guest wires it once, before anything runs.
// The engine owns the VM's hybrid vsock, so it makes the listener of the
// agent's port and hands it over. It calls Guest for records of mode appvm
// only:
//   - Boot before vm.create (after End of the previous boot's session),
//     with the listener (the agent dials at once): the guest end serves
//     it, forgets the previous boot's facts and returns the initramfs
//     holding the agent, which the boot adds to CH's payload;
//   - Adopt for a running AppVM recovered at agent start, with a new
//     listener: its agent redials with resume;
//   - Resume before vm.restore of an AppVM's saved state, with a new
//     listener: the restored guest's agent redials with resume (its
//     connection was reset), and the boot's facts stay;
//   - End when a boot fails, and at a stop, a delete and a rollback;
//   - Stop for a shutdown, instead of the ACPI power button (which the
//     engine presses when Stop fails);
//   - Settle before a VM's end is recorded, so what the guest sent before
//     it powered off (the workload's exit) is recorded first;
//   - Mount after a hot attach's vm.add-disk, Unmount before a hot
//     detach's vm.remove-device (a busy mount is *record.StateError).
//
// An engine without a Guest (classic VMs only) boots an AppVM without
// these.
type Guest interface {
	// Port is the vsock port the guest agent dials on its host.
	Port() uint32
	Boot(ctx context.Context, rec *record.Record, kernel string, l net.Listener) (initramfs string, err error)
	Adopt(ctx context.Context, rec *record.Record, l net.Listener) error
	Resume(ctx context.Context, rec *record.Record, l net.Listener) error
	End(id string)
	Stop(ctx context.Context, rec *record.Record) error
	Settle(id string)
	Mount(ctx context.Context, rec *record.Record, v record.VolumeSpec, bdf string) error
	Unmount(ctx context.Context, rec *record.Record, v record.VolumeSpec) error
}

// ErrNoAppVMKernel is returned when an AppVM is booted on a host whose
// configuration names no AppVM kernel (appvm_kernel).
var ErrNoAppVMKernel = errors.New("the host configuration sets no appvm_kernel: AppVMs cannot boot on this host")

// guest is the guest end of rec, or nil for a classic VM or an engine
// without one.
func (e *Engine) guest(rec *record.Record) Guest {
	if rec.Mode != record.ModeAppVM {
		return nil
	}
	return e.o.Guest
}

// listenGuest listens on the guest agent's port of VM id's hybrid vsock
// (<vsock.sock>_<port>).
func (e *Engine) listenGuest(g Guest, id string) (net.Listener, error) {
	sock := e.lay.VsockSocket(id)
	if err := os.MkdirAll(filepath.Dir(sock), 0o700); err != nil {
		return nil, fmt.Errorf("creating run directory of AppVM %q: %w", id, err)
	}
	l, err := chclient.ListenVsock(sock, g.Port())
	if err != nil {
		return nil, fmt.Errorf("listening for the guest agent of AppVM %q: %w", id, err)
	}
	// A confined CH connects to it as the VM's uid: connecting to a unix
	// socket needs write permission on it.
	if v := e.vmJail(e.recs.Get(id)); v != nil {
		if err := jail.Own(v.UID, v.GID, chclient.VsockListenPath(sock, g.Port())); err != nil {
			l.Close()
			return nil, fmt.Errorf("listening for the guest agent of AppVM %q: %w", id, err)
		}
	}
	return l, nil
}

// bootGuest readies the guest end of an AppVM's boot and completes cfg
// with its payload: the kernel is checked and the agent's initramfs added.
func (e *Engine) bootGuest(ctx context.Context, g Guest, rec *record.Record, cfg *chclient.VmConfig) error {
	p := cfg.Payload
	if p.Kernel == "" && p.Firmware == "" {
		return &record.HostError{Kind: record.HostInternal, Op: "booting AppVM " + rec.ID, Err: ErrNoAppVMKernel}
	}
	g.End(rec.ID) // the previous boot's session holds the listener's path
	l, err := e.listenGuest(g, rec.ID)
	if err != nil {
		return &record.HostError{Kind: record.HostHypervisor, Op: "booting AppVM " + rec.ID, Err: err}
	}
	initrd, err := g.Boot(ctx, rec, p.Kernel, l)
	if err != nil {
		return err
	}
	p.Initramfs = initrd
	return nil
}

// endGuest closes the guest end of rec, if it has one.
func (e *Engine) endGuest(rec *record.Record) {
	if g := e.guest(rec); g != nil {
		g.End(rec.ID)
	}
}

// adoptGuest hands the guest end a running AppVM found at Recover, in the
// background: its agent's reconnection is then accepted.
func (e *Engine) adoptGuest(id string) {
	g := e.o.Guest
	if g == nil {
		return
	}
	e.bg.Add(1)
	go func() {
		defer e.bg.Done()
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		rec := e.recs.Get(id)
		if rec == nil {
			return
		}
		l, err := e.listenGuest(g, id)
		if err == nil {
			err = g.Adopt(ctx, rec, l)
		}
		if err != nil {
			e.log.Error("adopting the guest agent session of an AppVM", "id", id, "err", err)
		}
	}()
}

// DialGuest connects to vsock port of AppVM id's guest through its hybrid
// vsock socket (appvm.GuestDialer): the operation connections of exec,
// files and signals. A guest that does not listen on the port gives an
// error matching chclient.ErrVsockRefused.
func (e *Engine) DialGuest(ctx context.Context, id string, port uint32) (net.Conn, error) {
	c, err := chclient.DialVsock(ctx, e.lay.VsockSocket(id), port)
	if err != nil {
		return nil, err
	}
	// The bare unix connection: frames go out in one writev each.
	return c.Conn, nil
}
