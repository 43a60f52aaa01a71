package api

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"

	"vmhost/appvm"
	"vmhost/auth"
	"vmhost/store"
	"vmhost/vm"
	"vmhost/vm/records"
)

func indent(t testing.TB, body string) string {
	t.Helper()
	var b bytes.Buffer
	if err := json.Indent(&b, []byte(body), "", "  "); err != nil {
		t.Fatalf("response is not JSON: %v\n%s", err, body)
	}
	return b.String() + "\n"
}

func minimalVMBody(h *harness, id string) string {
	return fmt.Sprintf(`{"vm_id":%q,"vcpus":1,"memory_mb":512,"kernel_path":%q,"disk":{"base_path":%q}}`, id, h.e.Kernel, h.e.Base)
}

// fullVMBody uses every field of the classic create request. The root disk
// comes from an image, so the create answers 202.
func fullVMBody(h *harness) string {
	return fmt.Sprintf(`{
	"vm_id": "full-vm",
	"vcpus": 4,
	"memory_mb": 4096,
	"kernel_path": %q,
	"disk": {"mode": "copy", "size_gib": 20},
	"image": {"image_id": "debian-12", "content_sha256": "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
		"fetch_url": "https://images.example/debian-12.qcow2", "distro": "debian", "version": "12"},
	"volumes": [{"size_gib": 10}, {"size_gib": 1}],
	"cmdline": "console=ttyS0 root=/dev/vda1 quiet",
	"nets": [
		{"mode": "bridge", "network_id": "lab", "mac": "02:aa:bb:cc:dd:01", "vlan_tag": 42,
		 "ipv4": {"address": "192.0.2.10/24", "gateway": "192.0.2.1", "dns_servers": ["192.0.2.53"]},
		 "ipv6": {"address": "2001:db8::10/64", "gateway": "2001:db8::1", "dns_servers": ["2001:db8::53"]},
		 "mtu": 1500, "isolated": true, "spoof_guard": false, "rate_limit_mbps": 1000, "allowed_ips": ["198.51.100.0/24"]},
		{"bridge": "br0"}
	],
	"platform": {"serial_number": "SN-0001"},
	"cloud_init": {"hostname": "full", "user": "ops", "ssh_authorized_keys": ["ssh-ed25519 AAAAC3Nza ops@example"],
		"password": %q,
		"network": {"ipv4": {"address": "192.0.2.10/24", "gateway": "192.0.2.1", "dns": ["192.0.2.53"]},
		            "ipv6": {"address": "2001:db8::10/64", "gateway": "2001:db8::1", "dns": ["2001:db8::53"]}},
		"console_autologin": true, "sudo": true, "instance_id": "iid-full-1",
		"raw_user_data": null, "raw_network_config": null},
	"nested": true,
	"cpu_affinity": "2-3,5",
	"cpu_topology": {"sockets": 1, "cores": 2, "threads": 2},
	"pci_devices": ["0000:01:00.0", "0000:01:00.1"],
	"disk_bps_total": 104857600,
	"disk_iops_total": 2000,
	"auto_boot": true
}`, h.e.Kernel, plantedPassword)
}

const minimalAppVMBody = `{"vm_id":"app-min","image_id":"plain","vcpus":1,"memory_mb":256,"disk_gib":1}`

// fullAppVMBody uses every field of the AppVM create request.
const fullAppVMBody = `{
	"vm_id": "app-full",
	"image_id": "web",
	"vcpus": 2,
	"memory_mb": 1024,
	"disk_gib": 8,
	"network_id": "lab",
	"ip": "192.0.2.20",
	"prefix": 24,
	"gateway": "192.0.2.1",
	"dns": ["192.0.2.53", "192.0.2.54"],
	"hostname": "  web-1  ",
	"auto_boot": false,
	"keepalive": true,
	"env": ["MODE=staging", "LOG=debug"],
	"secret_env": ["API_TOKEN=` + plantedSecret + `"],
	"restart_policy": "on-failure",
	"data_volumes": [{"size_gib": 5, "mountpoint": "/var/lib/data"}, {"size_gib": 1, "mountpoint": "/cache"}],
	"disk_bps_total": 52428800,
	"disk_iops_total": 1000
}`

func TestGoldenViews(t *testing.T) {
	h := newHarness(t)

	st, _, body := h.do(t, "POST", "/api/vms", h.rw, minimalVMBody(h, "min-vm"))
	if st != http.StatusCreated {
		t.Fatalf("POST minimal VM = %d %s", st, body)
	}
	golden(t, "vm-minimal-create.json", h.sanitize(indent(t, body)))
	_, _, body = h.do(t, "GET", "/api/vms/min-vm", h.ro, "")
	golden(t, "vm-minimal.json", h.sanitize(indent(t, body)))

	st, _, body = h.do(t, "POST", "/api/vms", h.rw, fullVMBody(h))
	if st != http.StatusAccepted {
		t.Fatalf("POST full VM = %d %s", st, body)
	}
	golden(t, "vm-full-accepted.json", h.sanitize(indent(t, body)))
	h.vms.Wait()
	_, _, body = h.do(t, "GET", "/api/vms/full-vm", h.ro, "")
	golden(t, "vm-full.json", h.sanitize(indent(t, body)))

	st, _, body = h.do(t, "POST", "/api/appvm/vms", h.rw, minimalAppVMBody)
	if st != http.StatusCreated {
		t.Fatalf("POST minimal AppVM = %d %s", st, body)
	}
	golden(t, "appvm-minimal-create.json", indent(t, body))
	_, _, body = h.do(t, "GET", "/api/appvm/vms/app-min", h.ro, "")
	golden(t, "appvm-minimal.json", h.sanitize(indent(t, body)))

	st, _, body = h.do(t, "POST", "/api/appvm/vms", h.rw, fullAppVMBody)
	if st != http.StatusCreated {
		t.Fatalf("POST full AppVM = %d %s", st, body)
	}
	golden(t, "appvm-full-create.json", indent(t, body))
	_, _, body = h.do(t, "GET", "/api/appvm/vms/app-full", h.ro, "")
	golden(t, "appvm-full.json", h.sanitize(indent(t, body)))

	want := strings.Join([]string{
		"preflight min-vm", "provision min-vm",
		"preflight full-vm", "provision full-vm", "boot full-vm",
		"preflight app-min", "provision app-min", "boot app-min",
		"preflight app-full", "provision app-full",
	}, "\n")
	if got := h.e.Host.Transcript(); got != want {
		t.Errorf("host calls:\n%s\nwant:\n%s", got, want)
	}
}

// TestViewPresence checks the presence rules on a decoded minimal view:
// always-fields present, nullable present as null, optional omitted.
func TestViewPresence(t *testing.T) {
	h := newHarness(t)
	h.do(t, "POST", "/api/vms", h.rw, minimalVMBody(h, "p1"))
	_, _, body := h.do(t, "GET", "/api/vms/p1", h.ro, "")
	var m map[string]json.RawMessage
	if err := json.Unmarshal([]byte(body), &m); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{"id", "state", "display_state", "vcpus", "memory_mb", "disk_path", "volumes", "cmdline", "console_socket_path", "nets", "pci_devices", "mode"} {
		if _, ok := m[f]; !ok {
			t.Errorf("always-field %s missing", f)
		}
	}
	if string(m["firmware_path"]) != "null" {
		t.Errorf("firmware_path = %s, want null", m["firmware_path"])
	}
	for _, f := range []string{"seed_disk", "failure_reason", "pid", "platform", "image", "cloud_init", "io_limit", "nested", "cpu_affinity", "cpu_topology", "balloon_mb", "discovered_ipv4", "guest_panicked_at", "shutting_down"} {
		if v, ok := m[f]; ok {
			t.Errorf("optional field %s present (%s), want omitted", f, v)
		}
	}
	if string(m["volumes"]) != "[]" || string(m["nets"]) != "[]" || string(m["pci_devices"]) != "[]" || string(m["mode"]) != `"vm"` {
		t.Errorf("volumes %s nets %s pci_devices %s mode %s", m["volumes"], m["nets"], m["pci_devices"], m["mode"])
	}
}

// TestDerivedValues checks device letters, the default interface and
// hostnames of a cloud-init VM without nets.
func TestDerivedValues(t *testing.T) {
	h := newHarness(t)
	body := fmt.Sprintf(`{"vm_id":"web_01.a","vcpus":1,"memory_mb":512,"kernel_path":%q,"disk":{"base_path":%q},
		"volumes":[{"size_gib":1},{"size_gib":2}],"cloud_init":{"ssh_authorized_keys":["ssh-ed25519 AAAA k"]}}`, h.e.Kernel, h.e.Base)
	if st, _, b := h.do(t, "POST", "/api/vms", h.rw, body); st != http.StatusCreated {
		t.Fatalf("POST = %d %s", st, b)
	}
	_, _, b := h.do(t, "GET", "/api/vms/web_01.a", h.ro, "")
	var v vm.View
	if err := json.Unmarshal([]byte(b), &v); err != nil {
		t.Fatal(err)
	}
	if v.SeedDisk == nil || v.SeedDisk.Device != "/dev/vdb" {
		t.Errorf("seed_disk = %+v, want /dev/vdb", v.SeedDisk)
	}
	if len(v.Volumes) != 2 || v.Volumes[0].Device != "/dev/vdc" || v.Volumes[1].Device != "/dev/vdd" || v.Volumes[1].ID != "data1" {
		t.Errorf("volumes = %+v, want data0 on vdc, data1 on vdd", v.Volumes)
	}
	if len(v.Nets) != 1 || v.Nets[0].NetworkID != "default" || v.Nets[0].Bridge != "vmhost0" || !strings.HasPrefix(v.Nets[0].MAC, "02:") || len(v.Nets[0].TapName) > 15 {
		t.Errorf("default interface = %+v", v.Nets)
	}
	if v.CloudInit.Hostname != "web-01-a" || v.CloudInit.User != "root" || v.CloudInit.InstanceID != "web_01.a" {
		t.Errorf("cloud_init = %+v", v.CloudInit)
	}
	if v.Cmdline != h.e.Config.DefaultCmdline {
		t.Errorf("cmdline = %q, want the host default %q", v.Cmdline, h.e.Config.DefaultCmdline)
	}
	if v.Volumes[0].DiskBytes == nil {
		t.Error("single-VM read did not fill disk_bytes")
	}
	_, _, b = h.do(t, "GET", "/api/vms", h.ro, "")
	if strings.Contains(b, "disk_bytes") || !strings.Contains(b, `"vms":[{`) {
		t.Errorf("list = %s, want vms without disk_bytes", b)
	}
}

func TestErrorsAndRouting(t *testing.T) {
	h := newHarness(t)
	h.do(t, "POST", "/api/vms", h.rw, minimalVMBody(h, "c1"))
	h.do(t, "POST", "/api/appvm/vms", h.rw, `{"vm_id":"a1","image_id":"plain","vcpus":1,"memory_mb":64,"disk_gib":1,"auto_boot":false}`)
	tests := []struct {
		name, method, path, body string
		status                   int
		code                     string
	}{
		{"unknown path", "GET", "/api/nope", "", 404, CodeNotFound},
		{"unknown nested path", "GET", "/api/vms/c1/disks", "", 404, CodeNotFound},
		{"wrong method", "DELETE", "/api/vms", "", 405, CodeBadRequest},
		{"missing VM", "GET", "/api/vms/zz", "", 404, CodeNotFound},
		{"AppVM through classic", "GET", "/api/vms/a1", "", 404, CodeNotFound},
		{"classic through AppVM", "GET", "/api/appvm/vms/c1", "", 404, CodeNotFound},
		{"taken id", "POST", "/api/vms", minimalVMBody(h, "c1"), 409, CodeAlreadyExists},
		{"taken id across families", "POST", "/api/vms", minimalVMBody(h, "a1"), 409, CodeAlreadyExists},
		{"AppVM taken id", "POST", "/api/appvm/vms", `{"vm_id":"c1","image_id":"plain","vcpus":1,"memory_mb":64,"disk_gib":1}`, 409, CodeAlreadyExists},
		{"importing image", "POST", "/api/appvm/vms", `{"image_id":"pending","vcpus":1,"memory_mb":64,"disk_gib":1}`, 409, CodeConflict},
		{"unknown image", "POST", "/api/appvm/vms", `{"image_id":"nope","vcpus":1,"memory_mb":64,"disk_gib":1}`, 400, CodeBadRequest},
		{"capacity", "POST", "/api/vms", strings.Replace(minimalVMBody(h, "big"), `"memory_mb":512`, `"memory_mb":70000`, 1), 409, CodeCapacityConflict},
		{"validation", "POST", "/api/vms", strings.Replace(minimalVMBody(h, "v"), `"vcpus":1`, `"vcpus":0`, 1), 400, CodeBadRequest},
		{"body too large", "POST", "/api/vms", `{"cmdline":"` + strings.Repeat("x", MaxBodyBytes) + `"}`, 400, CodeBadRequest},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			st, hdr, body := h.do(t, tt.method, tt.path, h.rw, tt.body)
			var e errorBody
			if st != tt.status || hdr.Get("Content-Type") != "application/json" || json.Unmarshal([]byte(body), &e) != nil || e.Code != tt.code || e.Message == "" {
				t.Errorf("%s %s = %d %q %s, want %d with code %s", tt.method, tt.path, st, hdr.Get("Content-Type"), body, tt.status, tt.code)
			}
		})
	}
	if _, hdr, _ := h.do(t, "DELETE", "/api/vms", h.rw, ""); hdr.Get("Allow") != "GET, POST, HEAD" {
		t.Errorf("405 Allow = %q, want \"GET, POST, HEAD\"", hdr.Get("Allow"))
	}
	// 422 is plain text, one line naming the field.
	st, hdr, body := h.do(t, "POST", "/api/vms", h.rw, `{"vcpus":1}`)
	if st != 422 || !strings.HasPrefix(hdr.Get("Content-Type"), "text/plain") || body != "memory_mb: required field missing\n" {
		t.Errorf("422 = %d %q %q", st, hdr.Get("Content-Type"), body)
	}
	// Nothing was handed to the host for any rejected create: the host
	// was at most asked for its preconditions (before admission), which
	// changes nothing.
	for _, c := range h.e.Host.Calls() {
		if !strings.HasSuffix(c, " c1") && !strings.HasSuffix(c, " a1") && !strings.HasPrefix(c, "preflight ") {
			t.Errorf("host call %q for a rejected create", c)
		}
	}
}

// TestConcurrentCreatesOneWinner races creates of one id across both
// families: exactly one wins, the rest are ALREADY_EXISTS.
func TestConcurrentCreatesOneWinner(t *testing.T) {
	h := newHarness(t)
	const n = 16
	statuses := make([]int, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			var st int
			var body string
			if i%2 == 0 {
				st, _, body = h.do(t, "POST", "/api/vms", h.rw, minimalVMBody(h, "race"))
			} else {
				st, _, body = h.do(t, "POST", "/api/appvm/vms", h.rw, `{"vm_id":"race","image_id":"plain","vcpus":1,"memory_mb":64,"disk_gib":1,"auto_boot":false}`)
			}
			if st == http.StatusConflict && !strings.Contains(body, CodeAlreadyExists) {
				t.Errorf("409 body %s, want ALREADY_EXISTS", body)
			}
			statuses[i] = st
		})
	}
	wg.Wait()
	won := 0
	for _, st := range statuses {
		switch st {
		case http.StatusCreated:
			won++
		case http.StatusConflict:
		default:
			t.Errorf("status %d, want 201 or 409", st)
		}
	}
	if won != 1 {
		t.Errorf("%d creates won, want exactly 1 (%v)", won, statuses)
	}
	if got := strings.Count(h.e.Host.Transcript(), "provision race"); got != 1 {
		t.Errorf("%d provisions of race, want 1", got)
	}
}

// TestCapacityCountsConcurrentCreates: admission holds pending creates, so
// concurrent creates cannot overbook memory together.
func TestCapacityCountsConcurrentCreates(t *testing.T) {
	h := newHarness(t)
	h.e.Host.Gate = make(chan struct{})
	// 65536 MiB x 1.0: two creates of 40000 MiB cannot both fit.
	body := func(id string) string {
		return strings.Replace(minimalVMBody(h, id), `"memory_mb":512`, `"memory_mb":40000`, 1)
	}
	res := make(chan int, 2)
	for _, id := range []string{"m1", "m2"} {
		go func() { st, _, _ := h.do(t, "POST", "/api/vms", h.rw, body(id)); res <- st }()
	}
	first := <-res // the loser answers while the winner waits at the gate
	close(h.e.Host.Gate)
	second := <-res
	if first != http.StatusConflict || second != http.StatusCreated {
		t.Errorf("statuses %d then %d, want 409 CAPACITY_CONFLICT then 201", first, second)
	}
}

func TestCreateFailures(t *testing.T) {
	h := newHarness(t)
	h.e.Host.FailProvision = &vm.HostError{Kind: vm.HostStorage, Op: "copying base image", Err: errors.New("no space left on device")}
	st, _, body := h.do(t, "POST", "/api/vms", h.rw, minimalVMBody(h, "f1"))
	if st != 500 || !strings.Contains(body, CodeStorageError) {
		t.Errorf("failed provision = %d %s, want 500 STORAGE_ERROR", st, body)
	}
	if st, _, _ := h.do(t, "GET", "/api/vms/f1", h.ro, ""); st != 404 {
		t.Errorf("after rollback GET = %d, want 404", st)
	}
	h.e.Host.FailProvision = nil
	if st, _, body := h.do(t, "POST", "/api/vms", h.rw, minimalVMBody(h, "f1")); st != 201 {
		t.Errorf("retry after rollback = %d %s, want 201", st, body)
	}
	if got := h.e.Host.Transcript(); !strings.Contains(got, "provision f1\nrollback f1\npreflight f1") {
		t.Errorf("transcript %q lacks the rollback", got)
	}

	// A boot failure keeps the VM and answers 500.
	h.e.Host.FailBoot = &vm.HostError{Kind: vm.HostHypervisor, Op: "vm.boot", Err: errors.New("500 Internal Server Error")}
	st, _, body = h.do(t, "POST", "/api/vms", h.rw, strings.Replace(minimalVMBody(h, "f2"), "}}", `},"auto_boot":true}`, 1))
	if st != 500 || !strings.Contains(body, CodeCHError) {
		t.Errorf("failed boot = %d %s, want 500 CH_ERROR", st, body)
	}
	if st, _, _ := h.do(t, "GET", "/api/vms/f2", h.ro, ""); st != 200 {
		t.Errorf("after failed boot GET = %d, want 200 (VM kept)", st)
	}

	// Background provisioning failure: provision_failed.
	h.e.Host.FailProvision = &vm.HostError{Kind: vm.HostStorage, Op: "downloading image", Err: errors.New("sha256 mismatch")}
	body = strings.Replace(minimalVMBody(h, "f3"), fmt.Sprintf(`"disk":{"base_path":%q}`, h.e.Base),
		`"image":{"image_id":"i","content_sha256":"0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef","fetch_url":"http://x/i"},"volumes":[{"size_gib":1}]`, 1)
	if st, _, b := h.do(t, "POST", "/api/vms", h.rw, body); st != 202 || !strings.Contains(b, `"display_state":"downloading"`) || !strings.Contains(b, `"disk_path":""`) {
		t.Errorf("image create = %d %s, want 202 downloading with empty disk_path", st, b)
	}
	h.vms.Wait()
	_, _, b := h.do(t, "GET", "/api/vms/f3", h.ro, "")
	if !strings.Contains(b, `"display_state":"provision_failed"`) || !strings.Contains(b, `"kind":"provision_failed"`) || !strings.Contains(b, `"cause":"provision_failed"`) {
		t.Errorf("after failed background provision: %s", b)
	}
	// Its disks were never made (or were rolled back): the view names no
	// path for them, in the single read and in the list.
	_, _, list := h.do(t, "GET", "/api/vms", h.ro, "")
	var l struct{ VMs []vm.View }
	if err := json.Unmarshal([]byte(list), &l); err != nil {
		t.Fatal(err)
	}
	var one vm.View
	if err := json.Unmarshal([]byte(b), &one); err != nil {
		t.Fatal(err)
	}
	for _, v := range append(l.VMs, one) {
		if v.ID != "f3" {
			continue
		}
		if v.DiskPath != "" || len(v.Volumes) != 1 || v.Volumes[0].Path != "" || v.Volumes[0].DiskBytes != nil {
			t.Errorf("provision_failed view: disk_path %q, volumes %+v; want no paths", v.DiskPath, v.Volumes)
		}
	}
	for _, p := range []string{h.vms.Layout().RootDisk("f3"), h.vms.Layout().DataVolume("f3", "data0")} {
		if _, err := os.Stat(p); err == nil {
			t.Errorf("%s exists after the failed provision", p)
		}
	}
}

// TestCreateStateChanged: a create whose VM changed state under it (the
// host's boot found it no longer bootable) answers 409 INVALID_STATE as the
// contract lists for both creates, not 500, and keeps the VM.
func TestCreateStateChanged(t *testing.T) {
	h := newHarness(t)
	h.e.Host.FailBoot = &vm.StateError{ID: "s1", Action: "boot", State: "stopped"}
	st, _, body := h.do(t, "POST", "/api/vms", h.rw, strings.Replace(minimalVMBody(h, "s1"), "}}", `},"auto_boot":true}`, 1))
	if st != http.StatusConflict || !strings.Contains(body, `"code":"INVALID_STATE"`) {
		t.Errorf("create with state change = %d %s, want 409 INVALID_STATE", st, body)
	}
	if st, _, _ := h.do(t, "GET", "/api/vms/s1", h.ro, ""); st != http.StatusOK {
		t.Errorf("after the failed boot GET = %d, want 200 (VM kept)", st)
	}
	h.e.Host.FailBoot = &vm.StateError{ID: "app-min", Action: "boot", State: "stopped"}
	if st, _, body := h.do(t, "POST", "/api/appvm/vms", h.rw, minimalAppVMBody); st != http.StatusConflict || !strings.Contains(body, `"code":"INVALID_STATE"`) {
		t.Errorf("AppVM create with state change = %d %s, want 409 INVALID_STATE", st, body)
	}
}

// TestNoHost: a host failure answers 500 INTERNAL with its reason, after
// the 4xx checks, and stores nothing.
func TestNoHost(t *testing.T) {
	h := newHarness(t)
	st, err := store.Open(filepath.Join(t.TempDir(), "vms"))
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	recs, err := records.Open(st, records.Options{})
	if err != nil {
		t.Fatal(err)
	}
	vms, err := vm.New(vm.Options{StateDir: h.e.StateDir, RunDir: h.e.RunDir, Config: h.e.Config, Records: recs, Host: vm.NoHost{}})
	if err != nil {
		t.Fatal(err)
	}
	keys, _ := auth.Open(h.keysPath)
	guests := appvm.NewGuests(appvm.GuestOptions{Records: recs, Config: h.e.Config, Layout: vms.Layout()})
	apps := appvm.New(appvm.Config{VMs: vms, Records: recs, Guests: guests, RootDisks: h.e.Host})
	h.srv = New(Config{Keys: keys, VMs: vms, AppVMs: apps, Logger: slog.New(slog.NewTextHandler(&logBuf, nil))})
	code, _, body := h.do(t, "POST", "/api/vms", h.rw, minimalVMBody(h, "nb"))
	if code != 500 || !strings.Contains(body, CodeInternal) || !strings.Contains(body, "creating VM nb: this service does no host work") {
		t.Errorf("classic create = %d %s", code, body)
	}
	code, _, body = h.do(t, "POST", "/api/appvm/vms", h.rw, minimalAppVMBody)
	if code != 500 || !strings.Contains(body, CodeInternal) || !strings.Contains(body, "this service does no host work") {
		t.Errorf("AppVM create = %d %s", code, body)
	}
	if code, _, _ := h.do(t, "GET", "/api/vms/nb", h.ro, ""); code != 404 {
		t.Errorf("GET after refused create = %d, want 404 (nothing stored)", code)
	}
	if code, _, _ := h.do(t, "POST", "/api/vms", h.rw, `{"vcpus":1}`); code != 422 {
		t.Errorf("422 before 500: got %d", code)
	}
}

// TestRestart stores VMs of both families, restarts on the same state
// dir and gets identical views; a torn temp file never replaces a record;
// a damaged record is moved aside and reported; an invalid file name loads
// as a failed VM.
func TestRestart(t *testing.T) {
	h := newHarness(t)
	h.do(t, "POST", "/api/vms", h.rw, minimalVMBody(h, "r1"))
	h.do(t, "POST", "/api/vms", h.rw, fullVMBody(h))
	h.vms.Wait()
	h.do(t, "POST", "/api/appvm/vms", h.rw, fullAppVMBody)
	h.do(t, "POST", "/api/appvm/vms", h.rw, minimalAppVMBody)
	paths := []string{"/api/vms/r1", "/api/vms/full-vm", "/api/appvm/vms/app-full", "/api/appvm/vms/app-min", "/api/vms", "/api/appvm/vms"}
	before := map[string]string{}
	for _, p := range paths {
		_, _, before[p] = h.do(t, "GET", p, h.ro, "")
	}
	vmsDir := filepath.Join(h.e.StateDir, "vms")
	good, err := os.ReadFile(filepath.Join(vmsDir, "r1.json"))
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Contains(mustRead(t, filepath.Join(vmsDir, "full-vm.json")), []byte(plantedPassword)) {
		t.Error("the record lost the cloud-init password the engine needs")
	}
	if fi, _ := os.Stat(filepath.Join(vmsDir, "full-vm.json")); fi.Mode().Perm() != 0o600 {
		t.Errorf("record mode %v, want 0600", fi.Mode().Perm())
	}
	// A torn temp file next to the good record, a damaged record, and a
	// record whose name is not a valid id.
	if err := os.WriteFile(filepath.Join(vmsDir, ".tmp-r1.json-123"), good[:len(good)/2], 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(vmsDir, "broken.json"), []byte(`{"id":"broken","mo`), 0o600); err != nil {
		t.Fatal(err)
	}
	bad := bytes.Replace(good, []byte(`"id": "r1"`), []byte(`"id": "-bad"`), 1)
	if err := os.WriteFile(filepath.Join(vmsDir, "-bad.json"), bad, 0o600); err != nil {
		t.Fatal(err)
	}

	h.start(t)
	for _, p := range paths {
		_, _, after := h.do(t, "GET", p, h.ro, "")
		want := before[p]
		if p == "/api/vms" {
			// The list now holds the invalid-id record too; compare the rest.
			var l struct {
				VMs []*vm.View `json:"vms"`
			}
			if err := json.Unmarshal([]byte(after), &l); err != nil {
				t.Fatal(err)
			}
			if len(l.VMs) != 3 || l.VMs[0].ID != "-bad" || l.VMs[0].FailureReason == nil || l.VMs[0].FailureReason.Detail.Kind != "invalid_vm_id" ||
				l.VMs[0].FailureReason.Detail.ID != "-bad" || l.VMs[0].FailureReason.Cause != "record_invalid" || l.VMs[0].State != vm.StateFailed {
				t.Errorf("invalid-id record in list: %s", after)
			}
			continue
		}
		if after != want {
			t.Errorf("GET %s after restart:\n%s\nbefore:\n%s", p, after, want)
		}
	}
	if after := mustRead(t, filepath.Join(vmsDir, "r1.json")); !bytes.Equal(after, good) {
		t.Error("the torn temp file replaced the good record")
	}
	if _, err := os.Stat(filepath.Join(vmsDir, ".tmp-r1.json-123")); err == nil {
		t.Error("the torn temp file was left behind")
	}
	rep := h.e.Records.Report()
	if len(rep.Damaged) != 1 || rep.Damaged[0].ID != "broken" || len(rep.RemovedTemps) != 1 || len(rep.Invalid) != 1 || rep.Loaded != 4 {
		t.Errorf("load report = %+v", rep)
	}
	if _, err := os.Stat(filepath.Join(vmsDir, rep.Damaged[0].MovedTo)); err != nil {
		t.Errorf("damaged record not moved aside: %v", err)
	}
	if !strings.Contains(logBuf.String(), "damaged VM record moved aside") {
		t.Error("damaged record not logged")
	}
	if st, _, _ := h.do(t, "GET", "/api/vms/broken", h.ro, ""); st != 404 {
		t.Errorf("damaged record served: %d", st)
	}
	// New creates still work after a restart and cannot take a loaded id.
	if st, _, _ := h.do(t, "POST", "/api/vms", h.rw, minimalVMBody(h, "app-min")); st != 409 {
		t.Errorf("create of a loaded AppVM id after restart = %d, want 409", st)
	}
}

func mustRead(t *testing.T, path string) []byte {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// TestSecretsNeverLeak sends the planted secrets through every path that
// could echo them: views, 400s, 422s; TestMain greps all bodies.
func TestSecretsNeverLeak(t *testing.T) {
	h := newHarness(t)
	h.do(t, "POST", "/api/vms", h.rw, fullVMBody(h))
	h.vms.Wait()
	h.do(t, "POST", "/api/appvm/vms", h.rw, fullAppVMBody)
	h.do(t, "GET", "/api/vms/full-vm", h.ro, "")
	h.do(t, "GET", "/api/appvm/vms/app-full", h.ro, "")
	h.do(t, "GET", "/api/vms", h.ro, "")
	h.do(t, "GET", "/api/appvm/vms", h.ro, "")
	// Rejections that carry the secrets in the body.
	h.do(t, "POST", "/api/appvm/vms", h.rw, `{"image_id":"web","vcpus":1,"memory_mb":64,"disk_gib":1,"secret_env":["BAD KEY=`+plantedSecret+`"]}`)
	h.do(t, "POST", "/api/appvm/vms", h.rw, `{"image_id":"web","vcpus":1,"memory_mb":64,"disk_gib":1,"secret_env":["K=`+plantedSecret+"\\n"+`"]}`)
	h.do(t, "POST", "/api/appvm/vms", h.rw, `{"image_id":"web","vcpus":1,"memory_mb":64,"disk_gib":1,"secret_env":["`+plantedSecret+`"]}`)
	h.do(t, "POST", "/api/appvm/vms", h.rw, `{"image_id":"web","vcpus":1,"memory_mb":64,"disk_gib":1,"secret_env":"`+plantedSecret+`"}`)
	h.do(t, "POST", "/api/appvm/vms", h.rw, `{"image_id":"web","vcpus":1,"memory_mb":64,"disk_gib":1,"secret_env":["K=`+plantedSecret+`"],"zz":1}`)
	h.do(t, "POST", "/api/vms", h.rw, `{"vcpus":1,"memory_mb":64,"cloud_init":{"password":"`+plantedPassword+"\\u0007"+`"}}`)
	h.do(t, "POST", "/api/vms", h.rw, fmt.Sprintf(`{"vcpus":1,"memory_mb":64,"kernel_path":%q,"disk":{"base_path":%q},"cloud_init":{"password":"%s\n"}}`, h.e.Kernel, h.e.Base, plantedPassword))
	h.do(t, "POST", "/api/vms", h.rw, `{"vcpus":1,"memory_mb":64,"cloud_init":{"password":{"v":"`+plantedPassword+`"}}}`)
	// The secret env value reaches the record (for the guest) but no view.
	rec, err := h.apps.Get("app-full")
	if err != nil {
		t.Fatal(err)
	}
	if len(rec.Secrets.SecretEnv) != 1 || rec.Secrets.SecretEnv[0].Value.Reveal() != plantedSecret {
		t.Errorf("record secrets = %v", rec.Secrets.SecretEnv)
	}
	if s := fmt.Sprintf("%v %+v %#v %s", rec.Secrets, rec.Secrets.SecretEnv, rec.Secrets.SecretEnv[0].Value, rec.Secrets.SecretEnv[0].Value); strings.Contains(s, plantedSecret) {
		t.Errorf("formatting secrets leaks: %s", s)
	}
	seenMu.Lock()
	n := len(seenBodies)
	seenMu.Unlock()
	if n == 0 {
		t.Fatal("no bodies recorded")
	}
}

// TestViewMemo: the single-VM read encodes each record version once, yet
// answers exactly what encoding the view afresh gives: a new record version
// is never served an old encoding, and disk_bytes is sampled on every read
// rather than frozen with the memo.
func TestViewMemo(t *testing.T) {
	h := newHarness(t)
	fresh := func(id string) string {
		t.Helper()
		rec, err := h.vms.Get(vm.ModeVM, id)
		if err != nil {
			t.Fatal(err)
		}
		var b bytes.Buffer
		enc := json.NewEncoder(&b)
		enc.SetEscapeHTML(false)
		if err := enc.Encode(h.vms.View(rec, vm.ViewOptions{DiskBytes: true})); err != nil {
			t.Fatal(err)
		}
		return b.String()
	}
	h.e.Host.Gate = make(chan struct{})
	body := strings.Replace(minimalVMBody(h, "c"), fmt.Sprintf(`"disk":{"base_path":%q}`, h.e.Base),
		`"volumes":[{"size_gib":1},{"size_gib":2}],"image":{"image_id":"i","content_sha256":"0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef","fetch_url":"http://x/i"}`, 1)
	if st, _, b := h.do(t, "POST", "/api/vms", h.rw, body); st != 202 {
		t.Fatalf("create = %d %s", st, b)
	}
	for range 2 { // the second read is served from the memo
		_, _, b := h.do(t, "GET", "/api/vms/c", h.ro, "")
		if !strings.Contains(b, `"display_state":"downloading"`) || strings.Contains(b, "disk_bytes") || b != fresh("c") {
			t.Fatalf("during provisioning: %s, want %s", b, fresh("c"))
		}
	}
	close(h.e.Host.Gate)
	h.vms.Wait()
	_, _, b := h.do(t, "GET", "/api/vms/c", h.ro, "")
	if !strings.Contains(b, `"display_state":"created"`) || strings.Count(b, `"disk_bytes":`) != 2 || b != fresh("c") {
		t.Fatalf("after provisioning the old encoding was served: %s", b)
	}
	var v vm.View
	if err := json.Unmarshal([]byte(b), &v); err != nil || v.Volumes[1].DiskBytes == nil {
		t.Fatalf("view %s: %v", b, err)
	}
	before := *v.Volumes[1].DiskBytes
	// Grow the second volume's allocation with the record unchanged: once
	// the one-second usage sample ages out, the memoised view shows it.
	f, err := os.OpenFile(v.Volumes[1].Path, os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.Write(bytes.Repeat([]byte{1}, 1<<20)); err != nil {
		t.Fatal(err)
	}
	f.Close()
	time.Sleep(1100 * time.Millisecond)
	_, _, b = h.do(t, "GET", "/api/vms/c", h.ro, "")
	if err := json.Unmarshal([]byte(b), &v); err != nil || *v.Volumes[1].DiskBytes < before+1<<20 || b != fresh("c") {
		t.Errorf("disk_bytes after writing 1 MiB: %s, want at least %d more than %d", b, 1<<20, before)
	}

	// The list is built from memoized items too: it equals encoding the
	// list afresh, without disk_bytes, before and after a record changes.
	for range 2 {
		_, _, b = h.do(t, "GET", "/api/vms", h.ro, "")
		var want bytes.Buffer
		enc := json.NewEncoder(&want)
		enc.SetEscapeHTML(false)
		list := struct {
			VMs []*vm.View `json:"vms"`
		}{VMs: []*vm.View{}}
		for _, rec := range h.vms.List(vm.ModeVM) {
			list.VMs = append(list.VMs, h.vms.View(rec, vm.ViewOptions{}))
		}
		if err := enc.Encode(list); err != nil {
			t.Fatal(err)
		}
		if b != want.String() || strings.Contains(b, "disk_bytes") {
			t.Fatalf("list:\n%s\nencoding/json:\n%s", b, want.String())
		}
		if _, err := h.e.Records.Update("c", func(r *vm.Record) { r.DisplayState = "changed" }); err != nil {
			t.Fatal(err)
		}
	}
	if _, _, b = h.do(t, "GET", "/api/vms", h.ro, ""); !strings.Contains(b, `"display_state":"changed"`) {
		t.Errorf("list after a record change: %s", b)
	}
}

// TestGeneratedIDs: a create without vm_id gets a UUID v4, for both
// families, and generated MACs are locally administered unicast.
func TestGeneratedIDs(t *testing.T) {
	h := newHarness(t)
	body := strings.Replace(minimalVMBody(h, "x"), `"vm_id":"x",`, `"nets":[{},{"mac":"02:00:00:00:00:07"}],`, 1)
	st, _, b := h.do(t, "POST", "/api/vms", h.rw, body)
	var v vm.View
	if st != 201 || json.Unmarshal([]byte(b), &v) != nil {
		t.Fatalf("create = %d %s", st, b)
	}
	if u, err := uuid.Parse(v.ID); err != nil || u.Version() != 4 || u.String() != v.ID {
		t.Errorf("generated id %q is not a canonical UUID v4", v.ID)
	}
	if len(v.Nets) != 2 || v.Nets[1].MAC != "02:00:00:00:00:07" || v.Nets[0].MAC == v.Nets[1].MAC {
		t.Fatalf("nets = %+v", v.Nets)
	}
	if mac, err := net.ParseMAC(v.Nets[0].MAC); err != nil || mac[0]&1 != 0 || mac[0]&2 == 0 {
		t.Errorf("generated MAC %s is not locally administered unicast", v.Nets[0].MAC)
	}
	rec, err := h.vms.Get(vm.ModeVM, v.ID)
	if err != nil || len(rec.NICs) != 2 || rec.NICs[0].MAC != v.Nets[0].MAC || rec.NICs[0].Tap != v.Nets[0].TapName {
		t.Errorf("generated MAC and tap not recorded: %+v %v", rec, err)
	}
	st, _, b = h.do(t, "POST", "/api/appvm/vms", h.rw, `{"image_id":"plain","vcpus":1,"memory_mb":64,"disk_gib":1}`)
	var r appvm.CreateResponse
	if st != 201 || json.Unmarshal([]byte(b), &r) != nil {
		t.Fatalf("AppVM create = %d %s", st, b)
	}
	if u, err := uuid.Parse(r.ID); err != nil || u.Version() != 4 || !r.Booted || r.Mode != "appvm" {
		t.Errorf("AppVM create response %+v", r)
	}
}

// TestEmptyVMID: "vm_id": "" is not an absent vm_id: it is refused (400
// on vm_id) in both families, and nothing is created, so a client whose id
// came out empty cannot make a new VM on each retry.
func TestEmptyVMID(t *testing.T) {
	h := newHarness(t)
	for _, c := range []struct{ path, body string }{
		{"/api/vms", minimalVMBody(h, "")},
		{"/api/appvm/vms", `{"vm_id":"","image_id":"plain","vcpus":1,"memory_mb":64,"disk_gib":1}`},
	} {
		st, _, b := h.do(t, "POST", c.path, h.rw, c.body)
		var e errorBody
		if st != 400 || json.Unmarshal([]byte(b), &e) != nil || e.Code != CodeBadRequest || !strings.HasPrefix(e.Message, "vm_id: ") {
			t.Errorf("POST %s with vm_id \"\" = %d %s, want 400 BAD_REQUEST on vm_id", c.path, st, b)
		}
	}
	if n := len(h.vms.List(vm.ModeVM)) + len(h.vms.List(vm.ModeAppVM)); n != 0 {
		t.Errorf("%d VMs exist after refused creates", n)
	}
}

// TestBodyReadTimeout: a client that sends its headers and part of the
// body, then stalls, is answered 400 once the body read timeout passes,
// instead of holding the connection and the handler for as long as it
// likes. The 20 s read deadline of the test is a guard, not a measure.
func TestBodyReadTimeout(t *testing.T) {
	h := newHarness(t)
	keys, err := auth.Open(h.keysPath)
	if err != nil {
		t.Fatal(err)
	}
	srv := New(Config{Keys: keys, VMs: h.vms, AppVMs: h.apps, BodyReadTimeout: 200 * time.Millisecond})
	ts := httptest.NewServer(srv)
	defer ts.Close()
	for _, path := range []string{"/api/vms", "/api/appvm/vms", "/api/appvm/images"} {
		c, err := net.Dial("tcp", ts.Listener.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		fmt.Fprintf(c, "POST %s HTTP/1.1\r\nHost: vmhost\r\nAuthorization: Bearer %s\r\nContent-Length: 100\r\n\r\n{\"vcpus\":", path, h.rw)
		c.SetReadDeadline(time.Now().Add(20 * time.Second))
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil {
			t.Fatalf("POST %s with a stalled body: no answer: %v", path, err)
		}
		b, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != 400 || !strings.Contains(string(b), "body: not received within 200ms") {
			t.Errorf("POST %s with a stalled body = %d %s, want 400 naming the timeout", path, resp.StatusCode, b)
		}
		c.Close()
	}
	// A body that arrives in time is served, and the connection is kept
	// for the next request past the timeout: the deadline covered the body
	// only.
	c, err := net.Dial("tcp", ts.Listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	r := bufio.NewReader(c)
	body := minimalVMBody(h, "in-time")
	fmt.Fprintf(c, "POST /api/vms HTTP/1.1\r\nHost: vmhost\r\nAuthorization: Bearer %s\r\nContent-Length: %d\r\n\r\n%s", h.rw, len(body), body)
	c.SetReadDeadline(time.Now().Add(20 * time.Second))
	resp, err := http.ReadResponse(r, nil)
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	if resp.StatusCode != 201 {
		t.Fatalf("POST in time = %d, want 201", resp.StatusCode)
	}
	time.Sleep(400 * time.Millisecond) // past the body timeout
	fmt.Fprintf(c, "GET /api/vms/in-time HTTP/1.1\r\nHost: vmhost\r\nAuthorization: Bearer %s\r\n\r\n", h.rw)
	if resp, err = http.ReadResponse(r, nil); err != nil || resp.StatusCode != 200 {
		t.Errorf("GET on the kept connection = %v, %v; want 200", resp, err)
	}
}

// TestChunkedBodyLimit: a body without Content-Length is cut at 1 MiB too.
func TestChunkedBodyLimit(t *testing.T) {
	h := newHarness(t)
	big := io.MultiReader(strings.NewReader(`{"cmdline":"`), strings.NewReader(strings.Repeat("x", MaxBodyBytes)), strings.NewReader(`"}`))
	req := httptest.NewRequest("POST", "/api/vms", io.NopCloser(big))
	req.ContentLength = -1
	req.Header.Set("Authorization", "Bearer "+h.rw)
	w := httptest.NewRecorder()
	h.srv.ServeHTTP(w, req)
	if w.Code != 400 || !strings.Contains(w.Body.String(), "larger than 1048576 bytes") {
		t.Errorf("chunked oversize body = %d %s", w.Code, w.Body)
	}
}

// TestOverRealSocket drives the API through a real HTTP server: a create,
// a read, a HEAD, and a body sent chunked.
func TestOverRealSocket(t *testing.T) {
	h := newHarness(t)
	ts := httptest.NewServer(h.srv)
	defer ts.Close()
	send := func(method, path, token string, body io.Reader) (*http.Response, string) {
		t.Helper()
		req, err := http.NewRequest(method, ts.URL+path, body)
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("Authorization", "Bearer "+token)
		resp, err := ts.Client().Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		if err != nil {
			t.Fatal(err)
		}
		seenMu.Lock()
		seenBodies = append(seenBodies, string(b))
		seenMu.Unlock()
		return resp, string(b)
	}
	// io.MultiReader hides the length, so the client sends it chunked.
	resp, created := send("POST", "/api/vms", h.rw, io.MultiReader(strings.NewReader(minimalVMBody(h, "sock"))))
	if resp.StatusCode != 201 || resp.Header.Get("Content-Type") != "application/json" {
		t.Fatalf("POST = %d %s", resp.StatusCode, created)
	}
	resp, got := send("GET", "/api/vms/sock", h.ro, nil)
	if resp.StatusCode != 200 || resp.ContentLength != int64(len(got)) || got != created {
		t.Errorf("GET = %d (length %d) %s, want the created view %s", resp.StatusCode, resp.ContentLength, got, created)
	}
	resp, got = send("HEAD", "/api/vms/sock", h.ro, nil)
	if resp.StatusCode != 200 || got != "" {
		t.Errorf("HEAD = %d %q", resp.StatusCode, got)
	}
	resp, got = send("GET", "/api/vms/sock", "wrong", nil)
	if resp.StatusCode != 401 || !strings.Contains(got, CodeUnauthorized) {
		t.Errorf("GET with a wrong token = %d %s", resp.StatusCode, got)
	}
}
