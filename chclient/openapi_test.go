package chclient_test

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"

	"vmhost/chclient"
	"vmhost/chclient/openapitest"
)

// openAPIPath is CH's v53 OpenAPI document as JSON, beside the checkout (shared/ref).
const openAPIPath = openapitest.DefaultPath

type wireRequest struct {
	method, path string
	body         []byte
}

// recordingClient returns a client whose requests go to an in-memory server that records
// them and answers each with a plausible success.
func recordingClient(t *testing.T) (*chclient.Client, func() []wireRequest) {
	var mu sync.Mutex
	var reqs []wireRequest
	c := chclient.New("/nonexistent")
	c.Dial = func(ctx context.Context) (net.Conn, error) {
		client, server := net.Pipe()
		go func() {
			defer server.Close()
			br := bufio.NewReader(server)
			for {
				req, err := http.ReadRequest(br)
				if err != nil {
					return
				}
				body, _ := io.ReadAll(req.Body)
				path := strings.TrimPrefix(req.URL.Path, "/api/v1/")
				mu.Lock()
				reqs = append(reqs, wireRequest{req.Method, path, body})
				mu.Unlock()
				answer := "HTTP/1.1 204 No Content\r\n\r\n"
				switch path {
				case "vmm.ping":
					answer = jsonAnswer(`{"build_version":"v53.0","version":"53.0.0","pid":1,"features":[]}`)
				case "vm.info":
					answer = jsonAnswer(`{"config":{},"state":"Running"}`)
				case "vm.counters":
					answer = jsonAnswer(`{}`)
				case "vmm.shutdown":
					answer = "HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
				}
				io.WriteString(server, answer)
			}
		}()
		return client, nil
	}
	return c, func() []wireRequest {
		mu.Lock()
		defer mu.Unlock()
		return slices.Clone(reqs)
	}
}

func jsonAnswer(body string) string {
	return fmt.Sprintf("HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
}

// TestRequestBodiesMatchOpenAPI sends every request chclient can make, with every config
// field set, and validates each body on the wire against CH's OpenAPI document.
func TestRequestBodiesMatchOpenAPI(t *testing.T) {
	doc, v := openapitest.Load(t, openAPIPath)
	c, recorded := recordingClient(t)
	ctx := ctxT(t)
	f := newFixture(t)
	full := fullConfig(f)
	yes := true
	firmware := fullConfig(f)
	firmware.Payload = &chclient.PayloadConfig{Firmware: "/usr/share/cloud-hypervisor/hypervisor-fw"}
	firmware.Cpus.Nested = &yes
	zero := uint64(0)
	balloon := uint64(128 << 20)

	steps := []struct {
		name string
		call func() error
	}{
		{"ping", func() error { _, err := c.Ping(ctx); return err }},
		{"create full", func() error { return c.CreateVM(ctx, full) }},
		{"create firmware", func() error { return c.CreateVM(ctx, firmware) }},
		{"create minimal", func() error {
			return c.CreateVM(ctx, &chclient.VmConfig{Payload: &chclient.PayloadConfig{Kernel: "/k"}})
		}},
		{"boot", func() error { return c.BootVM(ctx) }},
		{"info", func() error { _, err := c.VMInfo(ctx); return err }},
		{"shutdown", func() error { return c.ShutdownVM(ctx) }},
		{"power-button", func() error { return c.PowerButton(ctx) }},
		{"reboot", func() error { return c.RebootVM(ctx) }},
		{"pause", func() error { return c.PauseVM(ctx) }},
		{"resume", func() error { return c.ResumeVM(ctx) }},
		{"delete", func() error { return c.DeleteVM(ctx) }},
		{"add-disk vhost-user", func() error { _, err := c.AddDisk(ctx, &full.Disks[0]); return err }},
		{"add-disk raw", func() error { _, err := c.AddDisk(ctx, &full.Disks[1]); return err }},
		{"remove-device", func() error { return c.RemoveDevice(ctx, "_disk1") }},
		{"resize all", func() error {
			return c.Resize(ctx, &chclient.VmResize{DesiredVcpus: 4, DesiredRam: 2 << 30, DesiredBalloon: &balloon})
		}},
		{"resize balloon to zero", func() error { return c.Resize(ctx, &chclient.VmResize{DesiredBalloon: &zero}) }},
		{"counters", func() error { _, err := c.Counters(ctx); return err }},
		{"snapshot", func() error { return c.Snapshot(ctx, "file:///var/lib/vmhost/vms/x/suspend") }},
		{"restore minimal", func() error {
			return c.Restore(ctx, &chclient.RestoreConfig{SourceURL: "file:///var/lib/vmhost/vms/x/suspend"})
		}},
		{"restore full", func() error {
			return c.Restore(ctx, &chclient.RestoreConfig{SourceURL: "file:///s", Prefault: true,
				MemoryRestoreMode: chclient.MemoryRestoreCopy, Resume: true})
		}},
		{"restore on demand", func() error {
			return c.Restore(ctx, &chclient.RestoreConfig{SourceURL: "file:///s", MemoryRestoreMode: chclient.MemoryRestoreOnDemand})
		}},
		{"vmm.shutdown", func() error { return c.ShutdownVMM(ctx) }},
	}
	for _, s := range steps {
		if err := s.call(); err != nil {
			t.Fatalf("%s: %v", s.name, err)
		}
	}
	reqs := recorded()
	if len(reqs) != len(steps) {
		t.Fatalf("recorded %d requests for %d calls", len(reqs), len(steps))
	}
	for i, r := range reqs {
		schema, hasBody := doc.RequestSchema(t, r.method, r.path)
		if !hasBody {
			if len(r.body) != 0 {
				t.Errorf("%s: %s %s carries a body %q; CH answers 400", steps[i].name, r.method, r.path, r.body)
			}
			continue
		}
		dec := json.NewDecoder(strings.NewReader(string(r.body)))
		dec.UseNumber()
		var val any
		if err := dec.Decode(&val); err != nil {
			t.Fatalf("%s: body %q: %v", steps[i].name, r.body, err)
		}
		for _, e := range v.Validate(r.path, schema, val) {
			t.Errorf("%s: %s", steps[i].name, e)
		}
	}
	// Sanity: the full config really reaches the nested schemas.
	if !strings.Contains(string(reqs[1].body), `"rate_limiter_config":{"bandwidth"`) || !strings.Contains(string(reqs[1].body), `"nested":false`) {
		t.Errorf("full config body lacks nested fields: %s", reqs[1].body)
	}
}

// TestValidatorCatchesMistakes proves the validator fails on what it must catch.
func TestValidatorCatchesMistakes(t *testing.T) {
	doc, v := openapitest.Load(t, openAPIPath)
	schema, _ := doc.RequestSchema(t, "PUT", "vm.create")
	for _, bad := range []string{
		`{}`, // payload is required by the document
		`{"payload":{},"cpus":{"boot_vcpus":1}}`,
		`{"payload":{},"console":{"mode":"Bogus"}}`,
		`{"payload":{},"disks":[{"socket":"/x"}]}`,
		`{"payload":{},"memory":{"size":"1G"}}`,
		`{"payload":{},"pvpanic":1}`,
		`{"payload":{},"vsock":{"cid":2,"socket":"/x"}}`,
		`{"payload":{},"net":[{"rate_limiter_config":{"bandwidth":{"size":1}}}]}`,
	} {
		dec := json.NewDecoder(strings.NewReader(bad))
		dec.UseNumber()
		var val any
		dec.Decode(&val)
		if errs := v.Validate("vm.create", schema, val); len(errs) == 0 {
			t.Errorf("%s validated", bad)
		}
	}
	schema, _ = doc.RequestSchema(t, "PUT", "vm.restore")
	for _, bad := range []string{`{}`, `{"source_url":"file:///s","memory_restore_mode":"Lazy"}`, `{"source_url":"file:///s","resume":"yes"}`} {
		var val any
		json.Unmarshal([]byte(bad), &val)
		if errs := v.Validate("vm.restore", schema, val); len(errs) == 0 {
			t.Errorf("vm.restore %s validated", bad)
		}
	}
}

// TestSimulatorResponsesMatchOpenAPI validates what chsim answers (vmm.ping, vm.info while
// created and running, vm.counters, vm.add-disk) against CH's OpenAPI document. Properties
// the document does not name are logged, not failed: the v53 document lags the code.
func TestSimulatorResponsesMatchOpenAPI(t *testing.T) {
	doc, v := openapitest.Load(t, openAPIPath)
	v.Lenient = true
	f, _ := launchSim(t)
	hc := simHTTP(f)
	check := func(method, path, status, body string) {
		t.Helper()
		req, _ := http.NewRequest(method, "http://x/api/v1/"+path, strings.NewReader(body))
		resp, err := hc.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		data, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if fmt.Sprint(resp.StatusCode) != status {
			t.Fatalf("%s %s = %d %s, want %s", method, path, resp.StatusCode, data, status)
		}
		if status == "204" {
			return
		}
		dec := json.NewDecoder(strings.NewReader(string(data)))
		dec.UseNumber()
		var val any
		if err := dec.Decode(&val); err != nil {
			t.Fatalf("%s %s: %v", method, path, err)
		}
		for _, e := range v.Validate(path, doc.ResponseSchema(t, method, path, status), val) {
			t.Errorf("%s %s: %s", method, path, e)
		}
	}
	check("GET", "vmm.ping", "200", "")
	cfg := fullConfig(f)
	cfg.Net, cfg.Devices = nil, nil
	touch(t, cfg.Payload.Kernel)
	touch(t, cfg.Payload.Initramfs)
	touch(t, cfg.Disks[1].Path)
	vhost, err := net.Listen("unix", cfg.Disks[0].VhostSocket)
	if err != nil {
		t.Fatal(err)
	}
	defer vhost.Close()
	body, _ := json.Marshal(cfg)
	check("PUT", "vm.create", "204", string(body))
	check("GET", "vm.info", "200", "")
	check("PUT", "vm.boot", "204", "")
	check("GET", "vm.info", "200", "")
	check("GET", "vm.counters", "200", "")
	check("PUT", "vm.add-disk", "200", fmt.Sprintf(`{"path":%q}`, cfg.Disks[1].Path))
	slices.Sort(v.Extras)
	t.Logf("properties the document does not name: %v", slices.Compact(v.Extras))
}
