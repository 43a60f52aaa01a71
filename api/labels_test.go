package api

import (
	"bufio"
	"encoding/json"
	"fmt"
	"maps"
	"net/http"
	"net/http/httptest"
	"net/url"
	"slices"
	"strings"
	"testing"
	"time"
)

// labelsJSON is labels as a JSON object.
func labelsJSON(t testing.TB, l map[string]string) string {
	t.Helper()
	b, err := json.Marshal(l)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// vmBodyWithLabels is the minimal create body of family ("vm" or
// "appvm") with a labels member holding the raw JSON labels.
func vmBodyWithLabels(h *harness, family, id, labels string) string {
	if family == "appvm" {
		return fmt.Sprintf(`{"vm_id":%q,"image_id":"plain","vcpus":1,"memory_mb":64,"disk_gib":1,"labels":%s}`, id, labels)
	}
	return strings.TrimSuffix(minimalVMBody(h, id), "}") + `,"labels":` + labels + "}"
}

func familyPrefix(family string) string {
	if family == "appvm" {
		return "/api/appvm/vms"
	}
	return "/api/vms"
}

// viewLabels reads the labels of a VM view (or of an error body: none);
// present reports whether the view has the member at all.
func viewLabels(t testing.TB, body string) (l map[string]string, present bool) {
	t.Helper()
	var v map[string]json.RawMessage
	if err := json.Unmarshal([]byte(body), &v); err != nil {
		t.Fatalf("decoding %s: %v", body, err)
	}
	raw, present := v["labels"]
	if present {
		if err := json.Unmarshal(raw, &l); err != nil {
			t.Fatal(err)
		}
	}
	return l, present
}

func manyLabels(n int, key func(i int) string, value string) map[string]string {
	m := map[string]string{}
	for i := range n {
		m[key(i)] = value
	}
	return m
}

// TestLabelRules: for every label rule, a create of either family and a
// labels edit of either family that breaks it answer 400 naming the rule
// and the key, and nothing is made or changed; the boundary values are
// accepted; a label value that is not a string is a 422.
func TestLabelRules(t *testing.T) {
	h := newHarness(t)
	long := func(c byte, n int) string { return strings.Repeat(string(c), n) }
	rules := []struct {
		name   string
		labels map[string]string
		want   string // the 400's message, from the field on
	}{
		{"65 labels", manyLabels(65, func(i int) string { return fmt.Sprintf("k%d", i) }, "v"), "labels: at most 64 labels, got 65"},
		{"empty key", map[string]string{"": "v"}, `labels: key "": must be 1..63 bytes, got 0`},
		{"64-byte key", map[string]string{long('k', 64): "v"}, `labels: key "` + long('k', 63) + `…": must be 1..63 bytes, got 64`},
		{"upper-case key", map[string]string{"Team": "v"}, `labels: key "Team": may hold only a-z, 0-9, '.', '_', '/' and '-' (byte 0 is not one)`},
		{"key with a space", map[string]string{"my team": "v"}, `labels: key "my team": may hold only a-z, 0-9, '.', '_', '/' and '-' (byte 2 is not one)`},
		{"key ending in a dash", map[string]string{"team-": "v"}, `labels: key "team-": must start and end with a lower-case letter or a digit`},
		{"key starting with a dot", map[string]string{".team": "v"}, `labels: key ".team": must start and end with a lower-case letter or a digit`},
		{"257-byte value", map[string]string{"team": long('v', 257)}, `labels: value of key "team": at most 256 bytes, got 257`},
		{"control character", map[string]string{"team": "in\u0007fra"}, `labels: value of key "team": must not hold control characters (byte 2 is U+0007)`},
		{"newline", map[string]string{"team": "a\nb"}, `labels: value of key "team": must not hold control characters (byte 1 is U+000A)`},
	}
	// The targets of the edits: one VM of each family, with a label.
	for _, family := range []string{"vm", "appvm"} {
		if st, _, b := h.do(t, "POST", familyPrefix(family), h.rw, vmBodyWithLabels(h, family, "edit-"+family, `{"keep":"me"}`)); st != 201 {
			t.Fatalf("create edit-%s: %d %s", family, st, b)
		}
	}
	for _, family := range []string{"vm", "appvm"} {
		for _, r := range rules {
			t.Run(family+"/"+r.name, func(t *testing.T) {
				before, recs := h.e.Host.Transcript(), countRecords(t, h)
				st, _, b := h.do(t, "POST", familyPrefix(family), h.rw, vmBodyWithLabels(h, family, "bad", labelsJSON(t, r.labels)))
				if st != 400 || !strings.Contains(b, `"code":"BAD_REQUEST"`) || !strings.Contains(b, jsonString(r.want)) {
					t.Errorf("create = %d %s, want 400 %s", st, b, r.want)
				}
				if h.e.Host.Transcript() != before || countRecords(t, h) != recs {
					t.Error("a create refused for its labels made something")
				}
				// The same rule broken by an edit. An edit past 64 labels
				// counts the labels after it.
				edit := map[string]*string{}
				for k, v := range r.labels {
					edit[k] = &v
				}
				want := r.want
				if len(r.labels) > 64 {
					want = "labels: at most 64 labels, got 66 after the edit"
				}
				b1, _ := json.Marshal(edit)
				path := familyPrefix(family) + "/edit-" + family + "/labels"
				st, _, b = h.do(t, "PATCH", path, h.rw, string(b1))
				if st != 400 || !strings.Contains(b, jsonString(want)) {
					t.Errorf("PATCH %s = %d %s, want 400 %s", path, st, b, want)
				}
				_, _, g := h.do(t, "GET", familyPrefix(family)+"/edit-"+family, h.ro, "")
				if l, _ := viewLabels(t, g); !maps.Equal(l, map[string]string{"keep": "me"}) {
					t.Errorf("labels after a refused edit = %v, want keep=me only", l)
				}
			})
		}
		// A delete names a valid key too.
		if st, _, b := h.do(t, "PATCH", familyPrefix(family)+"/edit-"+family+"/labels", h.rw, `{"Keep":null}`); st != 400 || !strings.Contains(b, `key \"Keep\": may hold only`) {
			t.Errorf("PATCH deleting an invalid key = %d %s, want 400", st, b)
		}
		// The boundary: 64 labels of 63-byte keys and 256-byte values.
		max := manyLabels(64, func(i int) string { return fmt.Sprintf("%s%02d", long('k', 61), i) }, long('v', 256))
		st, _, b := h.do(t, "POST", familyPrefix(family), h.rw, vmBodyWithLabels(h, family, "max-"+family, labelsJSON(t, max)))
		if st != 201 {
			t.Fatalf("create with 64 labels at their limits = %d %s", st, b)
		}
		_, _, b = h.do(t, "GET", familyPrefix(family)+"/max-"+family, h.ro, "")
		if l, _ := viewLabels(t, b); !maps.Equal(l, max) {
			t.Errorf("view of max-%s has %d labels, want the 64 created", family, len(l))
		}
		// Types are the decoder's: 422, naming the label.
		for body, want := range map[string]string{
			`{"team":1}`:    `labels["team"]: expected string, got number`,
			`{"team":null}`: `labels["team"]: expected string, got null`,
			`"team"`:        `labels: expected object, got string`,
		} {
			st, _, b := h.do(t, "POST", familyPrefix(family), h.rw, vmBodyWithLabels(h, family, "typed", body))
			if st != 422 || !strings.Contains(b, want) {
				t.Errorf("create with labels %s = %d %s, want 422 %s", body, st, b, want)
			}
		}
		for body, want := range map[string]string{
			`{"team":1}`: `["team"]: expected string, got number`,
			`["team"]`:   `body: expected object, got array`,
		} {
			st, _, b := h.do(t, "PATCH", familyPrefix(family)+"/edit-"+family+"/labels", h.rw, body)
			if st != 422 || !strings.Contains(b, want) {
				t.Errorf("PATCH labels %s = %d %s, want 422 %s", body, st, b, want)
			}
		}
	}
}

// jsonString is s as it appears inside a JSON string.
func jsonString(s string) string {
	b, _ := json.Marshal(s)
	return string(b[1 : len(b)-1])
}

// TestLabelEdit: PATCH .../labels merges: a value adds or changes a label,
// null deletes it, a key left out stays; it answers the view; an edit that
// changes nothing writes nothing; deleting every label leaves the view
// without labels; an unknown id or one of the other family is 404.
func TestLabelEdit(t *testing.T) {
	h := newHarness(t)
	for _, family := range []string{"vm", "appvm"} {
		t.Run(family, func(t *testing.T) {
			prefix := familyPrefix(family)
			id := "merge-" + family
			if st, _, b := h.do(t, "POST", prefix, h.rw, vmBodyWithLabels(h, family, id, `{"team":"infra","job":"ci","keep":"me"}`)); st != 201 {
				t.Fatalf("create: %d %s", st, b)
			}
			path := prefix + "/" + id + "/labels"
			for _, step := range []struct {
				edit string
				want map[string]string
			}{
				{`{"owner":"ana"}`, map[string]string{"team": "infra", "job": "ci", "keep": "me", "owner": "ana"}},              // add
				{`{"team":"web"}`, map[string]string{"team": "web", "job": "ci", "keep": "me", "owner": "ana"}},                 // change
				{`{"job":null}`, map[string]string{"team": "web", "keep": "me", "owner": "ana"}},                                // delete
				{`{"gone":null}`, map[string]string{"team": "web", "keep": "me", "owner": "ana"}},                               // delete of an absent key
				{`{"team":"","owner":null,"x/y.z_1-2":"a=b"}`, map[string]string{"team": "", "keep": "me", "x/y.z_1-2": "a=b"}}, // all at once
				{`{}`, map[string]string{"team": "", "keep": "me", "x/y.z_1-2": "a=b"}},                                         // nothing
			} {
				st, _, b := h.do(t, "PATCH", path, h.rw, step.edit)
				if st != 200 {
					t.Fatalf("PATCH %s: %d %s", step.edit, st, b)
				}
				if l, _ := viewLabels(t, b); !maps.Equal(l, step.want) {
					t.Errorf("PATCH %s answered labels %v, want %v", step.edit, l, step.want)
				}
				if !strings.Contains(b, `"id":"`+id+`"`) || !strings.Contains(b, `"mode":"`+family+`"`) {
					t.Errorf("PATCH %s did not answer the view: %s", step.edit, b)
				}
				_, _, g := h.do(t, "GET", prefix+"/"+id, h.ro, "")
				if l, _ := viewLabels(t, g); !maps.Equal(l, step.want) {
					t.Errorf("GET after PATCH %s shows labels %v, want %v", step.edit, l, step.want)
				}
			}
			// An edit that changes nothing does not write the record (no
			// event, no record version).
			rec := h.e.Records.Get(id)
			for _, edit := range []string{`{}`, `{"keep":"me"}`, `{"absent":null}`} {
				if st, _, b := h.do(t, "PATCH", path, h.rw, edit); st != 200 {
					t.Fatalf("PATCH %s: %d %s", edit, st, b)
				}
				if h.e.Records.Get(id) != rec {
					t.Errorf("PATCH %s, which changes nothing, wrote the record", edit)
				}
			}
			_, _, b := h.do(t, "PATCH", path, h.rw, `{"team":null,"keep":null,"x/y.z_1-2":null}`)
			if l, present := viewLabels(t, b); present {
				t.Errorf("the view of a VM without labels has labels %v; the member is omitted when empty", l)
			}
			other := "/api/appvm/vms/"
			if family == "appvm" {
				other = "/api/vms/"
			}
			for _, p := range []string{prefix + "/nope/labels", other + id + "/labels"} {
				if st, _, b := h.do(t, "PATCH", p, h.rw, `{"a":"b"}`); st != 404 || !strings.Contains(b, CodeNotFound) {
					t.Errorf("PATCH %s = %d %s, want 404", p, st, b)
				}
			}
			if st, _, _ := h.do(t, "PATCH", path, h.ro, `{"a":"b"}`); st != 403 {
				t.Errorf("PATCH with a read key = %d, want 403", st)
			}
		})
	}
}

// listIDs lists a family's VM ids for a query.
func listIDs(t *testing.T, h *harness, family string, q url.Values) (int, []string, string) {
	t.Helper()
	path := familyPrefix(family)
	if len(q) > 0 {
		path += "?" + q.Encode()
	}
	st, _, b := h.do(t, "GET", path, h.ro, "")
	if st != 200 {
		return st, nil, b
	}
	var l struct {
		VMs []struct {
			ID string `json:"id"`
		} `json:"vms"`
	}
	if err := json.Unmarshal([]byte(b), &l); err != nil {
		t.Fatal(err)
	}
	ids := []string{}
	for _, v := range l.VMs {
		ids = append(ids, v.ID)
	}
	return st, ids, b
}

// TestLabelFilters: ?label=key=value and ?label=key filter both lists,
// several must all match, and a malformed filter is 400 on the lists and
// the event stream.
func TestLabelFilters(t *testing.T) {
	h := newHarness(t)
	for _, c := range []struct{ family, id, labels string }{
		{"vm", "a", `{"team":"infra","env":"prod"}`},
		{"vm", "b", `{"team":"infra","env":"dev"}`},
		{"vm", "c", `{}`},
		{"vm", "d", `{"team":"web","note":"x=y"}`},
		{"appvm", "x", `{"team":"infra","env":"prod"}`},
		{"appvm", "y", `{"team":"web"}`},
	} {
		if st, _, b := h.do(t, "POST", familyPrefix(c.family), h.rw, vmBodyWithLabels(h, c.family, c.id, c.labels)); st != 201 {
			t.Fatalf("create %s: %d %s", c.id, st, b)
		}
	}
	for _, tt := range []struct {
		filters   []string
		vms, apps []string
	}{
		{nil, []string{"a", "b", "c", "d"}, []string{"x", "y"}},
		{[]string{"team=infra"}, []string{"a", "b"}, []string{"x"}},
		{[]string{"team=infra", "env=prod"}, []string{"a"}, []string{"x"}},
		{[]string{"env=prod", "team=infra"}, []string{"a"}, []string{"x"}},
		{[]string{"team=infra", "env=staging"}, []string{}, []string{}},
		{[]string{"env"}, []string{"a", "b"}, []string{"x"}},
		{[]string{"team", "env"}, []string{"a", "b"}, []string{"x"}},
		{[]string{"team"}, []string{"a", "b", "d"}, []string{"x", "y"}},
		{[]string{"team=web"}, []string{"d"}, []string{"y"}},
		{[]string{"note=x=y"}, []string{"d"}, []string{}},
		{[]string{"owner"}, []string{}, []string{}},
		{[]string{"team="}, []string{}, []string{}},
	} {
		q := url.Values{"label": tt.filters}
		for family, want := range map[string][]string{"vm": tt.vms, "appvm": tt.apps} {
			if st, got, b := listIDs(t, h, family, q); st != 200 || !slices.Equal(got, want) {
				t.Errorf("GET %s?%s = %d %v %s, want %v", familyPrefix(family), q.Encode(), st, got, b, want)
			}
		}
	}
	for _, bad := range []struct{ query, want string }{
		{"label=", `label: filter \"\": key \"\": must be 1..63 bytes, got 0`},
		{"label=Team%3Dinfra", `label: filter \"Team=infra\": key \"Team\": may hold only`},
		{"label=team%21%3Dinfra", `label: filter \"team!=infra\": key \"team!\": may hold only`},
		{"label=team%3Din%07fra", `label: filter \"team=in\\afra\": value of key \"team\": must not hold control characters`},
		{"label=team&label=-x", `label: filter \"-x\": key \"-x\": must start and end`},
	} {
		for _, path := range []string{"/api/vms", "/api/appvm/vms", "/api/events"} {
			if st, _, b := h.do(t, "GET", path+"?"+bad.query, h.ro, ""); st != 400 || !strings.Contains(b, bad.want) {
				t.Errorf("GET %s?%s = %d %s, want 400 %s", path, bad.query, st, b, bad.want)
			}
		}
	}
}

// event is what the label tests read of an event.
type labelEvent struct {
	Type   string            `json:"type"`
	VMID   string            `json:"vm_id"`
	State  string            `json:"state"`
	Labels map[string]string `json:"labels"`
}

// storedEvents waits until the events the log shows readers include the
// last one of a VM's id (its deletion, in these tests) and returns them
// all.
func storedEvents(t *testing.T, h *harness, lastType, lastVM string) []labelEvent {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		ents, _, changed := h.events.After(0, 1<<20)
		out := make([]labelEvent, len(ents))
		for i, e := range ents {
			if err := json.Unmarshal(e.JSON, &out[i]); err != nil {
				t.Fatal(err)
			}
		}
		if slices.ContainsFunc(out, func(e labelEvent) bool { return e.Type == lastType && e.VMID == lastVM }) {
			return out
		}
		select {
		case <-changed:
		case <-time.After(time.Until(deadline)):
			t.Fatalf("the event log shows %d events, none of them %s %s", len(out), lastType, lastVM)
		}
	}
}

// TestLabelsInEvents: every event of a VM carries its labels as they are
// after the change (before it, for deleted), and ?label= on the event
// stream shows only the events whose labels match.
func TestLabelsInEvents(t *testing.T) {
	h := newHarness(t)
	ts := httptest.NewServer(h.srv)
	defer ts.Close()
	// A stream filtered to team=infra, open before anything happens.
	req, _ := http.NewRequest("GET", ts.URL+"/api/events?label=team%3Dinfra&label=env", nil)
	req.Header.Set("Authorization", "Bearer "+h.ro)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("GET /api/events?label=… = %d", resp.StatusCode)
	}
	filtered := bufio.NewScanner(resp.Body)

	steps := []struct{ method, path, body string }{
		{"POST", "/api/vms", vmBodyWithLabels(h, "vm", "a", `{"team":"infra","env":"prod"}`)},
		{"POST", "/api/vms", vmBodyWithLabels(h, "vm", "b", `{"team":"web","env":"prod"}`)},
		{"POST", "/api/appvm/vms", vmBodyWithLabels(h, "appvm", "x", `{"team":"infra","env":"dev"}`)},
		{"PATCH", "/api/vms/a/labels", `{"team":"web"}`},
		{"POST", "/api/vms/a/start", ""},
		{"PATCH", "/api/vms/b/labels", `{"team":"infra"}`},
		{"DELETE", "/api/vms/b?force=true", ""},
	}
	for _, s := range steps {
		if st, _, b := h.do(t, s.method, s.path, h.rw, s.body); st/100 != 2 {
			t.Fatalf("%s %s: %d %s", s.method, s.path, st, b)
		}
	}
	got := storedEvents(t, h, "deleted", "b")
	var lines []string
	for _, e := range got {
		lines = append(lines, fmt.Sprintf("%s %s %s", e.Type, e.VMID, labelLine(e.Labels)))
	}
	// The AppVM's boot (display booting, state running) comes as it
	// comes; its events are checked by their labels only.
	var classic []string
	for i, e := range got {
		if e.VMID == "x" {
			if !maps.Equal(e.Labels, map[string]string{"team": "infra", "env": "dev"}) {
				t.Errorf("event %s of x carries labels %v", e.Type, e.Labels)
			}
			continue
		}
		classic = append(classic, lines[i])
	}
	want := []string{
		"created a env=prod,team=infra",
		"display_state_changed a env=prod,team=infra",
		"created b env=prod,team=web",
		"display_state_changed b env=prod,team=web",
		// The labels edit itself is no event; the next event carries it.
		"state_changed a env=prod,team=web",
		"display_state_changed a env=prod,team=web",
		"deleted b env=prod,team=infra",
	}
	if !slices.Equal(classic, want) {
		t.Errorf("events of the classic VMs:\n%s\nwant\n%s", strings.Join(classic, "\n"), strings.Join(want, "\n"))
	}
	// The filtered stream: the events whose labels have team=infra and
	// an env, in order; the last is b's deletion.
	var streamed []string
	for len(streamed) == 0 || streamed[len(streamed)-1] != "deleted b" {
		var e labelEvent
		for filtered.Scan() {
			if v, ok := strings.CutPrefix(filtered.Text(), "data: "); ok {
				if err := json.Unmarshal([]byte(v), &e); err != nil {
					t.Fatal(err)
				}
				break
			}
		}
		if e.Type == "" {
			t.Fatalf("the filtered stream ended after %q: %v", streamed, filtered.Err())
		}
		if e.Labels["team"] != "infra" || e.Labels["env"] == "" {
			t.Errorf("the filtered stream sent %s %s with labels %v", e.Type, e.VMID, e.Labels)
		}
		streamed = append(streamed, e.Type+" "+e.VMID)
	}
	var wantStreamed []string
	for _, e := range got {
		if e.Labels["team"] == "infra" && e.Labels["env"] != "" {
			wantStreamed = append(wantStreamed, e.Type+" "+e.VMID)
		}
	}
	if !slices.Equal(streamed, wantStreamed) {
		t.Errorf("filtered stream = %q, want %q", streamed, wantStreamed)
	}
}

// labelLine is l as "k=v,k2=v2" by key.
func labelLine(l map[string]string) string {
	var parts []string
	for _, k := range slices.Sorted(maps.Keys(l)) {
		parts = append(parts, k+"="+l[k])
	}
	return strings.Join(parts, ",")
}

// TestLabelsSurviveRestart: labels, and their edits, are in the record
// file: an agent started again on the state directory shows and filters
// them, and its events carry them.
func TestLabelsSurviveRestart(t *testing.T) {
	h := newHarness(t)
	for _, family := range []string{"vm", "appvm"} {
		id := "keep-" + family
		if st, _, b := h.do(t, "POST", familyPrefix(family), h.rw, vmBodyWithLabels(h, family, id, `{"team":"infra","job":"j-1"}`)); st != 201 {
			t.Fatalf("create: %d %s", st, b)
		}
		if st, _, b := h.do(t, "PATCH", familyPrefix(family)+"/"+id+"/labels", h.rw, `{"job":null,"alloc":"a-7"}`); st != 200 {
			t.Fatalf("PATCH: %d %s", st, b)
		}
	}
	h.start(t) // a new agent on the same state directory
	want := map[string]string{"team": "infra", "alloc": "a-7"}
	for _, family := range []string{"vm", "appvm"} {
		id := "keep-" + family
		_, _, b := h.do(t, "GET", familyPrefix(family)+"/"+id, h.ro, "")
		if l, _ := viewLabels(t, b); !maps.Equal(l, want) {
			t.Errorf("%s after a restart has labels %v, want %v", id, l, want)
		}
		if st, ids, b := listIDs(t, h, family, url.Values{"label": {"alloc=a-7", "team=infra"}}); st != 200 || !slices.Equal(ids, []string{id}) {
			t.Errorf("list %s by label after a restart = %d %v %s", family, st, ids, b)
		}
	}
	if st, _, b := h.do(t, "DELETE", "/api/vms/keep-vm?force=true", h.rw, ""); st != 204 {
		t.Fatalf("delete: %d %s", st, b)
	}
	evs := storedEvents(t, h, "deleted", "keep-vm")
	i := slices.IndexFunc(evs, func(e labelEvent) bool { return e.Type == "deleted" && e.VMID == "keep-vm" })
	if i < 0 || !maps.Equal(evs[i].Labels, want) {
		t.Errorf("events after the restart = %+v, want keep-vm deleted with %v", evs, want)
	}
}
