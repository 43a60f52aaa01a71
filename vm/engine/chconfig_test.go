package engine

import (
	"bytes"
	"encoding/json"
	"flag"
	"os"
	"strings"
	"testing"

	"vmhost/chclient/openapitest"
	"vmhost/config"
	"vmhost/vm/record"
)

var update = flag.Bool("update", false, "rewrite testdata/*.golden")

// everyFieldRecord is the record of the every-field create request
// (testdata/every-field-request.json, the api package's full request).
func everyFieldRecord(t *testing.T) (*record.Record, *config.Config, record.Layout) {
	t.Helper()
	data, err := os.ReadFile("testdata/every-field-request.json")
	if err != nil {
		t.Fatal(err)
	}
	var sp record.Spec
	if err := json.Unmarshal(data, &sp); err != nil {
		t.Fatal(err)
	}
	sp.NormalizeVolumes()
	cfg := config.Default()
	cfg.Networks = append(cfg.Networks, config.Network{ID: "lab", Bridge: "br1", MTU: 9000}, config.Network{ID: "zero", Bridge: "br0"})
	rec := &record.Record{ID: sp.VMID, Mode: record.ModeVM, State: record.StateCreated, Spec: sp,
		NICs:    []record.NIC{{MAC: "02:aa:bb:cc:dd:01", Tap: record.TapName(sp.VMID, 0)}, {MAC: "02:9f:60:67:c4:ca", Tap: record.TapName(sp.VMID, 1)}},
		Runtime: &record.Runtime{VsockCID: 3}}
	return rec, cfg, record.Layout{StateDir: "/var/lib/vmhost", RunDir: "/run/vmhost"}
}

func TestCHConfigGolden(t *testing.T) {
	rec, cfg, l := everyFieldRecord(t)
	c, err := CHConfig(rec, cfg, l, CHConfigHost{CPUs: 16})
	if err != nil {
		t.Fatal(err)
	}
	got, err := json.MarshalIndent(c, "", "  ")
	if err != nil {
		t.Fatal(err)
	}
	got = append(got, '\n')
	const golden = "testdata/chconfig-every-field.golden"
	if *update {
		if err := os.WriteFile(golden, got, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, err := os.ReadFile(golden)
	if err != nil {
		t.Fatalf("%v (run with -update to create it)", err)
	}
	if !bytes.Equal(got, want) {
		t.Errorf("vm.create body differs from %s (run with -update if intended):\n%s", golden, got)
	}
	doc, v := openapitest.Load(t, openapitest.DefaultPath)
	schema, _ := doc.RequestSchema(t, "PUT", "vm.create")
	for _, e := range v.ValidateJSON("vm.create", schema, got) {
		t.Errorf("golden config: %s", e)
	}
	if bytes.Contains(got, []byte("s3cret-planted")) {
		t.Error("the config carries the cloud-init password")
	}
}

// TestCHConfigVariants checks the rules the every-field request does not
// reach, and validates each body against the OpenAPI document.
func TestCHConfigVariants(t *testing.T) {
	doc, v := openapitest.Load(t, openapitest.DefaultPath)
	schema, _ := doc.RequestSchema(t, "PUT", "vm.create")
	l := record.Layout{StateDir: "/s", RunDir: "/r"}
	cfg := config.Default()
	fw := "/usr/share/cloud-hypervisor/hypervisor-fw"
	kernel := "/boot/vmlinux"
	mbps := uint32(1)
	no := false
	tests := []struct {
		name  string
		rec   record.Record
		check func(t *testing.T, c map[string]any)
	}{
		{"minimal kernel", record.Record{ID: "a", Mode: record.ModeVM, Spec: record.Spec{Vcpus: 2, MemoryMB: 100, KernelPath: &kernel}},
			func(t *testing.T, c map[string]any) {
				want(t, c, "payload.cmdline", config.DefaultKernelCmdline)
				want(t, c, "cpus.max_vcpus", 8.0) // host CPUs
				want(t, c, "memory.hotplug_size", float64(128<<20))
				want(t, c, "disks", []any{map[string]any{"vhost_user": true, "vhost_socket": "/r/vms/a/root.vhost"}})
				want(t, c, "cpus.nested", nil)
				want(t, c, "net", nil)
			}},
		{"firmware drops the cmdline", record.Record{ID: "b", Mode: record.ModeVM, Spec: record.Spec{Vcpus: 1, MemoryMB: 64, FirmwarePath: &fw, Nested: &no}},
			func(t *testing.T, c map[string]any) {
				want(t, c, "payload", map[string]any{"firmware": fw})
				want(t, c, "cpus.nested", false)
			}},
		{"more vCPUs than the host keeps boot as max", record.Record{ID: "c", Mode: record.ModeVM, Spec: record.Spec{Vcpus: 12, MemoryMB: 64, KernelPath: &kernel}},
			func(t *testing.T, c map[string]any) { want(t, c, "cpus.max_vcpus", 12.0) }},
		{"1 Mbps", record.Record{ID: "d", Mode: record.ModeVM, Spec: record.Spec{Vcpus: 1, MemoryMB: 64, KernelPath: &kernel, Nets: []record.NetSpec{{RateLimitMbps: &mbps}}},
			NICs: []record.NIC{{MAC: "02:00:00:00:00:01", Tap: "vmhx0"}}},
			func(t *testing.T, c map[string]any) {
				want(t, c, "net", []any{map[string]any{"tap": "vmhx0", "mac": "02:00:00:00:00:01",
					"rate_limiter_config": map[string]any{"bandwidth": map[string]any{"size": 12500.0, "refill_time": 100.0}}}})
			}},
		{"AppVM kernel", record.Record{ID: "e", Mode: record.ModeAppVM, Spec: record.Spec{Vcpus: 1, MemoryMB: 64}},
			func(t *testing.T, c map[string]any) {
				want(t, c, "payload", map[string]any{"kernel": "/k/appvm", "cmdline": config.DefaultAppVMCmdline})
				want(t, c, "vsock", map[string]any{"cid": 9.0, "socket": l.VsockSocket("e")})
			}},
		{"a classic VM has no vsock", record.Record{ID: "f", Mode: record.ModeVM, Spec: record.Spec{Vcpus: 1, MemoryMB: 64, KernelPath: &kernel}},
			func(t *testing.T, c map[string]any) {
				if v, ok := c["vsock"]; ok {
					t.Errorf("vsock = %v, want none", v)
				}
			}},
	}
	cfg.AppVMKernel = "/k/appvm"
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tt.rec.Runtime = &record.Runtime{VsockCID: 9}
			c, err := CHConfig(&tt.rec, cfg, l, CHConfigHost{CPUs: 8})
			if err != nil {
				t.Fatal(err)
			}
			data, _ := json.Marshal(c)
			for _, e := range v.ValidateJSON("vm.create", schema, data) {
				t.Error(e)
			}
			var m map[string]any
			json.Unmarshal(data, &m)
			tt.check(t, m)
		})
	}
	if _, err := CHConfig(&record.Record{ID: "x", Spec: record.Spec{KernelPath: &kernel}}, cfg, l, CHConfigHost{}); err == nil || !strings.Contains(err.Error(), "vsock CID") {
		t.Errorf("CHConfig without a CID = %v, want an error", err)
	}
}

// want checks the value at a dotted path of a decoded JSON object.
func want(t *testing.T, m map[string]any, path string, w any) {
	t.Helper()
	var cur any = m
	for _, k := range strings.Split(path, ".") {
		obj, _ := cur.(map[string]any)
		cur = obj[k]
	}
	gb, _ := json.Marshal(cur)
	wb, _ := json.Marshal(w)
	if !bytes.Equal(gb, wb) {
		t.Errorf("%s = %s, want %s", path, gb, wb)
	}
}
