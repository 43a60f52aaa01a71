package appvm_test

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"

	"vmhost/appvm"
	"vmhost/appvm/guest/proto"
	"vmhost/vm"
)

func TestGuestSpecFromRecord(t *testing.T) {
	_, vms, apps := newEnv(t)
	req := baseReq()
	req.VMID = "s1"
	req.AutoBoot = ptr(false)
	req.Env = []string{"MODE=dev", "EXTRA=1"}
	req.SecretEnv = secrets([]string{"TOKEN=s3cr3t-value"})
	req.IP, req.Prefix, req.Gateway, req.DNS = ptr("10.0.0.5"), ptr[uint32](24), ptr("10.0.0.1"), []string{"10.0.0.53"}
	req.DataVolumes = []appvm.DataVolumeRequest{{SizeGiB: 1, Mountpoint: "/var/lib/data"}}
	if _, err := apps.Create(context.Background(), &req); err != nil {
		t.Fatal(err)
	}
	rec, _ := vms.Get(vm.ModeAppVM, "s1")
	sp := appvm.GuestSpec(rec, 2)
	if err := sp.Validate(); err != nil {
		t.Fatalf("spec does not validate: %v", err)
	}
	if fmt.Sprint(sp.Entrypoint, sp.Command) != "[/entry.sh] [serve --port 80]" {
		t.Errorf("argv = %v %v", sp.Entrypoint, sp.Command)
	}
	if got := strings.Join(sp.Env, " "); got != "PATH=/usr/bin:/bin MODE=dev EXTRA=1" {
		t.Errorf("env = %s", got)
	}
	if len(sp.SecretEnv) != 1 || sp.SecretEnv[0].Key != "TOKEN" || sp.SecretEnv[0].Value.Reveal() != "s3cr3t-value" {
		t.Errorf("secret env = %v", sp.SecretEnv)
	}
	if fmt.Sprintf("%v", sp) == "" || strings.Contains(fmt.Sprintf("%+v", sp.SecretEnv), "s3cr3t") {
		t.Error("secret value printed")
	}
	wire, _ := json.Marshal(sp)
	if !strings.Contains(string(wire), "s3cr3t-value") {
		t.Error("secret value missing from the wire form")
	}
	if n := sp.Network; n.Mode != proto.NetworkStatic || n.IP != "10.0.0.5" || n.Prefix != 24 || n.Gateway != "10.0.0.1" || fmt.Sprint(n.DNS) != "[10.0.0.53]" {
		t.Errorf("network = %+v", sp.Network)
	}
	if sp.Hostname != appvm.Hostname(rec) || !strings.HasPrefix(sp.Hostname, "appvm-") {
		t.Errorf("hostname = %q", sp.Hostname)
	}
	if len(sp.DataMounts) != 1 || sp.DataMounts[0] != (proto.DataMount{Device: "/dev/vdb", Mountpoint: "/var/lib/data"}) {
		t.Errorf("data mounts = %+v", sp.DataMounts)
	}
	if h := sp.Healthcheck; h == nil || h.Type != "exec" || fmt.Sprint(h.Command) != "[true]" || h.IntervalSecs != 30 || h.Retries != 3 {
		t.Errorf("healthcheck = %+v", h)
	}
	if sp.User != "www" || sp.Workdir != "/srv" || sp.HeartbeatSecs != 2 {
		t.Errorf("user %q workdir %q heartbeat %d", sp.User, sp.Workdir, sp.HeartbeatSecs)
	}

	req = baseReq()
	req.VMID = "s2"
	req.AutoBoot = ptr(false)
	req.Keepalive = true
	if _, err := apps.Create(context.Background(), &req); err != nil {
		t.Fatal(err)
	}
	rec, _ = vms.Get(vm.ModeAppVM, "s2")
	sp = appvm.GuestSpec(rec, 0)
	if len(sp.Entrypoint) != 0 || fmt.Sprint(sp.Command) != fmt.Sprint(appvm.KeepaliveArgs) || !sp.Keepalive || sp.Network.Mode != "dhcp" {
		t.Errorf("keepalive spec: %v %v keepalive=%v net=%v", sp.Entrypoint, sp.Command, sp.Keepalive, sp.Network)
	}
}
