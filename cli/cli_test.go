package cli

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

// recorder is a fake API: it records each request as "METHOD PATH BODY"
// and answers from a table keyed by "METHOD PATH".
type recorder struct {
	mu      sync.Mutex
	reqs    []string
	answers map[string]answer
}

type answer struct {
	status int
	body   string
}

func (rec *recorder) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	b, _ := io.ReadAll(r.Body)
	key := r.Method + " " + r.URL.RequestURI()
	rec.mu.Lock()
	rec.reqs = append(rec.reqs, strings.TrimSpace(key+" "+string(b)))
	rec.mu.Unlock()
	if r.Header.Get("Authorization") != "Bearer vmh_test" {
		w.WriteHeader(401)
		io.WriteString(w, `{"code":"UNAUTHORIZED","message":"missing or invalid API key"}`)
		return
	}
	a, ok := rec.answers[key]
	if !ok {
		w.WriteHeader(404)
		io.WriteString(w, `{"code":"NOT_FOUND","message":"no such endpoint"}`)
		return
	}
	if a.body != "" {
		w.Header().Set("Content-Type", "application/json")
	}
	w.WriteHeader(a.status)
	io.WriteString(w, a.body)
}

func runCLI(t *testing.T, api string, args ...string) (string, string, int) {
	t.Helper()
	var out, errb bytes.Buffer
	env := map[string]string{"VMHOST_API": api, "VMHOST_TOKEN": "vmh_test"}
	code := Run(context.Background(), args, strings.NewReader(""), &out, &errb, func(k string) string { return env[k] })
	return out.String(), errb.String(), code
}

const volJSON = `{"id":"db","path":"/var/lib/vmhost/volumes/db.qcow2","virtual_size_bytes":10737418240,"fmt":"qcow2","format":"ext4","created_at":"2026-11-20T10:00:00Z","attached_to":{"vm_id":"web","mode":"appvm","device":"/dev/vdc"}}`

// TestVolumeCommands: the volume commands send the volume routes
// and bodies (transcript), and print the answers as tables.
func TestVolumeCommands(t *testing.T) {
	rec := &recorder{answers: map[string]answer{
		"GET /api/volumes":                         {200, `{"volumes":[` + volJSON + `]}`},
		"GET /api/volumes/db":                      {200, volJSON},
		"POST /api/volumes":                        {201, volJSON},
		"DELETE /api/volumes/db":                   {409, `{"code":"INVALID_STATE","message":"volume db is attached to web"}`},
		"POST /api/appvm/vms/web/volumes":          {200, `{"id":"web","mode":"appvm","state":"running","display_state":"running","vcpus":2,"memory_mb":2048,"appvm":{"ip":"10.0.0.5"}}`},
		"DELETE /api/vms/vm1/volumes/data0":        {200, `{"id":"vm1","mode":"vm","state":"stopped","display_state":"stopped","vcpus":1,"memory_mb":512}`},
		"POST /api/vms/vm1/volumes":                {200, `{"id":"vm1","mode":"vm","state":"stopped","display_state":"stopped","vcpus":1,"memory_mb":512}`},
		"DELETE /api/appvm/vms/web/volumes/db%201": {200, `{"id":"web","mode":"appvm","state":"running","display_state":"running","vcpus":2,"memory_mb":2048}`},
	}}
	srv := httptest.NewServer(rec)
	defer srv.Close()

	out, errOut, code := runCLI(t, srv.URL, "volume", "list")
	if code != 0 || !strings.Contains(out, "db") || !strings.Contains(out, "10GiB") || !strings.Contains(out, "appvm/web /dev/vdc") {
		t.Errorf("volume list = %d\n%s%s", code, out, errOut)
	}
	if _, errOut, code = runCLI(t, srv.URL, "volume", "delete", "db"); code != 1 || errOut != "INVALID_STATE: volume db is attached to web\n" {
		t.Errorf("volume delete of an attached volume = %d, %q", code, errOut)
	}
	for _, args := range [][]string{
		{"volume", "get", "db"},
		{"volume", "create", "--size-gib", "10", "--format", "ext4", "--id", "db"},
		{"volume", "create", "--size-gib", "1"},
		{"volume", "attach", "web", "--appvm", "--volume", "db", "--mountpoint", "/data", "--readonly"},
		{"volume", "attach", "vm1", "--size-gib", "4"},
		{"volume", "detach", "vm1", "data0"},
		{"volume", "detach", "--appvm", "web", "db 1"},
	} {
		if out, errOut, code := runCLI(t, srv.URL, args...); code != 0 {
			t.Errorf("vmhost %q = %d\n%s%s", args, code, out, errOut)
		}
	}
	got := strings.Join(rec.reqs, "\n")
	want := `GET /api/volumes
DELETE /api/volumes/db
GET /api/volumes/db
POST /api/volumes {"volume_id":"db","size_gib":10,"format":"ext4"}
POST /api/volumes {"size_gib":1}
POST /api/appvm/vms/web/volumes {"volume_id":"db","readonly":true,"mountpoint":"/data"}
POST /api/vms/vm1/volumes {"size_gib":4}
DELETE /api/vms/vm1/volumes/data0
DELETE /api/appvm/vms/web/volumes/db%201`
	if got != want {
		t.Errorf("requests:\n%s\nwant:\n%s", got, want)
	}
	for _, args := range [][]string{
		{"volume", "create"},
		{"volume", "attach", "vm1"},
		{"volume", "attach", "vm1", "--volume", "a", "--size-gib", "1"},
		{"volume", "detach", "vm1"},
		{"volume", "frob"},
	} {
		if _, _, code := runCLI(t, srv.URL, args...); code != 2 {
			t.Errorf("vmhost %q = %d, want 2", args, code)
		}
	}
}

// TestVMTable: the columns of a VM table, the IPv4 an AppVM's lease or a
// static interface gives, the age, and errors in either envelope.
func TestVMTable(t *testing.T) {
	created := time.Now().Add(-3 * time.Hour).UTC().Format(time.RFC3339)
	rec := &recorder{answers: map[string]answer{
		"GET /api/appvm/vms": {200, `{"vms":[` +
			`{"id":"web","mode":"appvm","state":"running","display_state":"running","vcpus":2,"memory_mb":2048,"created_at":"` + created + `","appvm":{"lease":{"ip":"10.0.0.9"}}},` +
			`{"id":"batch-job-with-a-long-name","mode":"appvm","state":"failed","display_state":"failed","vcpus":1,"memory_mb":96,"nets":[{"ipv4":{"address":"192.168.1.4/24"}}]}]}`},
		"GET /api/vms/x":        {404, `{"error":{"code":"NOT_FOUND","message":"no VM has this id"}}`},
		"POST /api/vms":         {422, "missing field `vcpus`\n"},
		"POST /api/vms/x/pause": {204, ""},
	}}
	srv := httptest.NewServer(rec)
	defer srv.Close()
	out, _, code := runCLI(t, srv.URL, "appvm", "list")
	want := "" +
		"ID                          MODE   STATE    DISPLAY STATE  VCPUS  MEMORY  IPV4         AGE\n" +
		"web                         appvm  running  running        2      2GiB    10.0.0.9     3h\n" +
		"batch-job-with-a-long-name  appvm  failed   failed         1      96MiB   192.168.1.4  -\n"
	if code != 0 || out != want {
		t.Errorf("appvm list = %d\n%s\nwant\n%s", code, out, want)
	}
	if _, errOut, code := runCLI(t, srv.URL, "vm", "get", "x"); code != 1 || errOut != "NOT_FOUND: no VM has this id\n" {
		t.Errorf("vm get x = %d, %q", code, errOut)
	}
	if _, errOut, code := runCLI(t, srv.URL, "vm", "create", "-f", "-"); code != 1 || errOut != "HTTP 422: missing field `vcpus`\n" {
		t.Errorf("vm create of a bad body = %d, %q", code, errOut)
	}
	if out, _, code := runCLI(t, srv.URL, "vm", "pause", "x", "-o", "json"); code != 0 || out != "" {
		t.Errorf("vm pause -o json = %d, %q; want nothing (204)", code, out)
	}

	// An AppVM create answers the short create response; the
	// table then shows the AppVM read back. -o json is the answer as is.
	rec.answers["POST /api/appvm/vms"] = answer{201, `{"id":"web","mode":"appvm","image_id":"nginx","booted":true}`}
	rec.answers["GET /api/appvm/vms/web"] = answer{200, `{"id":"web","mode":"appvm","state":"running","display_state":"booting","vcpus":2,"memory_mb":512,"appvm":{"ip":"10.0.0.7"}}`}
	body := filepath.Join(t.TempDir(), "web.json")
	os.WriteFile(body, []byte(`{"vm_id":"web","image_id":"nginx","vcpus":2,"memory_mb":512,"disk_gib":1}`), 0o600)
	rec.reqs = nil
	out, errOut, code := runCLI(t, srv.URL, "appvm", "create", "-f", body)
	if code != 0 || !strings.Contains(out, "web  appvm  running  booting        2      512MiB  10.0.0.7") {
		t.Errorf("appvm create = %d\n%s%s", code, out, errOut)
	}
	if got := strings.Join(rec.reqs, "\n"); got != "POST /api/appvm/vms {\"vm_id\":\"web\",\"image_id\":\"nginx\",\"vcpus\":2,\"memory_mb\":512,\"disk_gib\":1}\nGET /api/appvm/vms/web" {
		t.Errorf("appvm create requests:\n%s", got)
	}
	if out, _, code := runCLI(t, srv.URL, "appvm", "create", "-f", body, "-o", "json"); code != 0 || out != `{"id":"web","mode":"appvm","image_id":"nginx","booted":true}`+"\n" {
		t.Errorf("appvm create -o json = %d, %q", code, out)
	}
}

// sseServer serves GET /api/events as the agent does (docs/api.md, Events): id: <seq>,
// data: {...}; a connection resumes after Last-Event-ID. Each connection
// sends the next two events and closes, as a restarting agent would.
type sseServer struct {
	mu      sync.Mutex
	resumes []string // the Last-Event-ID of each connection
}

func (s *sseServer) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path != "/api/events" || r.Header.Get("Authorization") != "Bearer vmh_test" {
		w.WriteHeader(403)
		io.WriteString(w, `{"code":"FORBIDDEN","message":"no"}`)
		return
	}
	last := r.Header.Get("Last-Event-ID")
	s.mu.Lock()
	s.resumes = append(s.resumes, last+"|"+r.URL.Query().Get("vm_id"))
	s.mu.Unlock()
	var after int
	fmt.Sscan(last, &after)
	w.Header().Set("Content-Type", "text/event-stream")
	fmt.Fprint(w, "retry: 10\n\n: keep-alive\n\n")
	for seq := after + 1; seq <= after+2; seq++ {
		fmt.Fprintf(w, "id: %d\r\ndata: {\"seq\":%d,\"time\":\"2026-11-24T07:00:0%dZ\",\"type\":\"state_changed\",\"vm_id\":\"vm1\",\"mode\":\"vm\",\"state\":\"running\",\"display_state\":\"booting\"}\n\n", seq, seq, seq)
	}
	w.(http.Flusher).Flush()
}

// lineWriter signals when n lines were written.
type lineWriter struct {
	mu    sync.Mutex
	buf   bytes.Buffer
	n     int
	done  chan struct{}
	fired bool
}

func (w *lineWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.buf.Write(p)
	if !w.fired && strings.Count(w.buf.String(), "\n") >= w.n {
		w.fired = true
		close(w.done)
	}
	return len(p), nil
}

// TestEventsReconnect: vmhost events prints each event, and when the
// stream ends it reconnects with Last-Event-ID, so no event is lost or
// repeated.
func TestEventsReconnect(t *testing.T) {
	sse := &sseServer{}
	srv := httptest.NewServer(sse)
	defer srv.Close()
	for _, tt := range []struct {
		output string
		lines  int
		check  func(out string) string
	}{
		{"json", 5, func(out string) string {
			for i, l := range strings.Split(strings.TrimSpace(out), "\n") {
				if !strings.HasPrefix(l, fmt.Sprintf(`{"seq":%d,`, i+4)) {
					return fmt.Sprintf("line %d = %q, want seq %d", i, l, i+4)
				}
			}
			return ""
		}},
		{"table", 4, func(out string) string {
			l := strings.Split(out, "\n")
			if !strings.HasPrefix(l[0], "SEQ") || strings.Join(strings.Fields(l[1]), " ") != "4 2026-11-24T07:00:04Z state_changed vm vm1 running booting" {
				return "unexpected table"
			}
			return ""
		}},
	} {
		sse.mu.Lock()
		sse.resumes = nil
		sse.mu.Unlock()
		ctx, cancel := context.WithCancel(context.Background())
		w := &lineWriter{n: tt.lines, done: make(chan struct{})}
		var errb bytes.Buffer
		code := make(chan int, 1)
		env := map[string]string{"VMHOST_API": srv.URL, "VMHOST_TOKEN": "vmh_test"}
		go func() {
			code <- Run(ctx, []string{"events", "--since", "3", "--vm", "vm1", "-o", tt.output}, nil, w, &errb, func(k string) string { return env[k] })
		}()
		select {
		case <-w.done:
		case <-time.After(30 * time.Second):
			t.Fatalf("-o %s: no %d lines of events:\n%s", tt.output, tt.lines, w.buf.String())
		}
		cancel()
		if c := <-code; c != 0 {
			t.Errorf("-o %s: events ended with %d, want 0 when interrupted", tt.output, c)
		}
		w.mu.Lock()
		out := w.buf.String()
		w.mu.Unlock()
		if msg := tt.check(out); msg != "" {
			t.Errorf("-o %s: %s:\n%s", tt.output, msg, out)
		}
		sse.mu.Lock()
		resumes := sse.resumes
		sse.mu.Unlock()
		if len(resumes) < 2 || resumes[0] != "3|vm1" || resumes[1] != "5|vm1" {
			t.Errorf("-o %s: connections resumed after %q, want 3|vm1 then 5|vm1", tt.output, resumes)
		}
	}

	// A refused stream is not retried.
	env := map[string]string{"VMHOST_API": srv.URL, "VMHOST_TOKEN": "vmh_wrong"}
	var out, errb bytes.Buffer
	if c := Run(context.Background(), []string{"events"}, nil, &out, &errb, func(k string) string { return env[k] }); c != 1 || errb.String() != "FORBIDDEN: no\n" {
		t.Errorf("events with a refused key = %d, %q", c, errb.String())
	}
}
