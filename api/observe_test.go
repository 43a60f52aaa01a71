package api

import (
	"bufio"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"vmhost/audit"
	"vmhost/metrics/metricstest"
)

// TestEventStream: GET /api/events streams a create's events as they are
// stored, resumes after ?since=, filters by ?vm_id=, refuses a bad resume
// point or VM id with 400, and ends when the server closes its streams.
func TestEventStream(t *testing.T) {
	h := newHarness(t)
	ts := httptest.NewServer(h.srv)
	defer ts.Close()
	for _, q := range []string{"?since=x", "?since=-1", "?vm_id=../x"} {
		if st, _, b := h.do(t, "GET", "/api/events"+q, h.ro, ""); st != 400 || !strings.Contains(b, CodeBadRequest) {
			t.Errorf("GET /api/events%s = %d %s, want 400", q, st, b)
		}
	}
	open := func(query string) (*bufio.Scanner, func()) {
		req, _ := http.NewRequest("GET", ts.URL+"/api/events"+query, nil)
		req.Header.Set("Authorization", "Bearer "+h.ro)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		if resp.StatusCode != 200 || resp.Header.Get("Content-Type") != "text/event-stream" {
			t.Fatalf("GET /api/events%s = %d %s", query, resp.StatusCode, resp.Header.Get("Content-Type"))
		}
		return bufio.NewScanner(resp.Body), func() { resp.Body.Close() }
	}
	type ev struct {
		Seq          uint64 `json:"seq"`
		Type         string `json:"type"`
		VMID         string `json:"vm_id"`
		DisplayState string `json:"display_state"`
	}
	next := func(sc *bufio.Scanner) (id string, e ev) {
		t.Helper()
		for sc.Scan() {
			line := sc.Text()
			if v, ok := strings.CutPrefix(line, "id: "); ok {
				id = v
			}
			if v, ok := strings.CutPrefix(line, "data: "); ok {
				if err := json.Unmarshal([]byte(v), &e); err != nil {
					t.Fatal(err)
				}
				return id, e
			}
		}
		t.Fatalf("stream ended: %v", sc.Err())
		return
	}
	all, closeAll := open("")
	defer closeAll()
	onlyB, closeB := open("?vm_id=b")
	defer closeB()
	for _, id := range []string{"a", "b"} {
		if st, _, b := h.do(t, "POST", "/api/vms", h.rw, minimalVMBody(h, id)); st != 201 {
			t.Fatalf("create %s: %d %s", id, st, b)
		}
	}
	var seqs []uint64
	for _, want := range []string{"created a", "display_state_changed a", "created b", "display_state_changed b"} {
		id, e := next(all)
		if e.Type+" "+e.VMID != want || id != strconv.FormatUint(e.Seq, 10) {
			t.Fatalf("event %s (id %s), want %s", e.Type+" "+e.VMID, id, want)
		}
		seqs = append(seqs, e.Seq)
	}
	if _, e := next(onlyB); e.Type != "created" || e.VMID != "b" || e.Seq != seqs[2] {
		t.Fatalf("filtered stream's first event %+v, want created b (seq %d)", e, seqs[2])
	}
	resumed, closeR := open("?since=" + strconv.FormatUint(seqs[1], 10))
	defer closeR()
	if _, e := next(resumed); e.Seq != seqs[2] {
		t.Fatalf("resumed after %d: first event %+v", seqs[1], e)
	}
	h.srv.CloseStreams()
	done := make(chan bool)
	go func() {
		for all.Scan() {
		}
		done <- true
	}()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("CloseStreams did not end an open stream")
	}
}

// TestAuditLog: every request to a mutating route is one line of the audit
// log, successful or not, refused (403) or unauthenticated (401) ones
// included, naming the key but never its token; reads are not audited.
func TestAuditLog(t *testing.T) {
	h := newHarness(t)
	h.do(t, "GET", "/api/vms", h.rw, "")
	h.do(t, "POST", "/api/vms", h.rw, minimalVMBody(h, "aud"))
	h.do(t, "POST", "/api/vms", h.rw, `{"vm_id":"bad","vcpus":0,"memory_mb":512}`)
	h.do(t, "DELETE", "/api/vms/aud", h.ro, "")
	h.do(t, "POST", "/api/vms/aud/start", "", "")
	h.do(t, "DELETE", "/api/appvm/images/spare", h.rw, "")
	h.closeLogs()
	data, err := os.ReadFile(filepath.Join(h.e.StateDir, "audit.log"))
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, line := range strings.Split(strings.TrimSpace(string(data)), "\n") {
		var e audit.Entry
		if err := json.Unmarshal([]byte(line), &e); err != nil {
			t.Fatalf("audit line %q: %v", line, err)
		}
		if e.Time.IsZero() || e.DurationMS < 0 || e.Remote == "" || e.Path == "" {
			t.Errorf("incomplete entry %s", line)
		}
		got = append(got, strings.Join([]string{e.Method, e.Route, e.VMID, e.ImageID, e.Key, strconv.Itoa(e.Status)}, "|"))
	}
	want := []string{
		"POST|POST /api/vms|aud||rw|201",
		"POST|POST /api/vms|bad||rw|400",
		"DELETE|DELETE /api/vms/{id}|aud||ro|403",
		"POST|POST /api/vms/{id}/start|aud|||401",
		"DELETE|DELETE /api/appvm/images/{id}||spare|rw|404",
	}
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Errorf("audit log:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
	for _, tok := range []string{h.rw, h.ro} {
		if strings.Contains(string(data), strings.TrimPrefix(tok, "vmh_")) {
			t.Error("the audit log holds a token")
		}
	}
	if fi, err := os.Stat(filepath.Join(h.e.StateDir, "audit.log")); err != nil || fi.Mode().Perm() != 0o600 {
		t.Errorf("audit.log mode: %v %v", fi, err)
	}
}

// TestMetricsExposition: /metrics shows each VM's state, the host's VMs by
// state and admission figures, counts a running VM whose counters cannot
// be read as a scrape error (the fake host runs no VMM), and passes
// promtool check metrics.
func TestMetricsExposition(t *testing.T) {
	h := newHarness(t)
	for _, id := range []string{"m1", "m2"} {
		if st, _, b := h.do(t, "POST", "/api/vms", h.rw, minimalVMBody(h, id)); st != 201 {
			t.Fatalf("create: %d %s", st, b)
		}
	}
	if st, _, b := h.do(t, "POST", "/api/vms/m2/start", h.rw, ""); st != 204 {
		t.Fatalf("start: %d %s", st, b)
	}
	st, hdr, body := h.do(t, "GET", "/metrics", h.ro, "")
	if st != 200 || hdr.Get("Content-Type") != "text/plain; version=0.0.4; charset=utf-8" {
		t.Fatalf("GET /metrics = %d %q", st, hdr.Get("Content-Type"))
	}
	for _, want := range []string{
		`vmhost_vm_state{vm_id="m1",mode="vm",state="created"} 1`,
		`vmhost_vm_state{vm_id="m2",mode="vm",state="running"} 1`,
		`vmhost_vms{mode="vm",state="running"} 1`,
		`vmhost_vms{mode="vm",state="created"} 1`,
		`vmhost_vms{mode="appvm",state="running"} 0`,
		"vmhost_admission_vcpus 64\n",
		"vmhost_admission_vcpus_used 2\n",
		"vmhost_admission_memory_used_bytes 1.073741824e+09\n",
		"vmhost_scrape_errors_total 1\n",
		"vmhost_image_cache_images 1\n",
		"# TYPE vmhost_vm_block_read_bytes_total counter\n",
		"process_resident_memory_bytes ",
	} {
		if !strings.Contains(body, want) {
			t.Errorf("no %q in\n%s", want, body)
		}
	}
	if _, _, body = h.do(t, "GET", "/metrics", h.ro, ""); !strings.Contains(body, "vmhost_scrape_errors_total 2\n") {
		t.Error("vmhost_scrape_errors_total does not count across scrapes")
	}
	metricstest.Check(t, []byte(body))
}
