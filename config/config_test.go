package config

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

func TestDefaultIsValid(t *testing.T) {
	c := Default()
	if err := c.Validate(); err != nil {
		t.Fatalf("Default().Validate() = %v", err)
	}
	n, ok := c.Network(c.DefaultNetwork)
	if !ok || n != (Network{ID: "default", Bridge: "vmhost0"}) {
		t.Errorf("default network = %+v, %v; want {default vmhost0}", n, ok)
	}
	if c.Overcommit != (Overcommit{CPU: 4, Memory: 1}) || c.BootTimeoutSecs != 120 ||
		c.SysfsRoot != "/sys" || c.ImageMaxBytes != 64<<30 || c.Nested != nil ||
		c.ImageImportMaxBytes != 16<<30 || c.ImageImportMaxEntries != 1_000_000 || c.AppVMRootDisk != "overlay" ||
		c.GuestFileMaxBytes != 1<<30 {
		t.Errorf("Default() = %+v", c)
	}
}

func TestMarshalRoundTrip(t *testing.T) {
	yes := true
	c := Default()
	c.Nested = &yes
	c.Networks = append(c.Networks, Network{ID: "iso", Bridge: "br-iso", MTU: 9000, Isolated: true, SpoofGuard: true})
	b, err := c.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	got, err := Parse(b)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, c) {
		t.Errorf("Parse(Marshal(c)) = %+v\nwant %+v", got, c)
	}
}

func TestLoad(t *testing.T) {
	path := filepath.Join(t.TempDir(), "config.json")
	body := `{
		"networks": [
			{"id": "lan", "bridge": "br0", "mtu": 1500, "spoof_guard": true},
			{"id": "dmz", "bridge": "br1", "isolated": true}
		],
		"default_network": "lan",
		"overcommit": {"cpu": 2},
		"nested": false,
		"boot_timeout_secs": 30,
		"image_import_max_bytes": 1073741824,
		"image_import_max_entries": 5000,
		"guest_file_max_bytes": 1048576,
		"binaries": {"cloud_hypervisor": "/opt/ch/cloud-hypervisor"}
	}`
	if err := os.WriteFile(path, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	c, err := Load(path)
	if err != nil {
		t.Fatal(err)
	}
	want := Default()
	no := false
	want.Networks = []Network{
		{ID: "lan", Bridge: "br0", MTU: 1500, SpoofGuard: true},
		{ID: "dmz", Bridge: "br1", Isolated: true},
	}
	want.DefaultNetwork = "lan"
	want.Overcommit.CPU = 2 // memory keeps its default
	want.Nested = &no
	want.BootTimeoutSecs = 30
	want.ImageImportMaxBytes, want.ImageImportMaxEntries = 1<<30, 5000
	want.GuestFileMaxBytes = 1 << 20
	want.Binaries.CloudHypervisor = "/opt/ch/cloud-hypervisor" // qsd keeps its default
	if !reflect.DeepEqual(c, want) {
		t.Errorf("Load = %+v\nwant %+v", c, want)
	}
	if n, ok := c.NetworkByBridge("br1"); !ok || n.ID != "dmz" {
		t.Errorf("NetworkByBridge(br1) = %+v, %v; want dmz", n, ok)
	}
	if _, ok := c.NetworkByBridge("vmhost0"); ok {
		t.Error("NetworkByBridge(vmhost0) found the replaced default network")
	}
	if _, ok := c.Network("nope"); ok {
		t.Error("Network(nope) = found")
	}
}

// TestHostPathRoots: the default roots are the documented ones; --dev's
// defaults have none, and a file's list replaces either.
func TestHostPathRoots(t *testing.T) {
	want := []string{"/var/lib/vmhost", "/usr/lib/vmhost", "/usr/share/cloud-hypervisor", "/usr/share/qemu", "/usr/share/OVMF", "/boot"}
	if got := Default().HostPathRoots; !reflect.DeepEqual(got, want) {
		t.Errorf("Default().HostPathRoots = %q, want %q", got, want)
	}
	if got := DevDefault().HostPathRoots; len(got) != 0 {
		t.Errorf("DevDefault().HostPathRoots = %q, want none", got)
	}
	dir := t.TempDir()
	for _, c := range []struct {
		body string
		def  *Config
		want []string
	}{
		{`{}`, DevDefault(), []string{}},
		{`{}`, Default(), want},
		{`{"host_path_roots": ["/srv/images"]}`, DevDefault(), []string{"/srv/images"}},
		{`{"host_path_roots": []}`, Default(), []string{}},
	} {
		path := filepath.Join(dir, "c.json")
		if err := os.WriteFile(path, []byte(c.body), 0o600); err != nil {
			t.Fatal(err)
		}
		cfg, err := LoadOver(path, c.def)
		if err != nil {
			t.Fatalf("LoadOver(%s): %v", c.body, err)
		}
		if !reflect.DeepEqual(cfg.HostPathRoots, c.want) {
			t.Errorf("LoadOver(%s) roots = %q, want %q", c.body, cfg.HostPathRoots, c.want)
		}
	}
}

func TestLoadMissing(t *testing.T) {
	_, err := Load(filepath.Join(t.TempDir(), "nope.json"))
	if !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("Load(missing) = %v, want fs.ErrNotExist", err)
	}
}

func TestParseErrors(t *testing.T) {
	tests := []struct {
		name string
		body string
		want []string // substrings of the error
	}{
		{"unknown key", `{"boot_timeout": 5}`, []string{`unknown field "boot_timeout"`}},
		{"unknown nested key", `{"networks":[{"id":"a","bridge":"b","vlan":3}],"default_network":"a"}`, []string{`unknown field "vlan"`}},
		{"wrong type", `{"boot_timeout_secs": "5"}`, []string{"boot_timeout_secs"}},
		{"trailing", `{} {}`, []string{"after the JSON object"}},
		{"not json", `networks: []`, []string{"decoding"}},
		{"no networks", `{"networks": []}`, []string{"networks: at least one"}},
		{"null networks", `{"networks": null}`, []string{"networks: at least one"}},
		{"default missing", `{"default_network": "lan"}`, []string{`default_network: "lan" is not the id`}},
		{"duplicate id", `{"networks":[{"id":"a","bridge":"b0"},{"id":"a","bridge":"b1"}],"default_network":"a"}`,
			[]string{`networks[1].id: "a" is also the id of networks[0]`}},
		{"duplicate bridge", `{"networks":[{"id":"a","bridge":"b0"},{"id":"c","bridge":"b0"}],"default_network":"a"}`,
			[]string{`networks[1].bridge: "b0" is also the bridge of networks[0]`}},
		{"bad id", `{"networks":[{"id":"-a","bridge":"b0"}],"default_network":"-a"}`, []string{"networks[0].id"}},
		{"bridge too long", `{"networks":[{"id":"a","bridge":"abcdefghijklmnop"}],"default_network":"a"}`, []string{"networks[0].bridge"}},
		{"bridge with slash", `{"networks":[{"id":"a","bridge":"b/0"}],"default_network":"a"}`, []string{"networks[0].bridge"}},
		{"empty bridge", `{"networks":[{"id":"a"}],"default_network":"a"}`, []string{"networks[0].bridge"}},
		{"network mtu", `{"networks":[{"id":"a","bridge":"b","mtu":1279}],"default_network":"a"}`, []string{"networks[0].mtu"}},
		{"default mtu", `{"default_mtu": 70000}`, []string{"default_mtu"}},
		// A tap's MTU tops out at 65535 minus the Ethernet header.
		{"network mtu above a tap's maximum", `{"networks":[{"id":"a","bridge":"b","mtu":65522}],"default_network":"a"}`, []string{"networks[0].mtu"}},
		{"negative mtu", `{"default_mtu": -1}`, []string{"default_mtu"}},
		{"zero cpu ratio", `{"overcommit": {"cpu": 0}}`, []string{"overcommit.cpu"}},
		{"negative memory ratio", `{"overcommit": {"memory": -1}}`, []string{"overcommit.memory"}},
		{"boot timeout", `{"boot_timeout_secs": 0}`, []string{"boot_timeout_secs"}},
		{"host cpus", `{"host_cpus": -2}`, []string{"host_cpus"}},
		{"host memory", `{"host_memory_mb": -2}`, []string{"host_memory_mb"}},
		{"sysfs relative", `{"sysfs_root": "sys"}`, []string{"sysfs_root"}},
		{"appvm kernel relative", `{"appvm_kernel": "vmlinux"}`, []string{"appvm_kernel"}},
		{"appvm modules relative", `{"appvm_kernel": "/boot/vmlinuz", "appvm_modules": "lib/modules/6.1.0"}`, []string{"appvm_modules: \"lib/modules/6.1.0\" must be an absolute path"}},
		{"appvm modules without kernel", `{"appvm_modules": "/lib/modules/6.1.0"}`, []string{"appvm_modules: set without appvm_kernel"}},
		{"appvm root disk", `{"appvm_root_disk": "clone"}`, []string{`appvm_root_disk: "clone" must be "overlay" or "copy"`}},
		{"appvm root disk empty", `{"appvm_root_disk": ""}`, []string{"appvm_root_disk"}},
		{"cmdline newline", `{"default_cmdline": "a\nb"}`, []string{"default_cmdline"}},
		{"appvm cmdline NUL", `{"appvm_cmdline": "a\u0000"}`, []string{"appvm_cmdline"}},
		{"binary relative path", `{"binaries": {"cloud_hypervisor": "bin/ch"}}`, []string{"binaries.cloud_hypervisor"}},
		{"binary empty", `{"binaries": {"qemu_storage_daemon": ""}}`, []string{"binaries.qemu_storage_daemon"}},
		{"image cap", `{"image_max_bytes": 0}`, []string{"image_max_bytes"}},
		{"import byte limit", `{"image_import_max_bytes": 0}`, []string{"image_import_max_bytes: 0 must be positive"}},
		{"import entry limit", `{"image_import_max_entries": -1}`, []string{"image_import_max_entries: -1 must be positive"}},
		{"guest file limit", `{"guest_file_max_bytes": 0}`, []string{"guest_file_max_bytes: 0 must be positive"}},
		{"host path root relative", `{"host_path_roots": ["/boot", "images"]}`, []string{`host_path_roots[1]: "images" must be an absolute path`}},
		{"jail id range with root", `{"jail": {"id_range": [0, 10]}}`, []string{"jail.id_range: must not include 0"}},
		{"jail id range with nobody", `{"jail": {"id_range": [60000, 70000]}}`, []string{"jail.id_range: must not include 65534"}},
		{"jail cgroup parent absolute", `{"jail": {"cgroup_parent": "/vmhost"}}`, []string{"jail.cgroup_parent"}},
		{"jail pids max", `{"jail": {"pids_max": 5}}`, []string{"jail.pids_max: 5 is below 128"}},
		{"jail unknown key", `{"jail": {"uid": 5}}`, []string{`unknown field "uid"`}},
		{"all at once", `{"boot_timeout_secs": 0, "image_max_bytes": 0, "overcommit": {"cpu": 0, "memory": 0}}`,
			[]string{"boot_timeout_secs", "image_max_bytes", "overcommit.cpu", "overcommit.memory"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := Parse([]byte(tt.body))
			if err == nil {
				t.Fatalf("Parse(%s) = nil error, want %q", tt.body, tt.want)
			}
			for _, w := range tt.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("Parse(%s) = %v, want it to contain %q", tt.body, err, w)
				}
			}
		})
	}
}

func TestValidateAcceptsBareAndAbsoluteBinaries(t *testing.T) {
	c := Default()
	c.Binaries = Binaries{CloudHypervisor: "/usr/local/bin/cloud-hypervisor", QemuStorageDaemon: "qemu-storage-daemon"}
	c.AppVMKernel = "/var/lib/vmhost/vmlinux"
	c.AppVMModules = "/lib/modules/6.1.0-56-cloud-amd64"
	c.HostCPUs, c.HostMemoryMB = 8, 16384
	if err := c.Validate(); err != nil {
		t.Errorf("Validate() = %v", err)
	}
}

func TestMTUBounds(t *testing.T) {
	for _, tt := range []struct {
		mtu int
		ok  bool
	}{{0, true}, {1279, false}, {1280, true}, {65521, true}, {65522, false}, {65535, false}} {
		body := fmt.Sprintf(`{"networks":[{"id":"a","bridge":"b","mtu":%d}],"default_network":"a","default_mtu":%d}`, tt.mtu, tt.mtu)
		_, err := Parse([]byte(body))
		if (err == nil) != tt.ok {
			t.Errorf("mtu %d: Parse error = %v, want ok=%t", tt.mtu, err, tt.ok)
		}
	}
}
