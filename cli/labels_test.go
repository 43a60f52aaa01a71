package cli

import (
	"net/http/httptest"
	"strings"
	"testing"
)

// TestLabelCommands: `vm label` sends a merge patch (KEY=VALUE sets, KEY-
// deletes) and shows the view with its labels; --label filters go as
// repeated ?label=; bad edits are usage errors that send nothing.
func TestLabelCommands(t *testing.T) {
	view := `{"id":"web","mode":"vm","state":"running","display_state":"running","vcpus":2,"memory_mb":2048,"labels":{"team":"infra","job":"ci=1"}}`
	rec := &recorder{answers: map[string]answer{
		"PATCH /api/vms/web/labels":                        {200, view},
		"PATCH /api/appvm/vms/app/labels":                  {200, view},
		"GET /api/vms?label=job%3Dci%3D1&label=team":       {200, `{"vms":[` + view + `]}`},
		"GET /api/appvm/vms?label=job%3Dci%3D1&label=team": {200, `{"vms":[]}`},
		"GET /api/appvm/vms?label=team":                    {200, `{"vms":[]}`},
	}}
	srv := httptest.NewServer(rec)
	defer srv.Close()

	out, errOut, code := runCLI(t, srv.URL, "vm", "label", "web", "team=infra", "job=ci=1", "old-")
	want := "" +
		"ID   MODE  STATE    DISPLAY STATE  VCPUS  MEMORY  IPV4  AGE\n" +
		"web  vm    running  running        2      2GiB    -     -\n" +
		"labels: job=ci=1, team=infra\n"
	if code != 0 || out != want {
		t.Errorf("vm label = %d\n%s%s\nwant\n%s", code, out, errOut, want)
	}
	if _, errOut, code := runCLI(t, srv.URL, "appvm", "label", "app", "team="); code != 0 {
		t.Errorf("appvm label = %d %s", code, errOut)
	}
	if out, errOut, code := runCLI(t, srv.URL, "list", "--label", "job=ci=1", "--label", "team"); code != 0 || !strings.Contains(out, "web") {
		t.Errorf("list --label = %d\n%s%s", code, out, errOut)
	}
	if _, errOut, code := runCLI(t, srv.URL, "appvm", "list", "--label", "team"); code != 0 {
		t.Errorf("appvm list --label = %d %s", code, errOut)
	}
	for _, bad := range [][]string{
		{"vm", "label", "web"},         // no edit
		{"vm", "label"},                // no id
		{"vm", "label", "web", "team"}, // neither set nor delete
		{"vm", "label", "web", "=v"},   // no key
		{"vm", "label", "web", "-"},    // no key
	} {
		if _, _, code := runCLI(t, srv.URL, bad...); code != 2 {
			t.Errorf("vmhost %q = %d, want 2 (usage)", bad, code)
		}
	}
	got := strings.Join(rec.reqs, "\n")
	wantReqs := "" +
		`PATCH /api/vms/web/labels {"job":"ci=1","old":null,"team":"infra"}` + "\n" +
		`PATCH /api/appvm/vms/app/labels {"team":""}` + "\n" +
		"GET /api/vms?label=job%3Dci%3D1&label=team\n" +
		"GET /api/appvm/vms?label=job%3Dci%3D1&label=team\n" +
		"GET /api/appvm/vms?label=team"
	if got != wantReqs {
		t.Errorf("requests:\n%s\nwant\n%s", got, wantReqs)
	}
}

// TestHostCommand: `vmhost host` shows GET /api/host, with what is left
// in admission's numbers; -o json prints it unchanged.
func TestHostCommand(t *testing.T) {
	body := `{"hostname":"hv1","agent_id":"0123456789abcdef","version":"1.4.0","boot_id":"b-1","kvm":true,` +
		`"cpus":{"online":8,"allocatable":32,"used":6},"memory_mb":{"total":65536,"allocatable":65536,"used":4096},` +
		`"disk_bytes":{"state_total":107374182400,"state_free":53687091200,"committed":2147483648},` +
		`"vms":{"created":0,"running":2,"paused":0,"stopped":1,"failed":0},"features":["appvm","labels"]}`
	rec := &recorder{answers: map[string]answer{"GET /api/host": {200, body}}}
	srv := httptest.NewServer(rec)
	defer srv.Close()
	out, errOut, code := runCLI(t, srv.URL, "host")
	want := "" +
		"hostname  hv1\n" +
		"agent id  0123456789abcdef\n" +
		"version   1.4.0\n" +
		"boot id   b-1\n" +
		"kvm       true\n" +
		"vcpus     26 free of 32 allocatable (6 used; 8 host CPUs)\n" +
		"memory    60GiB free of 64GiB allocatable (4GiB used; 64GiB on the host)\n" +
		"disk      48GiB free for new disks (50GiB free of 100GiB in the state directory; 2GiB committed)\n" +
		"vms       0 created, 2 running, 0 paused, 1 stopped, 0 failed\n" +
		"features  appvm, labels\n"
	if code != 0 || out != want {
		t.Errorf("host = %d\n%s%s\nwant\n%s", code, out, errOut, want)
	}
	if out, _, code := runCLI(t, srv.URL, "host", "-o", "json"); code != 0 || out != body+"\n" {
		t.Errorf("host -o json = %d %s", code, out)
	}
	if _, _, code := runCLI(t, srv.URL, "host", "extra"); code != 2 {
		t.Errorf("host extra = %d, want 2", code)
	}
}
