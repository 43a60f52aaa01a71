package api

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"vmhost/appvm"
	"vmhost/auth"
	"vmhost/cli"
	"vmhost/vm"
)

// The volume routes (docs/api.md, Volumes) over the real vm.Service and a fake
// host that runs no VM: every attach and detach here is the cold path,
// which changes the record only.

// must sends a request and fails the test unless it answers status.
func (h *harness) must(t *testing.T, method, path, body string, status int) string {
	t.Helper()
	st, _, b := h.do(t, method, path, h.rw, body)
	if st != status {
		t.Fatalf("%s %s = %d %s, want %d", method, path, st, b, status)
	}
	return b
}

// wantError checks an answer's status and code, and that its message holds
// msg.
func wantError(t *testing.T, what string, st int, body string, status int, code, msg string) {
	t.Helper()
	var e errorBody
	if st != status || json.Unmarshal([]byte(body), &e) != nil || e.Code != code || !strings.Contains(e.Message, msg) {
		t.Errorf("%s = %d %s, want %d %s with %q", what, st, body, status, code, msg)
	}
}

func needMkfs(t *testing.T) {
	t.Helper()
	if _, err := exec.LookPath("mkfs.ext4"); err != nil {
		t.Skip("mkfs.ext4 not installed (apt-get install e2fsprogs)")
	}
}

func decodeVolume(t *testing.T, body string) vm.VolumeInfo {
	t.Helper()
	var v vm.VolumeInfo
	if err := json.Unmarshal([]byte(body), &v); err != nil {
		t.Fatalf("not a Volume: %v\n%s", err, body)
	}
	return v
}

func decodeView(t *testing.T, body string) vm.View {
	t.Helper()
	var v vm.View
	if err := json.Unmarshal([]byte(body), &v); err != nil {
		t.Fatalf("not a view: %v\n%s", err, body)
	}
	return v
}

// devices is "id:device:owned:volume_id" per volume of a view.
func devices(v vm.View) string {
	var out []string
	for _, vol := range v.Volumes {
		out = append(out, fmt.Sprintf("%s:%s:%v:%s", vol.ID, vol.Device, vol.Owned, vol.VolumeID))
	}
	return strings.Join(out, " ")
}

// TestVolumeCreate: create raw (and ext4) volumes, their shape and file,
// a generated id, a taken id, and bodies the rules refuse.
func TestVolumeCreate(t *testing.T) {
	h := newHarness(t)
	b := h.must(t, "POST", "/api/volumes", `{"volume_id":"db","size_gib":2}`, 201)
	v := decodeVolume(t, b)
	path := filepath.Join(h.e.StateDir, "volumes", "db.qcow2")
	if v.ID != "db" || v.Path != path || v.VirtualSizeBytes != 2<<30 || v.Fmt != "qcow2" || v.Format != "raw" ||
		!v.CreatedAt.Equal(h.e.Now.UTC().Truncate(time.Second)) || v.AttachedTo != nil || v.DiskBytes != nil {
		t.Errorf("created volume = %+v", v)
	}
	if fi, err := os.Stat(path); err != nil || fi.Mode().Perm() != 0o600 {
		t.Errorf("volume file: %v, %v; want mode 0600", fi, err)
	}
	var m map[string]json.RawMessage
	json.Unmarshal([]byte(b), &m)
	for _, f := range []string{"id", "path", "virtual_size_bytes", "fmt", "format", "created_at"} {
		if _, ok := m[f]; !ok {
			t.Errorf("always-field %s missing: %s", f, b)
		}
	}

	st, _, b := h.do(t, "POST", "/api/volumes", h.rw, `{"volume_id":"db","size_gib":1}`)
	wantError(t, "a taken id", st, b, 409, CodeAlreadyExists, "db")

	v = decodeVolume(t, h.must(t, "POST", "/api/volumes", `{"size_gib":1}`, 201))
	if !regexp.MustCompile(`^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$`).MatchString(v.ID) || v.Format != "raw" {
		t.Errorf("generated volume = %+v, want a UUID id", v)
	}
	if _, err := os.Stat(filepath.Join(h.e.StateDir, "volumes", v.ID+".qcow2")); err != nil {
		t.Errorf("generated volume's file: %v", err)
	}

	for _, c := range []struct {
		name, body string
		status     int
		msg        string
	}{
		{"size 0", `{"volume_id":"z","size_gib":0}`, 400, "size_gib"},
		{"size 65536", `{"volume_id":"z","size_gib":65536}`, 400, "size_gib"},
		{"format xfs", `{"volume_id":"z","size_gib":1,"format":"xfs"}`, 400, "format"},
		{"bad id", `{"volume_id":"../z","size_gib":1}`, 400, "volume_id"},
		{"id too long", `{"volume_id":"` + strings.Repeat("a", 65) + `","size_gib":1}`, 400, "volume_id"},
		// Undecodable bodies are the framework's 422 (docs/api.md, Conventions).
		{"unknown field", `{"volume_id":"z","size_gib":1,"fmt":"qcow2"}`, 422, `unknown field "fmt"`},
		{"no size", `{"volume_id":"z"}`, 422, "size_gib: required field missing"},
		{"negative size", `{"size_gib":-1}`, 422, "size_gib"},
		{"size as string", `{"size_gib":"1"}`, 422, "size_gib"},
	} {
		st, _, b := h.do(t, "POST", "/api/volumes", h.rw, c.body)
		if c.status == 422 {
			if st != 422 || !strings.Contains(b, c.msg) {
				t.Errorf("%s = %d %s, want 422 %q", c.name, st, b, c.msg)
			}
			continue
		}
		wantError(t, c.name, st, b, c.status, CodeBadRequest, c.msg)
	}
	if _, err := os.Stat(filepath.Join(h.e.StateDir, "volumes", "z.qcow2")); err == nil {
		t.Error("a refused create left a file")
	}

	t.Run("ext4", func(t *testing.T) {
		needMkfs(t)
		v := decodeVolume(t, h.must(t, "POST", "/api/volumes", `{"volume_id":"fs","size_gib":1,"format":"ext4"}`, 201))
		if v.Format != "ext4" || v.Fmt != "qcow2" || v.VirtualSizeBytes != 1<<30 {
			t.Errorf("ext4 volume = %+v", v)
		}
		if fi, err := os.Stat(v.Path); err != nil || fi.Mode().Perm() != 0o600 {
			t.Errorf("ext4 volume file: %v, %v; want mode 0600", fi, err)
		}
	})
}

// TestVolumeListGetDelete: the list is sorted and without disk_bytes, a
// read has them, a delete erases, and unknown or impossible ids are 404.
func TestVolumeListGetDelete(t *testing.T) {
	h := newHarness(t)
	if b := h.must(t, "GET", "/api/volumes", "", 200); b != "{\"volumes\":[]}\n" {
		t.Errorf("empty list = %s", b)
	}
	for _, id := range []string{"c", "a", "b"} {
		h.must(t, "POST", "/api/volumes", `{"volume_id":"`+id+`","size_gib":1}`, 201)
	}
	var l volumeList
	b := h.must(t, "GET", "/api/volumes", "", 200)
	if err := json.Unmarshal([]byte(b), &l); err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, v := range l.Volumes {
		ids = append(ids, v.ID)
	}
	if strings.Join(ids, ",") != "a,b,c" || strings.Contains(b, "disk_bytes") {
		t.Errorf("list = %s, want a,b,c without disk_bytes", b)
	}
	if st, _, b := h.do(t, "GET", "/api/volumes/b", h.ro, ""); st != 200 || decodeVolume(t, b).DiskBytes == nil {
		t.Errorf("GET /api/volumes/b = %d %s, want disk_bytes", st, b)
	}
	h.must(t, "DELETE", "/api/volumes/b", "", 204)
	if _, err := os.Stat(filepath.Join(h.e.StateDir, "volumes", "b.qcow2")); err == nil {
		t.Error("deleted volume's file remains")
	}
	for _, c := range [][2]string{
		{"GET", "/api/volumes/b"}, {"DELETE", "/api/volumes/b"}, {"GET", "/api/volumes/nope"},
		{"GET", "/api/volumes/..%2fkeys"}, {"DELETE", "/api/volumes/..%2fkeys"}, {"GET", "/api/volumes/.hidden"},
	} {
		st, _, b := h.do(t, c[0], c[1], h.rw, "")
		wantError(t, c[0]+" "+c[1], st, b, 404, CodeNotFound, "no volume has this id")
	}
	// The audit log names a volume by its path, never as a VM.
	h.closeLogs()
	data, err := os.ReadFile(filepath.Join(h.e.StateDir, "audit.log"))
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, line := range strings.Split(strings.TrimSpace(string(data)), "\n") {
		if strings.Contains(line, `"route":"DELETE /api/volumes/{id}"`) || strings.Contains(line, `"route":"POST /api/volumes"`) {
			n++
			if strings.Contains(line, `"vm_id"`) || strings.Contains(line, `"image_id"`) {
				t.Errorf("audit entry of a volume route names a VM or image: %s", line)
			}
		}
	}
	if n != 6 {
		t.Errorf("%d audit entries of volume creates and deletes, want 6:\n%s", n, data)
	}
}

// TestVolumeAttachDetach: the cold attach and detach of a classic VM, as
// docs/api.md (Attach and detach; The VM view) describes them.
func TestVolumeAttachDetach(t *testing.T) {
	h := newHarness(t)
	// A cloud-init VM: vda root, vdb seed, then data0 (owned, from create).
	h.must(t, "POST", "/api/vms", fmt.Sprintf(`{"vm_id":"v1","vcpus":1,"memory_mb":512,"kernel_path":%q,"disk":{"base_path":%q},
		"volumes":[{"size_gib":1}],"cloud_init":{"ssh_authorized_keys":["ssh-ed25519 AAAA k"]}}`, h.e.Kernel, h.e.Base), 201)
	h.must(t, "POST", "/api/vms", minimalVMBody(h, "v2"), 201)
	h.must(t, "POST", "/api/volumes", `{"volume_id":"shared","size_gib":3}`, 201)

	v := decodeView(t, h.must(t, "POST", "/api/vms/v1/volumes", `{"volume_id":"shared","readonly":true}`, 200))
	if got := devices(v); got != "data0:/dev/vdc:true: data1:/dev/vdd:false:shared" {
		t.Errorf("after attach: %s", got)
	}
	if vol := v.Volumes[1]; !vol.Readonly || vol.VirtualSizeBytes != 3<<30 || vol.Path != filepath.Join(h.e.StateDir, "volumes", "shared.qcow2") {
		t.Errorf("attached volume = %+v", vol)
	}
	// The attach answers the view GET answers.
	if _, _, b := h.do(t, "GET", "/api/vms/v1", h.ro, ""); devices(decodeView(t, b)) != devices(v) {
		t.Errorf("GET after attach: %s", b)
	}
	// The volume's volumes array, pinned (a golden of its own: testdata/api
	// is not this package's to extend).
	_, _, b := h.do(t, "GET", "/api/vms/v1", h.ro, "")
	var raw struct {
		Volumes json.RawMessage `json:"volumes"`
	}
	json.Unmarshal([]byte(b), &raw)
	var buf bytes.Buffer
	json.Indent(&buf, raw.Volumes, "", "  ")
	wantVolumes := `[
  {
    "id": "data0",
    "path": "/TEST/state/vms/v1/data0.qcow2",
    "virtual_size_bytes": 1073741824,
    "fmt": "qcow2",
    "readonly": false,
    "owned": true,
    "device": "/dev/vdc",
    "disk_bytes": DISK
  },
  {
    "id": "data1",
    "path": "/TEST/state/volumes/shared.qcow2",
    "virtual_size_bytes": 3221225472,
    "fmt": "qcow2",
    "readonly": true,
    "owned": false,
    "volume_id": "shared",
    "device": "/dev/vdd",
    "disk_bytes": DISK
  }
]`
	if got := regexp.MustCompile(`"disk_bytes": \d+`).ReplaceAllString(h.sanitize(buf.String()), `"disk_bytes": DISK`); got != wantVolumes {
		t.Errorf("volumes of the view:\n%s\nwant:\n%s", got, wantVolumes)
	}

	got := decodeVolume(t, h.must(t, "GET", "/api/volumes/shared", "", 200))
	if a := got.AttachedTo; a == nil || a.VMID != "v1" || a.Mode != vm.ModeVM || a.Device != "/dev/vdd" {
		t.Errorf("attached_to = %+v, want v1 vm /dev/vdd", a)
	}
	if _, _, b := h.do(t, "GET", "/api/volumes", h.ro, ""); !strings.Contains(b, `"attached_to":{"vm_id":"v1","mode":"vm","device":"/dev/vdd"}`) {
		t.Errorf("list after attach: %s", b)
	}

	st, _, b := h.do(t, "POST", "/api/vms/v2/volumes", h.rw, `{"volume_id":"shared"}`)
	wantError(t, "attach to a second VM", st, b, 409, CodeInvalidState, "already attached")
	st, _, b = h.do(t, "POST", "/api/vms/v1/volumes", h.rw, `{"volume_id":"shared"}`)
	wantError(t, "attach twice", st, b, 409, CodeInvalidState, "already attached")
	st, _, b = h.do(t, "DELETE", "/api/volumes/shared", h.rw, "")
	wantError(t, "delete of an attached volume", st, b, 409, CodeInvalidState, "detach it first")

	v = decodeView(t, h.must(t, "POST", "/api/vms/v1/volumes", `{"size_gib":2}`, 200))
	if got := devices(v); got != "data0:/dev/vdc:true: data1:/dev/vdd:false:shared data2:/dev/vde:true:" {
		t.Errorf("after an owned attach: %s", got)
	}
	if _, err := os.Stat(filepath.Join(h.e.StateDir, "vms", "v1", "data2.qcow2")); err != nil {
		t.Errorf("owned attach made no file: %v", err)
	}

	// Detaching the first volume shifts the later ones down a letter; the
	// VM-owned data0 is kept as the first-class volume v1-data0.
	data0 := filepath.Join(h.e.StateDir, "vms", "v1", "data0.qcow2")
	v = decodeView(t, h.must(t, "DELETE", "/api/vms/v1/volumes/data0", "", 200))
	if got := devices(v); got != "data1:/dev/vdc:false:shared data2:/dev/vdd:true:" {
		t.Errorf("after detaching data0: %s", got)
	}
	kept := decodeVolume(t, h.must(t, "GET", "/api/volumes/v1-data0", "", 200))
	if kept.AttachedTo != nil || kept.Format != "raw" || kept.VirtualSizeBytes != 1<<30 {
		t.Errorf("kept volume = %+v", kept)
	}
	if _, err := os.Stat(kept.Path); err != nil {
		t.Errorf("kept volume's file: %v", err)
	}
	if _, err := os.Stat(data0); err == nil {
		t.Error("the detached volume's old name remains")
	}
	if got := decodeVolume(t, h.must(t, "GET", "/api/volumes/shared", "", 200)).AttachedTo; got == nil || got.Device != "/dev/vdc" {
		t.Errorf("shared's attached_to after the shift = %+v, want /dev/vdc", got)
	}

	// Detach by volume_id; then it may go to the other VM.
	v = decodeView(t, h.must(t, "DELETE", "/api/vms/v1/volumes/shared", "", 200))
	if got := devices(v); got != "data2:/dev/vdc:true:" {
		t.Errorf("after detaching shared: %s", got)
	}
	v = decodeView(t, h.must(t, "POST", "/api/vms/v2/volumes", `{"volume_id":"shared"}`, 200))
	if got := devices(v); got != "data0:/dev/vdb:false:shared" {
		t.Errorf("v2 (no seed) after attach: %s", got)
	}

	// Deleting the VM keeps its first-class volume, detached.
	h.must(t, "DELETE", "/api/vms/v2", "", 204)
	got = decodeVolume(t, h.must(t, "GET", "/api/volumes/shared", "", 200))
	if got.AttachedTo != nil {
		t.Errorf("after the VM's delete attached_to = %+v", got.AttachedTo)
	}
	if _, err := os.Stat(got.Path); err != nil {
		t.Errorf("the VM's delete removed its first-class volume: %v", err)
	}
	h.must(t, "DELETE", "/api/volumes/shared", "", 204)
}

// TestVolumeAttachRefusals: unknown ids (also of the other family), bad
// bodies, and the 16-volume limit.
func TestVolumeAttachRefusals(t *testing.T) {
	h := newHarness(t)
	h.must(t, "POST", "/api/vms", minimalVMBody(h, "v1"), 201)
	h.must(t, "POST", "/api/appvm/vms", `{"vm_id":"a1","image_id":"plain","vcpus":1,"memory_mb":64,"disk_gib":1,"auto_boot":false}`, 201)
	h.must(t, "POST", "/api/volumes", `{"volume_id":"raw1","size_gib":1}`, 201)
	before := h.must(t, "GET", "/api/vms/v1", "", 200)
	for _, c := range []struct {
		name, method, path, body string
		status                   int
		code, msg                string
	}{
		{"unknown VM", "POST", "/api/vms/nope/volumes", `{"volume_id":"raw1"}`, 404, CodeNotFound, "no classic VM has this id"},
		{"AppVM on the classic route", "POST", "/api/vms/a1/volumes", `{"volume_id":"raw1"}`, 404, CodeNotFound, "no classic VM has this id"},
		{"classic VM on the AppVM route", "POST", "/api/appvm/vms/v1/volumes", `{"volume_id":"raw1","mountpoint":"/d"}`, 404, CodeNotFound, "no AppVM has this id"},
		{"classic VM on the AppVM route, no mountpoint", "POST", "/api/appvm/vms/v1/volumes", `{"volume_id":"raw1"}`, 404, CodeNotFound, "no AppVM has this id"},
		{"unknown volume", "POST", "/api/vms/v1/volumes", `{"volume_id":"nope"}`, 404, CodeNotFound, "nope"},
		{"both", "POST", "/api/vms/v1/volumes", `{"volume_id":"raw1","size_gib":1}`, 400, CodeBadRequest, "exactly one"},
		{"neither", "POST", "/api/vms/v1/volumes", `{"readonly":true}`, 400, CodeBadRequest, "exactly one"},
		{"size 0", "POST", "/api/vms/v1/volumes", `{"size_gib":0}`, 400, CodeBadRequest, "size_gib"},
		{"size 65536", "POST", "/api/vms/v1/volumes", `{"size_gib":65536}`, 400, CodeBadRequest, "size_gib"},
		{"mountpoint on a classic VM", "POST", "/api/vms/v1/volumes", `{"volume_id":"raw1","mountpoint":"/d"}`, 400, CodeBadRequest, "mountpoint"},
		{"AppVM without a mountpoint", "POST", "/api/appvm/vms/a1/volumes", `{"size_gib":1}`, 400, CodeBadRequest, "mountpoint"},
		{"AppVM, relative mountpoint", "POST", "/api/appvm/vms/a1/volumes", `{"size_gib":1,"mountpoint":"d"}`, 400, CodeBadRequest, "mountpoint"},
		{"AppVM, raw volume", "POST", "/api/appvm/vms/a1/volumes", `{"volume_id":"raw1","mountpoint":"/d"}`, 400, CodeBadRequest, "ext4"},
		{"detach from an unknown VM", "DELETE", "/api/vms/nope/volumes/data0", "", 404, CodeNotFound, "no classic VM has this id"},
		{"detach on the other family", "DELETE", "/api/appvm/vms/v1/volumes/data0", "", 404, CodeNotFound, "no AppVM has this id"},
		{"detach of an unknown volume", "DELETE", "/api/vms/v1/volumes/data0", "", 404, CodeNotFound, `no volume "data0"`},
		{"detach of a volume the VM lacks", "DELETE", "/api/vms/v1/volumes/raw1", "", 404, CodeNotFound, `no volume "raw1"`},
	} {
		st, _, b := h.do(t, c.method, c.path, h.rw, c.body)
		wantError(t, c.name, st, b, c.status, c.code, c.msg)
	}
	for _, c := range []struct{ name, body, msg string }{
		{"unknown field", `{"volume_id":"raw1","device":"/dev/vdz"}`, `unknown field "device"`},
		{"readonly as string", `{"volume_id":"raw1","readonly":"yes"}`, "readonly"},
		{"negative size", `{"size_gib":-2}`, "size_gib"},
		{"empty body", ``, "empty body"},
	} {
		if st, _, b := h.do(t, "POST", "/api/vms/v1/volumes", h.rw, c.body); st != 422 || !strings.Contains(b, c.msg) {
			t.Errorf("%s = %d %s, want 422 %q", c.name, st, b, c.msg)
		}
	}
	if after := h.must(t, "GET", "/api/vms/v1", "", 200); after != before {
		t.Errorf("refused attaches changed the VM:\n%s\nwas\n%s", after, before)
	}

	// 16 volumes are the most a classic VM has.
	vols := strings.TrimSuffix(strings.Repeat(`{"size_gib":1},`, 15), ",")
	h.must(t, "POST", "/api/vms", fmt.Sprintf(`{"vm_id":"full","vcpus":1,"memory_mb":512,"kernel_path":%q,"disk":{"base_path":%q},"volumes":[%s]}`, h.e.Kernel, h.e.Base, vols), 201)
	h.must(t, "POST", "/api/vms/full/volumes", `{"volume_id":"raw1"}`, 200)
	st, _, b := h.do(t, "POST", "/api/vms/full/volumes", h.rw, `{"size_gib":1}`)
	wantError(t, "a 17th volume", st, b, 400, CodeBadRequest, "the most it may have")
}

// TestVolumeAppVM: an AppVM attaches ext4 volumes at mountpoints (a new
// one, and a first-class one), refuses a mountpoint in use, and a detach
// keeps its own volume as a first-class one.
func TestVolumeAppVM(t *testing.T) {
	needMkfs(t)
	h := newHarness(t)
	h.must(t, "POST", "/api/appvm/vms", `{"vm_id":"a1","image_id":"plain","vcpus":1,"memory_mb":64,"disk_gib":1,"auto_boot":false,
		"data_volumes":[{"size_gib":1,"mountpoint":"/data"}]}`, 201)
	h.must(t, "POST", "/api/volumes", `{"volume_id":"fs","size_gib":1,"format":"ext4"}`, 201)
	var v appvm.View
	if err := json.Unmarshal([]byte(h.must(t, "POST", "/api/appvm/vms/a1/volumes", `{"volume_id":"fs","mountpoint":"/srv/fs"}`, 200)), &v); err != nil {
		t.Fatal(err)
	}
	if got := devices(*v.View); got != "data0:/dev/vdb:true: data1:/dev/vdc:false:fs" {
		t.Errorf("AppVM volumes after attach: %s", got)
	}
	if got := fmt.Sprint(v.AppVM.DataMounts); got != "[{/dev/vdb /data false} {/dev/vdc /srv/fs false}]" {
		t.Errorf("data_mounts = %s", got)
	}
	if a := decodeVolume(t, h.must(t, "GET", "/api/volumes/fs", "", 200)).AttachedTo; a == nil || a.VMID != "a1" || a.Mode != vm.ModeAppVM || a.Device != "/dev/vdc" {
		t.Errorf("attached_to = %+v", a)
	}
	st, _, b := h.do(t, "POST", "/api/appvm/vms/a1/volumes", h.rw, `{"size_gib":1,"mountpoint":"/data"}`)
	wantError(t, "a mountpoint in use", st, b, 400, CodeBadRequest, "mountpoint")
	h.must(t, "POST", "/api/appvm/vms/a1/volumes", `{"size_gib":1,"mountpoint":"/scratch","readonly":true}`, 200)
	// The AppVM view's GET agrees with the detach's answer.
	b = h.must(t, "DELETE", "/api/appvm/vms/a1/volumes/data0", "", 200)
	if got := h.must(t, "GET", "/api/appvm/vms/a1", "", 200); got != b {
		t.Errorf("detach answered\n%s\nGET answers\n%s", b, got)
	}
	json.Unmarshal([]byte(b), &v)
	if got := fmt.Sprint(v.AppVM.DataMounts); got != "[{/dev/vdb /srv/fs false} {/dev/vdc /scratch true}]" {
		t.Errorf("data_mounts after detaching data0 = %s", got)
	}
	if kept := decodeVolume(t, h.must(t, "GET", "/api/volumes/a1-data0", "", 200)); kept.Format != "ext4" || kept.AttachedTo != nil {
		t.Errorf("kept AppVM volume = %+v", kept)
	}
	h.must(t, "DELETE", "/api/appvm/vms/a1/volumes/fs", "", 200)
	if a := decodeVolume(t, h.must(t, "GET", "/api/volumes/fs", "", 200)).AttachedTo; a != nil {
		t.Errorf("fs still attached: %+v", a)
	}
}

// TestVolumeKeys: a read key lists and reads volumes but cannot create,
// delete, attach or detach; an allowlist key reaches only what it lists.
func TestVolumeKeys(t *testing.T) {
	h := newHarness(t)
	h.must(t, "POST", "/api/vms", minimalVMBody(h, "v1"), 201)
	h.must(t, "POST", "/api/volumes", `{"volume_id":"db","size_gib":1}`, 201)
	only, err := auth.Add(h.keysPath, "vol-reader", auth.ScopeReadWrite, []string{"GET /api/volumes/{id}", "POST /api/vms/{id}/volumes"})
	if err != nil {
		t.Fatal(err)
	}
	h.start(t)
	for _, c := range []struct {
		name, token, method, path, body string
		status                          int
	}{
		{"read key lists", h.ro, "GET", "/api/volumes", "", 200},
		{"read key reads", h.ro, "GET", "/api/volumes/db", "", 200},
		{"read key creates", h.ro, "POST", "/api/volumes", `{"volume_id":"x","size_gib":1}`, 403},
		{"read key deletes", h.ro, "DELETE", "/api/volumes/db", "", 403},
		{"read key attaches", h.ro, "POST", "/api/vms/v1/volumes", `{"volume_id":"db"}`, 403},
		{"read key detaches", h.ro, "DELETE", "/api/vms/v1/volumes/data0", "", 403},
		{"read key attaches to an AppVM", h.ro, "POST", "/api/appvm/vms/a/volumes", `{"volume_id":"db"}`, 403},
		{"read key detaches from an AppVM", h.ro, "DELETE", "/api/appvm/vms/a/volumes/data0", "", 403},
		{"allowlist: listed read", only, "GET", "/api/volumes/db", "", 200},
		{"allowlist: list not listed", only, "GET", "/api/volumes", "", 403},
		{"allowlist: create not listed", only, "POST", "/api/volumes", `{"volume_id":"y","size_gib":1}`, 403},
		{"allowlist: delete not listed", only, "DELETE", "/api/volumes/db", "", 403},
		{"allowlist: listed attach", only, "POST", "/api/vms/v1/volumes", `{"volume_id":"db"}`, 200},
		{"allowlist: detach not listed", only, "DELETE", "/api/vms/v1/volumes/db", "", 403},
		{"narrow key", h.narrow, "GET", "/api/volumes/db", "", 403},
	} {
		st, _, b := h.do(t, c.method, c.path, c.token, c.body)
		if st != c.status || (st == 403 && !strings.Contains(b, `"code":"FORBIDDEN"`)) {
			t.Errorf("%s: %s %s = %d %s, want %d", c.name, c.method, c.path, st, b, c.status)
		}
	}
	for _, id := range []string{"x", "y"} {
		if _, err := os.Stat(filepath.Join(h.e.StateDir, "volumes", id+".qcow2")); err == nil {
			t.Errorf("a refused create made volume %s", id)
		}
	}
	if a := decodeVolume(t, h.must(t, "GET", "/api/volumes/db", "", 200)).AttachedTo; a == nil || a.VMID != "v1" {
		t.Errorf("db after the allowed attach: %+v", a)
	}
}

// TestVolumeEvents: a cold attach and detach publish volume_attached and
// volume_detached with the volume id and the device.
func TestVolumeEvents(t *testing.T) {
	h := newHarness(t)
	ts := httptest.NewServer(h.srv)
	defer ts.Close()
	h.must(t, "POST", "/api/vms", minimalVMBody(h, "ev"), 201)
	h.must(t, "POST", "/api/volumes", `{"volume_id":"evvol","size_gib":1}`, 201)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, "GET", ts.URL+"/api/events?vm_id=ev", nil)
	req.Header.Set("Authorization", "Bearer "+h.ro)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	h.must(t, "POST", "/api/vms/ev/volumes", `{"volume_id":"evvol"}`, 200)
	h.must(t, "POST", "/api/vms/ev/volumes", `{"size_gib":1}`, 200)
	h.must(t, "DELETE", "/api/vms/ev/volumes/evvol", "", 200)
	h.must(t, "DELETE", "/api/vms/ev/volumes/data1", "", 200)
	var got []string
	sc := bufio.NewScanner(resp.Body)
	for len(got) < 4 && sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok {
			continue
		}
		var e struct{ Type, VMID, Mode, VolumeID, Device string }
		var m map[string]any
		json.Unmarshal([]byte(data), &m)
		e.Type, _ = m["type"].(string)
		e.VMID, _ = m["vm_id"].(string)
		e.Mode, _ = m["mode"].(string)
		e.VolumeID, _ = m["volume_id"].(string)
		e.Device, _ = m["device"].(string)
		if strings.HasPrefix(e.Type, "volume_") {
			got = append(got, fmt.Sprintf("%s %s %s %s %s", e.Type, e.VMID, e.Mode, e.VolumeID, e.Device))
		}
	}
	// A detached VM-owned volume is named by the first-class volume it
	// was kept as.
	want := "volume_attached ev vm evvol /dev/vdb\nvolume_attached ev vm data1 /dev/vdc\nvolume_detached ev vm evvol /dev/vdb\nvolume_detached ev vm ev-data1 /dev/vdb"
	if strings.Join(got, "\n") != want {
		t.Errorf("volume events (%v):\n%s\nwant:\n%s", sc.Err(), strings.Join(got, "\n"), want)
	}
}

// TestVolumeCLI drives `vmhost volume` (package cli) against the real
// API: the client's routes and bodies are the server's.
func TestVolumeCLI(t *testing.T) {
	h := newHarness(t)
	ts := httptest.NewServer(h.srv)
	defer ts.Close()
	h.must(t, "POST", "/api/vms", minimalVMBody(h, "c1"), 201)
	run := func(args ...string) (string, string, int) {
		t.Helper()
		var out, errb bytes.Buffer
		env := map[string]string{"VMHOST_API": ts.URL, "VMHOST_TOKEN": h.rw}
		code := cli.Run(context.Background(), args, strings.NewReader(""), &out, &errb, func(k string) string { return env[k] })
		if strings.Contains(out.String()+errb.String(), h.rw) {
			t.Errorf("vmhost %q printed the token", args)
		}
		return out.String(), errb.String(), code
	}
	for _, c := range []struct {
		args []string
		want string // in stdout
	}{
		{[]string{"volume", "create", "--id", "cv", "--size-gib", "2"}, "cv"},
		{[]string{"volume", "list"}, "ATTACHED TO"},
		{[]string{"volume", "attach", "c1", "--volume", "cv", "--readonly"}, "c1"},
		{[]string{"volume", "get", "cv"}, "vm/c1 /dev/vdb"},
		{[]string{"volume", "attach", "c1", "--size-gib", "1"}, "c1"},
		{[]string{"volume", "detach", "c1", "cv"}, "c1"},
		{[]string{"volume", "detach", "c1", "data1"}, "c1"},
		{[]string{"volume", "list"}, "c1-data1"},
		{[]string{"volume", "delete", "cv"}, "cv: deleted"},
	} {
		out, errOut, code := run(c.args...)
		if code != 0 || !strings.Contains(out, c.want) {
			t.Errorf("vmhost %q = %d\n%s%s\nwant %q in stdout", c.args, code, out, errOut, c.want)
		}
	}
	if _, errOut, code := run("volume", "get", "cv"); code != 1 || !strings.HasPrefix(errOut, "NOT_FOUND: ") {
		t.Errorf("volume get of a deleted volume = %d %q", code, errOut)
	}
	if _, errOut, code := run("volume", "attach", "c1", "--appvm", "--volume", "c1-data1", "--mountpoint", "/d"); code != 1 || !strings.HasPrefix(errOut, "NOT_FOUND: ") {
		t.Errorf("volume attach --appvm to a classic VM = %d %q", code, errOut)
	}
	if _, _, b := h.do(t, "GET", "/api/vms/c1", h.ro, ""); devices(decodeView(t, b)) != "" {
		t.Errorf("c1 after the CLI's detaches: %s", b)
	}
}
