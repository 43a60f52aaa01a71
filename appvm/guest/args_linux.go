package guest

import (
	"strconv"
	"time"
)

// ProcessOptions describe a process-mode agent, for the simulator that
// starts one per VM.
type ProcessOptions struct {
	// Socket is the unix socket to dial: the hybrid vsock listener
	// `<vsock socket>_<proto.Port>`.
	Socket string
	// Root is the workload root directory.
	Root string
	// Chroot, Mounts and Network need root; Mounts wants a private mount
	// namespace and Network a network namespace of the VM's own.
	Chroot, Mounts, Network bool
	// Heartbeat is the interval before the Spec sets one; 0 keeps 5 s.
	Heartbeat time.Duration
	// Listen, when set, is the prefix of the unix sockets standing in for
	// the guest's vsock ports: operation connections come to
	// <Listen>_<proto.OpPort>.
	Listen string
}

// Args returns the arguments after `vmhost guest` for o.
func (o ProcessOptions) Args() []string {
	args := []string{"--transport", "unix:" + o.Socket, "--root", o.Root}
	for _, f := range []struct {
		on   bool
		name string
	}{{o.Chroot, "--chroot"}, {o.Mounts, "--mounts"}, {o.Network, "--network"}} {
		if f.on {
			args = append(args, f.name)
		}
	}
	if o.Listen != "" {
		args = append(args, "--listen", "unix:"+o.Listen)
	}
	if o.Heartbeat > 0 {
		args = append(args, "--heartbeat", strconv.FormatInt(o.Heartbeat.Milliseconds(), 10)+"ms")
	}
	return args
}
