package vm

import (
	"bytes"
	"encoding/json"
	"path/filepath"
	"strings"
	"testing"

	"vmhost/config"
	"vmhost/store"
	"vmhost/vm/records"
)

// TestViewGuestFacts: the view shows the recorded guest facts (snooped
// and observed addresses, discovered_ipv4 snooped first) and processes.
func TestViewGuestFacts(t *testing.T) {
	s := newNoHostService(t)
	size := uint32(2)
	rec := &Record{ID: "vm1", Mode: ModeVM, State: StateRunning, DisplayState: "running", PID: 4242,
		Spec: Spec{VMID: "vm1", Vcpus: 1, MemoryMB: 256, Disk: &DiskSpec{BasePath: "/img/base.qcow2", SizeGiB: &size},
			Nets: []NetSpec{{Bridge: "br0"}, {Bridge: "br0"}}},
		Base: &BaseImage{Path: "/img/base.qcow2", VirtualSizeBytes: 1 << 30},
		NICs: []NIC{
			{MAC: "02:00:00:00:00:01", Tap: "vmh1", LastObservedIPv4: "10.0.0.9"},
			{MAC: "02:00:00:00:00:02", Tap: "vmh2", DHCPSnoopedIPv4: "10.0.0.7", LastObservedIPv4: "10.0.0.8"},
		},
		Runtime: &Runtime{
			CH:  &CHRuntime{Pid: 4242, StartTime: 99, APISocket: "/r/ch.sock"},
			QSD: &QSDRuntime{Pid: 4343, StartTime: 77, QMPSocket: "/r/qsd.qmp", RootSocket: "/r/root.vhost"},
		},
	}
	v := s.View(rec, ViewOptions{})
	if v.PID != 4242 {
		t.Errorf("pid = %d, want the recorded 4242", v.PID)
	}
	if v.DiscoveredIPv4 != "10.0.0.7" {
		t.Errorf("discovered_ipv4 = %q, want the snooped 10.0.0.7 before any observed address", v.DiscoveredIPv4)
	}
	if n := v.Nets[0]; n.DHCPSnoopedIPv4 != "" || n.LastObservedIPv4 != "10.0.0.9" {
		t.Errorf("nets[0] facts = %q, %q", n.DHCPSnoopedIPv4, n.LastObservedIPv4)
	}
	if n := v.Nets[1]; n.DHCPSnoopedIPv4 != "10.0.0.7" || n.LastObservedIPv4 != "10.0.0.8" {
		t.Errorf("nets[1] facts = %q, %q", n.DHCPSnoopedIPv4, n.LastObservedIPv4)
	}
	d := v.Disk
	want := VolumeRef{Backend: "qsd", Pid: 4343, StartTime: 77, BlkSocket: "/r/root.vhost", QMPSocket: "/r/qsd.qmp"}
	if d == nil || d.Runtime == nil || *d.Runtime != want || d.QSDPid != 4343 || d.QSDStartTime != 77 ||
		d.QSDBlkSocket != "/r/root.vhost" || d.QSDQMPSocket != "/r/qsd.qmp" {
		t.Fatalf("disk = %+v", d)
	}
	var enc bytes.Buffer
	e := json.NewEncoder(&enc)
	e.SetEscapeHTML(false)
	if err := e.Encode(v); err != nil {
		t.Fatal(err)
	}
	got := strings.TrimSuffix(enc.String(), "\n")
	for _, key := range []string{`"qsd_pid":4343`, `"runtime":{"backend":"qsd","pid":4343,"start_time":77,"blk_socket":"/r/root.vhost","qmp_socket":"/r/qsd.qmp"}`,
		`"discovered_ipv4":"10.0.0.7"`, `"last_observed_ipv4":"10.0.0.9"`, `"pid":4242`} {
		if !strings.Contains(got, key) {
			t.Errorf("view lacks %s", key)
		}
	}

	// Without processes and facts, none of it appears.
	rec.Runtime, rec.PID, rec.NICs[0], rec.NICs[1] = nil, 0, NIC{MAC: "02:00:00:00:00:01", Tap: "vmh1"}, NIC{MAC: "02:00:00:00:00:02", Tap: "vmh2"}
	got = string(encodeView(s.View(rec, ViewOptions{})))
	for _, key := range []string{"qsd_", `"runtime"`, "discovered_ipv4", "last_observed_ipv4", "dhcp_snooped_ipv4", `"pid"`} {
		if strings.Contains(got, key) {
			t.Errorf("view of a VM without processes or facts has %s: %s", key, got)
		}
	}
}

// newNoHostService is a Service over temp directories that does no host
// work.
func newNoHostService(t *testing.T) *Service {
	t.Helper()
	dir := t.TempDir()
	st, err := store.Open(filepath.Join(dir, "s", "vms"))
	if err != nil {
		t.Fatal(err)
	}
	recs, err := records.Open(st, records.Options{})
	if err != nil {
		t.Fatal(err)
	}
	s, err := New(Options{StateDir: filepath.Join(dir, "s"), RunDir: filepath.Join(dir, "r"), Config: config.Default(), Records: recs, Host: NoHost{}})
	if err != nil {
		t.Fatal(err)
	}
	return s
}
