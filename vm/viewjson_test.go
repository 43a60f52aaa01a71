package vm_test

import (
	"bytes"
	"encoding/json"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"vmhost/vm"
)

func encodingJSON(t *testing.T, v any) string {
	t.Helper()
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		t.Fatal(err)
	}
	return strings.TrimSuffix(b.String(), "\n")
}

// fullView sets every field of a View, with s in every string.
func fullView(s string) *vm.View {
	at := time.Date(2026, 3, 4, 5, 6, 7, 890, time.FixedZone("x", 3600))
	n := uint64(4096)
	return &vm.View{
		ID: "id" + s, State: vm.StateRunning, DisplayState: s, Vcpus: 3, MemoryMB: 1 << 40,
		KernelPath: ptr("/k" + s), FirmwarePath: nil, DiskPath: s,
		Volumes: []vm.VolumeView{
			{ID: "data0", Path: s, VirtualSizeBytes: 1, Fmt: "qcow2", Readonly: true, Owned: true, VolumeID: s, Device: "/dev/vdc", DiskBytes: &n},
			{ID: "data1", Path: "/p", Fmt: "qcow2", Device: "/dev/vdd"},
		},
		SeedDisk: &vm.SeedDiskView{Device: "/dev/vdb", SizeBytes: 1 << 20},
		Cmdline:  s, ConsoleSocketPath: s,
		FailureReason: &vm.FailureReason{DetectedAt: at, Summary: s, Cause: "ch_crash",
			Detail: vm.FailureDetail{Kind: "process_exit", Code: ptr(-1), Signum: ptr(9), Path: s, ID: s, Seconds: ptr(120)}},
		PID: 4242,
		Nets: []vm.NetView{{Mode: "bridge", Bridge: s, TapName: "vmh1", MAC: "02:00:00:00:00:01", NetworkID: s, VLANTag: ptr[uint32](7),
			IPv4: &vm.NetIPSpec{Address: s, Gateway: s, DNSServers: []string{s, ""}}, IPv6: &vm.NetIPSpec{Address: "fd00::1/64"},
			MTU: 1500, Isolated: ptr(false), SpoofGuard: ptr(true), RateLimitMbps: ptr[uint32](10), AllowedIPs: []string{s},
			DHCPSnoopedIPv4: s, LastObservedIPv4: s}, {Mode: "bridge"}},
		Platform: &vm.Platform{SerialNumber: s},
		Disk:     &vm.DiskView{Mode: "copy", BasePath: s, VirtualSizeBytes: 9, Owned: true, ImageFmt: "qcow2"},
		Image:    &vm.ImageView{ImageID: s, Distro: s, Version: s},
		CloudInit: &vm.CloudInitView{Hostname: s, User: s, SSHAuthorizedKeys: []string{s}, InstanceID: s, ConsoleAutologin: true,
			Network: &vm.CloudInitNet{IPv4: &vm.CloudInitIP{Address: s, Gateway: s, DNS: []string{s}}, IPv6: &vm.CloudInitIP{Address: s}}},
		IOLimit:     &vm.IOLimitView{IopsTotal: 5},
		Nested:      ptr(false),
		CPUAffinity: []int{0, 5, 8191},
		CPUTopology: &vm.CPUTopology{Sockets: 1, Cores: 3, Threads: 1},
		PCIDevices:  []string{s},
		BalloonMB:   12, CreatedAt: &at, DiscoveredIPv4: s, GuestPanickedAt: &at, ShuttingDown: true, Mode: vm.ModeVM,
	}
}

// TestAppendJSONMatches keeps the reflection-free encoder byte-identical
// to encoding/json, for every field and for every kind of string escape.
func TestAppendJSONMatches(t *testing.T) {
	strs := []string{"", "plain", `q"uote\back`, "ctl\x00\x01\b\f\n\r\t\x1f\x7f", "<&>", "é ünï 日本", "\u2028\u2029", "bad\xff\xfeutf8", "12345678\"12345678"}
	views := []*vm.View{
		{Volumes: []vm.VolumeView{}, Nets: []vm.NetView{}, PCIDevices: []string{}},
		{IOLimit: &vm.IOLimitView{BpsTotal: 1}, CloudInit: &vm.CloudInitView{Network: &vm.CloudInitNet{}}, Platform: &vm.Platform{}},
	}
	for _, s := range strs {
		views = append(views, fullView(s))
	}
	// Random strings over bytes that exercise every escape path.
	const alphabet = "a\"\\\x00\x1f\x7f\x80\xe2\x80\xa8é/ 0123456789"
	r := rand.New(rand.NewPCG(1, 2))
	for range 300 {
		b := make([]byte, r.IntN(40))
		for i := range b {
			b[i] = alphabet[r.IntN(len(alphabet))]
		}
		views = append(views, fullView(string(b)))
	}
	for _, v := range views {
		want := encodingJSON(t, v)
		if got := string(v.AppendJSON(nil)); got != want {
			t.Fatalf("AppendJSON:\n%s\nencoding/json:\n%s", got, want)
		}
	}
}
