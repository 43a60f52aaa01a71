//go:build linux

package e2e

import (
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"

	"vmhost/config"
	"vmhost/vm"
)

// TestIOLimitsAtTheStorageDaemonsBoundary creates VMs whose root disk
// limits sit at the real qemu-storage-daemon's ceiling and just above it:
// 10^15 bytes/s and I/O/s boot (the daemon takes the throttle group and
// reports the limits back), 10^15+1 and 2^64-1 are 400 naming the field and
// the limit, with nothing made.
func TestIOLimitsAtTheStorageDaemonsBoundary(t *testing.T) {
	qsd, err := exec.LookPath("qemu-storage-daemon")
	if err != nil {
		if os.Getenv("CI") != "" {
			t.Fatal("qemu-storage-daemon not installed")
		}
		t.Skip("qemu-storage-daemon not installed")
	}
	s := startServer(t, serverOpts{simulate: "ch", edit: func(c *config.Config) { c.Binaries.QemuStorageDaemon = qsd }})
	f := newFixture(t)
	limits := func(bps, iops uint64) string {
		return fmt.Sprintf(`,"disk_bps_total":%d,"disk_iops_total":%d`, bps, iops)
	}
	s.create(f.body("edge", true, limits(vm.MaxIOLimit, vm.MaxIOLimit)), http.StatusCreated)
	s.waitDisplay("edge", "running", "running")
	if st, b := s.do("GET", "/api/vms/edge", ""); st != http.StatusOK || !strings.Contains(string(b), fmt.Sprintf(`"io_limit":{"bps_total":%d,"iops_total":%d}`, uint64(vm.MaxIOLimit), uint64(vm.MaxIOLimit))) {
		t.Errorf("view = %d %s", st, b)
	}
	// The daemon took the group at launch (it exits refusing one it does
	// not accept, and the create fails), and still runs.
	if v, _ := s.get("edge"); v.Disk == nil || v.Disk.QSDPid == 0 || syscall.Kill(v.Disk.QSDPid, 0) != nil {
		t.Errorf("the storage daemon of edge does not run: %+v", v)
	}
	if st, b := s.do("DELETE", "/api/vms/edge?force=true", ""); st != http.StatusNoContent {
		t.Fatalf("DELETE = %d %s", st, b)
	}
	for _, tc := range []struct {
		field     string
		bps, iops uint64
	}{
		{"disk_bps_total", vm.MaxIOLimit + 1, 1},
		{"disk_iops_total", 1, vm.MaxIOLimit + 1},
		{"disk_bps_total", ^uint64(0), 1},
		{"disk_iops_total", 1, ^uint64(0)},
	} {
		st, b := s.do("POST", "/api/vms", f.body("over", true, limits(tc.bps, tc.iops)))
		if st != http.StatusBadRequest || !strings.Contains(string(b), tc.field) || !strings.Contains(string(b), "1000000000000000") {
			t.Errorf("create with %s %d/%d = %d %s, want 400 naming the field and the limit", tc.field, tc.bps, tc.iops, st, b)
		}
		checkGone(t, s, "over")
	}
}
