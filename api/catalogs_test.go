package api

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
)

func TestRegistryImages(t *testing.T) {
	h := newHarness(t)
	st, _, b := h.do(t, "GET", "/api/registry/images", h.ro, "")
	want := `{"images":[{"image_id":"debian-12","content_sha256":"` + fixtureDigest + `","fetch_url":"https://images.example/debian-12.qcow2",` +
		`"distro":"debian","version":"12","arch":"amd64","size_bytes":5,"source":"` + h.e.StateDir + `/registry-index.json","cached":true,"cached_at":"`
	if st != 200 || !strings.HasPrefix(b, want) {
		t.Errorf("GET /api/registry/images = %d %s\nwant a prefix %s", st, b, want)
	}
	if st, _, b := h.do(t, "GET", "/api/registry/images/debian-12", h.ro, ""); st != 200 || !strings.Contains(b, `"cached":true`) {
		t.Errorf("GET one = %d %s", st, b)
	}
	if st, _, b := h.do(t, "GET", "/api/registry/images/ubuntu", h.ro, ""); st != 404 || !strings.Contains(b, `"NOT_FOUND"`) {
		t.Errorf("GET unknown = %d %s", st, b)
	}
	// Once the cached copy is gone the image is still listed, not cached.
	if st, _, b := h.do(t, "DELETE", "/api/images/cache/"+fixtureDigest, h.rw, ""); st != 204 {
		t.Fatalf("DELETE cache = %d %s", st, b)
	}
	if _, _, b := h.do(t, "GET", "/api/registry/images/debian-12", h.ro, ""); !strings.Contains(b, `"cached":false`) || strings.Contains(b, "cached_at") {
		t.Errorf("after the cache entry went: %s", b)
	}
}

func TestImageCacheRoutes(t *testing.T) {
	h := newHarness(t)
	var list struct {
		Images []struct {
			Digest           string   `json:"digest"`
			SizeBytes        int64    `json:"size_bytes"`
			CachedAt         string   `json:"cached_at"`
			LastUsedAt       string   `json:"last_used_at"`
			InUse            bool     `json:"in_use"`
			RegistryImageIDs []string `json:"registry_image_ids"`
		} `json:"images"`
	}
	get := func() {
		t.Helper()
		st, _, b := h.do(t, "GET", "/api/images/cache", h.ro, "")
		if st != 200 || json.Unmarshal([]byte(b), &list) != nil {
			t.Fatalf("GET /api/images/cache = %d %s", st, b)
		}
	}
	get()
	if len(list.Images) != 1 || list.Images[0].Digest != fixtureDigest || list.Images[0].SizeBytes != 5 || list.Images[0].InUse ||
		fmt.Sprint(list.Images[0].RegistryImageIDs) != "[debian-12]" || list.Images[0].CachedAt == "" || list.Images[0].LastUsedAt == "" {
		t.Errorf("cache = %+v", list.Images)
	}
	// A provision holds it: listed in use, and not deletable.
	release := h.cache.Use(fixtureDigest)
	get()
	if !list.Images[0].InUse {
		t.Errorf("pinned image not in use: %+v", list.Images)
	}
	if st, _, b := h.do(t, "DELETE", "/api/images/cache/"+fixtureDigest, h.rw, ""); st != 409 || !strings.Contains(b, `"CONFLICT"`) {
		t.Errorf("DELETE in use = %d %s, want 409 CONFLICT", st, b)
	}
	release()
	if st, _, b := h.do(t, "DELETE", "/api/images/cache/"+fixtureDigest, h.rw, ""); st != 204 {
		t.Errorf("DELETE = %d %s", st, b)
	}
	if st, _, b := h.do(t, "DELETE", "/api/images/cache/"+fixtureDigest, h.rw, ""); st != 404 {
		t.Errorf("DELETE again = %d %s, want 404", st, b)
	}
	if st, _, b := h.do(t, "DELETE", "/api/images/cache/..%2f..%2fkeys.json", h.rw, ""); st != 404 {
		t.Errorf("DELETE of a path = %d %s, want 404", st, b)
	}
	get()
	if len(list.Images) != 0 {
		t.Errorf("after delete: %+v", list.Images)
	}
}

// The env's fake sysfs: group 7 holds 0000:01:00.0 and .1, group 8
// 0000:02:00.0, all on vfio-pci; group 9 holds 0000:04:00.0, still on
// e1000e.
func TestHostPCI(t *testing.T) {
	h := newHarness(t)
	st, _, b := h.do(t, "POST", "/api/vms", h.rw, fmt.Sprintf(`{"vm_id":"gpu","vcpus":1,"memory_mb":512,"kernel_path":%q,"disk":{"base_path":%q},"pci_devices":["0000:02:00.0"]}`, h.e.Kernel, h.e.Base))
	if st != 201 {
		t.Fatalf("create with a ready device = %d %s", st, b)
	}
	st, _, b = h.do(t, "POST", "/api/vms", h.rw, fmt.Sprintf(`{"vm_id":"nic","vcpus":1,"memory_mb":512,"kernel_path":%q,"disk":{"base_path":%q},"pci_devices":["0000:04:00.0"]}`, h.e.Kernel, h.e.Base))
	if want := `pci_devices[0]: 0000:04:00.0 is not ready for passthrough: 0000:04:00.0 is bound to e1000e, not vfio-pci`; st != 400 || !strings.Contains(b, want) {
		t.Errorf("create with a device on its host driver = %d %s, want 400 %q", st, b, want)
	}

	st, _, b = h.do(t, "GET", "/api/host/pci", h.ro, "")
	var got struct {
		Devices []map[string]any `json:"devices"`
	}
	if st != 200 || json.Unmarshal([]byte(b), &got) != nil || len(got.Devices) != 4 {
		t.Fatalf("GET /api/host/pci = %d %s", st, b)
	}
	byBDF := map[string]map[string]any{}
	var order []string
	for _, d := range got.Devices {
		byBDF[d["bdf"].(string)] = d
		order = append(order, d["bdf"].(string))
	}
	if fmt.Sprint(order) != "[0000:01:00.0 0000:01:00.1 0000:02:00.0 0000:04:00.0]" {
		t.Errorf("order = %v, want BDF order", order)
	}
	g := byBDF["0000:02:00.0"]
	if g["passthrough_ready"] != true || g["claimed_by"] != "gpu" || g["iommu_group"] != 8.0 || g["driver"] != "vfio-pci" ||
		g["vendor_id"] != "0x1af4" || fmt.Sprint(g["iommu_group_devices"]) != "[0000:02:00.0]" {
		t.Errorf("0000:02:00.0 = %v", g)
	}
	n := byBDF["0000:04:00.0"]
	if n["passthrough_ready"] != false || n["driver"] != "e1000e" || n["claimed_by"] != nil {
		t.Errorf("0000:04:00.0 = %v", n)
	}
	if fmt.Sprint(byBDF["0000:01:00.1"]["iommu_group_devices"]) != "[0000:01:00.0 0000:01:00.1]" {
		t.Errorf("group 7 members = %v", byBDF["0000:01:00.1"]["iommu_group_devices"])
	}
}

func TestBalloon(t *testing.T) {
	h := newHarness(t)
	if st, _, b := h.do(t, "POST", "/api/vms", h.rw, minimalVMBody(h, "b1")); st != 201 {
		t.Fatalf("create = %d %s", st, b)
	}
	// Not running: recorded for the next boot, no host call.
	before := h.e.Host.Transcript()
	if st, _, b := h.do(t, "POST", "/api/vms/b1/balloon", h.rw, `{"balloon_mb": 256}`); st != 204 {
		t.Fatalf("balloon = %d %s", st, b)
	}
	if h.e.Host.Transcript() != before {
		t.Errorf("a created VM's balloon called the host: %s", h.e.Host.Transcript())
	}
	if _, _, b := h.do(t, "GET", "/api/vms/b1", h.ro, ""); !strings.Contains(b, `"balloon_mb":256`) {
		t.Errorf("view after balloon: %s", b)
	}
	for _, tc := range []struct {
		path, body string
		status     int
		want       string
	}{
		{"/api/vms/b1/balloon", `{"balloon_mb": 512}`, 400, "balloon_mb: 512 must be below the VM's memory_mb (512)"},
		{"/api/vms/b1/balloon", `{}`, 422, "balloon_mb"},
		{"/api/vms/b1/balloon", `{"balloon_mb": -1}`, 422, "balloon_mb"},
		{"/api/vms/nope/balloon", `{"balloon_mb": 1}`, 404, "no classic VM has this id"},
		{"/api/appvm/vms/b1/balloon", `{"balloon_mb": 1}`, 404, "no AppVM has this id"},
	} {
		if st, _, b := h.do(t, "POST", tc.path, h.rw, tc.body); st != tc.status || !strings.Contains(b, tc.want) {
			t.Errorf("POST %s %s = %d %s, want %d %q", tc.path, tc.body, st, b, tc.status, tc.want)
		}
	}
	// Balloon 0 deflates: the field leaves the view.
	if st, _, b := h.do(t, "POST", "/api/vms/b1/balloon", h.rw, `{"balloon_mb": 0}`); st != 204 {
		t.Fatalf("balloon 0 = %d %s", st, b)
	}
	if _, _, b := h.do(t, "GET", "/api/vms/b1", h.ro, ""); strings.Contains(b, `"balloon_mb"`) {
		t.Errorf("view after deflating: %s", b)
	}
}
