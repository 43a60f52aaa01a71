package appvm

import (
	"strings"

	"vmhost/appvm/guest/proto"
	"vmhost/vm"
)

// GuestSpec builds the Spec the guest agent of rec receives: the image's
// workload defaults recorded at create time overlaid with the request
// (keepalive replaces the argument vector), secret env values from the
// record's secrets, the hostname, the network mode and the data mounts.
func GuestSpec(rec *vm.Record, heartbeatSecs int) *proto.Spec {
	a := rec.AppVM
	sp := &proto.Spec{
		V:             proto.Version,
		User:          a.Image.User,
		Workdir:       a.Image.Workdir,
		Hostname:      Hostname(rec),
		Keepalive:     a.Keepalive,
		HeartbeatSecs: heartbeatSecs,
		Healthcheck:   guestHealthcheck(a.Image.Healthcheck),
	}
	if a.Keepalive {
		sp.Command = append([]string(nil), KeepaliveArgs...)
	} else {
		sp.Entrypoint = append([]string(nil), a.Image.Entrypoint...)
		sp.Command = append([]string(nil), a.Image.Cmd...)
	}
	for _, e := range effectiveEnv(a) {
		if !e.Secret {
			sp.Env = append(sp.Env, e.Key+"="+e.Value)
		}
	}
	for _, e := range rec.Secrets.SecretEnv {
		sp.SecretEnv = append(sp.SecretEnv, proto.SecretEnv{Key: e.Key, Value: proto.NewSecret(e.Value.Reveal())})
	}
	switch a.NetworkMode {
	case "static":
		sp.Network = proto.Network{Mode: proto.NetworkStatic, IP: a.IP, Prefix: int(a.Prefix), Gateway: a.Gateway, DNS: a.DNS}
	default:
		sp.Network = proto.Network{Mode: proto.NetworkDHCP}
	}
	for i, d := range a.DataVolumes {
		sp.DataMounts = append(sp.DataMounts, proto.DataMount{Device: vm.DeviceName(1 + i), Mountpoint: d.Mountpoint})
	}
	return sp
}

// guestHealthcheck converts an image health check (Docker's form: test
// ["CMD", argv...], ["CMD-SHELL", "cmd"] or ["NONE"]) to the protocol's
// exec check; nil when there is none.
func guestHealthcheck(h *vm.Healthcheck) *proto.Healthcheck {
	if h == nil || len(h.Test) == 0 {
		return nil
	}
	var argv []string
	switch strings.ToUpper(h.Test[0]) {
	case "NONE":
		return nil
	case "CMD":
		argv = h.Test[1:]
	case "CMD-SHELL":
		argv = []string{"/bin/sh", "-c", strings.Join(h.Test[1:], " ")}
	default:
		// A bare command, as some image builders write it.
		argv = h.Test
	}
	if len(argv) == 0 {
		return nil
	}
	return &proto.Healthcheck{
		Type:            proto.CheckExec,
		Command:         append([]string(nil), argv...),
		IntervalSecs:    int(h.IntervalSecs),
		TimeoutSecs:     int(h.TimeoutSecs),
		Retries:         int(h.Retries),
		StartPeriodSecs: int(h.StartPeriodSecs),
	}
}
