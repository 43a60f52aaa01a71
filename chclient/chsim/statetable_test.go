package chsim_test

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"
)

// TestStateTable walks the state × action table of docs/ref/cloud-hypervisor.md §4 (all but
// vmm.shutdown, which ends the process and is covered by check 13).
func TestStateTable(t *testing.T) {
	// A guest that never comes up ignores the power button, so the process stays.
	p := startSim(t, "--sim-no-activate")
	cfg := minimalConfig(t, p.dir)
	disk := filepath.Join(p.dir, "extra.img")
	os.WriteFile(disk, nil, 0o600)
	addDisk := fmt.Sprintf(`{"path":%q}`, disk)
	// A snapshot to restore from; every vm.snapshot row gets an empty directory of its own.
	base := filepath.Join(p.dir, "base")
	os.Mkdir(base, 0o700)
	for _, step := range []string{"vm.create", "vm.boot", "vm.pause"} {
		body := ""
		if step == "vm.create" {
			body = cfg
		}
		p.wantStatus("PUT", "/api/v1/"+step, body, 204)
	}
	p.wantStatus("PUT", "/api/v1/vm.snapshot", fmt.Sprintf(`{"destination_url":"file://%s"}`, base), 204)
	restore := fmt.Sprintf(`{"source_url":"file://%s"}`, base)
	snapshots := 0

	setup := map[string][]string{
		"None":    nil,
		"Created": {"vm.create"},
		"Running": {"vm.create", "vm.boot"},
		"Paused":  {"vm.create", "vm.boot", "vm.pause"},
	}
	type cell struct {
		status int
		last   string // last element of the error chain, when the ref quotes it
		after  string // state afterwards ("" = None)
	}
	rows := []struct {
		method, action, body string
		cells                map[string]cell
	}{
		{"PUT", "vm.create", cfg, map[string]cell{
			"None": {204, "", "Created"}, "Created": {500, "VM is already created", "Created"},
			"Running": {500, "VM is already created", "Running"}, "Paused": {500, "VM is already created", "Paused"}}},
		{"PUT", "vm.boot", "", map[string]cell{
			"None": {404, "VM config is missing", ""}, "Created": {204, "", "Running"},
			"Running": {500, "VM is already created", "Running"}, "Paused": {500, "VM is already created", "Paused"}}},
		{"GET", "vm.info", "", map[string]cell{
			"None": {404, "VM is not created", ""}, "Created": {200, "", "Created"},
			"Running": {200, "", "Running"}, "Paused": {200, "", "Paused"}}},
		{"PUT", "vm.shutdown", "", map[string]cell{
			"None": {500, "VM is not running", ""}, "Created": {500, "VM is not running", "Created"},
			"Running": {204, "", "Created"}, "Paused": {204, "", "Created"}}},
		{"PUT", "vm.reboot", "", map[string]cell{
			"None": {404, "VM is not created", ""}, "Created": {404, "VM is not created", "Created"},
			"Running": {204, "", "Running"}, "Paused": {204, "", "Running"}}},
		{"PUT", "vm.pause", "", map[string]cell{
			"None": {500, "VM is not running", ""}, "Created": {500, "VM is not running", "Created"},
			"Running": {204, "", "Paused"}, "Paused": {500, "Invalid transition: InvalidStateTransition(Paused, Paused)", "Paused"}}},
		{"PUT", "vm.resume", "", map[string]cell{
			"None": {500, "VM is not running", ""}, "Created": {500, "VM is not running", "Created"},
			"Running": {500, "", "Running"}, "Paused": {204, "", "Running"}}},
		{"PUT", "vm.power-button", "", map[string]cell{
			"None": {500, "VM is not running", ""}, "Created": {500, "VM is not running", "Created"},
			"Running": {204, "", "Running"}, "Paused": {204, "", "Paused"}}},
		{"PUT", "vm.delete", "", map[string]cell{
			"None": {204, "", ""}, "Created": {204, "", ""}, "Running": {204, "", ""}, "Paused": {204, "", ""}}},
		{"GET", "vm.counters", "", map[string]cell{
			"None": {500, "VM is not running", ""}, "Created": {500, "VM is not running", "Created"},
			"Running": {200, "", "Running"}, "Paused": {200, "", "Paused"}}},
		{"PUT", "vm.resize", `{"desired_vcpus":2}`, map[string]cell{
			"None": {404, "", ""}, "Created": {204, "", "Created"}, "Running": {204, "", "Running"}, "Paused": {204, "", "Paused"}}},
		{"PUT", "vm.add-disk", addDisk, map[string]cell{
			"None": {404, "", ""}, "Created": {204, "", "Created"}, "Running": {200, "", "Running"}, "Paused": {200, "", "Paused"}}},
		{"PUT", "vm.snapshot", "SNAPSHOT", map[string]cell{
			"None": {500, "VM is not running", ""}, "Created": {500, "VM is not running", "Created"},
			"Running": {500, "Trying to snapshot while VM is running", "Running"}, "Paused": {204, "", "Paused"}}},
		{"PUT", "vm.restore", restore, map[string]cell{
			"None": {204, "", "Paused"}, "Created": {500, "VM is already created", "Created"},
			"Running": {500, "VM is already created", "Running"}, "Paused": {500, "VM is already created", "Paused"}}},
		{"PUT", "vm.remove-device", `{"id":"nope"}`, map[string]cell{
			"None": {404, "", ""}, "Created": {500, "No device with id nope to remove", "Created"},
			"Running": {500, "No device with id nope to remove", "Running"}, "Paused": {500, "No device with id nope to remove", "Paused"}}},
	}
	for _, row := range rows {
		for _, state := range []string{"None", "Created", "Running", "Paused"} {
			want := row.cells[state]
			t.Run(row.action+"/"+state, func(t *testing.T) {
				p.t = t
				p.wantStatus("PUT", "/api/v1/vm.delete", "", 204)
				for _, step := range setup[state] {
					body := ""
					if step == "vm.create" {
						body = cfg
					}
					p.wantStatus("PUT", "/api/v1/"+step, body, 204)
				}
				body := row.body
				if body == "SNAPSHOT" {
					snapshots++
					dir := filepath.Join(p.dir, fmt.Sprintf("snap%d", snapshots))
					os.Mkdir(dir, 0o700)
					body = fmt.Sprintf(`{"destination_url":"file://%s"}`, dir)
				}
				resp, data := p.do(row.method, "/api/v1/"+row.action, body)
				if resp.StatusCode != want.status {
					t.Fatalf("%s in %s = %d %s, want %d", row.action, state, resp.StatusCode, data, want.status)
				}
				if want.last != "" {
					if got := lastOf(errorChain(t, data)); got != want.last {
						t.Errorf("%s in %s ends %q, want %q", row.action, state, got, want.last)
					}
				}
				if resp.StatusCode >= 400 {
					if chain := errorChain(t, data); len(chain) < 2 || chain[0] != "Error from API" {
						t.Errorf("%s in %s: chain %q does not start with \"Error from API\"", row.action, state, chain)
					}
				}
				after := "None"
				if r, _ := p.do("GET", "/api/v1/vm.info", ""); r.StatusCode == 200 {
					after = p.state()
				}
				if want.after == "" {
					want.after = "None"
				}
				if after != want.after {
					t.Errorf("%s in %s left the VM %s, want %s", row.action, state, after, want.after)
				}
			})
		}
	}
}
