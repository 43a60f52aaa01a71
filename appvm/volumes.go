package appvm

import (
	"context"
	"errors"
	"fmt"
	"net"
	"time"

	"vmhost/appvm/guest/proto"
	"vmhost/vm"
)

// MountTimeout bounds the wait for the guest agent's answer to a Mount or
// an Unmount: the guest waits up to 10 s for a hot-plugged disk to probe.
var MountTimeout = 30 * time.Second

// Mount has the guest agent of AppVM rec mount its hot-plugged volume v
// (at PCI address bdf) at v's mountpoint (engine.Guest).
func (g *Guests) Mount(ctx context.Context, rec *vm.Record, v vm.VolumeSpec, bdf string) error {
	mp := v.Mountpoint
	res, err := g.volumeRequest(ctx, rec.ID, "mount "+mp, func(seq uint64) proto.Message {
		return &proto.Mount{Seq: seq, BDF: bdf, Mountpoint: mp, ReadOnly: v.Readonly}
	})
	if err != nil {
		return err
	}
	if res.Error != "" {
		return &vm.HostError{Kind: vm.HostStorage, Op: fmt.Sprintf("mounting volume %s at %s in AppVM %q", v.ID, mp, rec.ID), Err: errors.New(res.Error)}
	}
	return nil
}

// Unmount has the guest agent of AppVM rec unmount volume v before a hot
// detach (engine.Guest): a file system in use is a *vm.StateError naming
// the mountpoint.
func (g *Guests) Unmount(ctx context.Context, rec *vm.Record, v vm.VolumeSpec) error {
	mp := v.Mountpoint
	res, err := g.volumeRequest(ctx, rec.ID, "unmount "+mp, func(seq uint64) proto.Message {
		return &proto.Unmount{Seq: seq, Mountpoint: mp}
	})
	if err != nil {
		return err
	}
	if res.Busy {
		return &vm.StateError{Msg: fmt.Sprintf("mountpoint %s of AppVM %q is busy in the guest (%s); the volume stays attached: stop what uses it and retry", mp, rec.ID, res.Error)}
	}
	if res.Error != "" {
		return &vm.HostError{Kind: vm.HostStorage, Op: fmt.Sprintf("unmounting volume %s from %s in AppVM %q", v.ID, mp, rec.ID), Err: errors.New(res.Error)}
	}
	return nil
}

// guestConnectWait bounds how long a Mount or Unmount waits for the guest
// agent of a running AppVM to be connected.
const guestConnectWait = 15 * time.Second

// volumeRequest sends the Mount or Unmount that build makes (given its
// Seq) to the guest agent of AppVM id and waits for its MountResult. A
// guest that is not connected, or whose protocol predates the two
// messages, is a *vm.StateError: nothing was asked of it.
func (g *Guests) volumeRequest(ctx context.Context, id, what string, build func(seq uint64) proto.Message) (*proto.MountResult, error) {
	var (
		ss      *session
		nc      net.Conn
		served  chan struct{}
		version int
	)
	// A guest agent between two connections (reconnecting after an agent
	// restart, which is when recovery finishes an interrupted change) is
	// waited for, a while.
	wait := time.NewTimer(guestConnectWait)
	defer wait.Stop()
	for {
		if ss = g.get(id); ss != nil {
			ss.mu.Lock()
			nc, served, version = ss.nc, ss.served, ss.version
			ss.mu.Unlock()
			if nc != nil && version != 0 {
				break
			}
		}
		select {
		case <-time.After(20 * time.Millisecond):
			continue
		case <-wait.C:
		case <-ctx.Done():
		}
		break
	}
	if nc == nil || version == 0 {
		return nil, &vm.StateError{Msg: fmt.Sprintf("the guest agent of AppVM %q is not connected, so it cannot %s; retry once its heartbeat is back, or stop the AppVM and change its volumes then", id, what)}
	}
	if version < proto.Version2 {
		return nil, &vm.StateError{Msg: fmt.Sprintf("the guest agent of AppVM %q speaks protocol version %d, which cannot %s while it runs (version %d can); restart the AppVM to boot the current agent, or stop it and change its volumes then", id, version, what, proto.Version2)}
	}
	ch := make(chan *proto.MountResult, 1)
	ss.mu.Lock()
	ss.mountSeq++
	seq := ss.mountSeq
	if ss.mountWait == nil {
		ss.mountWait = map[uint64]chan *proto.MountResult{}
	}
	ss.mountWait[seq] = ch
	ss.mu.Unlock()
	defer func() {
		ss.mu.Lock()
		delete(ss.mountWait, seq)
		ss.mu.Unlock()
	}()
	fail := func(err error) error {
		return &vm.HostError{Kind: vm.HostStorage, Op: fmt.Sprintf("asking the guest agent of AppVM %q to %s", id, what), Err: err}
	}
	if err := sendToGuest(nc, build(seq)); err != nil {
		return nil, fail(err)
	}
	t := time.NewTimer(MountTimeout)
	defer t.Stop()
	select {
	case res := <-ch:
		return res, nil
	case <-served:
		return nil, fail(errors.New("the connection ended before its answer"))
	case <-t.C:
		return nil, fail(fmt.Errorf("no answer within %s", MountTimeout))
	case <-ctx.Done():
		return nil, fail(ctx.Err())
	}
}
