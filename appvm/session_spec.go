package appvm

import (
	"strings"

	"vmhost/appvm/guest/proto"
	"vmhost/vm"
)

// GuestSpec builds the Spec the guest agent of rec receives: the image's
// workload defaults recorded at create time overlaid with the spec
// (keepalive, then command, replace the argument vector; workdir, user and
// the health check override the image's), secret env values and secret
// files from the record's secrets, the hostname, the network mode, the
// /etc/hosts entries, files and tmpfs mounts, and the data mounts.
func GuestSpec(rec *vm.Record, heartbeatSecs int) *proto.Spec {
	a := rec.AppVM
	sp := &proto.Spec{
		V:             proto.Version,
		User:          effectiveUser(a),
		Workdir:       effectiveWorkdir(a),
		Hostname:      Hostname(rec),
		Keepalive:     a.Keepalive,
		HeartbeatSecs: heartbeatSecs,
		Healthcheck:   guestHealthcheck(effectiveHealthcheck(a)),
	}
	entrypoint, cmd := effectiveArgs(a)
	sp.Entrypoint = append([]string(nil), entrypoint...)
	sp.Command = append([]string(nil), cmd...)
	guestFiles(rec, sp)
	for _, e := range effectiveEnv(a) {
		if !e.Secret {
			sp.Env = append(sp.Env, e.Key+"="+e.Value)
		}
	}
	for _, e := range rec.Secrets.SecretEnv {
		sp.SecretEnv = append(sp.SecretEnv, proto.SecretEnv{Key: e.Key, Value: proto.NewSecret(e.Value.Reveal())})
	}
	switch a.NetworkMode {
	case NetworkStatic:
		sp.Network = proto.Network{Mode: proto.NetworkStatic, IP: a.IP, Prefix: int(a.Prefix), Gateway: a.Gateway, DNS: a.DNS}
	case NetworkNone:
		sp.Network = proto.Network{Mode: proto.NetworkNone}
	default:
		sp.Network = proto.Network{Mode: proto.NetworkDHCP}
	}
	for _, m := range rec.Mounts() {
		sp.DataMounts = append(sp.DataMounts, proto.DataMount{Device: m.Device, Mountpoint: m.Mountpoint, ReadOnly: m.ReadOnly})
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
