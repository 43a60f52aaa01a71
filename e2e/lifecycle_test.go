//go:build linux

package e2e

import (
	"fmt"
	"net/http"
	"slices"
	"strings"
	"testing"
)

// TestLifecycleTable runs every action in every state a VM can be put in
// and checks 204 or 409 INVALID_STATE, and the state after a 204.
func TestLifecycleTable(t *testing.T) {
	s := startServer(t, serverOpts{})
	f := newFixture(t)
	// into brings VM id into a state.
	into := map[string]func(id string){
		"created": func(id string) { s.create(f.body(id, false, ""), http.StatusCreated) },
		"running": func(id string) {
			s.create(f.body(id, true, ""), http.StatusCreated)
			s.waitDisplay(id, "running", "running")
		},
		"paused": func(id string) {
			s.create(f.body(id, true, ""), http.StatusCreated)
			s.waitDisplay(id, "running", "running")
			if st := s.act(id, "pause"); st != http.StatusNoContent {
				t.Fatalf("pause = %d", st)
			}
		},
		"stopped": func(id string) {
			s.create(f.body(id, true, ""), http.StatusCreated)
			if st := s.act(id, "stop"); st != http.StatusNoContent {
				t.Fatalf("stop = %d", st)
			}
		},
		"failed": func(id string) { // CH killed by a signal: failed, ch_crash
			s.create(f.body(id, true, ""), http.StatusCreated)
			s.waitDisplay(id, "running", "running")
			s.sim(id, "crash", `{"signal":9}`)
			s.waitFor(id, "failed", func(v view) bool { return v.State == "failed" })
		},
	}
	const ok, bad = http.StatusNoContent, http.StatusConflict
	// want[state][action] = status, and the state after a 204 (a guest
	// may power off at once after the power button).
	type outcome struct {
		status int
		after  string
	}
	want := map[string]map[string]outcome{
		"created": {"start": {ok, "running"}, "shutdown": {bad, ""}, "stop": {bad, ""}, "pause": {bad, ""}, "resume": {bad, ""}, "reboot": {bad, ""}, "delete": {ok, ""}},
		"running": {"start": {bad, ""}, "shutdown": {ok, "running|stopped"}, "stop": {ok, "stopped"}, "pause": {ok, "paused"}, "resume": {bad, ""}, "reboot": {ok, "running"}, "delete": {bad, ""}},
		"paused":  {"start": {bad, ""}, "shutdown": {bad, ""}, "stop": {ok, "stopped"}, "pause": {bad, ""}, "resume": {ok, "running"}, "reboot": {bad, ""}, "delete": {bad, ""}},
		"stopped": {"start": {ok, "running"}, "shutdown": {bad, ""}, "stop": {bad, ""}, "pause": {bad, ""}, "resume": {bad, ""}, "reboot": {bad, ""}, "delete": {ok, ""}},
		"failed":  {"start": {ok, "running"}, "shutdown": {bad, ""}, "stop": {bad, ""}, "pause": {bad, ""}, "resume": {bad, ""}, "reboot": {bad, ""}, "delete": {ok, ""}},
	}
	n := 0
	for _, state := range []string{"created", "running", "paused", "stopped", "failed"} {
		for _, action := range []string{"start", "shutdown", "stop", "pause", "resume", "reboot", "delete"} {
			w := want[state][action]
			t.Run(state+"/"+action, func(t *testing.T) {
				id := fmt.Sprintf("lc%d", n)
				n++
				into[state](id)
				var st int
				var body []byte
				if action == "delete" {
					st, body = s.do("DELETE", "/api/vms/"+id, "")
				} else {
					st, body = s.do("POST", "/api/vms/"+id+"/"+action, "")
				}
				if st != w.status {
					t.Fatalf("%s in %s = %d %s, want %d", action, state, st, body, w.status)
				}
				if st == bad && !strings.Contains(string(body), `"code":"INVALID_STATE"`) {
					t.Errorf("409 body %s lacks INVALID_STATE", body)
				}
				v, exists := s.get(id)
				switch {
				case action == "delete" && st == ok:
					if exists {
						t.Error("the VM still exists after delete")
					}
				case st == ok && !slices.Contains(strings.Split(w.after, "|"), v.State):
					t.Errorf("state after %s = %s, want %s", action, v.State, w.after)
				case st == bad && v.State != state:
					t.Errorf("a refused %s changed the state to %s", action, v.State)
				}
				if exists {
					if st, b := s.do("DELETE", "/api/vms/"+id+"?force=true", ""); st != ok {
						t.Fatalf("cleanup DELETE ?force=true = %d %s", st, b)
					}
				}
				checkGone(t, s, id)
			})
		}
	}
	if st, _ := s.do("POST", "/api/vms/nope/start", ""); st != http.StatusNotFound {
		t.Errorf("start of a missing VM = %d, want 404", st)
	}
	if st, _ := s.do("DELETE", "/api/vms/nope", ""); st != http.StatusNotFound {
		t.Errorf("delete of a missing VM = %d, want 404", st)
	}
}
