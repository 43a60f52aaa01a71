package realguest

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"strings"
	"time"

	"vmhost/chclient"
	"vmhost/ociimage/ocitest"
)

// Guest timeouts: TCG on 2 shared cores, three guests at once. Measured
// boots are 45-70 s alone (real-guests.md).
const (
	bootTimeout  = 300 * time.Second
	appvmTimeout = 180 * time.Second
)

// workload is the AppVM image's entrypoint. It counts its runs on the data
// volume (so a restart proves the volume persisted and was mounted again),
// prints the secret (which the workload log must show redacted), fails its
// first run with exit code 3 (restart_policy on-failure restarts it) and
// keeps running from the second on.
const workload = `#!/bin/sh
# What the spec asked the guest agent to set up before the workload.
echo "lane-workload config: $(cat /etc/lane.conf)"
grep -q "^10.9.9.9[[:space:]].*lane-db.internal" /etc/hosts && echo "lane-workload hosts ok"
echo "lane-workload scratch $(stat -f -c %T /scratch) cwd $(pwd)"
echo "lane-workload key mode $(stat -c %a /run/lane.key)"
echo "lane-workload edit=$LANE_EDIT"
# A mount point is on another device than the root.
[ "$(stat -c %d /data)" != "$(stat -c %d /)" ] && echo "lane-workload data mounted ($(stat -f -c %T /data))"
n=$(cat /data/count 2>/dev/null || echo 0)
n=$((n + 1))
echo $n >/data/count
sync
echo "lane-workload run $n secret=$LANE_SECRET"
if [ "$n" = 1 ]; then exit 3; fi
# A graceful stop (the host's Stop, or the power button) is a clean exit.
trap 'echo "lane-workload got TERM"; exit 0' TERM
# A volume the host hot-plugs shows up mounted at /hot.
seen=
while :; do
	if [ -z "$seen" ] && [ -d /hot ] && [ "$(stat -c %d /hot)" != "$(stat -c %d /)" ]; then
		echo hot-ok >/hot/file && echo "lane-workload hot mounted ($(stat -f -c %T /hot))"
		seen=1
	fi
	sleep 0.2
done
`

// importImage builds a static busybox OCI image layout and imports it
// through the API.
func importImage(l *lane) {
	t := l.t
	busybox, err := os.ReadFile("/bin/busybox")
	if err != nil {
		t.Fatalf("reading the static busybox (busybox-static): %v", err)
	}
	entries := []ocitest.Entry{
		ocitest.Dir("bin/", 0o755), ocitest.Dir("etc/", 0o755), ocitest.Dir("proc/", 0o555),
		ocitest.Dir("sys/", 0o555), ocitest.Dir("dev/", 0o755), ocitest.Dir("tmp/", 0o1777),
		ocitest.Dir("data/", 0o755),
		ocitest.File("bin/busybox", string(busybox), 0o755, 0, 0),
		ocitest.File("workload.sh", workload, 0o755, 0, 0),
	}
	for _, applet := range []string{"sh", "cat", "echo", "sync", "sleep", "stat", "grep", "pwd", "uname", "sha256sum", "head", "true", "env", "stty"} {
		entries = append(entries, ocitest.Symlink("bin/"+applet, "busybox"))
	}
	img := ocitest.Image{
		Layers: [][]byte{ocitest.Layer(t, entries...)},
		Config: ocitest.Config{Entrypoint: []string{"/bin/sh", "/workload.sh"}, Env: []string{"PATH=/bin"}},
	}
	layout := l.dir + "/busybox-oci"
	digest := img.WriteDir(t, layout)
	l.must("POST", "/api/appvm/images", fmt.Sprintf(`{"id":"busybox","path":%q}`, layout), http.StatusAccepted)
	var got struct {
		Status      string `json:"status"`
		Failure     string `json:"failure"`
		BuildDigest string `json:"build_digest"`
	}
	l.poll("image import", 60*time.Second, func() bool {
		b := l.must("GET", "/api/appvm/images/busybox", "", http.StatusOK)
		if err := json.Unmarshal(b, &got); err != nil {
			t.Fatal(err)
		}
		if got.Status == "failed" {
			t.Fatalf("image import failed: %s", got.Failure)
		}
		return got.Status == "ready"
	})
	if got.BuildDigest != digest {
		t.Fatalf("imported build_digest %s, want the manifest's %s", got.BuildDigest, digest)
	}
}

// classicStatic: a Debian guest with a static address from cloud_init,
// checked over SSH; then delete.
func classicStatic(l *lane, a artifacts) {
	t := l.t
	const id = "lane-static"
	password := "lane-pw-" + randomHex(6)
	req := map[string]any{
		"vm_id": id, "vcpus": 1, "memory_mb": 768, "firmware_path": ovmf,
		"disk": map[string]any{"base_path": a.image},
		"nets": []any{map[string]any{"network_id": "lane"}},
		"cloud_init": map[string]any{
			"hostname": "lane-static-host", "user": "lane", "ssh_authorized_keys": []string{l.sshPub},
			"password": password, "sudo": true,
			"network": map[string]any{"ipv4": map[string]any{
				"address": staticIP + "/24", "gateway": hostIP, "dns": []string{hostIP}}},
		},
		"auto_boot": true,
	}
	start := time.Now()
	body, _ := json.Marshal(req)
	l.must("POST", "/api/vms", string(body), http.StatusCreated)
	l.waitView("/api/vms", id, "display running", bootTimeout, func(v vmView) bool { return v.DisplayState == "running" })
	phase(t, "classic static: running", start)
	l.waitSSH("lane", staticIP, bootTimeout)
	l.checkConfined("/api/vms", id)
	phase(t, "classic static: ssh answers", start)
	l.checkActivations(id)

	// The key got us in as the user; the rest is read in the guest.
	check := func(what, command, want string) {
		t.Helper()
		out, err := l.ssh("lane", staticIP, command)
		if err != nil || !strings.Contains(out, want) {
			t.Errorf("%s: `%s` = %q (%v), want it to contain %q", what, command, out, err, want)
		}
	}
	check("cloud-init finished", "cloud-init status --wait", "status: done")
	check("hostname", "hostname", "lane-static-host")
	check("user", "id -un", "lane")
	check("static address", "ip -4 -o addr show", staticIP+"/24")
	check("default route", "ip route show default", "default via "+hostIP)
	// The password: its shadow hash verifies (crypt through libxcrypt).
	verify := `sudo -n python3 -W ignore -c 'import crypt,sys; pw=sys.stdin.readline().rstrip("\n"); ` +
		`h=[x.split(":")[1] for x in open("/etc/shadow") if x.startswith("lane:")][0]; ` +
		`print("password " + ("verifies" if crypt.crypt(pw, h) == h else "does not verify"))'`
	out, err := l.sshIn("lane", staticIP, verify, password+"\n")
	if err != nil || !strings.Contains(out, "password verifies") {
		t.Errorf("password: %q (%v), want it to verify against /etc/shadow", out, err)
	}
	phase(t, "classic static: checks", start)

	// The balloon: 256 MiB of the guest's 768 go to it at once (CH
	// vm.resize); the real guest's virtio_balloon driver gives them back,
	// which qemu reports as the memory the guest has left.
	l.must("POST", "/api/vms/"+id+"/balloon", `{"balloon_mb": 256}`, http.StatusNoContent)
	if v, _ := l.view("/api/vms", id); v.BalloonMB != 256 {
		t.Errorf("view balloon_mb = %d, want 256", v.BalloonMB)
	}
	ch := chclient.New(l.runDir + "/vms/" + id + "/ch.sock")
	defer ch.Close()
	var actual uint64
	l.poll("the guest's balloon driver to give back 256 MiB", time.Minute, func() bool {
		info, err := ch.VMInfo(context.Background())
		if err == nil {
			actual = info.MemoryActualSize
		}
		return err == nil && actual <= (768-256)<<20
	})
	t.Logf("guest memory with a 256 MiB balloon: %d MiB", actual>>20)
	phase(t, "classic static: balloon inflated", start)
	l.deleteVM("/api/vms", id)
	phase(t, "classic static: total with delete", start)
}

// checkActivations checks the events of classic VM id, whose guest is up:
// as Cloud Hypervisor v53, the qemu backend announced the activation of
// the devices CH implements itself that the guest took (the seed _disk1,
// the balloon, the NIC), which is what turned the VM running, and not that
// of the vhost-user root disk _disk0.
func (l *lane) checkActivations(id string) {
	t := l.t
	t.Helper()
	f, err := os.Open(l.runDir + "/vms/" + id + "/events")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	seen := map[string]bool{}
	r := chclient.NewEventReader(f)
	for {
		ev, err := r.Next()
		if err != nil {
			break
		}
		if ev.Source == "virtio-device" && ev.Event == "activated" {
			seen[ev.Properties["id"]] = true
		}
	}
	nic := false
	for id := range seen {
		nic = nic || strings.HasPrefix(id, "_net")
	}
	if !seen["_disk1"] || !seen["__balloon"] || !nic || seen["_disk0"] {
		t.Errorf("activations announced for %v; want the seed _disk1, __balloon and the NIC, not the vhost-user root _disk0", seen)
	}
}

// classicDHCP: a Debian guest without network config takes a lease from
// the lane's dnsmasq; vmhost learns it from the DHCP ACK it snoops. Then
// stop, start (the guest answers again) and delete.
func classicDHCP(l *lane, a artifacts) {
	t := l.t
	const id = "lane-dhcp"
	req := map[string]any{
		"vm_id": id, "vcpus": 1, "memory_mb": 768, "firmware_path": ovmf,
		"disk": map[string]any{"base_path": a.image},
		"nets": []any{map[string]any{"network_id": "lane"}},
		"cloud_init": map[string]any{"hostname": "lane-dhcp-host", "user": "lane", "sudo": true,
			"ssh_authorized_keys": []string{l.sshPub}},
		"auto_boot": true,
	}
	start := time.Now()
	body, _ := json.Marshal(req)
	l.must("POST", "/api/vms", string(body), http.StatusCreated)
	v := l.waitView("/api/vms", id, "dhcp_snooped_ipv4", bootTimeout, func(v vmView) bool {
		return len(v.Nets) == 1 && v.Nets[0].DHCPSnoopedIPv4 != ""
	})
	phase(t, "classic dhcp: lease snooped", start)
	ip := v.Nets[0].DHCPSnoopedIPv4
	first, last := netip.MustParseAddr(dhcpFirst), netip.MustParseAddr(dhcpLast)
	if addr, err := netip.ParseAddr(ip); err != nil || addr.Less(first) || last.Less(addr) {
		t.Fatalf("dhcp_snooped_ipv4 %q is not in dnsmasq's range %s-%s", ip, dhcpFirst, dhcpLast)
	}
	// dnsmasq's own record of the lease: the same MAC got the same address.
	leases, err := os.ReadFile(l.leases)
	if err != nil || !strings.Contains(string(leases), v.Nets[0].MAC+" "+ip+" ") {
		t.Errorf("dnsmasq leases %q (%v) do not give %s to %s", leases, err, ip, v.Nets[0].MAC)
	}
	v = l.waitView("/api/vms", id, "discovered_ipv4", 30*time.Second, func(v vmView) bool { return v.DiscoveredIPv4 != "" })
	if v.DiscoveredIPv4 != ip {
		t.Errorf("discovered_ipv4 = %q, want the snooped %s", v.DiscoveredIPv4, ip)
	}
	l.waitSSH("lane", ip, bootTimeout)
	l.checkConfined("/api/vms", id)
	if out, err := l.ssh("lane", ip, "hostname; ip -4 -o addr show"); err != nil ||
		!strings.Contains(out, "lane-dhcp-host") || !strings.Contains(out, ip+"/24") {
		t.Errorf("dhcp guest: %q (%v), want hostname lane-dhcp-host and address %s/24", out, err, ip)
	}
	phase(t, "classic dhcp: ssh checks", start)
	hotPlug(l, id, ip)
	phase(t, "classic dhcp: volume hot-plug", start)

	// Stop and start here rather than on the static VM, whose checks take
	// longer: the two classic VMs then end closer together. Stop is a hard
	// power-off: the guest syncs first, or files cloud-init wrote moments
	// ago (its new ssh host key) may still be unallocated in its page cache
	// (ext4 delayed allocation) and come back empty, and sshd fails.
	if out, err := l.ssh("lane", ip, "sync"); err != nil {
		t.Fatalf("sync in the guest before stop: %v %s", err, out)
	}
	l.stopVM("/api/vms", id)
	cold := time.Now()
	l.must("POST", "/api/vms/"+id+"/start", "", http.StatusNoContent)
	l.waitView("/api/vms", id, "running after start", bootTimeout, func(v vmView) bool { return v.DisplayState == "running" })
	l.waitSSH("lane", ip, bootTimeout)
	coldBoot := time.Since(cold)
	if out, err := l.ssh("lane", ip, "hostname"); err != nil || !strings.Contains(out, "lane-dhcp-host") {
		t.Errorf("after stop and start: hostname %q (%v), want lane-dhcp-host", out, err)
	}
	// The volume attached while it ran is in the boot's disk list.
	if out, err := l.ssh("lane", ip, "sudo -n head -c 16 /dev/vdc"); err != nil || out != laneVolumeData {
		t.Errorf("after stop and start: /dev/vdc starts with %q (%v), want %q", out, err, laneVolumeData)
	}
	phase(t, "classic dhcp: stop, start", start)
	suspendClassic(l, id, ip, start, coldBoot)
	l.deleteVM("/api/vms", id)
	// Deleting the VM kept its first-class volume.
	l.must("DELETE", "/api/volumes/lane-vol", "", http.StatusNoContent)
	phase(t, "classic dhcp: total with delete", start)
}

const laneVolumeData = "lane-volume-data"

// hotPlug: a first-class volume attached to the running guest appears as
// its next disk (vdc: vda is the root disk, vdb the seed); written,
// detached (the guest ejects it: CH's device-removed), attached again, the
// data is there. It stays attached.
func hotPlug(l *lane, id, ip string) {
	t := l.t
	l.must("POST", "/api/volumes", `{"volume_id":"lane-vol","size_gib":1}`, http.StatusCreated)
	attach := func() {
		b := l.must("POST", "/api/vms/"+id+"/volumes", `{"volume_id":"lane-vol"}`, http.StatusOK)
		if !strings.Contains(string(b), `"device":"/dev/vdc"`) {
			t.Errorf("attach answered %s, want the volume as /dev/vdc", b)
		}
		l.poll("the guest to see /dev/vdc", time.Minute, func() bool {
			out, err := l.ssh("lane", ip, "lsblk -dn -o SIZE /dev/vdc")
			return err == nil && strings.TrimSpace(out) == "1G"
		})
	}
	attach()
	if out, err := l.ssh("lane", ip, "printf "+laneVolumeData+" | sudo -n dd of=/dev/vdc conv=fsync status=none && echo written"); err != nil || !strings.Contains(out, "written") {
		t.Fatalf("writing the hot-plugged disk: %q %v", out, err)
	}
	l.must("DELETE", "/api/vms/"+id+"/volumes/lane-vol", "", http.StatusOK)
	// The guest released the disk before the detach answered; udev then
	// removes its node.
	l.poll("/dev/vdc to leave the guest", 30*time.Second, func() bool {
		out, err := l.ssh("lane", ip, "test -e /sys/block/vdc && echo present || echo gone")
		return err == nil && strings.Contains(out, "gone")
	})
	attach()
	if out, err := l.ssh("lane", ip, "sudo -n head -c 16 /dev/vdc"); err != nil || out != laneVolumeData {
		t.Errorf("re-attached volume starts with %q (%v), want %q", out, err, laneVolumeData)
	}
}

// appVM: the busybox image on Debian's cloud kernel through appvm_modules.
func appVM(l *lane, a artifacts) {
	t := l.t
	const id = "lane-app"
	req := map[string]any{
		"vm_id": id, "image_id": "busybox", "vcpus": 1, "memory_mb": 256, "disk_gib": 1,
		"network_id": "lane", "secret_env": []string{"LANE_SECRET=" + laneSecret},
		"restart_policy": "on-failure",
		"data_volumes":   []any{map[string]any{"size_gib": 1, "mountpoint": "/data"}},
		// The whole workload, applied by the guest agent in a real guest.
		"workdir":      "/data",
		"config_files": []any{map[string]any{"path": "/etc/lane.conf", "content": "lane-config-ok\n"}},
		"secret_files": []any{map[string]any{"path": "/run/lane.key", "content": laneSecret}},
		"extra_hosts":  []any{map[string]any{"hostname": "lane-db.internal", "ip": "10.9.9.9"}},
		"tmpfs_mounts": []any{map[string]any{"path": "/scratch", "size_mb": 16}},
	}
	start := time.Now()
	body, _ := json.Marshal(req)
	l.must("POST", "/api/appvm/vms", string(body), http.StatusCreated)
	const prefix = "/api/appvm/vms"
	l.waitView(prefix, id, "display running (guest agent heartbeat)", appvmTimeout, func(v vmView) bool {
		return v.DisplayState == "running"
	})
	phase(t, "appvm: running", start)
	l.checkConfined(prefix, id)
	l.checkOverlay(id) // the default appvm_root_disk

	logPath := l.stateDir + "/vms/" + id + "/workload.ndjson"
	readLog := func() string { return l.output(id) }
	// Run 1 exits 3; on-failure boots it again; run 2 keeps running. The
	// exit code shows from the exit until the next boot clears it (a
	// per-run field), so it is watched for while waiting.
	var sawExit3 bool
	l.waitView(prefix, id, "restarted after exit 3", appvmTimeout, func(v vmView) bool {
		if v.AppVM != nil && v.AppVM.WorkloadExitCode != nil && *v.AppVM.WorkloadExitCode == 3 {
			sawExit3 = true
		}
		return v.AppVM != nil && v.AppVM.RestartCount >= 1 && v.DisplayState == "running" &&
			strings.Contains(readLog(), "lane-workload run 2 ")
	})
	phase(t, "appvm: exit 3, restarted", start)
	if !sawExit3 {
		t.Errorf("workload_exit_code 3 (run 1's exit) never reached the view before the restart")
	}
	log := readLog()
	if strings.Contains(log, laneSecret) {
		t.Errorf("the workload log contains the secret value:\n%s", log)
	}
	for _, want := range []string{"lane-workload run 1 secret=[redacted]", "lane-workload run 2 secret=[redacted]",
		"lane-workload data mounted (ext2/ext3)", "lane-workload config: lane-config-ok", "lane-workload hosts ok",
		"lane-workload scratch tmpfs cwd /data", "lane-workload key mode 400"} {
		if !strings.Contains(log, want) {
			t.Errorf("the workload log lacks %q:\n%s", want, log)
		}
	}
	if info, err := os.Stat(logPath); err == nil && info.Mode().Perm() != 0o600 {
		t.Errorf("%s mode %v, want 0600", logPath, info.Mode().Perm())
	}

	l.stopVM(prefix, id)
	l.must("POST", prefix+"/"+id+"/start", "", http.StatusNoContent)
	l.waitView(prefix, id, "running after start", appvmTimeout, func(v vmView) bool {
		return v.DisplayState == "running" && strings.Contains(readLog(), "lane-workload run 3 ")
	})
	phase(t, "appvm: stop, start", start)
	// An edit applied now: a graceful stop, then a boot on the new spec.
	l.must("PATCH", prefix+"/"+id+"/spec?restart=true", `{"env":["LANE_EDIT=yes"]}`, http.StatusOK)
	l.waitView(prefix, id, "running on the edited spec", appvmTimeout, func(v vmView) bool {
		return v.DisplayState == "running" && strings.Contains(readLog(), "lane-workload edit=yes")
	})
	phase(t, "appvm: spec edit with restart", start)
	// A volume hot-plugged into the running AppVM: the guest agent mounts
	// it before the attach answers, and unmounts it before the detach.
	b := l.must("POST", prefix+"/"+id+"/volumes", `{"size_gib":1,"mountpoint":"/hot"}`, http.StatusOK)
	if !strings.Contains(string(b), `"mountpoint":"/hot"`) {
		t.Errorf("hot attach answered %s, want a data mount at /hot", b)
	}
	l.poll("the workload to see /hot mounted", time.Minute, func() bool {
		return strings.Contains(readLog(), "lane-workload hot mounted (ext2/ext3)")
	})
	l.must("DELETE", prefix+"/"+id+"/volumes/data1", "", http.StatusOK)
	phase(t, "appvm: volume hot-plug", start)
	l.checkConfined(prefix, id) // the hot-plugged volume changed nothing of it

	// The ACPI power button, pressed on the hypervisor behind vmhost's
	// back: the guest agent stops the workload gracefully (its TERM trap
	// runs, a clean exit) and powers off.
	ch := &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", l.runDir+"/vms/"+id+"/ch.sock")
	}}}
	req2, _ := http.NewRequest("PUT", "http://localhost/api/v1/vm.power-button", nil)
	if resp, err := ch.Do(req2); err != nil || resp.StatusCode != http.StatusNoContent {
		t.Fatalf("vm.power-button: %v %v", resp, err)
	}
	l.waitView(prefix, id, "stopped by the power button", appvmTimeout, func(v vmView) bool { return v.State == "stopped" })
	if log := readLog(); !strings.Contains(log, "lane-workload got TERM") {
		t.Errorf("the power button did not stop the workload gracefully; workload log:\n%s", log)
	}
	phase(t, "appvm: power button", start)
	l.deleteVM(prefix, id)
	phase(t, "appvm: total with delete", start)
}

// sshIn is ssh with stdin. A connection failure (ssh's exit status 255)
// is retried for a minute: cloud-init restarts sshd while it configures
// the guest, and a loaded host can miss the banner timeout.
func (l *lane) sshIn(user, ip, command, stdin string) (string, error) {
	deadline := time.Now().Add(time.Minute)
	for {
		out, err := l.sshOnce(user, ip, command, stdin)
		var exit *exec.ExitError
		if err == nil || !errors.As(err, &exit) || exit.ExitCode() != 255 || time.Now().After(deadline) {
			return out, err
		}
		time.Sleep(2 * time.Second)
	}
}

// sshOnce runs command in the guest from the namespace, with the lane's key.
func (l *lane) sshOnce(user, ip, command, stdin string) (string, error) {
	cmd := exec.Command("ip", "netns", "exec", l.ns, "ssh", "-i", l.sshKey, "-o", "BatchMode=yes",
		"-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null", "-o", "ConnectTimeout=15",
		"-o", "LogLevel=ERROR", user+"@"+ip, command)
	cmd.Stdin = strings.NewReader(stdin)
	out, err := cmd.CombinedOutput()
	return string(out), err
}
