package api

import (
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http/httptest"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"vmhost/doctor"
)

// getHostView reads GET /api/host.
func getHostView(t *testing.T, h *harness) HostView {
	t.Helper()
	st, _, b := h.do(t, "GET", "/api/host", h.ro, "")
	if st != 200 {
		t.Fatalf("GET /api/host = %d %s", st, b)
	}
	var v HostView
	if err := json.Unmarshal([]byte(b), &v); err != nil {
		t.Fatal(err)
	}
	return v
}

// TestHostView: GET /api/host says who the agent is (hostname, its agent
// id, version, the host's boot id, KVM), counts the VMs of both families
// by state, and lists the features it has now, the wiring's among them.
func TestHostView(t *testing.T) {
	h := newHarness(t)
	jail := false
	h.features = []Feature{{Name: "jail", On: func() bool { return jail }}}
	h.start(t)
	for _, body := range []string{minimalVMBody(h, "a"), minimalVMBody(h, "b")} {
		if st, _, b := h.do(t, "POST", "/api/vms", h.rw, body); st != 201 {
			t.Fatalf("create: %d %s", st, b)
		}
	}
	if st, _, b := h.do(t, "POST", "/api/appvm/vms", h.rw, `{"vm_id":"x","image_id":"plain","vcpus":1,"memory_mb":64,"disk_gib":1}`); st != 201 {
		t.Fatalf("create x: %d %s", st, b)
	}
	if st, _, b := h.do(t, "POST", "/api/vms/b/start", h.rw, ""); st != 204 {
		t.Fatalf("start b: %d %s", st, b)
	}
	v := getHostView(t, h)
	host, _ := os.Hostname()
	bootID, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	if err != nil {
		t.Skipf("no boot id on this host: %v", err)
	}
	if v.Hostname != host || v.AgentID != testAgentID || v.Version != "test-1" || v.BootID != strings.TrimSpace(string(bootID)) {
		t.Errorf("GET /api/host = hostname %q, agent_id %q, version %q, boot_id %q; want %q, %q, test-1, %q",
			v.Hostname, v.AgentID, v.Version, v.BootID, host, testAgentID, strings.TrimSpace(string(bootID)))
	}
	if v.KVM != doctor.KVMReady("/dev/kvm") {
		t.Errorf("kvm = %v, but the doctor's kvm check says %v", v.KVM, !v.KVM)
	}
	wantVMs := map[string]int{"created": 1, "running": 2, "paused": 0, "stopped": 0, "failed": 0}
	if fmt.Sprint(v.VMs) != fmt.Sprint(wantVMs) {
		t.Errorf("vms = %v, want %v", v.VMs, wantVMs)
	}
	// The fake sysfs has nested KVM and IOMMU groups; the configured
	// AppVM kernel does not exist.
	if want := []string{"labels", "nested", "pci_passthrough"}; !slices.Equal(v.Features, want) {
		t.Errorf("features = %q, want %q", v.Features, want)
	}
	jail, h.e.Config.AppVMKernel = true, h.e.Kernel
	if want := []string{"appvm", "jail", "labels", "nested", "pci_passthrough"}; !slices.Equal(getHostView(t, h).Features, want) {
		t.Errorf("features with the AppVM kernel in place and the jail on = %q, want %q", getHostView(t, h).Features, want)
	}

	// A device that is not KVM is no KVM.
	srv := New(Config{Keys: h.srv.keys, VMs: h.vms, AppVMs: h.apps, KVMDevice: os.DevNull, Logger: slog.New(slog.DiscardHandler)})
	w := httptest.NewRecorder()
	r := httptest.NewRequest("GET", "/api/host", nil)
	r.Header.Set("Authorization", "Bearer "+h.ro)
	srv.ServeHTTP(w, r)
	if w.Code != 200 || !strings.Contains(w.Body.String(), `"kvm":false`) {
		t.Errorf("GET /api/host with %s as the KVM device = %d %s, want kvm false", os.DevNull, w.Code, w.Body)
	}
}

// TestHostEqualsAdmission: GET /api/host reports the numbers admission
// decides with. For vCPUs, memory and disk, a create that the reported
// allocatable − used (state_free − committed) says fits is admitted, and
// one just over is 409 CAPACITY_CONFLICT naming the resource; what VMs
// hold (creates in flight and provisions included) is counted at once,
// for both families.
func TestHostEqualsAdmission(t *testing.T) {
	create := func(t *testing.T, h *harness, family, id string, vcpus, memMB uint64) (int, string) {
		t.Helper()
		body := fmt.Sprintf(`{"vm_id":%q,"vcpus":%d,"memory_mb":%d,"kernel_path":%q,"disk":{"base_path":%q}}`, id, vcpus, memMB, h.e.Kernel, h.e.Base)
		if family == "appvm" {
			body = fmt.Sprintf(`{"vm_id":%q,"image_id":"plain","vcpus":%d,"memory_mb":%d,"disk_gib":1}`, id, vcpus, memMB)
		}
		st, _, b := h.do(t, "POST", familyPrefix(family), h.rw, body)
		return st, b
	}
	wantCapacityConflict := func(t *testing.T, st int, b, resource string) {
		t.Helper()
		if st != 409 || !strings.Contains(b, `"code":"CAPACITY_CONFLICT"`) || !strings.Contains(b, "host capacity: "+resource+":") {
			t.Errorf("create just over the reported capacity = %d %s, want 409 CAPACITY_CONFLICT for %s", st, b, resource)
		}
	}

	t.Run("vcpus", func(t *testing.T) {
		h := newHarness(t)
		h.e.Config.HostCPUs = 3 // x overcommit 4: 12 vCPUs
		v := getHostView(t, h)
		if v.CPUs.Online != 3 || v.CPUs.Allocatable != 12 || v.CPUs.Used != 0 {
			t.Fatalf("cpus = %+v, want 3 online, 12 allocatable, 0 used", v.CPUs)
		}
		if st, b := create(t, h, "vm", "first", 5, 64); st != 201 {
			t.Fatalf("create: %d %s", st, b)
		}
		for i, family := range []string{"appvm", "vm"} {
			v := getHostView(t, h)
			left := v.CPUs.Allocatable - v.CPUs.Used
			st, b := create(t, h, family, fmt.Sprintf("over%d", i), left+1, 64)
			wantCapacityConflict(t, st, b, "vcpus")
			fit := left
			if i == 0 {
				fit = left - 2 // leave two for the classic VM's turn
			}
			if st, b := create(t, h, family, fmt.Sprintf("fit%d", i), fit, 64); st != 201 {
				t.Errorf("%s create of %d vCPUs, which GET /api/host says fit (%d left), = %d %s", family, fit, left, st, b)
			}
		}
		if v := getHostView(t, h); v.CPUs.Used != v.CPUs.Allocatable {
			t.Errorf("cpus after filling the host = %+v, want used = allocatable", v.CPUs)
		}
	})

	t.Run("memory", func(t *testing.T) {
		h := newHarness(t)
		h.e.Config.HostMemoryMB = 3000
		h.e.Config.Overcommit.Memory = 1.5
		if st, b := create(t, h, "appvm", "first", 1, 1000); st != 201 {
			t.Fatalf("create: %d %s", st, b)
		}
		v := getHostView(t, h)
		if v.MemoryMB.Total != 3000 || v.MemoryMB.Allocatable != 4500 || v.MemoryMB.Used != 1000 {
			t.Fatalf("memory_mb = %+v, want 3000 total, 4500 allocatable, 1000 used", v.MemoryMB)
		}
		left := v.MemoryMB.Allocatable - v.MemoryMB.Used
		st, b := create(t, h, "vm", "over", 1, left+1)
		wantCapacityConflict(t, st, b, "memory_mb")
		if st, b := create(t, h, "vm", "fit", 1, left); st != 201 {
			t.Errorf("create of %d MiB, which GET /api/host says fit, = %d %s", left, st, b)
		}
		v = getHostView(t, h)
		if v.MemoryMB.Used != v.MemoryMB.Allocatable {
			t.Errorf("memory_mb after filling the host = %+v", v.MemoryMB)
		}
		st, b = create(t, h, "appvm", "over2", 1, 64)
		wantCapacityConflict(t, st, b, "memory_mb")
	})

	t.Run("disk", func(t *testing.T) {
		h := newHarness(t)
		// A provision that waits at the gate: its disks are committed
		// until it has written them. Every create below waits there too.
		h.e.Host.Gate = make(chan struct{})
		var wg sync.WaitGroup
		defer func() { close(h.e.Host.Gate); wg.Wait() }()
		async := func(id, body string) {
			wg.Add(1)
			go func() {
				defer wg.Done()
				if st, _, b := h.do(t, "POST", "/api/vms", h.rw, body); st != 201 {
					t.Errorf("create %s: %d %s", id, st, b)
				}
			}()
			for deadline := time.Now().Add(5 * time.Second); h.e.Records.Get(id) == nil; time.Sleep(2 * time.Millisecond) {
				if time.Now().After(deadline) {
					t.Fatalf("create %s was not admitted", id)
				}
			}
		}
		// Each create: the 1 GiB base image's copy and a 2 GiB volume.
		body := func(id string) string {
			return strings.TrimSuffix(minimalVMBody(h, id), "}") + `,"volumes":[{"size_gib":2}]}`
		}
		const need = 3 << 30
		async("slow", body("slow"))
		v := getHostView(t, h)
		if v.DiskBytes.Committed != need || v.DiskBytes.StateFree != h.e.DiskFree || v.DiskBytes.StateTotal == 0 {
			t.Fatalf("disk_bytes = %+v, want %d committed and %d free", v.DiskBytes, need, h.e.DiskFree)
		}
		// The state directory has one byte too few for the next create.
		h.e.DiskFree = v.DiskBytes.Committed + need - 1
		v = getHostView(t, h)
		if left := v.DiskBytes.StateFree - v.DiskBytes.Committed; left != need-1 {
			t.Fatalf("state_free - committed = %d, want %d", left, need-1)
		}
		st, _, b := h.do(t, "POST", "/api/vms", h.rw, body("over"))
		wantCapacityConflict(t, st, b, "disk")
		// Exactly enough.
		h.e.DiskFree++
		v = getHostView(t, h)
		if left := v.DiskBytes.StateFree - v.DiskBytes.Committed; left != need {
			t.Fatalf("state_free - committed = %d, want %d", left, need)
		}
		async("fit", body("fit"))
		if v := getHostView(t, h); v.DiskBytes.Committed != 2*need {
			t.Errorf("committed with two provisions in flight = %d, want %d", v.DiskBytes.Committed, 2*need)
		}
		st, _, b = h.do(t, "POST", "/api/vms", h.rw, body("over2"))
		wantCapacityConflict(t, st, b, "disk")
	})
}
