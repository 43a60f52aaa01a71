package api

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
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
	"sync/atomic"
	"testing"
	"time"

	"vmhost/appvm"
	"vmhost/appvm/guest"
	"vmhost/audit"
	"vmhost/auth"
	"vmhost/disk"
	"vmhost/events"
	"vmhost/openapi"
	"vmhost/qcow2"
	"vmhost/registry"
	"vmhost/vm"
	"vmhost/vm/vmtest"
)

// fixtureDigest is the registry image and cache entry every harness has.
const fixtureDigest = "5c9a844d6cca04221c6739eb746bad3b2091f4d5f9a7c9a063f72a688875296d"

var update = flag.Bool("update", false, "rewrite the golden files in ../testdata/api")

// Planted secrets: every test that sends a password or a secret env value
// uses these, and TestMain checks that no response body and no log line
// of the whole suite contains them.
const (
	plantedPassword = "PLANTED-pw-4711"
	plantedSecret   = "PLANTED-secret-0815"
	plantedFile     = "PLANTED-file-2342"
)

var (
	seenMu     sync.Mutex
	seenBodies []string
	logBuf     lockedBuffer
)

type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

func TestMain(m *testing.M) {
	// The guest operation tests run real guest agents: this binary as
	// `guest` (process mode).
	if len(os.Args) > 1 && os.Args[1] == "guest" {
		os.Exit(guest.Main(os.Args[2:]))
	}
	flag.Parse()
	code := m.Run()
	seenMu.Lock()
	n := len(seenBodies)
	leaks := 0
	for _, b := range append(seenBodies, logBuf.String()) {
		for _, s := range []string{plantedPassword, plantedSecret, plantedFile} {
			if strings.Contains(b, s) {
				fmt.Fprintf(os.Stderr, "FAIL: planted secret %q appears in a response body or log:\n%s\n", s, b)
				leaks++
			}
		}
	}
	seenMu.Unlock()
	if leaks > 0 {
		code = 1
	} else if code == 0 && testing.Verbose() {
		fmt.Printf("secret grep: %d response bodies and the log checked, no planted secret found\n", n)
		fmt.Printf("openapi: %d responses validated against the document\n", validated.Load())
	}
	os.Exit(code)
}

// harness is an API over a vmtest.Env with three keys: rw (readwrite), ro
// (read) and narrow (readwrite, allowlist GET /api/vms/{id} only).
type harness struct {
	e        *vmtest.Env
	cache    *disk.Cache
	registry *registry.Registry
	vms      *vm.Service
	apps     *appvm.Service
	guests   *appvm.Guests
	// dialer reaches the guest agents tests start (startGuest).
	dialer   *socketDialer
	srv      *Server
	events   *events.Log
	audit    *audit.Log
	keysPath string
	rw       string
	ro       string
	narrow   string
	// features are the wiring's features the API lists (Config.Features).
	features []Feature
}

// testAgentID is the agent id every harness's API reports.
const testAgentID = "0123456789abcdef"

func newHarness(t testing.TB) *harness {
	t.Helper()
	h := &harness{e: vmtest.NewEnv(t)}
	h.e.Logger = slog.New(slog.NewTextHandler(&logBuf, nil))
	h.keysPath = filepath.Join(h.e.StateDir, "keys.json")
	if err := os.MkdirAll(h.e.StateDir, 0o700); err != nil {
		t.Fatal(err)
	}
	var err error
	if h.rw, err = auth.Add(h.keysPath, "rw", auth.ScopeReadWrite, nil); err != nil {
		t.Fatal(err)
	}
	if h.ro, err = auth.Add(h.keysPath, "ro", auth.ScopeRead, nil); err != nil {
		t.Fatal(err)
	}
	if h.narrow, err = auth.Add(h.keysPath, "narrow", auth.ScopeReadWrite, []string{"GET /api/vms/{id}"}); err != nil {
		t.Fatal(err)
	}
	h.start(t)
	for _, im := range []*appvm.Image{
		{ID: "web", Status: appvm.StatusReady, CreatedAt: h.e.Now, Workload: vm.Workload{
			BuildDigest: "sha256:1a2b3c4d", SizeBytes: 1 << 30,
			Entrypoint: []string{"/entry.sh"}, Cmd: []string{"serve", "--port", "80"},
			Env: []string{"PATH=/usr/bin:/bin", "MODE=prod"}, Workdir: "/srv", User: "www",
			Healthcheck: &vm.Healthcheck{Test: []string{"CMD", "true"}, IntervalSecs: 30, TimeoutSecs: 5, StartPeriodSecs: 10, Retries: 3},
		}},
		{ID: "plain", Status: appvm.StatusReady, CreatedAt: h.e.Now, Workload: vm.Workload{SizeBytes: 512 << 20, Cmd: []string{"/app"}, Workdir: "/"}},
		{ID: "pending", Status: appvm.StatusImporting, CreatedAt: h.e.Now},
	} {
		if err := h.apps.Catalog().Put(im); err != nil {
			t.Fatal(err)
		}
		if im.Status == appvm.StatusReady {
			if err := qcow2.Create(h.apps.Catalog().RootFS(im), im.SizeBytes); err != nil {
				t.Fatal(err)
			}
		}
	}
	return h
}

// start (re)opens the services and the API on the env's state dir, as an
// agent start does.
func (h *harness) start(t testing.TB) {
	t.Helper()
	keys, err := auth.Open(h.keysPath)
	if err != nil {
		t.Fatal(err)
	}
	h.openLogs(t)
	h.vms = h.e.Service(t)
	if h.dialer == nil {
		h.dialer = &socketDialer{prefix: map[string]string{}}
	}
	h.apps, h.guests = newApps(h.e, h.vms, h.dialer)
	t.Cleanup(h.apps.Wait) // background redeploys end before the test's files go
	if h.cache, err = disk.NewCache(filepath.Join(h.e.StateDir, "images"), disk.CacheOptions{}); err != nil {
		t.Fatal(err)
	}
	// One registry image, and its content in the cache (as a download
	// leaves it): the catalog routes have something to show.
	index := filepath.Join(h.e.StateDir, "registry-index.json")
	os.WriteFile(index, []byte(`{"images": [{"image_id": "debian-12", "distro": "debian", "version": "12", "arch": "amd64", "content_sha256": "`+
		fixtureDigest+`", "fetch_url": "https://images.example/debian-12.qcow2", "size_bytes": 5}]}`), 0o600)
	os.WriteFile(h.cache.Path(fixtureDigest), []byte("qcow2"), 0o600)
	h.registry = registry.New([]string{index}, nil, nil)
	if err := h.registry.Refresh(context.Background()); err != nil {
		t.Fatal(err)
	}
	h.srv = New(Config{Keys: keys, VMs: h.vms, AppVMs: h.apps, Logger: slog.New(slog.NewTextHandler(&logBuf, nil)),
		ImageCache: h.cache, Registry: h.registry, PCIIDs: []string{}, Events: h.events, Audit: h.audit,
		AgentID: testAgentID, Version: "test-1", Features: h.features})
}

// newApps is the AppVM service over vms and e's records, with the host
// end of its guest agents, e's fake host for redeploys and d for the
// guest agents' operation connections.
func newApps(e *vmtest.Env, vms *vm.Service, d appvm.GuestDialer) (*appvm.Service, *appvm.Guests) {
	guests := appvm.NewGuests(appvm.GuestOptions{Records: e.Records, Config: e.Config, Layout: vms.Layout(),
		Now: func() time.Time { return e.Now }, Logger: e.Logger, Events: e.Events})
	return appvm.New(appvm.Config{VMs: vms, Records: e.Records, Guests: guests, RootDisks: e.Host, Dialer: d}), guests
}

// socketDialer stands in for the engine's hybrid vsock dial: AppVM id's
// guest port P is the unix socket <prefix[id]>_P, where a process-mode
// guest agent (--listen unix:<prefix>) takes operation connections.
type socketDialer struct {
	mu     sync.Mutex
	prefix map[string]string
}

func (d *socketDialer) DialGuest(ctx context.Context, id string, port uint32) (net.Conn, error) {
	d.mu.Lock()
	p, ok := d.prefix[id]
	d.mu.Unlock()
	if !ok {
		return nil, fmt.Errorf("no guest agent started for %s", id)
	}
	var nd net.Dialer
	return nd.DialContext(ctx, "unix", fmt.Sprintf("%s_%d", p, port))
}

// openLogs (re)opens the event log and the audit log in the state dir, as
// an agent start does; at the test's end their content joins the secret
// grep.
func (h *harness) openLogs(t testing.TB) {
	t.Helper()
	h.closeLogs()
	var err error
	if h.events, err = events.Open(filepath.Join(h.e.StateDir, "events"), events.Options{}); err != nil {
		t.Fatal(err)
	}
	if h.audit, err = audit.Open(filepath.Join(h.e.StateDir, "audit.log"), 1<<20); err != nil {
		t.Fatal(err)
	}
	h.e.Events = h.events
	t.Cleanup(func() {
		h.closeLogs()
		for _, f := range []string{"events/events.jsonl", "events/events.1.jsonl", "audit.log"} {
			if b, err := os.ReadFile(filepath.Join(h.e.StateDir, f)); err == nil {
				seenMu.Lock()
				seenBodies = append(seenBodies, string(b))
				seenMu.Unlock()
			}
		}
	})
}

func (h *harness) closeLogs() {
	if h.events != nil {
		h.events.Close()
		h.audit.Close()
		h.events, h.audit = nil, nil
	}
}

// do sends a request with token (none when empty) and returns status,
// headers and body. Every body is kept for the secret grep.
func (h *harness) do(t testing.TB, method, path, token, body string) (int, http.Header, string) {
	t.Helper()
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	req := httptest.NewRequest(method, path, rd)
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	w := httptest.NewRecorder()
	h.srv.ServeHTTP(w, req)
	h.validate(t, req, w)
	seenMu.Lock()
	seenBodies = append(seenBodies, w.Body.String())
	seenMu.Unlock()
	return w.Code, w.Header(), w.Body.String()
}

// validate checks a response against the OpenAPI document: its status for
// the route, its content type, and a JSON body's every field. Requests
// that match no route (404, 405) have no document entry and are checked
// as the error envelope only.
func (h *harness) validate(t testing.TB, req *http.Request, w *httptest.ResponseRecorder) {
	t.Helper()
	_, pattern := h.srv.mux.Handler(req)
	if pattern == "/" || pattern == "" {
		var e errorBody
		if err := json.Unmarshal(w.Body.Bytes(), &e); err != nil || e.Code == "" || e.Message == "" {
			t.Errorf("%s %s: an unrouted request's answer is not the error envelope: %d %s", req.Method, req.URL.Path, w.Code, w.Body)
		}
		return
	}
	if err := parsedOpenAPI(t).ValidateResponse(pattern, w.Code, w.Header().Get("Content-Type"), w.Body.Bytes()); err != nil {
		t.Errorf("OpenAPI: %v\nbody: %.2000s", err, w.Body)
	}
	validated.Add(1)
}

var (
	docOnce   sync.Once
	parsedDoc *openapi.Doc
	validated atomic.Int64
)

func parsedOpenAPI(t testing.TB) *openapi.Doc {
	t.Helper()
	docOnce.Do(func() {
		data, err := OpenAPI()
		if err != nil {
			panic(err)
		}
		if parsedDoc, err = openapi.Parse(data); err != nil {
			panic(err)
		}
	})
	return parsedDoc
}

// sanitize replaces the env's temp root with a fixed path, so goldens do
// not depend on where the test ran.
func (h *harness) sanitize(s string) string {
	return strings.ReplaceAll(s, filepath.Dir(h.e.StateDir), "/TEST")
}

// golden compares got with testdata/api/name, or rewrites it with -update.
func golden(t *testing.T, name, got string) {
	t.Helper()
	path := filepath.Join("..", "testdata", "api", name)
	if *update {
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, []byte(got), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("reading golden (run with -update to create it): %v", err)
	}
	if got != string(want) {
		t.Errorf("%s differs from the golden file; got:\n%s\nwant:\n%s", name, got, want)
	}
}
