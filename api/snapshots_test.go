package api

import (
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"testing"
)

// TestSuspendSnapshotRoutes checks the API side of suspend, start?cold=,
// snapshots, restore and from_snapshot over the recording host, in the
// order an operator would use them: each success's status and shape (the
// harness validates every answer against the OpenAPI document), and 400,
// 404, 409 and 422 with their codes and words. The engine's side is
// tested in vm/engine and end to end in package e2e.
func TestSuspendSnapshotRoutes(t *testing.T) {
	h := newHarness(t)
	if st, _, b := h.do(t, "POST", "/api/vms", h.rw, minimalVMBody(h, "sv")); st != http.StatusCreated {
		t.Fatalf("create = %d %s", st, b)
	}
	if st, _, b := h.do(t, "POST", "/api/appvm/vms", h.rw, `{"vm_id":"sa","image_id":"plain","vcpus":1,"memory_mb":64,"disk_gib":1,"auto_boot":false}`); st != http.StatusCreated {
		t.Fatalf("create AppVM = %d %s", st, b)
	}
	type step struct {
		method, path, body string
		status             int
		code, msg          string // code "" for a success; msg a part of the body
	}
	run := func(steps []step) {
		t.Helper()
		for _, s := range steps {
			st, _, body := h.do(t, s.method, s.path, h.rw, s.body)
			if st != s.status {
				t.Errorf("%s %s %s = %d %s, want %d", s.method, s.path, s.body, st, body, s.status)
				continue
			}
			if s.status == http.StatusNoContent && body != "" {
				t.Errorf("%s %s: 204 with body %q", s.method, s.path, body)
			}
			if s.code != "" && !strings.Contains(body, `"code":"`+s.code+`"`) {
				t.Errorf("%s %s body = %s, want code %s", s.method, s.path, body, s.code)
			}
			if !strings.Contains(body, s.msg) {
				t.Errorf("%s %s body = %s, want %q in it", s.method, s.path, body, s.msg)
			}
		}
	}
	run([]step{
		{"POST", "/api/vms/sv/suspend", "", http.StatusConflict, CodeInvalidState, `cannot suspend VM \"sv\" while it is created`},
		{"POST", "/api/vms/nope/suspend", "", http.StatusNotFound, CodeNotFound, "no classic VM"},
		{"POST", "/api/appvm/vms/sv/suspend", "", http.StatusNotFound, CodeNotFound, "no AppVM"},
		{"POST", "/api/vms/sv/start", "", http.StatusNoContent, "", ""},
		{"POST", "/api/vms/sv/suspend", "", http.StatusNoContent, "", ""},
		{"POST", "/api/vms/sv/suspend", "", http.StatusConflict, CodeInvalidState, "while it is stopped"},
		{"GET", "/api/vms/sv", "", http.StatusOK, "", `"suspended_at":"2023-11-14T22:13:20Z"`},
		{"POST", "/api/vms/sv/volumes", `{"size_gib":1}`, http.StatusConflict, CodeInvalidState, "suspended"},
		// A snapshot of the suspended VM keeps its saved state.
		{"POST", "/api/vms/sv/snapshots", `{"snapshot_id":"s1","memory":true}`, http.StatusCreated, "", `"memory":true`},
		{"POST", "/api/vms/sv/snapshots", `{"snapshot_id":"s1"}`, http.StatusConflict, CodeAlreadyExists, `a snapshot with id \"s1\" already exists`},
		{"POST", "/api/vms/sv/snapshots", `{"snapshot_id":"../x"}`, http.StatusBadRequest, CodeBadRequest, "snapshot_id: must match"},
		{"POST", "/api/vms/sv/snapshots", `{"memory":"yes"}`, http.StatusUnprocessableEntity, "", "memory: expected boolean"},
		{"POST", "/api/vms/sv/snapshots", `{"volumes":[]}`, http.StatusUnprocessableEntity, "", `unknown field "volumes"`},
		{"POST", "/api/vms/nope/snapshots", `{}`, http.StatusNotFound, CodeNotFound, "no classic VM"},
		{"POST", "/api/vms/sv/start?cold=maybe", "", http.StatusBadRequest, CodeBadRequest, "cold: must be true or false"},
		{"POST", "/api/vms/sv/start?cold=true", "", http.StatusNoContent, "", ""},
		{"GET", "/api/vms/sv", "", http.StatusOK, "", `"state":"running"`},
		// A running VM's snapshot with memory; then restores.
		{"POST", "/api/vms/sv/snapshots", `{"snapshot_id":"s2","memory":true}`, http.StatusCreated, "", `"disks":[{"id":"root","path":"` + h.e.StateDir + `/snapshots/s2/disks/root.qcow2","virtual_size_bytes":1073741824}]`},
		{"POST", "/api/appvm/vms/sa/snapshots", `{"snapshot_id":"sa1","memory":true}`, http.StatusCreated, "", `"memory":false`},
		{"POST", "/api/vms/sv/restore", `{"snapshot_id":"s2"}`, http.StatusConflict, CodeInvalidState, "stop or suspend it first"},
		{"POST", "/api/vms/sv/suspend", "", http.StatusNoContent, "", ""},
		{"POST", "/api/vms/sv/restore", `{}`, http.StatusUnprocessableEntity, "", "snapshot_id: required field missing"},
		{"POST", "/api/vms/sv/restore", `{"snapshot_id":"nope"}`, http.StatusNotFound, CodeNotFound, `no snapshot has id \"nope\"`},
		{"POST", "/api/vms/sv/restore", `{"snapshot_id":"sa1"}`, http.StatusBadRequest, CodeBadRequest, "snapshot_id: snapshot \\\"sa1\\\" is of another VM"},
		{"POST", "/api/vms/nope/restore", `{"snapshot_id":"s2"}`, http.StatusNotFound, CodeNotFound, "no classic VM"},
		{"POST", "/api/appvm/vms/sv/restore", `{"snapshot_id":"s2"}`, http.StatusNotFound, CodeNotFound, "no AppVM"},
		{"POST", "/api/vms/sv/restore", `{"snapshot_id":"s2"}`, http.StatusOK, "", `"suspended_at":"`},
		{"POST", "/api/appvm/vms/sa/restore", `{"snapshot_id":"sa1"}`, http.StatusOK, "", `"image_id":"plain"`},
		// The snapshots themselves.
		{"GET", "/api/snapshots?vm_id=../", "", http.StatusBadRequest, CodeBadRequest, "vm_id"},
		{"GET", "/api/snapshots/nope", "", http.StatusNotFound, CodeNotFound, "no snapshot has this id"},
		{"DELETE", "/api/snapshots/nope", "", http.StatusNotFound, CodeNotFound, "no snapshot has this id"},
		// New VMs from snapshots.
		{"POST", "/api/vms", fmt.Sprintf(`{"vm_id":"c1","vcpus":1,"memory_mb":64,"kernel_path":%q,"from_snapshot":"s2","disk":{"base_path":%q}}`, h.e.Kernel, h.e.Base),
			http.StatusBadRequest, CodeBadRequest, "disk: not with from_snapshot"},
		{"POST", "/api/vms", fmt.Sprintf(`{"vm_id":"c1","vcpus":1,"memory_mb":64,"kernel_path":%q,"from_snapshot":"nope"}`, h.e.Kernel),
			http.StatusBadRequest, CodeBadRequest, `from_snapshot: no snapshot has id \"nope\"`},
		{"POST", "/api/vms", fmt.Sprintf(`{"vm_id":"c1","vcpus":1,"memory_mb":64,"kernel_path":%q,"from_snapshot":"sa1"}`, h.e.Kernel),
			http.StatusBadRequest, CodeBadRequest, "from_snapshot: snapshot \\\"sa1\\\" is of a VM of family appvm"},
		{"POST", "/api/vms", fmt.Sprintf(`{"vm_id":"c1","vcpus":1,"memory_mb":64,"kernel_path":%q,"from_snapshot":"s2"}`, h.e.Kernel),
			http.StatusCreated, "", `"base_path":"` + h.e.StateDir + `/snapshots/s2/disks/root.qcow2"`},
		{"POST", "/api/appvm/vms", `{"vm_id":"a1","image_id":"plain","from_snapshot":"sa1","vcpus":1,"memory_mb":64,"disk_gib":1}`,
			http.StatusBadRequest, CodeBadRequest, "image_id: not with from_snapshot"},
		{"POST", "/api/appvm/vms", `{"vm_id":"a1","vcpus":1,"memory_mb":64,"disk_gib":1}`,
			http.StatusBadRequest, CodeBadRequest, "image_id: required unless from_snapshot"},
		{"POST", "/api/appvm/vms", `{"vm_id":"a1","from_snapshot":"sa1","vcpus":1,"memory_mb":64,"disk_gib":1,"auto_boot":false}`,
			http.StatusCreated, "", `"image_id":"plain"`},
		{"DELETE", "/api/snapshots/sa1", "", http.StatusNoContent, "", ""},
		{"GET", "/api/snapshots/sa1", "", http.StatusNotFound, CodeNotFound, ""},
	})
	var list struct {
		Snapshots []struct {
			ID   string `json:"id"`
			VMID string `json:"vm_id"`
		} `json:"snapshots"`
	}
	ids := func(path string) []string {
		_, _, b := h.do(t, "GET", path, h.ro, "")
		if err := json.Unmarshal([]byte(b), &list); err != nil {
			t.Fatalf("GET %s: %v %s", path, err, b)
		}
		var out []string
		for _, s := range list.Snapshots {
			out = append(out, s.ID)
		}
		return out
	}
	if got := ids("/api/snapshots"); !slices.Equal(got, []string{"s1", "s2"}) {
		t.Errorf("GET /api/snapshots = %v", got)
	}
	if got := ids("/api/snapshots?vm_id=sa"); len(got) != 0 {
		t.Errorf("GET /api/snapshots?vm_id=sa after its delete = %v", got)
	}
	want := []string{"boot sv", "suspend sv", "snapshot sv s1", "discard sv", "boot sv", "snapshot sv s2", "snapshot sa sa1",
		"suspend sv", "restore sv s2", "restore sa sa1"}
	var got []string
	for _, c := range h.e.Host.Calls() {
		if slices.ContainsFunc([]string{"boot ", "suspend ", "snapshot ", "discard ", "restore "}, func(p string) bool { return strings.HasPrefix(c, p) }) {
			got = append(got, c)
		}
	}
	if len(got) < len(want) || !slices.Equal(got[:len(want)], want) {
		t.Errorf("host calls %q, want them to begin %q", got, want)
	}
}

// TestSnapshotAdmission: a snapshot counts against the state directory's
// free space (its memory here: the recording host makes no disk files), so
// one that does not fit is 409 CAPACITY_CONFLICT with nothing made and the
// VM left running; with the room it is taken.
func TestSnapshotAdmission(t *testing.T) {
	h := newHarness(t)
	if st, _, b := h.do(t, "POST", "/api/vms", h.rw, minimalVMBody(h, "sv")); st != http.StatusCreated {
		t.Fatalf("create = %d %s", st, b)
	}
	if st, _, b := h.do(t, "POST", "/api/vms/sv/start", h.rw, ""); st != http.StatusNoContent {
		t.Fatalf("start = %d %s", st, b)
	}
	h.e.DiskFree = 512<<20 - 1 // the VM's 512 MiB of memory, less a byte
	st, _, b := h.do(t, "POST", "/api/vms/sv/snapshots", h.rw, `{"snapshot_id":"big","memory":true}`)
	if st != http.StatusConflict || !strings.Contains(b, `"code":"CAPACITY_CONFLICT"`) || !strings.Contains(b, "host capacity: disk:") {
		t.Errorf("snapshot over the free space = %d %s, want 409 CAPACITY_CONFLICT for disk", st, b)
	}
	if st, _, b := h.do(t, "GET", "/api/snapshots/big", h.ro, ""); st != http.StatusNotFound {
		t.Errorf("the refused snapshot: GET = %d %s, want 404", st, b)
	}
	if st, _, b := h.do(t, "GET", "/api/vms/sv", h.ro, ""); st != http.StatusOK || !strings.Contains(b, `"state":"running"`) {
		t.Errorf("after the refused snapshot the VM is %d %s, want running", st, b)
	}
	for _, c := range h.e.Host.Calls() {
		if strings.HasPrefix(c, "snapshot ") {
			t.Errorf("the refused snapshot reached the host: %q", c)
		}
	}
	// A snapshot without memory needs no room here; with it, exactly enough.
	if st, _, b := h.do(t, "POST", "/api/vms/sv/snapshots", h.rw, `{"snapshot_id":"disks"}`); st != http.StatusCreated {
		t.Errorf("snapshot of the disks = %d %s, want 201", st, b)
	}
	h.e.DiskFree++
	if st, _, b := h.do(t, "POST", "/api/vms/sv/snapshots", h.rw, `{"snapshot_id":"big","memory":true}`); st != http.StatusCreated || !strings.Contains(b, `"memory":true`) {
		t.Errorf("snapshot with exactly the room = %d %s, want 201 with memory", st, b)
	}
}
