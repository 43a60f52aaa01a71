package api

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"unicode"

	"vmhost/appvm"
	"vmhost/vm"
)

const minimalVM = `{"vcpus":1,"memory_mb":64,"kernel_path":"/k","disk":{"base_path":"/b"}}`

func TestDecodeStrictRejects(t *testing.T) {
	tests := []struct {
		name, body, want string
		appvm            bool
	}{
		{"malformed", `{"vcpus":`, "body: malformed JSON", false},
		{"empty body", ``, "body: empty body", false},
		{"not an object", `[1]`, "body: expected object, got array", false},
		{"trailing data", minimalVM + ` {}`, "body: trailing data", false},
		{"trailing garbage", minimalVM + `x`, "body: trailing data", false},
		{"wrong type", `{"vcpus":"1","memory_mb":64}`, "vcpus: expected a non-negative integer, got string", false},
		{"wrong type nested", `{"vcpus":1,"memory_mb":64,"nets":[{"mtu":true}]}`, "nets[0].mtu: expected a non-negative integer, got boolean", false},
		{"unknown field", `{"vcpus":1,"memory_mb":64,"colour":"red"}`, `body: unknown field "colour"`, false},
		{"unknown nested field", `{"vcpus":1,"memory_mb":64,"disk":{"base_path":"/b","zz":1}}`, `disk: unknown field "zz"`, false},
		{"negative count", `{"vcpus":-1,"memory_mb":64}`, "vcpus: expected a non-negative integer, got -1", false},
		{"fractional count", `{"vcpus":1.5,"memory_mb":64}`, "vcpus: expected a non-negative integer, got 1.5", false},
		{"exponent count", `{"vcpus":1e2,"memory_mb":64}`, "vcpus: expected a non-negative integer, got 1e2", false},
		{"count overflow", `{"vcpus":4294967296,"memory_mb":64}`, "vcpus: integer 4294967296 out of range", false},
		{"missing vcpus", `{"memory_mb":64}`, "vcpus: required field missing", false},
		{"null vcpus", `{"vcpus":null,"memory_mb":64}`, "vcpus: required field is null", false},
		{"missing memory", `{"vcpus":1}`, "memory_mb: required field missing", false},
		{"image missing sha", `{"vcpus":1,"memory_mb":64,"image":{"image_id":"a","fetch_url":"http://x/"}}`, "image.content_sha256: required field missing", false},
		{"image null url", `{"vcpus":1,"memory_mb":64,"image":{"image_id":"a","content_sha256":"x","fetch_url":null}}`, "image.fetch_url: required field is null", false},
		{"image missing id", `{"vcpus":1,"memory_mb":64,"image":{"content_sha256":"x","fetch_url":"u"}}`, "image.image_id: required field missing", false},
		{"volume size missing", `{"vcpus":1,"memory_mb":64,"volumes":[{"size_gib":1},{}]}`, "volumes[1].size_gib: required field missing", false},
		{"topology cores missing", `{"vcpus":1,"memory_mb":64,"cpu_topology":{"sockets":1,"threads":1}}`, "cpu_topology.cores: required field missing", false},
		{"topology null threads", `{"vcpus":1,"memory_mb":64,"cpu_topology":{"sockets":1,"cores":1,"threads":null}}`, "cpu_topology.threads: required field is null", false},
		{"nets ipv4 address", `{"vcpus":1,"memory_mb":64,"nets":[{},{"ipv4":{"gateway":"10.0.0.1"}}]}`, "nets[1].ipv4.address: required field missing", false},
		{"nets ipv6 address", `{"vcpus":1,"memory_mb":64,"nets":[{"ipv6":{"address":null}}]}`, "nets[0].ipv6.address: required field is null", false},
		{"cloud_init network ipv4", `{"vcpus":1,"memory_mb":64,"cloud_init":{"network":{}}}`, "cloud_init.network.ipv4: required field missing", false},
		{"cloud_init network ipv4 null", `{"vcpus":1,"memory_mb":64,"cloud_init":{"network":{"ipv4":null}}}`, "cloud_init.network.ipv4: required field is null", false},
		{"cloud_init network address", `{"vcpus":1,"memory_mb":64,"cloud_init":{"network":{"ipv4":{"dns":["1.1.1.1"]}}}}`, "cloud_init.network.ipv4.address: required field missing", false},
		{"string array item", `{"vcpus":1,"memory_mb":64,"pci_devices":["0000:00:01.0",7]}`, "pci_devices[1]: expected string, got number", false},
		{"object expected", `{"vcpus":1,"memory_mb":64,"disk":"x"}`, "disk: expected object, got string", false},
		{"null array item", `{"vcpus":1,"memory_mb":64,"volumes":[null]}`, "volumes[0]: expected object, got null", false},
		{"bool expected", `{"vcpus":1,"memory_mb":64,"auto_boot":"yes"}`, "auto_boot: expected boolean, got string", false},
		{"labels not an object", `{"vcpus":1,"memory_mb":64,"labels":["a"]}`, "labels: expected object, got array", false},
		{"label value number", `{"vcpus":1,"memory_mb":64,"labels":{"a":"1","b.c":2}}`, `labels["b.c"]: expected string, got number`, false},
		{"label value null", `{"vcpus":1,"memory_mb":64,"labels":{"a":null}}`, `labels["a"]: expected string, got null`, false},
		{"label key quoted", `{"vcpus":1,"memory_mb":64,"labels":{"a\nb":{}}}`, `labels["a\nb"]: expected string, got object`, false},
		{"appvm label value", `{"image_id":"i","vcpus":1,"memory_mb":64,"disk_gib":1,"labels":{"a":true}}`, `labels["a"]: expected string, got boolean`, true},

		{"appvm image_id type", `{"image_id":7,"vcpus":1,"memory_mb":64,"disk_gib":1}`, "image_id: expected string, got number", true},
		{"appvm from_snapshot type", `{"from_snapshot":[],"vcpus":1,"memory_mb":64,"disk_gib":1}`, "from_snapshot: expected string, got array", true},
		{"appvm disk_gib null", `{"image_id":"i","vcpus":1,"memory_mb":64,"disk_gib":null}`, "disk_gib: required field is null", true},
		{"appvm vcpus missing", `{"image_id":"i","memory_mb":64,"disk_gib":1}`, "vcpus: required field missing", true},
		{"appvm memory missing", `{"image_id":"i","vcpus":1,"disk_gib":1}`, "memory_mb: required field missing", true},
		{"appvm restart policy", `{"image_id":"i","vcpus":1,"memory_mb":64,"disk_gib":1,"restart_policy":"sometimes"}`, `restart_policy: unknown value "sometimes", expected one of no, on-failure, always`, true},
		{"appvm data volume mountpoint", `{"image_id":"i","vcpus":1,"memory_mb":64,"disk_gib":1,"data_volumes":[{"size_gib":1}]}`, "data_volumes[0].mountpoint: required field missing", true},
		{"appvm data volume size", `{"image_id":"i","vcpus":1,"memory_mb":64,"disk_gib":1,"data_volumes":[{"mountpoint":"/d","size_gib":null}]}`, "data_volumes[0].size_gib: required field is null", true},
		{"appvm negative prefix", `{"image_id":"i","vcpus":1,"memory_mb":64,"disk_gib":1,"prefix":-24}`, "prefix: expected a non-negative integer, got -24", true},
		{"appvm unknown field", `{"image_id":"i","vcpus":1,"memory_mb":64,"disk_gib":1,"entrypoint":["x"]}`, `body: unknown field "entrypoint"`, true},
		{"appvm secret env type", `{"image_id":"i","vcpus":1,"memory_mb":64,"disk_gib":1,"secret_env":[1]}`, "secret_env[0]: expected string, got number", true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var err error
			if tt.appvm {
				err = decodeStrict([]byte(tt.body), new(appvm.CreateRequest))
			} else {
				err = decodeStrict([]byte(tt.body), new(vm.Spec))
			}
			var de *DecodeError
			if !errors.As(err, &de) {
				t.Fatalf("decodeStrict(%s) = %v, want a *DecodeError", tt.body, err)
			}
			if msg := err.Error(); !strings.HasPrefix(msg, tt.want) || strings.Contains(msg, "\n") {
				t.Errorf("decodeStrict(%s) = %q, want one line starting %q", tt.body, msg, tt.want)
			}
		})
	}
}

func TestDecodeStrictAccepts(t *testing.T) {
	var s vm.Spec
	body := `{"vcpus":2,"memory_mb":128,"kernel_path":"/k","nested":null,"disk":{"base_path":"/b","size_gib":0},
		"cloud_init":{"password":"pw","raw_user_data":null},"nets":[{"ipv4":{"address":"10.0.0.2/24"}}]}`
	if err := decodeStrict([]byte(body), &s); err != nil {
		t.Fatalf("decodeStrict: %v", err)
	}
	if s.Vcpus != 2 || s.MemoryMB != 128 || *s.KernelPath != "/k" || s.Nested != nil || *s.Disk.SizeGiB != 0 {
		t.Errorf("decoded %+v", s)
	}
	if got := string(s.CloudInit.RawUserData); got != "null" {
		t.Errorf("raw_user_data = %q, want the literal null kept", got)
	}
	if s.CloudInit.RawNetworkConfig != nil {
		t.Errorf("absent raw_network_config = %q, want nil", s.CloudInit.RawNetworkConfig)
	}
	if s.CloudInit.Password.Reveal() != "pw" || s.Nets[0].IPv4.Address != "10.0.0.2/24" {
		t.Errorf("decoded %+v", s)
	}

	var e LabelsEdit
	if err := decodeStrict([]byte(`{"set":"v","gone":null,"empty":""}`), &e); err != nil {
		t.Fatalf("decodeStrict of a labels edit: %v", err)
	}
	if len(e) != 3 || *e["set"] != "v" || e["gone"] != nil || *e["empty"] != "" {
		t.Errorf("decoded labels edit %v: want set=v, gone=null (present, nil), empty", e)
	}
	if err := decodeStrict([]byte(`{"vcpus":1,"memory_mb":64,"labels":{"team":"infra"}}`), &s); err != nil || s.Labels["team"] != "infra" {
		t.Errorf("decodeStrict of labels = %v, %v", s.Labels, err)
	}

	var a appvm.CreateRequest
	if err := decodeStrict([]byte(`{"image_id":"i","vcpus":1,"memory_mb":64,"disk_gib":1,"restart_policy":"on-failure","prefix":0}`), &a); err != nil {
		t.Fatalf("decodeStrict: %v", err)
	}
	if a.RestartPolicy != "on-failure" || a.Prefix == nil || *a.Prefix != 0 {
		t.Errorf("decoded %+v", a)
	}
}

// TestDecodeErrorQuotesUnknownField: an unknown field's name is the
// client's; the 422 line quotes it, so newlines, control characters and
// line separators in it cannot break the line or the terminal reading it.
func TestDecodeErrorQuotesUnknownField(t *testing.T) {
	for body, want := range map[string]string{
		`{"vcpus":1,"memory_mb":64,"a\nb":1}`:                         `body: unknown field "a\nb"`,
		`{"vcpus":1,"memory_mb":64,"x\u001b[2J\u2028\u0085":1}`:       `body: unknown field "x\x1b[2J\u2028\u0085"`,
		`{"vcpus":1,"memory_mb":64,"disk":{"base_path":"/b","\r":1}}`: `disk: unknown field "\r"`,
		"{\"vcpus\":1,\"memory_mb\":64,\"\xff\xfe\":1}":               "body: unknown field \"\ufffd\ufffd\"", // the JSON decoder replaced the bytes
	} {
		err := decodeStrict([]byte(body), new(vm.Spec))
		if err == nil || err.Error() != want {
			t.Errorf("decodeStrict(%q) = %v, want %s", body, err, want)
		}
		if msg := fmt.Sprint(err); strings.ContainsFunc(msg, func(r rune) bool { return !unicode.IsPrint(r) }) {
			t.Errorf("decodeStrict(%q) = %q, holds a character that is not printable", body, msg)
		}
	}
}

func TestDecodeErrorNeverEchoesStrings(t *testing.T) {
	// A secret value in a wrongly typed or unknown place must not appear
	// in the 422 text.
	for _, body := range []string{
		`{"image_id":"i","vcpus":1,"memory_mb":64,"disk_gib":1,"secret_env":"TOPSECRET=1"}`,
		`{"vcpus":1,"memory_mb":64,"cloud_init":{"password":["TOPSECRET"]}}`,
	} {
		err := decodeStrict([]byte(body), new(appvm.CreateRequest))
		if err == nil {
			err = decodeStrict([]byte(body), new(vm.Spec))
		}
		if err == nil || strings.Contains(err.Error(), "TOPSECRET") {
			t.Errorf("decodeStrict(%s) = %v, want an error without the value", body, err)
		}
	}
}
