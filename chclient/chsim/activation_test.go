package chsim_test

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"vmhost/chclient"
)

// eventIDs lists, in order, the device ids of the events source/event in evs.
func eventIDs(evs []chclient.Event, name string) []string {
	var ids []string
	for _, e := range evs {
		if e.Source+"/"+e.Event == name {
			ids = append(ids, e.Properties["id"])
		}
	}
	return ids
}

// sameIDs compares two id lists as sets (each id once).
func sameIDs(got, want []string) bool {
	got, want = slices.Clone(got), slices.Clone(want)
	slices.Sort(got)
	slices.Sort(want)
	return slices.Equal(got, want)
}

// activationVMConfig is a classic VM as vmhost builds it, and more: a vhost-user root disk
// (_disk0), a raw seed (_disk1), a vhost-user data volume (_disk2), a NIC (_net3, no tap:
// the simulator only logs it), a vhost-user NIC (_net4), the balloon, vsock (_vsock5) and
// CH's watchdog. It starts the stand-ins of the vhost-user backends.
func activationVMConfig(t testing.TB, dir string) string {
	t.Helper()
	kernel := filepath.Join(dir, "vmlinux")
	seed := filepath.Join(dir, "seed.img")
	for _, f := range []string{kernel, seed} {
		if err := os.WriteFile(f, []byte("x"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	for _, s := range []string{"root.vhost", "data.vhost"} {
		vhostListener(t, filepath.Join(dir, s))
	}
	cfg := map[string]any{
		"cpus":    map[string]any{"boot_vcpus": 2, "max_vcpus": 2},
		"memory":  map[string]any{"size": 512 << 20, "shared": true},
		"payload": map[string]any{"kernel": kernel, "cmdline": "console=ttyS0"},
		"disks": []any{
			map[string]any{"vhost_user": true, "vhost_socket": filepath.Join(dir, "root.vhost")},
			map[string]any{"path": seed, "readonly": true, "image_type": "Raw"},
			map[string]any{"vhost_user": true, "vhost_socket": filepath.Join(dir, "data.vhost")},
		},
		"net": []any{
			map[string]any{"mac": "02:00:00:00:00:01"},
			map[string]any{"vhost_user": true, "vhost_socket": filepath.Join(dir, "net.vhost"), "mac": "02:00:00:00:00:02"},
		},
		"balloon":  map[string]any{"size": 0, "deflate_on_oom": true},
		"vsock":    map[string]any{"cid": 42, "socket": filepath.Join(dir, "vsock.sock")},
		"watchdog": true,
		"serial":   map[string]any{"mode": "Null"},
		"console":  map[string]any{"mode": "Off"},
	}
	data, _ := json.Marshal(cfg)
	return string(data)
}

// TestActivationEventsFollowCH: as CH v53, the guest's drivers taking its devices (all, or
// those /sim/v1/activate names) yields
// virtio-device activated for the devices CH implements itself (the seed, a NIC on a tap,
// rng, balloon, vsock) and none for vhost-user disks (the root disk, data volumes) or
// nets, nor for the watchdog a stock kernel has no driver for; a hot-plugged disk likewise.
// A guest reboot resets every device the guest had, vhost-user ones included (CH's common
// vhost-user reset emits it). A restore re-announces the same set.
func TestActivationEventsFollowCH(t *testing.T) {
	p := startSim(t, "--sim-no-activate")
	p.wantStatus("PUT", "/api/v1/vm.create", activationVMConfig(t, p.dir), 204)
	p.wantStatus("PUT", "/api/v1/vm.boot", "", 204)
	var info struct {
		Config struct {
			Disks   []struct{ ID string }
			Net     []struct{ ID string }
			Balloon struct{ ID string }
			Vsock   struct{ ID string }
		}
	}
	json.Unmarshal(p.wantStatus("GET", "/api/v1/vm.info", "", 200), &info)
	c := info.Config
	if len(c.Disks) != 3 || c.Disks[0].ID != "_disk0" || c.Disks[1].ID != "_disk1" || c.Disks[2].ID != "_disk2" ||
		len(c.Net) != 2 || c.Net[0].ID != "_net3" || c.Net[1].ID != "_net4" || c.Balloon.ID != "__balloon" || c.Vsock.ID != "_vsock5" {
		t.Fatalf("generated ids = %+v", c)
	}

	// A guest whose drivers load one by one: the balloon's first.
	p.wantStatus("PUT", "/sim/v1/activate", `{"devices":["nope"]}`, 409)
	p.wantStatus("PUT", "/sim/v1/activate", `{"devices":["__watchdog"]}`, 409)
	p.wantStatus("PUT", "/sim/v1/activate", `{"devices":["__balloon"]}`, 204)
	if got := eventIDs(p.eventsSoFar(), "virtio-device/activated"); !slices.Equal(got, []string{"__balloon"}) {
		t.Errorf("activated %v, want the balloon alone", got)
	}
	p.wantStatus("PUT", "/sim/v1/activate", "", 204)
	p.wantStatus("PUT", "/sim/v1/activate", "", 409) // nothing left to take
	announced := []string{"_disk1", "_net3", "__rng", "__balloon", "_vsock5"}
	evs := p.eventsSoFar()
	if got := eventIDs(evs, "virtio-device/activated"); !sameIDs(got, announced) || len(got) != len(announced) {
		t.Errorf("activated %v, want each of %v once (no vhost-user device, no watchdog)", got, announced)
	}
	// The rest in CH's order: disks first.
	if got := eventIDs(evs, "virtio-device/activated"); len(got) < 2 || got[1] != "_disk1" {
		t.Errorf("activations %v, want the seed _disk1 right after the balloon", got)
	}

	// A hot-plugged vhost-user disk is taken silently; a disk image is announced.
	vhostListener(t, filepath.Join(p.dir, "hot.vhost"))
	var added struct{ ID string }
	json.Unmarshal(p.wantStatus("PUT", "/api/v1/vm.add-disk", fmt.Sprintf(`{"vhost_user":true,"vhost_socket":%q}`, filepath.Join(p.dir, "hot.vhost")), 200), &added)
	if added.ID != "_disk6" {
		t.Fatalf("hot-plugged vhost-user disk id %s, want _disk6", added.ID)
	}
	img := filepath.Join(p.dir, "hot.img")
	os.WriteFile(img, nil, 0o600)
	json.Unmarshal(p.wantStatus("PUT", "/api/v1/vm.add-disk", fmt.Sprintf(`{"path":%q}`, img), 200), &added)
	if added.ID != "_disk7" {
		t.Fatalf("hot-plugged image id %s, want _disk7", added.ID)
	}
	p.waitEvents("virtio-device/activated map[id:_disk7]")
	if evs := p.eventsSoFar(); hasEvent(evs, "virtio-device/activated", "_disk6") {
		t.Errorf("the hot-plugged vhost-user disk was announced: %v", evs)
	}
	announced = append(announced, "_disk7")

	// The guest reboots: every device it had is reset, then nothing is activated until its
	// drivers come up again.
	before := len(p.eventsSoFar())
	p.wantStatus("PUT", "/sim/v1/reboot", "", 204)
	evs = p.waitEvents("vm/rebooting", "vm/rebooted")[before:]
	wantReset := []string{"_disk0", "_disk1", "_disk2", "_net3", "_net4", "__rng", "__balloon", "_vsock5", "_disk6", "_disk7"}
	if got := eventIDs(evs, "virtio-device/reset"); !sameIDs(got, wantReset) || len(got) != len(wantReset) {
		t.Errorf("reset %v, want each of %v once", got, wantReset)
	}
	if got := eventIDs(evs, "virtio-device/activated"); len(got) != 0 {
		t.Errorf("activated %v before the rebooted guest's drivers came up", got)
	}
	p.wantStatus("PUT", "/sim/v1/activate", "", 204)
	evs = p.eventsSoFar()[before:]
	if got := eventIDs(evs, "virtio-device/activated"); !sameIDs(got, announced) || len(got) != len(announced) {
		t.Errorf("after the reboot: activated %v, want each of %v once", got, announced)
	}

	// Snapshot and restore: the transports the guest had are activated again at once,
	// and again only CH's own devices are announced.
	p.wantStatus("PUT", "/sim/v1/power-button", `{"ignore":true}`, 204)
	p.wantStatus("PUT", "/api/v1/vm.pause", "", 204)
	snap := filepath.Join(p.dir, "snap")
	if err := os.Mkdir(snap, 0o700); err != nil {
		t.Fatal(err)
	}
	p.wantStatus("PUT", "/api/v1/vm.snapshot", snapshotBody(snap), 204)
	p.wantStatus("PUT", "/api/v1/vmm.shutdown", "", 200)
	p.wait(t)
	q := startSim(t, "--sim-no-activate")
	q.wantStatus("PUT", "/api/v1/vm.restore", fmt.Sprintf(`{"source_url":%q}`, "file://"+snap), 204)
	evs = q.waitEvents("vm/restoring", "vm/restored")
	if got := eventIDs(evs, "virtio-device/activated"); !sameIDs(got, announced) || len(got) != len(announced) {
		t.Errorf("restore: activated %v, want each of %v once", got, announced)
	}
	// The guest's choice to ignore the power button is in its memory: it survives.
	var st struct {
		Activated         bool `json:"activated"`
		IgnorePowerButton bool `json:"ignore_power_button"`
	}
	json.Unmarshal(q.wantStatus("GET", "/sim/v1/status", "", 200), &st)
	if !st.Activated || !st.IgnorePowerButton {
		t.Errorf("restored guest status %+v, want activated and ignoring the power button", st)
	}
}

// TestPowerButtonSwitch: a classic guest that is up powers off shortly after the ACPI
// power button, as systemd would; after PUT /sim/v1/power-button {"ignore":true} it does
// nothing on it, until {"ignore":false}.
func TestPowerButtonSwitch(t *testing.T) {
	p := startSim(t, "--sim-activate-delay", "0s")
	p.wantStatus("PUT", "/api/v1/vm.create", minimalConfig(t, p.dir), 204)
	p.wantStatus("PUT", "/api/v1/vm.boot", "", 204)
	p.waitEvents("virtio-device/activated map[id:_disk0]")
	p.wantStatus("PUT", "/sim/v1/power-button", `{}`, 400)
	p.wantStatus("PUT", "/sim/v1/power-button", `{"ignore":true}`, 204)
	var st struct {
		IgnorePowerButton bool `json:"ignore_power_button"`
	}
	json.Unmarshal(p.wantStatus("GET", "/sim/v1/status", "", 200), &st)
	if !st.IgnorePowerButton {
		t.Errorf("status does not say the guest ignores the power button")
	}
	p.wantStatus("PUT", "/api/v1/vm.power-button", "", 204)
	// Many times the delay the guest takes to power off when it honours the button.
	time.Sleep(500 * time.Millisecond)
	if s := p.state(); s != "Running" {
		t.Fatalf("state after the ignored button = %s, want Running", s)
	}
	if evs := p.eventsSoFar(); hasEvent(evs, "vm/shutdown", "") || hasEvent(evs, "virtio-device/reset", "") {
		t.Fatalf("the ignored button was acted on: %v", evs)
	}
	p.wantStatus("PUT", "/sim/v1/power-button", `{"ignore":false}`, 204)
	p.wantStatus("PUT", "/api/v1/vm.power-button", "", 204)
	if st := p.wait(t); st.ExitCode() != 0 {
		t.Fatalf("exit after the honoured button = %v, want 0", st)
	}
	p.waitEvents("virtio-device/reset map[id:_disk0]", "vm/shutdown", "vm/deleted", "vmm/shutdown")
}
