package api

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"vmhost/appvm"
)

// stream is a long answer read as it comes, through a real server.
type stream struct {
	t    *testing.T
	resp *http.Response
	rd   *bufio.Reader
	seen strings.Builder
}

// openStream sends GET path to the harness's API over HTTP and returns
// the answer once its headers are in, checked against the document.
func (h *harness) openStream(t *testing.T, path string) *stream {
	t.Helper()
	srv := httptest.NewServer(h.srv)
	t.Cleanup(srv.Close)
	req, _ := http.NewRequest("GET", srv.URL+path, nil)
	req.Header.Set("Authorization", "Bearer "+h.ro)
	resp, err := srv.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { resp.Body.Close() })
	_, pattern := h.srv.mux.Handler(req)
	if err := parsedOpenAPI(t).ValidateResponse(pattern, resp.StatusCode, resp.Header.Get("Content-Type"), nil); err != nil {
		t.Errorf("OpenAPI: %v", err)
	}
	s := &stream{t: t, resp: resp, rd: bufio.NewReader(resp.Body)}
	t.Cleanup(func() {
		seenMu.Lock()
		seenBodies = append(seenBodies, s.seen.String())
		seenMu.Unlock()
	})
	return s
}

// readUntil reads until what was read ends with suffix.
func (s *stream) readUntil(suffix string) string {
	s.t.Helper()
	done := make(chan error, 1)
	go func() {
		for !strings.HasSuffix(s.seen.String(), suffix) {
			b, err := s.rd.ReadByte()
			if err != nil {
				done <- err
				return
			}
			s.seen.WriteByte(b)
		}
		done <- nil
	}()
	select {
	case err := <-done:
		if err != nil {
			s.t.Fatalf("stream ended (%v) before %q; read %q", err, suffix, s.seen.String())
		}
	case <-time.After(20 * time.Second):
		s.t.Fatalf("no %q in the stream; read %q", suffix, s.seen.String())
	}
	return s.seen.String()
}

// end reads to the end of the answer, which must come.
func (s *stream) end() string {
	s.t.Helper()
	done := make(chan error, 1)
	go func() {
		b, err := io.ReadAll(s.rd)
		s.seen.Write(b)
		done <- err
	}()
	select {
	case err := <-done:
		if err != nil {
			s.t.Fatalf("reading the stream's end: %v", err)
		}
	case <-time.After(20 * time.Second):
		s.t.Fatalf("the stream did not end; read %q", s.seen.String())
	}
	return s.seen.String()
}

func TestWaitRoute(t *testing.T) {
	h := newHarness(t)
	if st, _, b := h.do(t, "POST", "/api/vms", h.rw, minimalVMBody(h, "w1")); st != 201 {
		t.Fatalf("create: %d %s", st, b)
	}
	for _, tc := range []struct {
		path   string
		status int
		has    string
	}{
		{"/api/vms/w1/wait", 400, "for: required"},
		{"/api/vms/w1/wait?for=up", 400, `for: \"up\" is not one of`},
		{"/api/vms/w1/wait?for=running,", 400, `for: \"\"`},
		{"/api/vms/w1/wait?for=running&timeout_secs=0", 400, "timeout_secs"},
		{"/api/vms/w1/wait?for=running&timeout_secs=601", 400, "timeout_secs"},
		{"/api/vms/w1/wait?for=running&timeout_secs=1.5", 400, "timeout_secs"},
		{"/api/vms/nope/wait?for=running", 404, "NOT_FOUND"},
		{"/api/appvm/vms/w1/wait?for=running", 404, "no AppVM has this id"},
		{"/api/vms/w1/wait?for=stopped,created", 200, `"display_state":"created"`},
		{"/api/vms/nope/wait?for=deleted", 204, ""},
		{"/api/vms/w1/wait?for=paused&timeout_secs=1", 408, `"code":"TIMEOUT"`},
	} {
		st, _, b := h.do(t, "GET", tc.path, h.ro, "")
		if st != tc.status || !strings.Contains(b, tc.has) {
			t.Errorf("GET %s = %d %s, want %d with %q", tc.path, st, b, tc.status, tc.has)
		}
	}
	// Waiting holds no lock: the start goes through while two requests
	// wait, and answers them.
	running := make(chan string, 1)
	go func() {
		st, _, b := h.do(t, "GET", "/api/vms/w1/wait?for=booting,running", h.ro, "")
		running <- fmt.Sprint(st, " ", b)
	}()
	deleted := make(chan string, 1)
	go func() {
		st, _, b := h.do(t, "GET", "/api/vms/w1/wait?for=deleted&timeout_secs=30", h.ro, "")
		deleted <- fmt.Sprint(st, " ", b)
	}()
	if st, _, b := h.do(t, "POST", "/api/vms/w1/start", h.rw, ""); st != 204 {
		t.Fatalf("start: %d %s", st, b)
	}
	if got := <-running; !strings.HasPrefix(got, "200 ") || !strings.Contains(got, `"state":"running"`) {
		t.Errorf("wait for running = %s", got)
	}
	if st, _, b := h.do(t, "DELETE", "/api/vms/w1?force=true", h.rw, ""); st != 204 {
		t.Fatalf("delete: %d %s", st, b)
	}
	if got := <-deleted; got != "204 " {
		t.Errorf("wait for deleted = %q", got)
	}
}

// TestWaitEndsAtShutdown: CloseStreams answers a pending wait at once
// (408, ask again) instead of holding the server's shutdown.
func TestWaitEndsAtShutdown(t *testing.T) {
	h := newHarness(t)
	h.do(t, "POST", "/api/vms", h.rw, minimalVMBody(h, "w2"))
	got := make(chan string, 1)
	go func() {
		st, _, b := h.do(t, "GET", "/api/vms/w2/wait?for=paused&timeout_secs=600", h.ro, "")
		got <- fmt.Sprint(st, " ", b)
	}()
	time.Sleep(50 * time.Millisecond) // the wait is (most likely) pending; either way it must end
	h.srv.CloseStreams()
	select {
	case g := <-got:
		if !strings.HasPrefix(g, "408 ") || !strings.Contains(g, "shutting down") {
			t.Errorf("wait at shutdown = %s", g)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("CloseStreams did not end the wait")
	}
}

func TestConsoleRoute(t *testing.T) {
	h := newHarness(t)
	body := fmt.Sprintf(`{"vm_id":"c1","vcpus":1,"memory_mb":512,"kernel_path":%q,"disk":{"base_path":%q},"cloud_init":{"password":%q}}`,
		h.e.Kernel, h.e.Base, plantedPassword)
	if st, _, b := h.do(t, "POST", "/api/vms", h.rw, body); st != 201 {
		t.Fatalf("create: %d %s", st, b)
	}
	for _, tc := range []struct {
		path   string
		status int
		want   string
	}{
		{"/api/vms/c1/console", 200, ""}, // never started: nothing kept
		{"/api/vms/c1/console?tail_bytes=-1", 400, "tail_bytes"},
		{"/api/vms/c1/console?tail_bytes=16777217", 400, "tail_bytes"},
		{"/api/vms/c1/console?follow=yes", 400, "follow"},
		{"/api/appvm/vms/c1/console", 404, "NOT_FOUND"},
	} {
		st, hdr, b := h.do(t, "GET", tc.path, h.ro, "")
		if st != tc.status || !strings.Contains(b, tc.want) || (st == 200 && (b != "" || hdr.Get("Content-Type") != "text/plain")) {
			t.Errorf("GET %s = %d %q %q", tc.path, st, hdr.Get("Content-Type"), b)
		}
	}
	// A log of two generations, kept before redaction existed: the
	// password is replaced on the way out.
	log := h.vms.Layout().ConsoleLog("c1")
	os.MkdirAll(filepath.Dir(log), 0o700)
	os.WriteFile(log+".1", []byte("boot 1\nlogin: "+plantedPassword[:6]), 0o600)
	os.WriteFile(log, []byte(plantedPassword[6:]+"\nboot 2\n"), 0o600)
	if _, _, b := h.do(t, "GET", "/api/vms/c1/console", h.ro, ""); b != "boot 1\nlogin: [redacted]\nboot 2\n" {
		t.Errorf("console = %q", b)
	}
	if _, _, b := h.do(t, "GET", "/api/vms/c1/console?tail_bytes=8", h.ro, ""); b != "\nboot 2\n" {
		t.Errorf("tail_bytes=8: %q", b)
	}
	// A tail that starts inside the secret starts with its replacement,
	// never with the secret's end.
	for _, n := range []int{9, 12, 20} {
		if _, _, b := h.do(t, "GET", fmt.Sprintf("/api/vms/c1/console?tail_bytes=%d", n), h.ro, ""); b != "[redacted]\nboot 2\n" {
			t.Errorf("tail_bytes=%d: %q", n, b)
		}
	}
	// Follow: what comes next, across a rotation, until the VM is
	// deleted.
	s := h.openStream(t, "/api/vms/c1/console?follow=true&tail_bytes=7")
	s.readUntil("boot 2\n")
	appendFile(t, log, "more output\n")
	s.readUntil("more output\n")
	os.Rename(log, log+".1")
	os.WriteFile(log, []byte("after the rotation\n"), 0o600)
	s.readUntil("after the rotation\n")
	if st, _, b := h.do(t, "DELETE", "/api/vms/c1?force=true", h.rw, ""); st != 204 {
		t.Fatalf("delete: %d %s", st, b)
	}
	if got := s.end(); got != "boot 2\nmore output\nafter the rotation\n" {
		t.Errorf("followed %q", got)
	}
}

func appendFile(t *testing.T, path, s string) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_APPEND|os.O_WRONLY|os.O_CREATE, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteString(s); err != nil {
		t.Fatal(err)
	}
}

// logLineJSON is a stored workload log line as the writer makes it.
func logLineJSON(seq int, stream, data string) string {
	b, _ := json.Marshal(struct {
		Seq    int       `json:"seq"`
		Time   time.Time `json:"time"`
		Stream string    `json:"stream"`
		Data   string    `json:"data"`
		Boot   string    `json:"boot"`
		GOut   int       `json:"gout"`
	}{seq, time.Date(2026, 1, 2, 3, 4, seq, 0, time.UTC), stream, data, "b", seq})
	return string(b) + "\n"
}

func TestWorkloadLogsRoute(t *testing.T) {
	h := newHarness(t)
	if st, _, b := h.do(t, "POST", "/api/appvm/vms", h.rw, `{"vm_id":"l1","image_id":"plain","vcpus":1,"memory_mb":64,"disk_gib":1,"auto_boot":false}`); st != 201 {
		t.Fatalf("create: %d %s", st, b)
	}
	path := appvm.WorkloadLog(h.vms.Layout(), "l1")
	var lines string
	for i := 1; i <= 5; i++ {
		stream := "stdout"
		if i%2 == 0 {
			stream = "stderr"
		}
		lines += logLineJSON(i, stream, fmt.Sprintf("line %d\n", i))
	}
	os.MkdirAll(filepath.Dir(path), 0o700)
	os.WriteFile(path, []byte(lines), 0o600)
	chunk := func(seq int, stream string) string {
		return fmt.Sprintf(`{"seq":%d,"time":"2026-01-02T03:04:%02dZ","stream":%q,"data":"line %d\n"}`+"\n", seq, seq, stream, seq)
	}
	all := chunk(1, "stdout") + chunk(2, "stderr") + chunk(3, "stdout") + chunk(4, "stderr") + chunk(5, "stdout")
	for _, tc := range []struct {
		query string
		want  string
	}{
		{"", all},
		{"?tail=2", chunk(4, "stderr") + chunk(5, "stdout")},
		{"?tail=0", ""},
		{"?stream=stderr", chunk(2, "stderr") + chunk(4, "stderr")},
		{"?since_seq=3", chunk(4, "stderr") + chunk(5, "stdout")},
		{"?since_seq=3&stream=stdout", chunk(5, "stdout")},
		{"?since_seq=0&tail=1", all}, // since_seq wins
		{"?since_seq=9", ""},
	} {
		st, hdr, b := h.do(t, "GET", "/api/appvm/vms/l1/logs"+tc.query, h.ro, "")
		if st != 200 || hdr.Get("Content-Type") != "application/x-ndjson" || b != tc.want {
			t.Errorf("logs%s = %d %q:\n%s\nwant:\n%s", tc.query, st, hdr.Get("Content-Type"), b, tc.want)
		}
	}
	for _, q := range []string{"?tail=10001", "?tail=-1", "?since_seq=-1", "?since_seq=x", "?stream=both", "?follow=1"} {
		if st, _, b := h.do(t, "GET", "/api/appvm/vms/l1/logs"+q, h.ro, ""); st != 400 || !strings.Contains(b, "BAD_REQUEST") {
			t.Errorf("logs%s = %d %s, want 400", q, st, b)
		}
	}
	if st, _, _ := h.do(t, "GET", "/api/appvm/vms/nope/logs", h.ro, ""); st != 404 {
		t.Errorf("unknown AppVM: %d", st)
	}
	// Follow from seq 4 on: the chunks stored next, until the delete.
	s := h.openStream(t, "/api/appvm/vms/l1/logs?follow=true&since_seq=4")
	s.readUntil(chunk(5, "stdout"))
	appendFile(t, path, logLineJSON(6, "stderr", "line 6\n"))
	s.readUntil(chunk(6, "stderr"))
	if st, _, b := h.do(t, "DELETE", "/api/appvm/vms/l1?force=true", h.rw, ""); st != 204 {
		t.Fatalf("delete: %d %s", st, b)
	}
	if got := s.end(); got != chunk(5, "stdout")+chunk(6, "stderr") {
		t.Errorf("followed %q", got)
	}
}

// TestWorkloadLogsMigratesAndRedacts: an AppVM's log of the format before
// (raw output, with a secret file's content the old writer kept) is
// served as chunks with the secret replaced.
func TestWorkloadLogsMigratesAndRedacts(t *testing.T) {
	h := newHarness(t)
	body := `{"vm_id":"l2","image_id":"plain","vcpus":1,"memory_mb":64,"disk_gib":1,"auto_boot":false,` +
		`"secret_files":[{"path":"/run/key","content":"` + plantedFile + `"}]}`
	if st, _, b := h.do(t, "POST", "/api/appvm/vms", h.rw, body); st != 201 {
		t.Fatalf("create: %d %s", st, b)
	}
	dir := filepath.Dir(appvm.WorkloadLog(h.vms.Layout(), "l2"))
	os.MkdirAll(dir, 0o700)
	os.WriteFile(filepath.Join(dir, "workload.log"), []byte("the key is "+plantedFile+"\nbye\n"), 0o600)
	_, _, b := h.do(t, "GET", "/api/appvm/vms/l2/logs", h.ro, "")
	var got []string
	for _, l := range strings.SplitAfter(b, "\n") {
		var c appvm.LogChunk
		if l != "" && json.Unmarshal([]byte(l), &c) == nil {
			got = append(got, fmt.Sprintf("%d %s %q", c.Seq, c.Stream, c.Data))
		}
	}
	if want := `1 stdout "the key is [redacted]\n"|2 stdout "bye\n"`; strings.Join(got, "|") != want {
		t.Errorf("migrated log = %s, want %s", strings.Join(got, "|"), want)
	}
}
